"""Expert parallelism: sparsetrain.torch.ExpertParallelMoELayer on W GPUs (NCCL, one
process each) against one GPU holding all the experts (MoELayer), on the same global batch: every
rank passes `tokens` tokens, the single GPU all W * tokens of them. One training step = forward +
backward (dx, dlogits and the experts' weight gradients), bf16. Timed as a training loop sees it:
CUDA events around `reps` steps back to back after warm-up, the slowest rank's time per step
(the exchange makes the ranks wait for each other), median over rounds; the single GPU the same
way. Reported: ms per step, the speedup of EP over one GPU for the batch (ideal: W), and the
experts' GEMM TFLOP/s per GPU (6 * rows * hidden * ffn forward, twice that backward; rows =
tokens * top_k per rank). Shapes are bench_moe.py's, split over the ranks (per-rank tokens =
its tokens / W, so each GPU holds E / W experts and sees bench_moe's load).

--exchange: the layer's exchanges to time, each a row: nccl (all_to_all_single after the counts,
one host sync a forward; gloo on the CPU) and symmetric_memory (torch's NVSHMEM all-to-all with
device splits, no host sync; capacity max_tokens_per_rank = the rank's tokens; only where
E / W <= 16). Default: both where symmetric memory is available (CUDA, NVSHMEM), else nccl.

--overlap adds two rows, the rank's tokens as two micro-batches of half the tokens each through
the nccl exchange: "nccl_halves" runs the layer on each half in turn; "nccl_overlap" routes both
halves, starts both dispatches (async_op), runs the first half's experts while the second half's
rows travel, and starts the first half's return while the second half's experts run. Forward
only: the backward runs as autograd orders it (an exchange of the backward waits on the stream).
This lives in the bench, from the layer's parts: the layer's API would need micro-batch state.

--chunks N adds the row "nccl_chunksN": the layer's own overlap, overlap_chunks=N (N groups of a
rank's experts, every dispatch started at once, chunk c's experts under the later chunks' rows,
its return behind them; at most the experts a rank holds).

--quick: small shapes; --device cpu (with --quick) runs W gloo processes on the CPU: a smoke test
of the script, no timings worth reading.

    python bench/bench_moe_ep.py [--world 2] [--only mixtral,qwen3] [--quick] [--device cuda|cpu]
                                 [--exchange nccl,symmetric_memory] [--overlap] [--chunks N]
                                 [--reps 10] [--rounds 3] [--json out.json]
"""

import argparse
import functools
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


class _Arrived(torch.autograd.Function):
    """Waits for `works` (the current stream waits for the exchange; the host does not), identity."""

    @staticmethod
    def forward(ctx, works, *tensors):
        for w in works:
            w.wait()
        return tuple(t.view_as(t) for t in tensors)

    @staticmethod
    def backward(ctx, *grads):
        return (None, *grads)


def _overlapped_forward(layer, parts):
    """The layer's nccl forward on two micro-batches, the second half's dispatch under the first
    half's experts and the first half's return under the second half's experts."""
    from sparsetrain.torch.expert_parallel import _AllToAll, _exchange_plan  # noqa: PLC0415
    from sparsetrain.torch.moe import moe_route
    from sparsetrain.torch.token_rows import Rows, combine, expert_rows  # noqa: PLC0415

    staged = []
    for x, logits in parts:  # both halves' routing and host syncs first
        r = moe_route(logits, layer.top_k, score=layer.score, normalize=layer.normalize)
        rows = expert_rows(x, r)
        plan = _exchange_plan(r.counts, layer.world_size, layer.group)
        works = []
        staged.append((rows, plan, works, _AllToAll.apply(layer.group, plan.send, plan.receive, works,
                                                               rows.x, rows.probs)))
    backs = []
    for rows, plan, works, got in staged:
        got_x, got_probs = _Arrived.apply(works, *got)
        y = layer.experts(Rows.apply(got_x, plan.by_expert, plan.by_source), plan.local_counts,
                          Rows.apply(got_probs, plan.by_expert, plan.by_source))
        back_works = []
        backs.append((back_works, _AllToAll.apply(layer.group, plan.receive, plan.send, back_works,
                                                       Rows.apply(y, plan.by_source, plan.by_expert))))
    return [combine(_Arrived.apply(w, *back)[0], rows) for (w, back), (rows, *_) in zip(backs, staged)]


