"""Experiment: the bf16 grouped fprop under other kernel shapes against torch._grouped_mm, same
process, bench_grouped_linear's Dirichlet routing and timing (back to back and one call at a
time). Usage: python3 2026-12-02_gemm_kernel_shapes.py DIR_WITH_SHAPE_SOS [rounds]"""
import ctypes
import glob
import json
import os
import sys

import numpy as np
import torch


def routing(G, T):
    """bench_grouped_linear.py's: Dirichlet(alpha = 2), seed 0; expert 5 empty at G = 128."""
    rng = np.random.default_rng(0)
    p = rng.dirichlet([2.0] * G)
    if G == 128:
        p[5] = 0
        p /= p.sum()
    s = np.floor(p * T).astype(np.int64)
    s[np.argmax(s)] += T - s.sum()
    return s.tolist()


def time_ms(fn, reps=50):
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
        for _ in range(10):
            fn()
        b.record()
        b.synchronize()
        burst.append(a.elapsed_time(b) / 10)
    return float(np.median(one)), float(np.median(burst))

SHAPES = [  # (name, G, T, in, out)
    ("g128_2048_768", 128, 65536, 2048, 768),
    ("qwen.fc1", 128, 65536, 2048, 1536),
    ("qwen.fc2", 128, 65536, 768, 2048),
    ("g64_4096_4096", 64, 131072, 4096, 4096),
    ("deepseek.fc1", 8, 32768, 7168, 4096),
    ("mixtral.fc2", 8, 16384, 14336, 4096),
    ("g24_7168_2048", 24, 20000, 7168, 2048),
]
# SHAPES=many: the many-expert class around the shapes above (G 32..128, N 768..4096, K 768..4096).
# SHAPES=k2048: in = 2048 from few to many experts (deepseek fc2 among them).
if os.environ.get("SHAPES") == "k2048":
    SHAPES = [(f"g{G}_2048_{o}", G, T, 2048, o) for G, T in ((8, 32768), (16, 32768), (64, 65536), (128, 65536))
              for o in (768, 1536, 4096, 7168)]
if os.environ.get("SHAPES") == "many":
    SHAPES = [(f"g{G}_{i}_{o}", G, T, i, o) for G, T in ((128, 65536), (64, 32768), (32, 32768))
              for i, o in ((2048, 768), (2048, 1536), (768, 2048), (4096, 1024), (1024, 4096))]


def main():
    libs = {}
    # ORDER=reverse times the kernels in the other order (a later kernel may find the GPU warmer).
    paths = sorted(glob.glob(os.path.join(sys.argv[1], "*.so")), reverse=os.environ.get("ORDER") == "reverse")
    for path in paths:
        lib = ctypes.CDLL(path)
        lib.st_ws_bytes.restype = ctypes.c_size_t
        lib.st_ws_bytes.argtypes = [ctypes.c_int64]
        lib.st_fprop.restype = ctypes.c_int
        lib.st_fprop.argtypes = [ctypes.c_int64] * 4 + [ctypes.c_void_p] * 5 + [ctypes.c_size_t, ctypes.c_void_p]
        libs[os.path.basename(path)[:-3]] = lib
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 1
    dev = torch.device("cuda")
    for name, G, T, k_in, n_out in SHAPES:
        splits = routing(G, T)
        torch.manual_seed(0)
        x = torch.randn(T, k_in, device=dev, dtype=torch.bfloat16)
        w = torch.randn(G, n_out, k_in, device=dev, dtype=torch.bfloat16) / k_in**0.5
        offsets = torch.zeros(G + 1, dtype=torch.int64)
        offsets[1:] = torch.tensor(splits).cumsum(0)
        offsets = offsets.to(dev)
        offs32 = offsets[1:].to(torch.int32)
        wt = w.transpose(1, 2)
        ref = torch._grouped_mm(x, wt, offs=offs32)
        flops = 2.0 * T * k_in * n_out
        row = {"shape": name, "G": G, "T": T, "in": k_in, "out": n_out}
        for _ in range(rounds):
            peer = time_ms(lambda: torch._grouped_mm(x, wt, offs=offs32))
            row.setdefault("torch_ms", []).append(peer)
            for tag, lib in libs.items():
                ws = torch.empty(lib.st_ws_bytes(G), dtype=torch.uint8, device=dev)
                y = torch.full((T, n_out), float("nan"), device=dev, dtype=torch.bfloat16)
                stream = torch.cuda.current_stream().cuda_stream

                def call():
                    rc = lib.st_fprop(G, T, k_in, n_out, offsets.data_ptr(), x.data_ptr(), w.data_ptr(), y.data_ptr(),
                                      ws.data_ptr(), ws.numel(), stream)
                    assert rc == 0, tag

                call()
                torch.cuda.synchronize()
                err = (y.float() - ref.float()).abs().max().item()
                same = bool(torch.equal(y, ref))
                ms = time_ms(call)
                row.setdefault(tag, []).append(ms)
                row[tag + "_maxerr"] = err
                row[tag + "_bitwise_torch"] = same
        best = lambda k, i: min(r[i] for r in row[k])  # noqa: E731
        summary = " ".join(
            f"{t}={best(t, 0):.3f}/{best(t, 1):.3f}ms({best('torch_ms', 0) / best(t, 0):.3f}/"
            f"{best('torch_ms', 1) / best(t, 1):.3f}x,{flops / best(t, 1) / 1e9:.0f}TF)" for t in libs)
        print(f"{name:16s} torch={best('torch_ms', 0):.3f}/{best('torch_ms', 1):.3f}ms {summary}", flush=True)
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
