"""GroupedLinear benchmark (docs/DESIGN.md section 9): the three MoE models' six GEMM shapes x fprop,
dgrad, wgrad, wgrad + fp32 main_grad, ours against torch._grouped_mm, a loop of torch.mm and one
dense GEMM of the same FLOPs, all in this process on this GPU, timed with CUDA events after
warm-up (median over repetitions). Writes JSON (--json) and prints a table.

    python bench/bench_grouped_linear.py [--models mixtral,deepseek,qwen] [--json out.json]
"""

import argparse
import json
import os
import statistics
import time

import numpy as np
import torch

import sparsetrain

MODELS = {  # name: (G, T, [(gemm, in, out)])
    "mixtral": (8, 16384, [("fc1", 4096, 28672), ("fc2", 14336, 4096)]),
    "deepseek": (8, 32768, [("fc1", 7168, 4096), ("fc2", 2048, 7168)]),
    "qwen": (128, 65536, [("fc1", 2048, 1536), ("fc2", 768, 2048)]),
    # Fine-grained experts at a small N (issue 59's many-expert fprop class; not a DESIGN.md model).
    "g128": (128, 65536, [("fc", 2048, 768)]),
}


def routing(G, T):
    """Expert loads from a Dirichlet(alpha = 2) draw, seed 0; expert 5 empty in the G = 128 model."""
    rng = np.random.default_rng(0)
    p = rng.dirichlet([2.0] * G)
    if G == 128:
        p[5] = 0
        p /= p.sum()
    s = np.floor(p * T).astype(np.int64)
    s[np.argmax(s)] += T - s.sum()
    return s.tolist()


def time_ms(fn, min_reps=100, max_seconds=2.0, warmup=3, setup=None):
    """Median of CUDA-event timings; fewer than min_reps only when one call is slow (recorded).
    setup (optional) runs before each call, outside the timed events (queued work still runs
    first on the stream, so only fn's own kernels fall between the events)."""
    setup = setup or (lambda: None)
    for _ in range(warmup):
        setup()
        fn()
    torch.cuda.synchronize()
    setup()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    one = time.perf_counter() - t0
    reps = max(5, min(min_reps, int(max_seconds / max(one, 1e-6))))
    times = []
    for _ in range(reps):
        setup()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times), reps