def _halves_step(layer, x, logits, dout, overlap):
    half = x.shape[0] // 2
    parts = [(x[:half], logits[:half]), (x[half:], logits[half:])]
    outs = _overlapped_forward(layer, parts) if overlap else [layer(*part).out for part in parts]
    torch.autograd.backward(outs, [dout[:half], dout[half:]])


def _symmetric_heap_bytes(tokens, hidden, experts, top_k, world):
    """NVSHMEM's symmetric heap for the layer's buffers (ExpertParallelMoELayer's docstring), with
    room to spare; NVSHMEM's default is 1 GiB."""
    send = tokens * top_k
    receive = world * send + experts // world + 1
    return int(1.25 * ((2 * send + 3 * receive) * hidden * 2 + (2 * send + 2 * receive) * 4)) + (256 << 20)


def _ep_worker(rank, world, init_file, shape, variants, reps, rounds, device_kind, result_file):
    import sparsetrain.torch as stt  # noqa: PLC0415  (each spawned process imports it)

    tokens, hidden, ffn, experts, top_k = shape
    per_rank = tokens // world
    device, options = "cpu", {}
    if device_kind == "cuda":
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
        os.environ.setdefault("NVSHMEM_SYMMETRIC_SIZE", str(_symmetric_heap_bytes(per_rank, hidden, experts, top_k,
                                                                                  world)))
        device = f"cuda:{rank}"
        torch.cuda.set_device(device)
        options = dict(device_id=torch.device(device))  # NVSHMEM's teams need the group bound to the GPU
    else:
        torch.set_num_threads(1)
    dist.init_process_group("nccl" if device_kind == "cuda" else "gloo", init_method=f"file://{init_file}",
                            rank=rank, world_size=world, timeout=timedelta(seconds=300), **options)
    try:
        x, logits, dout = _inputs(per_rank, hidden, experts, device, seed=rank)
        results = {}
        for variant in variants:
            torch.manual_seed(0)
            exchange = dict(exchange="symmetric_memory", max_tokens_per_rank=per_rank) \
                if variant == "symmetric_memory" else {}
            if variant.startswith("nccl_chunks"):
                exchange = dict(overlap_chunks=int(variant[len("nccl_chunks"):]))
            layer = stt.ExpertParallelMoELayer(experts, hidden, ffn, top_k, params_dtype=torch.bfloat16,
                                               device=device, **exchange)
            if variant in ("nccl_halves", "nccl_overlap"):
                fn = functools.partial(_halves_step, layer, x, logits, dout, variant == "nccl_overlap")
            else:
                fn = functools.partial(_step, layer, x, logits, dout)
            times = _time_steps(fn, reps, rounds, device_kind)
            # The step of the group is its slowest rank's.
            t = torch.tensor(times, dtype=torch.float64, device=device)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            results[variant] = {"rounds_ms": t.tolist()}
            del layer, fn
        if rank == 0:
            with open(result_file, "w") as f:
                json.dump(results, f)
    finally:
        dist.destroy_process_group()


def run_ep(world, shape, variants, reps, rounds, device):
    """{variant: {"rounds_ms": [...]}} from one group of `world` processes."""
    with tempfile.TemporaryDirectory() as tmp:
        result = os.path.join(tmp, "result.json")
        mp.start_processes(_ep_worker, args=(world, os.path.join(tmp, "store"), shape, variants, reps, rounds, device,
                                             result), nprocs=world, join=True, start_method="spawn")
        with open(result) as f:
            return json.load(f)


