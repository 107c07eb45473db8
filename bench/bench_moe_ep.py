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

--torch adds the row "torch": the peer, a plain torch.distributed composition in the same
processes (_TorchEP: softmax top-k routing, rows sorted by expert, the counts and rows by
all_to_all_single, the local experts' SwiGLU MLP by torch._grouped_mm, the rows back, a weighted
sum), with its own weights.

--weak W1,W2,...: weak scaling instead: every GPU holds tokens / 2 tokens (the EP = 2 load of the
shape) at each world size W (W = 1 a group of one: the same layer with all experts local), the
experts fixed; rows "weak": ms a step per W and the efficiency t(1) / t(W) (ideal 1), for each
exchange row (and "torch").

--main-grad: our layers (EP and the single GPU) with fuse_wgrad_accumulation and an fp32
main_grad on every expert weight, as Megatron's DDP trains them: the weight gradients are added
into main_grad by the wgrad GEMMs' epilogue (a chunk of overlap_chunks then touches only its own
experts' main_grad) instead of being handed to autograd as .grad. The torch row is unchanged.

--quick: small shapes; --device cpu (with --quick) runs W gloo processes on the CPU: a smoke test
of the script, no timings worth reading.

    python bench/bench_moe_ep.py [--world 2] [--only mixtral,qwen3] [--quick] [--device cuda|cpu]
                                 [--exchange nccl,symmetric_memory] [--overlap] [--chunks N] [--torch]
                                 [--weak 1,2,4,8] [--main-grad] [--reps 10] [--rounds 3] [--json out.json]
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


def _main_grad_options(main_grad):
    """Our layers' options for --main-grad."""
    return dict(fuse_wgrad_accumulation=True) if main_grad else {}


def _give_main_grads(layer, main_grad):
    """An fp32 main_grad on each expert weight (--main-grad), as Megatron's DDP attaches them."""
    if main_grad:
        for w in layer.experts.parameters():
            w.main_grad = torch.zeros(w.shape, dtype=torch.float32, device=w.device)


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


class _TorchEP(torch.nn.Module):
    """The peer: expert parallelism as a plain torch.distributed composition (what a user writes
    without this library). Softmax top-k routing; a token's rows sorted by expert; the counts by
    all_to_all_single and read on the host (the splits); the rows there and back by
    torch.distributed.nn's all_to_all_single (with autograd); on each rank its experts' SwiGLU MLP,
    rows grouped by expert, by torch._grouped_mm; each token's rows weighted and summed."""

    def __init__(self, experts, hidden, ffn, top_k, device, seed):
        super().__init__()
        self.world = dist.get_world_size()
        self.experts, self.local, self.top_k, self.ffn = experts, experts // self.world, top_k, ffn
        g = torch.Generator().manual_seed(seed)

        def weight(*shape):
            return torch.nn.Parameter((torch.randn(*shape, generator=g) / shape[-1] ** 0.5).to(device, torch.bfloat16))

        self.w1 = weight(self.local, 2 * ffn, hidden)  # [E_local, out, in]: _grouped_mm takes it transposed
        self.w2 = weight(self.local, hidden, ffn)

    def forward(self, x, logits):
        from torch.distributed.nn.functional import all_to_all_single  # noqa: PLC0415

        W, L, k = self.world, self.local, self.top_k
        probs, chosen = torch.topk(torch.softmax(logits.float(), dim=-1), k, dim=-1)
        flat = chosen.reshape(-1)
        order = torch.argsort(flat, stable=True)
        token = order // k
        counts = torch.bincount(flat, minlength=self.experts)
        theirs = torch.empty_like(counts)
        dist.all_to_all_single(theirs, counts)  # [source, local expert]: what each rank sends here
        theirs = theirs.view(W, L)
        send = counts.view(W, L).sum(1).tolist()  # host syncs: the splits
        receive = theirs.sum(1).tolist()
        got = all_to_all_single(x.new_empty(sum(receive), x.shape[1]), x[token], receive, send)
        # got is source-major (each source's rows by expert); the GEMMs want expert-major rows.
        per = theirs.reshape(-1)
        start = torch.cumsum(per, 0) - per  # block (source, expert) in got
        by_expert = theirs.t().reshape(-1)
        first = torch.repeat_interleave(start.view(W, L).t().reshape(-1), by_expert)
        rank_in = torch.arange(first.numel(), device=x.device) - torch.repeat_interleave(
            torch.cumsum(by_expert, 0) - by_expert, by_expert)
        idx = first + rank_in
        offs = torch.cumsum(theirs.sum(0), 0).to(torch.int32)
        h = torch._grouped_mm(got[idx], self.w1.transpose(-2, -1), offs=offs)
        y = torch._grouped_mm(torch.nn.functional.silu(h[:, :self.ffn]) * h[:, self.ffn:], self.w2.transpose(-2, -1),
                              offs=offs)
        inverse = torch.empty_like(idx)
        inverse[idx] = torch.arange(idx.numel(), device=x.device)
        back = all_to_all_single(x.new_empty(sum(send), x.shape[1]), y[inverse], send, receive)
        weighted = back.float() * probs.reshape(-1)[order, None]
        return torch.zeros(x.shape, dtype=torch.float32, device=x.device).index_add(0, token, weighted).to(x.dtype)