def graph_ms(fn):
    """Median time of fn captured in a CUDA graph and replayed: the GPU work without the host
    overhead of issuing it (Python, argument checks, CUTLASS initialisation)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return time_ms(graph.replay)[0]


def bench_shape(G, T, splits, name, k_in, n_out, sweep=()):
    dev, dt = "cuda", torch.bfloat16
    torch.manual_seed(0)
    x = torch.randn(T, k_in, device=dev, dtype=dt)
    dy = torch.randn(T, n_out, device=dev, dtype=dt)
    w = torch.randn(G, n_out, k_in, device=dev, dtype=dt) / k_in ** 0.5
    main_grad = torch.zeros(G, n_out, k_in, device=dev, dtype=torch.float32)
    splits_dev = torch.tensor(splits, device=dev)
    offs = torch.cumsum(splits_dev, 0).to(torch.int32)
    S = sum(splits)
    flops = 2.0 * S * k_in * n_out
    layer = sparsetrain.GroupedLinear(w, delay_wgrad_compute=True)
    fused = sparsetrain.GroupedLinear(w, main_grad=main_grad, fuse_wgrad_accumulation=True, delay_wgrad_compute=True)
    dsplits = sparsetrain.DeviceSplits(splits_dev)

    bounds = np.cumsum([0] + splits)
    chunks = [(int(bounds[g]), int(bounds[g + 1])) for g in range(G)]
    peers = {
        "fprop": {
            "grouped_mm": lambda: torch._grouped_mm(x, w.transpose(-2, -1), offs=offs),
            "mm_loop": lambda: [torch.mm(x[a:b], w[g].t()) for g, (a, b) in enumerate(chunks) if b > a],
            "dense": lambda: torch.mm(x[:S], w[0].t()),
        },
        "dgrad": {
            "grouped_mm": lambda: torch._grouped_mm(dy, w, offs=offs),
            "mm_loop": lambda: [torch.mm(dy[a:b], w[g]) for g, (a, b) in enumerate(chunks) if b > a],
            "dense": lambda: torch.mm(dy[:S], w[0]),
        },
        "wgrad": {
            "grouped_mm": lambda: torch._grouped_mm(dy.t(), x, offs=offs),
            "mm_loop": lambda: [torch.mm(dy[a:b].t(), x[a:b]) for g, (a, b) in enumerate(chunks)],
            "dense": lambda: torch.mm(dy[:S].t(), x[:S]),
        },
    }
    rows = []

    # dgrad alone: backward of a delayed-wgrad layer, each followed (untimed) by its backward_dw.
    # wgrad alone: backward_dw, each preceded (untimed) by the backward that queues it.
    def ours_ms(pass_name):
        if pass_name == "fprop":
            return time_ms(lambda: layer.forward(x, dsplits))
        if pass_name == "dgrad":
            return time_ms(lambda: layer.backward(x, dy, dsplits),
                           setup=lambda: layer.pending_wgrads and layer.backward_dw())
        lay = layer if pass_name == "wgrad" else fused
        return time_ms(lambda: lay.backward_dw(), setup=lambda: lay.backward(x, dy, dsplits))

    for pass_name in ["fprop", "dgrad", "wgrad", "wgrad_main_grad"]:
        t, reps = ours_ms(pass_name)
        forced = {}
        for var, value in sweep:  # the same pass with one tuning variable forced
            os.environ[var] = value
            forced[f"ours[{var}={value}]_ms"] = ours_ms(pass_name)[0]
            del os.environ[var]
        row = {"shape": name, "pass": pass_name, "G": G, "T": T, "in": k_in, "out": n_out, "ours_ms": t,
               "ours_tflops": flops / t * 1e-9, "reps": reps, **forced}
        if pass_name in ("fprop", "dgrad"):  # host overhead: the same work replayed from a CUDA graph
            ours = (lambda: layer.forward(x, dsplits)) if pass_name == "fprop" else \
                (lambda: layer.backward(x, dy, dsplits))
            row["ours_graph_ms"] = graph_ms(ours)
            row["grouped_mm_graph_ms"] = graph_ms(peers[pass_name]["grouped_mm"])
        peer_pass = "wgrad" if pass_name.startswith("wgrad") else pass_name
        for peer, fn in peers[peer_pass].items():
            try:
                pt, _ = time_ms(fn)
            except RuntimeError as e:  # a peer that cannot run this shape is recorded, not fatal
                row[f"{peer}_error"] = str(e).splitlines()[0]
                pt = float("nan")
            row[f"{peer}_ms"] = pt
            row[f"speedup_vs_{peer}"] = pt / t
        if pass_name == "wgrad_main_grad":
            # The bar: <= 1.05 x max(plain wgrad, fp32 read+write bytes / copy bandwidth).
            src = torch.empty_like(main_grad)
            copy_ms, _ = time_ms(lambda: main_grad.copy_(src))
            row["bar_ms"] = 1.05 * max(rows[-1]["ours_ms"], copy_ms)
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="mixtral,deepseek,qwen")
    ap.add_argument("--json", default=None)
    ap.add_argument("--sweep", action="append", default=[], metavar="VAR=V1,V2",
                    help="also time ours with the environment variable VAR set to each value in turn "
                         "(the sm90 tuning overrides, e.g. SPARSETRAIN_SM90_RASTER=m,n); repeatable")
    args = ap.parse_args()
    info = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "cuda": torch.version.cuda,
            "date": time.strftime("%Y-%m-%d")}
    sweep = [(var, value) for spec in args.sweep for var, values in [spec.split("=", 1)]
             for value in values.split(",")]
    rows = []
    for model in args.models.split(","):
        G, T, gemms = MODELS[model]
        splits = routing(G, T)
        for gemm, k_in, n_out in gemms:
            rows += bench_shape(G, T, splits, f"{model}.{gemm}", k_in, n_out, sweep)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"info": info, "rows": rows}, f, indent=1)
    print(f"\n{info}")
    print(f"{'shape':16} {'pass':16} {'ours ms':>9} {'TFLOP/s':>8} {'vs grouped_mm':>13} {'vs mm loop':>10} "
          f"{'vs dense':>9} {'graphed: ours/gmm ms':>22}  forced")
    for r in rows:
        graphed = f"{r['ours_graph_ms']:.3f}/{r['grouped_mm_graph_ms']:.3f}" if "ours_graph_ms" in r else ""
        forced = " ".join(f"{k[5:-4].replace('SPARSETRAIN_SM90_', '')}:{v:.3f}" for k, v in r.items()
                          if k.startswith("ours[") and k.endswith("]_ms"))
        print(f"{r['shape']:16} {r['pass']:16} {r['ours_ms']:9.3f} {r['ours_tflops']:8.1f} "
              f"{r['speedup_vs_grouped_mm']:13.3f} {r['speedup_vs_mm_loop']:10.3f} {r['speedup_vs_dense']:9.3f} "
              f"{graphed:>22}  {forced}")


if __name__ == "__main__":
    main()