def _symmetric_memory_here(device):
    if device != "cuda":
        return False
    try:
        import torch.distributed._symmetric_memory as symm_mem  # noqa: PLC0415
    except ImportError:
        return False
    return symm_mem.is_nvshmem_available()


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
    ap.add_argument("--exchange", default=None, metavar="NAMES",
                    help="comma-separated: nccl, symmetric_memory (default: both where available)")
    ap.add_argument("--overlap", action="store_true", help="add the two-micro-batch rows (nccl_halves, nccl_overlap)")
    ap.add_argument("--chunks", type=int, default=0, metavar="N",
                    help="add the row nccl_chunksN: the layer with overlap_chunks=N")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", default=None, metavar="PATH")
    a = ap.parse_args()
    if a.device == "cuda" and torch.cuda.device_count() < a.world:
        sys.exit(f"--world {a.world} needs {a.world} GPUs; this machine has {torch.cuda.device_count()}")
    if a.exchange is None:
        exchanges = ["nccl", "symmetric_memory"] if _symmetric_memory_here(a.device) else ["nccl"]
    else:
        exchanges = a.exchange.split(",")
        unknown = [e for e in exchanges if e not in ("nccl", "symmetric_memory")]
        if unknown:
            sys.exit(f"--exchange: expected nccl and/or symmetric_memory, got {','.join(unknown)}")
        if "symmetric_memory" in exchanges and not _symmetric_memory_here(a.device):
            sys.exit("--exchange symmetric_memory needs CUDA and torch with NVSHMEM (symm_mem.is_nvshmem_available())")
    cases = bench_moe.QUICK if a.quick else bench_moe.CASES
    names = a.only.split(",") if a.only else list(cases)
    rows = []
    print(f"{'case':20s} {'W':>2s} {'exchange':>16s} {'EP ms/step':>11s} {'1 GPU ms/step':>14s} {'speedup':>8s} "
          f"{'EP TFLOP/s/GPU':>15s} {'1 GPU TFLOP/s':>14s}")
    for name in names:
        shape = cases[name]
        tokens, hidden, ffn, experts, top_k = shape
        if experts % a.world or tokens % a.world:
            print(f"{name:20s} skipped: {experts} experts / {tokens} tokens not divisible by W = {a.world}")
            continue
        variants = exchanges + (["nccl_halves", "nccl_overlap"] if a.overlap else [])
        if a.chunks > 1:
            if a.chunks > experts // a.world:
                print(f"{name:20s} nccl_chunks{a.chunks} skipped: {experts // a.world} experts per rank")
            else:
                variants.append(f"nccl_chunks{a.chunks}")
        if "symmetric_memory" in variants and experts // a.world > 16:
            print(f"{name:20s} symmetric_memory skipped: {experts // a.world} experts per rank > 16 "
                  "(torch's all_to_all_vdev_2d)")
            variants.remove("symmetric_memory")
        ep = run_ep(a.world, shape, variants, a.reps, a.rounds, a.device)
        single = run_single(shape, a.reps, a.rounds, a.device)
        single_ms = statistics.median(single)
        flops_per_rank = 18.0 * (tokens // a.world) * top_k * hidden * ffn  # fwd 6 + bwd 12 per row
        for variant in variants:
            ep_rounds = ep[variant]["rounds_ms"]
            ep_ms = statistics.median(ep_rounds)
            row = {"case": name, "world": a.world, "exchange": variant, "tokens": tokens, "hidden": hidden,
                   "ffn": ffn, "experts": experts, "top_k": top_k, "reps": a.reps, "ep_rounds_ms": ep_rounds,
                   "single_rounds_ms": single, "ep_ms": ep_ms, "single_ms": single_ms, "speedup": single_ms / ep_ms,
                   "ep_tflops_per_gpu": flops_per_rank / ep_ms / 1e9,
                   "single_tflops": flops_per_rank * a.world / single_ms / 1e9}
            rows.append(row)
            print(f"{name:20s} {a.world:2d} {variant:>16s} {ep_ms:11.3f} {single_ms:14.3f} {row['speedup']:7.2f}x "
                  f"{row['ep_tflops_per_gpu']:15.1f} {row['single_tflops']:14.1f}", flush=True)
    if a.json:
        info = {"device": torch.cuda.get_device_name(0) if a.device == "cuda" else "cpu", "torch": torch.__version__,
                "world": a.world, "exchanges": exchanges, "overlap": a.overlap, "chunks": a.chunks,
                "nccl_nvls_enable": os.environ.get("NCCL_NVLS_ENABLE", "0 (set by the bench)")}
        with open(a.json, "w") as f:
            json.dump({"info": info, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