def _torch_step(layer, x, logits, dout):
    torch.autograd.backward(layer(x, logits), dout)


def _symmetric_heap_bytes(tokens, hidden, experts, top_k, world):
    """NVSHMEM's symmetric heap for the layer's buffers (ExpertParallelMoELayer's docstring), with
    room to spare; NVSHMEM's default is 1 GiB."""
    send = tokens * top_k
    receive = world * send + experts // world + 1
    return int(1.25 * ((2 * send + 3 * receive) * hidden * 2 + (2 * send + 2 * receive) * 4)) + (256 << 20)


def _ep_worker(rank, world, init_file, shape, variants, reps, rounds, device_kind, main_grad, result_file):
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
            if variant == "torch":
                layer = _TorchEP(experts, hidden, ffn, top_k, device, seed=rank)
            else:
                layer = stt.ExpertParallelMoELayer(experts, hidden, ffn, top_k, params_dtype=torch.bfloat16,
                                                   device=device, **exchange, **_main_grad_options(main_grad))
                _give_main_grads(layer, main_grad)
            if variant == "torch":
                fn = functools.partial(_torch_step, layer, x, logits, dout)
            elif variant in ("nccl_halves", "nccl_overlap"):
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


def run_ep(world, shape, variants, reps, rounds, device, main_grad=False):
    """{variant: {"rounds_ms": [...]}} from one group of `world` processes."""
    with tempfile.TemporaryDirectory() as tmp:
        result = os.path.join(tmp, "result.json")
        mp.start_processes(_ep_worker, args=(world, os.path.join(tmp, "store"), shape, variants, reps, rounds, device,
                                             main_grad, result), nprocs=world, join=True, start_method="spawn")
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


def run_single(shape, reps, rounds, device, main_grad=False):
    import sparsetrain.torch as stt  # noqa: PLC0415

    tokens, hidden, ffn, experts, top_k = shape
    torch.manual_seed(0)
    layer = stt.MoELayer(experts, hidden, ffn, top_k, params_dtype=torch.bfloat16, device=device,
                         **_main_grad_options(main_grad))
    _give_main_grads(layer, main_grad)
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
    ap.add_argument("--torch", action="store_true", help="add the row torch: a plain torch.distributed composition")
    ap.add_argument("--weak", default=None, metavar="W1,W2,...",
                    help="weak scaling over these world sizes (each GPU the EP = 2 load) instead of --world")
    ap.add_argument("--main-grad", action="store_true",
                    help="our layers with fuse_wgrad_accumulation and fp32 main_grad (Megatron's DDP)")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", default=None, metavar="PATH")
    a = ap.parse_args()
    worlds = [int(w) for w in a.weak.split(",")] if a.weak else [a.world]
    if a.device == "cuda" and torch.cuda.device_count() < max(worlds):
        sys.exit(f"world {max(worlds)} needs {max(worlds)} GPUs; this machine has {torch.cuda.device_count()}")
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
    if a.weak:
        variants = (exchanges if a.exchange else ["nccl"]) + (["torch"] if a.torch else [])
        rows = weak_scaling(worlds, [(n, cases[n]) for n in names], variants, a.reps, a.rounds, a.device,
                            a.main_grad)
        info = {"mode": "weak", "worlds": worlds, "main_grad": a.main_grad}
    else:
        rows = strong_scaling(a, exchanges, [(n, cases[n]) for n in names])
        info = {"world": a.world, "overlap": a.overlap, "chunks": a.chunks, "main_grad": a.main_grad}
    if a.json:
        info.update({"device": torch.cuda.get_device_name(0) if a.device == "cuda" else "cpu",
                     "torch": torch.__version__, "exchanges": exchanges,
                     "nccl_nvls_enable": os.environ.get("NCCL_NVLS_ENABLE", "0 (set by the bench)")})
        with open(a.json, "w") as f:
            json.dump({"info": info, "rows": rows}, f, indent=1)


