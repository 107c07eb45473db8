"""The size rule for tiny GroupedLinear problems, measured (host time per call; the rule:
arch::simt_by_size in src/common/gpu_arch.h): per shape, an eager forward (no_grad, host splits,
the torch front) through the sm90 path (set-up kernel and GEMM) and through the SIMT kernel (one
launch), pinned per round by SPARSETRAIN_GEMM_SIMT_MAX_MACS (read at every call), in alternating
rounds; wall time per call of an eager loop (host and GPU work overlapping, as in a step; medians
of 7 rounds) and the GPU time of one call replayed from a CUDA graph (CUDA events, median of 50).
The threshold: the largest T x in x out at which the SIMT path's eager wall time wins. Prints one
JSON line per shape.

    python bench/bench_gemm_paths.py [--calls 300] [--json out.jsonl]
"""
import argparse
import json
import os
import statistics
import time

import torch

SHAPES = [  # (G, T, in, out); the first as bench_host.py's tiny case (there biased)
    (4, 16, 64, 64), (4, 16, 256, 256), (4, 64, 256, 256), (4, 128, 512, 512), (4, 256, 1024, 1024),
    (4, 1024, 1024, 1024), (4, 4096, 1024, 1024), (8, 64, 2048, 1024), (64, 256, 256, 256),
    (64, 1024, 1024, 512), (64, 4096, 2048, 1024),
]
OFF, ON = "0", str(1 << 62)  # the sm90 path wherever it applies / the SIMT kernel at every size


def wall_us(fn, calls):
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / calls * 1e6


def graph_us(fn):
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    times = []
    for _ in range(50):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3)
    return statistics.median(times)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--json")
    args = ap.parse_args()
    import sparsetrain.torch as stt

    out = open(args.json, "w") if args.json else None
    for (G, T, k, n), bias in [(s, False) for s in SHAPES] + [(SHAPES[0], True)]:
        m = stt.GroupedLinear(G, k, n, bias=bias, params_dtype=torch.bfloat16, device="cuda")
        x = torch.randn(T, k, device="cuda", dtype=torch.bfloat16)
        splits = [T // G] * (G - 1) + [T - (T // G) * (G - 1)]
        fn = lambda: m(x, splits)  # noqa: E731
        res = {}
        with torch.no_grad():
            ref = {}
            for tag, env in (("sm90", OFF), ("simt", ON)):
                os.environ["SPARSETRAIN_GEMM_SIMT_MAX_MACS"] = env
                ref[tag] = fn().float()
                for _ in range(20):
                    fn()
                res[tag + "_graph_us"] = graph_us(fn)
            rounds = {"sm90": [], "simt": []}
            for _ in range(7):
                for tag, env in (("sm90", OFF), ("simt", ON)):
                    os.environ["SPARSETRAIN_GEMM_SIMT_MAX_MACS"] = env
                    rounds[tag].append(wall_us(fn, args.calls))
            for tag in rounds:
                res[tag + "_wall_us"] = statistics.median(rounds[tag])
        del os.environ["SPARSETRAIN_GEMM_SIMT_MAX_MACS"]  # back to the library's rule
        row = {"G": G, "T": T, "in": k, "out": n, "bias": bias, "macs": T * k * n, **res,
               "simt_over_sm90_wall": res["simt_wall_us"] / res["sm90_wall_us"],
               "simt_over_sm90_graph": res["simt_graph_us"] / res["sm90_graph_us"],
               "max_abs_diff": float((ref["sm90"] - ref["simt"]).abs().max())}
        print(json.dumps(row), flush=True)
        if out:
            out.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
