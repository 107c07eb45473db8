"""Expert parallelism (issue 19): sparsetrain.torch.ExpertParallelMoELayer on W GPUs (NCCL, one
process each) against one GPU holding all the experts (MoELayer), on the same global batch: every
rank passes `tokens` tokens, the single GPU all W * tokens of them. One training step = forward +
backward (dx, dlogits and the experts' weight gradients), bf16. Timed as a training loop sees it:
CUDA events around `reps` steps back to back after warm-up, the slowest rank's time per step
(the exchange makes the ranks wait for each other), median over rounds; the single GPU the same
way. Reported: ms per step, the speedup of EP over one GPU for the batch (ideal: W), and the
experts' GEMM TFLOP/s per GPU (6 * rows * hidden * ffn forward, twice that backward; rows =
tokens * top_k per rank). Shapes are bench_moe.py's, split over the ranks (per-rank tokens =
its tokens / W, so each GPU holds E / W experts and sees bench_moe's load).

--quick: small shapes; --device cpu (with --quick) runs W gloo processes on the CPU: a smoke test
of the script, no timings worth reading.

    python bench/bench_moe_ep.py [--world 2] [--only mixtral,qwen3] [--quick] [--device cuda|cpu]
                                 [--reps 10] [--rounds 3] [--json out.json]
"""

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import bench_moe


def _step(layer, x, logits, dout):
    o = layer(x, logits)
    torch.autograd.backward(o.out, dout)
    return o


def _inputs(tokens, hidden, experts, device, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=g).to(device=device, dtype=torch.bfloat16).requires_grad_()
    logits = torch.randn(tokens, experts, generator=g).to(device).requires_grad_()
    dout = torch.randn(tokens, hidden, generator=g).to(device=device, dtype=torch.bfloat16)
    return x, logits, dout


def _time_steps(fn, reps, rounds, device):
    """ms per step, per round: `reps` steps back to back (bench_attention.queued_ms on CUDA, wall
    clock on the CPU), after warm-up."""
    if device == "cuda":
        import bench_attention as ba  # noqa: PLC0415

        return [ba.queued_ms(fn, reps, warmup=2 if r == 0 else 0) for r in range(rounds)]
    for _ in range(2):
        fn()
    out = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        out.append((time.perf_counter() - t0) * 1e3 / reps)
    return out


def _ep_worker(rank, world, init_file, shape, reps, rounds, device_kind, result_file):
    import sparsetrain.torch as stt  # noqa: PLC0415  (each spawned process imports it)

    tokens, hidden, ffn, experts, top_k = shape
    device = "cpu"
    if device_kind == "cuda":
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
        device = f"cuda:{rank}"
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(1)
    dist.init_process_group("nccl" if device_kind == "cuda" else "gloo", init_method=f"file://{init_file}",
                            rank=rank, world_size=world, timeout=timedelta(seconds=300))
    try:
        torch.manual_seed(0)
        layer = stt.ExpertParallelMoELayer(experts, hidden, ffn, top_k, params_dtype=torch.bfloat16, device=device)
        x, logits, dout = _inputs(tokens // world, hidden, experts, device, seed=rank)
        times = _time_steps(lambda: _step(layer, x, logits, dout), reps, rounds, device_kind)
        # The step of the group is its slowest rank's.
        t = torch.tensor(times, dtype=torch.float64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        rows = torch.tensor([float(tokens // world * top_k)], dtype=torch.float64, device=device)
        dist.all_reduce(rows, op=dist.ReduceOp.MAX)
        if rank == 0:
            with open(result_file, "w") as f:
                json.dump({"rounds_ms": t.tolist(), "max_rows_per_rank": float(rows.item())}, f)
    finally:
        dist.destroy_process_group()


def run_ep(world, shape, reps, rounds, device):
    with tempfile.TemporaryDirectory() as tmp:
        result = os.path.join(tmp, "result.json")
        mp.start_processes(_ep_worker, args=(world, os.path.join(tmp, "store"), shape, reps, rounds, device, result),
                           nprocs=world, join=True, start_method="spawn")
        with open(result) as f:
            return json.load(f)


def run_single(shape, reps, rounds, device):
    import sparsetrain.torch as stt  # noqa: PLC0415

    tokens, hidden, ffn, experts, top_k = shape
    torch.manual_seed(0)
    layer = stt.MoELayer(experts, hidden, ffn, top_k, params_dtype=torch.bfloat16, device=device)
    x, logits, dout = _inputs(tokens, hidden, experts, device, seed=0)
    return _time_steps(lambda: _step(layer, x, logits, dout), reps, rounds, device)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--only", default=None, metavar="NAMES", help="comma-separated bench_moe CASES")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", default=None, metavar="PATH")
    a = ap.parse_args()
    if a.device == "cuda" and torch.cuda.device_count() < a.world:
        sys.exit(f"--world {a.world} needs {a.world} GPUs; this machine has {torch.cuda.device_count()}")
    cases = bench_moe.QUICK if a.quick else bench_moe.CASES
    names = a.only.split(",") if a.only else list(cases)
    rows = []
    print(f"{'case':20s} {'W':>2s} {'EP ms/step':>11s} {'1 GPU ms/step':>14s} {'speedup':>8s} "
          f"{'EP TFLOP/s/GPU':>15s} {'1 GPU TFLOP/s':>14s}")
    for name in names:
        shape = cases[name]
        tokens, hidden, ffn, experts, top_k = shape
        if experts % a.world or tokens % a.world:
            print(f"{name:20s} skipped: {experts} experts / {tokens} tokens not divisible by W = {a.world}")
            continue
        ep = run_ep(a.world, shape, a.reps, a.rounds, a.device)
        single = run_single(shape, a.reps, a.rounds, a.device)
        ep_ms, single_ms = statistics.median(ep["rounds_ms"]), statistics.median(single)
        flops_per_rank = 18.0 * (tokens // a.world) * top_k * hidden * ffn  # fwd 6 + bwd 12 per row
        row = {"case": name, "world": a.world, "tokens": tokens, "hidden": hidden, "ffn": ffn, "experts": experts,
               "top_k": top_k, "reps": a.reps, "ep_rounds_ms": ep["rounds_ms"], "single_rounds_ms": single,
               "ep_ms": ep_ms, "single_ms": single_ms, "speedup": single_ms / ep_ms,
               "ep_tflops_per_gpu": flops_per_rank / ep_ms / 1e9,
               "single_tflops": flops_per_rank * a.world / single_ms / 1e9}
        rows.append(row)
        print(f"{name:20s} {a.world:2d} {ep_ms:11.3f} {single_ms:14.3f} {row['speedup']:7.2f}x "
              f"{row['ep_tflops_per_gpu']:15.1f} {row['single_tflops']:14.1f}", flush=True)
    if a.json:
        info = {"device": torch.cuda.get_device_name(0) if a.device == "cuda" else "cpu", "torch": torch.__version__,
                "world": a.world, "nccl_nvls_enable": os.environ.get("NCCL_NVLS_ENABLE", "0 (set by the bench)")}
        with open(a.json, "w") as f:
            json.dump({"info": info, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