def weak_scaling(worlds, shapes, variants, reps, rounds, device, main_grad):
    """Each GPU tokens / 2 tokens of a shape at every world size; ms a step and t(W_min) / t(W)."""
    rows = []
    print(f"{'case':20s} {'exchange':>10s} " + " ".join(f"{'W=' + str(w) + ' ms':>10s} {'eff':>5s}" for w in worlds))
    for name, (tokens, hidden, ffn, experts, top_k) in shapes:
        per_gpu = tokens // 2
        ms = {v: {} for v in variants}
        for w in worlds:
            if experts % w:
                print(f"{name:20s} W = {w} skipped: {experts} experts not divisible by it")
                continue
            here = [v for v in variants if not (v == "symmetric_memory" and experts // w > 16)]
            got = run_ep(w, (per_gpu * w, hidden, ffn, experts, top_k), here, reps, rounds, device, main_grad)
            for v in here:
                ms[v][w] = statistics.median(got[v]["rounds_ms"])
        for v in variants:
            if not ms[v]:
                continue
            base = ms[v][min(ms[v])]
            eff = {w: base / t for w, t in ms[v].items()}
            rows.append({"case": name, "mode": "weak", "exchange": v, "tokens_per_gpu": per_gpu, "hidden": hidden,
                         "ffn": ffn, "experts": experts, "top_k": top_k, "reps": reps, "ms": ms[v],
                         "efficiency": eff})
            print(f"{name:20s} {v:>10s} " + " ".join(
                f"{ms[v][w]:10.3f} {eff[w]:5.2f}" if w in ms[v] else f"{'-':>10s} {'-':>5s}" for w in worlds),
                flush=True)
    return rows


def strong_scaling(a, exchanges, shapes):
    """The layer on a.world GPUs against one GPU holding every expert, the same global batch."""
    rows = []
    print(f"{'case':20s} {'W':>2s} {'exchange':>16s} {'EP ms/step':>11s} {'1 GPU ms/step':>14s} {'speedup':>8s} "
          f"{'EP TFLOP/s/GPU':>15s} {'1 GPU TFLOP/s':>14s}")
    for name, shape in shapes:
        tokens, hidden, ffn, experts, top_k = shape
        if experts % a.world or tokens % a.world:
            print(f"{name:20s} skipped: {experts} experts / {tokens} tokens not divisible by W = {a.world}")
            continue
        variants = exchanges + (["nccl_halves", "nccl_overlap"] if a.overlap else []) + (["torch"] if a.torch else [])
        if a.chunks > 1:
            if a.chunks > experts // a.world:
                print(f"{name:20s} nccl_chunks{a.chunks} skipped: {experts // a.world} experts per rank")
            else:
                variants.append(f"nccl_chunks{a.chunks}")
        if "symmetric_memory" in variants and experts // a.world > 16:
            print(f"{name:20s} symmetric_memory skipped: {experts // a.world} experts per rank > 16 "
                  "(torch's all_to_all_vdev_2d)")
            variants.remove("symmetric_memory")
        ep = run_ep(a.world, shape, variants, a.reps, a.rounds, a.device, a.main_grad)
        single = run_single(shape, a.reps, a.rounds, a.device, a.main_grad)
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
    return rows


if __name__ == "__main__":
    main()
