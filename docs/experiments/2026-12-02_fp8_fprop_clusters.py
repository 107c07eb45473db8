"""Experiment: the FP8 blockwise fprop GEMM on other clusters / rasters / swizzles
(2026-12-02_fp8_fprop_clusters.cu, one .so a cluster) against torch._scaled_grouped_mm (rowwise,
fast accumulation), bench_fp8's four shapes and routings, unit scales, same process, alternating
rounds; CUDA events, (one call at a time, back to back) medians. Usage: python3 THIS.py DIR [rounds]"""
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

GEMMS = [("g8_t32768_7168x4096", 8, 32768, 7168, 4096), ("g64_t131072_4096x4096", 64, 131072, 4096, 4096),
         ("g24_t20000_7168x2048", 24, 20000, 7168, 2048), ("g128_t65536_2048x768", 128, 65536, 2048, 768)]
SCHED = [(-1, 0), (0, 1), (1, 1), (0, 2), (0, 4), (1, 4), (0, 8)]  # (raster, swizzle)


def time_ms(fn, reps=30):
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


def main():
    libs = {}
    for path in sorted(glob.glob(os.path.join(sys.argv[1], "c*.so"))):
        lib = ctypes.CDLL(path)
        lib.st_ws_bytes.restype = ctypes.c_size_t
        lib.st_ws_bytes.argtypes = [ctypes.c_int64]
        lib.st_fprop.restype = ctypes.c_int
        lib.st_fprop.argtypes = ([ctypes.c_int64] * 3 + [ctypes.c_void_p] * 6 + [ctypes.c_int, ctypes.c_int,
                                 ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p])
        libs[os.path.basename(path)[:-3]] = lib
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 2
    print(torch.cuda.get_device_name(), list(libs), flush=True)
    for name, G, T, K, N in GEMMS:
        splits = routing(G, T)
        gen = torch.Generator(device="cuda").manual_seed(0)
        xq = torch.randn(T, K, device="cuda", generator=gen).to(torch.float8_e4m3fn)
        wq = (torch.randn(G, N, K, device="cuda", generator=gen) * 0.02).to(torch.float8_e4m3fn)
        sa, sb = torch.ones(T, device="cuda"), torch.ones(G, N, device="cuda")
        sfa = torch.ones(T * (K // 128), device="cuda")
        wscale = torch.ones(G, N // 128, K // 128, device="cuda")
        offs = torch.cumsum(torch.tensor(splits, device="cuda"), 0).to(torch.int32)
        offsets = torch.zeros(G + 1, dtype=torch.int64, device="cuda")
        offsets[1:] = offs
        y = torch.empty(T, N, device="cuda", dtype=torch.bfloat16)
        stream = torch.cuda.current_stream().cuda_stream
        flops = 2.0 * T * K * N

        def peer():
            return torch._scaled_grouped_mm(xq, wq.transpose(-2, -1), sa, sb, offs=offs, out_dtype=torch.bfloat16,
                                            use_fast_accum=True)

        ref = peer().float()
        calls, first = {}, None
        for tag, lib in libs.items():
            ws = torch.empty(lib.st_ws_bytes(G), dtype=torch.uint8, device="cuda")
            for raster, swz in SCHED:
                def call(lib=lib, ws=ws, raster=raster, swz=swz, tag=tag):
                    rc = lib.st_fprop(G, K, N, offsets.data_ptr(), xq.data_ptr(), sfa.data_ptr(), wq.data_ptr(),
                                      wscale.data_ptr(), y.data_ptr(), raster, swz, ws.data_ptr(), ws.numel(), stream)
                    assert rc == 0, (tag, rc)
                key = f"{tag}_r{raster}_s{swz}"
                y.fill_(float("nan"))
                call()
                torch.cuda.synchronize()
                if first is None:
                    first = y.clone()
                    relerr = float((y.float() - ref).norm() / ref.norm())
                assert torch.equal(y, first), key  # every schedule, the same sums
                calls[key] = call
        row = {"case": name, "G": G, "T": T, "in": K, "out": N, "relerr_vs_torch": relerr}
        for _ in range(rounds):
            row.setdefault("torch", []).append(time_ms(peer))
            for key, call in calls.items():
                row.setdefault(key, []).append(time_ms(call))
        best = lambda k, i: min(r[i] for r in row[k])  # noqa: E731
        t = best("torch", 1)
        order = sorted(calls, key=lambda k: best(k, 1))
        print(f"{name}: torch {t:.3f} ms ({flops / t * 1e-9:.0f} TF); ours b2b torch/ours: " +
              " ".join(f"{k}={t / best(k, 1):.3f}" for k in order) +
              f"; one call at a time: torch/base {best('torch', 0) / best(order[0], 0):.3f}", flush=True)
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
