"""Experiment: the bf16 grouped wgrad accumulating into an fp32 main_grad under other kernel shapes
and epilogues (2026-12-02_wgrad_main_grad_kernel_shapes.cu, one .so each), beside the bar the
GroupedLinear table uses (1.05 x max(torch._grouped_mm's bf16 wgrad, main_grad's read + write at
copy bandwidth)), same process, bench_grouped_linear's Dirichlet routing, alternating rounds.
Usage: python3 THIS.py DIR_WITH_SOS [rounds]   (names: <coop|pp><M?x>N_c<cluster>_<f32|add>)"""
import ctypes
import glob
import json
import os
import re
import sys

import numpy as np
import torch


def routing(G, T):
    rng = np.random.default_rng(0)
    p = rng.dirichlet([2.0] * G)
    if G == 128:
        p[5] = 0
        p /= p.sum()
    s = np.floor(p * T).astype(np.int64)
    s[np.argmax(s)] += T - s.sum()
    return s.tolist()


def time_ms(fn, reps=30):
    """(one call at a time, back to back): medians of CUDA-event timings after warm-up."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    one = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        one.append(a.elapsed_time(b))
    burst = []
    for _ in range(5):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(5):
            fn()
        b.record()
        b.synchronize()
        burst.append(a.elapsed_time(b) / 5)
    return float(np.median(one)), float(np.median(burst))


SHAPES = [  # (name, G, T, in, out)
    ("qwen.fc1", 128, 65536, 2048, 1536),
    ("qwen.fc2", 128, 65536, 768, 2048),
    ("g128.fc", 128, 65536, 2048, 768),
    ("g64_512", 64, 32768, 2048, 1536),
    ("g32_1024", 32, 32768, 2048, 1536),
    ("g32_2048", 32, 65536, 4096, 1024),
    ("deepseek.fc1", 8, 32768, 7168, 4096),
    ("deepseek.fc2", 8, 32768, 2048, 7168),
    ("g8_1024", 8, 8192, 4096, 4096),
]


def tile(name):
    m = re.match(r"(coop|pp)(?:(\d+)x)?(\d+)_", name)
    return (int(m.group(2)) if m.group(2) else 128), int(m.group(3))


def main():
    libs = {}
    for path in sorted(glob.glob(os.path.join(sys.argv[1], "*.so"))):
        lib = ctypes.CDLL(path)
        lib.st_ws_bytes.restype = ctypes.c_size_t
        lib.st_ws_bytes.argtypes = [ctypes.c_int64]
        lib.st_wgrad.restype = ctypes.c_int
        lib.st_wgrad.argtypes = ([ctypes.c_int64] * 4 + [ctypes.c_void_p] * 4 + [ctypes.c_int, ctypes.c_void_p,
                                 ctypes.c_size_t, ctypes.c_void_p])
        libs[os.path.basename(path)[:-3]] = lib
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 2
    dev = "cuda"
    print(torch.cuda.get_device_name(), "variants:", list(libs), flush=True)
    for name, G, T, k_in, n_out in SHAPES:
        torch.manual_seed(0)
        splits = routing(G, T)
        x = torch.randn(T, k_in, device=dev, dtype=torch.bfloat16)
        dy = torch.randn(T, n_out, device=dev, dtype=torch.bfloat16)
        offsets = torch.zeros(G + 1, dtype=torch.int64)
        offsets[1:] = torch.tensor(splits).cumsum(0)
        offsets = offsets.to(dev)
        offs32 = offsets[1:].to(torch.int32)
        init = torch.randn(G, n_out, k_in, device=dev, dtype=torch.float32)
        mg = init.clone()
        stream = torch.cuda.current_stream().cuda_stream
        calls, first = {}, {}
        for tag, lib in libs.items():
            ws = torch.empty(lib.st_ws_bytes(G), dtype=torch.uint8, device=dev)
            tm, tn = tile(tag)
            raster_n = int((n_out + tm - 1) // tm >= 2 * ((k_in + tn - 1) // tn))

            def call(lib=lib, ws=ws, raster_n=raster_n, tag=tag):
                rc = lib.st_wgrad(G, T, k_in, n_out, offsets.data_ptr(), dy.data_ptr(), x.data_ptr(), mg.data_ptr(),
                                  raster_n, ws.data_ptr(), ws.numel(), stream)
                assert rc == 0, tag

            mg.copy_(init)
            call()
            torch.cuda.synchronize()
            first[tag] = mg.clone()
            calls[tag] = call
        ref = init.clone()
        for g in range(G):
            a, b = int(offsets[g]), int(offsets[g + 1])
            ref[g] += dy[a:b].float().t() @ x[a:b].float()
        row = {"shape": name, "G": G, "T": T, "in": k_in, "out": n_out}
        base = next(iter(first))
        for tag in first:
            row[tag + "_maxerr"] = float((first[tag] - ref).abs().max())
            row[tag + "_bitwise_" + base] = bool(torch.equal(first[tag], first[base]))
        del first, ref
        for _ in range(rounds):
            row.setdefault("torch_wgrad_ms", []).append(
                time_ms(lambda: torch._grouped_mm(dy.t(), x, offs=offs32)))
            row.setdefault("copy_ms", []).append(time_ms(lambda: mg.mul_(1.0)))
            for tag, call in calls.items():
                row.setdefault(tag, []).append(time_ms(call))
        best = lambda k, i: min(r[i] for r in row[k])  # noqa: E731
        bar = [1.05 * max(best("torch_wgrad_ms", i), best("copy_ms", i)) for i in (0, 1)]
        row["bar_ms"] = bar
        summary = " ".join(f"{t}={best(t, 0):.3f}/{best(t, 1):.3f}({best(t, 0) / bar[0]:.2f}/{best(t, 1) / bar[1]:.2f})"
                           for t in calls)
        print(f"{name:13s} wgrad={best('torch_wgrad_ms', 1):.3f} copy={best('copy_ms', 1):.3f} ms; time ms one/b2b "
              f"(/bar): {summary}", flush=True)
        print(json.dumps(row), flush=True)
        del x, dy, init, mg, calls
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
