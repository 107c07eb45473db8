"""sparsetrain.torch.ExpertParallelMoELayer on 2, 4 and 8 gloo processes (one machine, CPU), and on
2, 4 and 8 GPUs with NCCL where the machine has them (skipped, visibly, elsewhere), against the
single-process MoELayer holding all the experts (on the rank's own device), run on the ranks'
tokens concatenated in rank order: out, dx, dlogits and every expert's weight gradients (gathered
from the ranks) must be bitwise equal. Cases: fp32 and bf16, softmax and sigmoid, top_k 1 and 2, token counts per rank
that are multiples of nothing (one rank with none), empty experts, a rank whose tokens all go to
other ranks and a rank that receives no rows, single grouped weights with main_grad and delayed
wgrad, the experts in FP8 (blockwise e4m3). Each world size is launched once for all its cases
(processes cost seconds to start); the exchanges' receive buffers are poisoned with NaN; a
failing rank fails its case with the rank's traceback, and a launch that outlives its timeout (a
deadlock) fails every case left. The same cases with overlap_chunks=2 (the NCCL exchange in two
groups of experts, on gloo here) and its refusals.
exchange="symmetric_memory" (torch's NVSHMEM all-to-all with device splits): the same cases on
GPUs where NVSHMEM is available (its symmetric buffers poisoned too, capacity above every rank's
tokens so the padded tail is exercised), N > max_tokens_per_rank refused before anything runs,
and the layer's forward + backward captured in one CUDA graph and replayed with new routing; on
the CPU (gloo) its argument checks and the error that says why it cannot run there."""

import os
import socket
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import NamedTuple, Tuple

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed: expert-parallel tests skipped")
dist = torch.distributed
if not dist.is_available() or not dist.is_gloo_available():
    pytest.skip("torch.distributed with gloo is not available: expert-parallel tests skipped", allow_module_level=True)

import torch.multiprocessing as mp  # noqa: E402

import sparsetrain.torch as stt  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
H, F = 16, 8
FP8_F = 16  # the FP8 recipe's features are multiples of 16 (fc2's in)
LAUNCH_TIMEOUT_S = 480  # 8 processes on CI's 2 cores; a deadlock ends here, not in CI's own timeout


class Case(NamedTuple):
    name: str
    world: int
    dtype: str
    score: str
    top_k: int
    num_experts: int
    tokens: Tuple[int, ...]  # per rank
    routing: str = "random"  # or "skewed": rank 0's tokens avoid its experts, _silent(world) gets none
    normalize: bool = False
    expert_bias: bool = False
    grouped_main_grad_delayed: bool = False  # single_grouped_weight, bias, main_grad, delayed wgrad
    seed: int = 0
    fp8: bool = False  # the experts in FP8 (bf16, no bias, ffn FP8_F)


CASES = [
    Case("fp32_softmax_k2_E4_N13_7", 2, "float32", "softmax", 2, 4, (13, 7), seed=1),
    Case("bf16_sigmoid_k1_E6_N5_11_bias", 2, "bfloat16", "sigmoid", 1, 6, (5, 11), expert_bias=True, seed=2),
    Case("bf16_softmax_k2_E4_skewed", 2, "bfloat16", "softmax", 2, 4, (9, 6), "skewed", normalize=True, seed=3),
    Case("fp32_sigmoid_k1_E4_N10_0", 2, "float32", "sigmoid", 1, 4, (10, 0), seed=4),
    Case("bf16_softmax_k2_E6_grouped_main_grad_delayed", 2, "bfloat16", "softmax", 2, 6, (11, 8),
         grouped_main_grad_delayed=True, seed=5),
    Case("bf16_softmax_k2_E8_N7_13_3_10", 4, "bfloat16", "softmax", 2, 8, (7, 13, 3, 10), normalize=True, seed=6),
    Case("fp32_sigmoid_k1_E8_skewed", 4, "float32", "sigmoid", 1, 8, (5, 9, 4, 6), "skewed", seed=7),
    Case("bf16_sigmoid_k2_E8_skewed", 4, "bfloat16", "sigmoid", 2, 8, (6, 3, 11, 2), "skewed", normalize=True,
         expert_bias=True, seed=8),
    Case("fp32_softmax_k2_E4_N3_0_8_5", 4, "float32", "softmax", 2, 4, (3, 0, 8, 5), seed=9),
    Case("bf16_sigmoid_k2_E12_grouped_main_grad_delayed", 4, "bfloat16", "sigmoid", 2, 12, (9, 4, 7, 5),
         grouped_main_grad_delayed=True, seed=10),
    Case("bf16_softmax_k2_E4_N13_7_fp8", 2, "bfloat16", "softmax", 2, 4, (13, 7), normalize=True, seed=11, fp8=True),
    Case("bf16_sigmoid_k2_E8_skewed_fp8", 4, "bfloat16", "sigmoid", 2, 8, (6, 3, 11, 2), "skewed", seed=12, fp8=True),
    Case("fp32_softmax_k2_E8_N5_0_9_3_1_7_2_11_bias", 8, "float32", "softmax", 2, 8, (5, 0, 9, 3, 1, 7, 2, 11),
         expert_bias=True, seed=13),
    # (skewed without an expert bias: a bias can lift an expert the skewed logits rule out)
    Case("bf16_sigmoid_k2_E16_skewed", 8, "bfloat16", "sigmoid", 2, 16, (6, 3, 11, 2, 4, 0, 8, 5), "skewed",
         normalize=True, seed=14),
    Case("bf16_softmax_k2_E16_grouped_main_grad_delayed", 8, "bfloat16", "softmax", 2, 16, (9, 4, 7, 5, 1, 3, 6, 2),
         grouped_main_grad_delayed=True, seed=15),
    Case("bf16_softmax_k1_E8_fp8", 8, "bfloat16", "softmax", 1, 8, (4, 7, 0, 5, 9, 2, 6, 3), seed=16, fp8=True),
]


def _poisoned_buffer(like, rows):
    return like.new_full((rows, *like.shape[1:]), float("nan"))


def _silent(world):
    """The rank whose experts no token chooses in a skewed case (with 2 ranks, rank 0: it then
    both sends all its tokens away and receives none)."""
    return world - 1 if world > 2 else 0


def _data(case, rank):
    """The whole batch (the same on every rank, from the case's seed) and this rank's slice."""
    g = torch.Generator().manual_seed(1000 + case.seed)
    dtype = getattr(torch, case.dtype)
    n, E = sum(case.tokens), case.num_experts
    x = torch.randn(n, H, generator=g).to(dtype)
    logits = 2 * torch.randn(n, E, generator=g)
    if case.routing == "skewed":
        local = E // case.world
        silent = _silent(case.world)
        logits[:, silent * local:(silent + 1) * local] = -30.0  # nobody chooses its experts
        logits[:case.tokens[0], :local] = -30.0  # rank 0's tokens choose none of rank 0's experts
    dout = torch.randn(n, H, generator=g).to(dtype)
    dsum = torch.randn(E, generator=g)
    bias = 0.3 * torch.randn(E, generator=g) if case.expert_bias else None
    first = sum(case.tokens[:rank])
    return x, logits, dout, dsum, bias, slice(first, first + case.tokens[rank])


def _run(layer, x, logits, dout, dsum, bias, fused):
    x, logits = x.clone().requires_grad_(), logits.clone().requires_grad_()
    o = layer(x, logits, bias)
    (o.out.float() * dout.float()).sum().add((o.score_sum * dsum).sum()).backward()
    if fused:
        layer.backward_dw()
    return o, x.grad, logits.grad


def _weight_grads(experts, fused):
    grads = {}
    for name, p in experts.named_parameters():
        if fused:
            grads[name] = p.main_grad
        else:
            grads[name] = torch.zeros_like(p) if p.grad is None else p.grad
    return grads


def _global_name(name, source, local):
    """An EP rank's local parameter name -> the full layer's (per-expert names renumbered)."""
    stem = name.rstrip("0123456789")
    return f"{stem}{source * local + int(name[len(stem):])}" if stem != name else name


CHUNKED = "nccl_chunks"  # the NCCL exchange with overlap_chunks=2: 1 + 1 experts at 2 a rank, 1 + 2 at 3


def _exchange_options(case, exchange):
    """The EP layer's exchange arguments; the symmetric buffers' capacity is above every rank's
    tokens, so every rank's receive buffer has a padded tail."""
    if exchange == "nccl":
        return {}
    if exchange == CHUNKED:
        return dict(overlap_chunks=min(2, case.num_experts // case.world))
    return dict(exchange=exchange, max_tokens_per_rank=max(case.tokens) + 2)


def _layers(case, device, exchange):
    """The full MoELayer and the EP layer holding this rank's slice of its experts."""
    fused = case.grouped_main_grad_delayed
    options = dict(score=case.score, normalize=case.normalize, params_dtype=getattr(torch, case.dtype),
                   bias=fused, single_grouped_weight=fused, fuse_wgrad_accumulation=fused, delay_wgrad_compute=fused,
                   device=device, fp8=case.fp8)
    ffn = FP8_F if case.fp8 else F
    torch.manual_seed(case.seed)
    full = stt.MoELayer(case.num_experts, H, ffn, case.top_k, **options)
    ep = stt.ExpertParallelMoELayer(case.num_experts, H, ffn, case.top_k, **options,
                                    **_exchange_options(case, exchange))
    ep.load_full_state_dict(full.state_dict())
    if fused:
        for p in list(full.experts.parameters()) + list(ep.experts.parameters()):
            p.main_grad = torch.zeros(p.shape, dtype=torch.float32, device=device)
    return full, ep


def _check_case(case, rank, world, device, exchange="nccl"):
    fused = case.grouped_main_grad_delayed
    full, ep = _layers(case, device, exchange)
    x, logits, dout, dsum, bias, mine = (t.to(device) if isinstance(t, torch.Tensor) else t
                                         for t in _data(case, rank))

    want, want_dx, want_dlogits = _run(full, x, logits, dout, dsum, bias, fused)
    got, got_dx, got_dlogits = _run(ep, x[mine], logits[mine], dout[mine], dsum, bias, fused)
    _compare(case, rank, world, ep, full, fused, (got, got_dx, got_dlogits), (want, want_dx, want_dlogits), mine)


def _compare(case, rank, world, ep, full, fused, got_all, want_all, mine):
    """The EP rank's out, dx, dlogits and the gathered experts' gradients against the full layer's."""
    (got, got_dx, got_dlogits), (want, want_dx, want_dlogits) = got_all, want_all
    # Every collective before any assertion, so a mismatch on one rank cannot leave the others waiting.
    counts = got.counts.clone()
    dist.all_reduce(counts)
    local = case.num_experts // world
    gathered = {}
    for name, g in _weight_grads(ep.experts, fused).items():
        parts = [torch.empty_like(g) for _ in range(world)]
        dist.all_gather(parts, g.contiguous())
        if name.rstrip("0123456789") == name:  # single grouped [E / W, ...]: the ranks' slices in order
            gathered[name] = torch.cat(parts)
        else:
            for source, part in enumerate(parts):
                gathered[_global_name(name, source, local)] = part

    where = f"case {case.name}, rank {rank} of {world}"
    if case.routing == "skewed":
        silent = _silent(world)
        assert int(counts[silent * local:(silent + 1) * local].sum()) == 0, f"{where}: rank {silent} got rows"
        if rank == 0:
            assert int(got.counts[:local].sum()) == 0, f"{where}: rank 0's tokens chose its own experts"
    assert torch.equal(counts, want.counts), f"{where}: counts summed over ranks"
    for what, a, b in (("out", got.out, want.out[mine]), ("dx", got_dx, want_dx[mine]),
                       ("dlogits", got_dlogits, want_dlogits[mine])):
        assert a.dtype == b.dtype and torch.equal(a, b), f"{where}: {what} differs from MoELayer's"
    want_grads = {f"experts.{k}": v for k, v in _weight_grads(full.experts, fused).items()}
    assert sorted(gathered) == sorted(k[len("experts."):] for k in want_grads), f"{where}: parameter names"
    for name, g in gathered.items():
        assert torch.equal(g, want_grads[f"experts.{name}"]), f"{where}: gradient of experts.{name} differs"


def _poisoned_symmetric(empty):
    def make(shape, dtype, device, group_name):
        t = empty(shape, dtype, device, group_name)
        return t.fill_(float("nan")) if t.dtype.is_floating_point else t.fill_(-1)
    return make


def _check_symmetric_arguments(world):
    """exchange="symmetric_memory"'s argument checks, then (on gloo) the error saying why it cannot run."""
    with pytest.raises(ValueError, match="exchange: expected one of nccl, symmetric_memory, got 'nvshmem'"):
        stt.ExpertParallelMoELayer(2 * world, H, F, 1, exchange="nvshmem")
    for bad in (None, 0, 2.5):
        with pytest.raises(ValueError, match=f"max_tokens_per_rank: expected a positive int .* got {bad}"):
            stt.ExpertParallelMoELayer(2 * world, H, F, 1, exchange="symmetric_memory", max_tokens_per_rank=bad)
    with pytest.raises(ValueError, match="num_experts: exchange='symmetric_memory' takes at most 16 experts per rank"):
        stt.ExpertParallelMoELayer(17 * world, H, F, 1, exchange="symmetric_memory", max_tokens_per_rank=8)
    if dist.get_backend() == "gloo":
        with pytest.raises(RuntimeError, match="exchange='symmetric_memory' is not available here: .*use "
                                               "exchange='nccl'"):
            stt.ExpertParallelMoELayer(2 * world, H, F, 1, exchange="symmetric_memory", max_tokens_per_rank=8)


def _check_chunk_arguments(world):
    """overlap_chunks' refusals, each before anything runs."""
    for chunks, extra, match in ((0, {}, "overlap_chunks: expected an int >= 1, got 0"),
                                 (3, {}, "overlap_chunks: expected at most the 2 experts of a rank"),
                                 (2, dict(exchange="symmetric_memory", max_tokens_per_rank=4),
                                  "overlap_chunks: expected 1 with exchange='symmetric_memory'")):
        with pytest.raises(ValueError, match=match):
            stt.ExpertParallelMoELayer(2 * world, H, F, 1, overlap_chunks=chunks, **extra)
    layer = stt.ExpertParallelMoELayer(2 * world, H, F, 1, overlap_chunks=2, fuse_wgrad_accumulation=True)
    for p in layer.experts.parameters():
        p.main_grad, p.overwrite_main_grad = torch.zeros_like(p, dtype=torch.float32), True
    with pytest.raises(ValueError, match="overlap_chunks: expected expert parameters without overwrite_main_grad"):
        layer(torch.zeros(3, H), torch.zeros(3, 2 * world))


def _gather(t):
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, t.contiguous())
    return parts


def _emulated_dispatch(src, dst, in_splits, splits_offsets):
    """torch.ops.symm_mem.all_to_all_vdev_2d as nvshmem_extension.cu does it, over gloo: src's rows
    ordered by (destination, local expert) with in_splits [E]; dst grouped by local expert, sources
    in rank order; an expert that gets no row still takes major_align = 1 row (left unwritten);
    splits_offsets [2, E] = [local expert, source] splits and dst offsets."""
    world, rank = dist.get_world_size(), dist.get_rank()
    local = in_splits.numel() // world
    sources, splits = _gather(src), _gather(in_splits)
    starts = [torch.cumsum(s, 0) - s for s in splits]
    offset, table = 0, torch.zeros(2, local, world, dtype=torch.int64)
    for e in range(local):
        first = offset
        for s in range(world):
            n, at = int(splits[s][rank * local + e]), int(starts[s][rank * local + e])
            dst[offset:offset + n] = sources[s][at:at + n]
            table[0, e, s], table[1, e, s] = n, offset
            offset += n
        offset = first + max(offset - first, 1)
    splits_offsets.copy_(table.view(2, -1))


def _emulated_combine(src, dst, in_splits_offsets, splits_offsets):
    """torch.ops.symm_mem.all_to_all_vdev_2d_offset likewise: src's rows at [local expert,
    destination] splits and offsets; dst in (source rank, its local expert) order, no gaps."""
    world, rank = dist.get_world_size(), dist.get_rank()
    local = in_splits_offsets.shape[1] // world
    sources, tables = _gather(src), _gather(in_splits_offsets)
    offset, table = 0, torch.zeros(2, world, local, dtype=torch.int64)
    for s in range(world):
        for e in range(local):
            n, at = int(tables[s][0, e * world + rank]), int(tables[s][1, e * world + rank])
            dst[offset:offset + n] = sources[s][at:at + n]
            table[0, s, e], table[1, s, e] = n, offset
            offset += n
    splits_offsets.copy_(table.view(2, -1))


def _emulate_symmetric_memory(ep):
    """The symmetric-memory layer on gloo: plain CPU buffers and the ops above, so that CI checks
    the layer's layout logic (groups, an empty expert's row, offsets, autograd) without NVSHMEM."""
    ep._symmetric_memory_unavailable = lambda group, device: None
    ep._symmetric_empty = lambda shape, dtype, device, group_name: torch.empty(shape, dtype=dtype, device=device)
    ep._SymmetricBuffers.dispatch = lambda self, src, dst, name: _emulated_dispatch(
        src, dst, self.in_splits, self.splits_offsets[name])
    ep._SymmetricBuffers.combine = lambda self, src, dst, name: _emulated_combine(
        src, dst, self.splits_offsets["x"], self.splits_offsets[name])


GRAPH_CASE = "cuda_graph_replays_with_new_routing"


def _check_graph(rank, world, device):
    """The symmetric-memory layer's forward + backward captured in one CUDA graph (no host sync
    may happen in it), replayed on new tokens (new routing, new split values), each replay equal
    to the full layer run eagerly on the same tokens."""
    case = Case(GRAPH_CASE, world, "bfloat16", "softmax", 2, 2 * world, tuple(5 + 3 * r for r in range(world)),
                seed=20)
    full, ep = _layers(case, device, "symmetric_memory")
    x, logits, dout, dsum, bias, mine = (t.to(device) if isinstance(t, torch.Tensor) else t
                                         for t in _data(case, rank))
    static_x, static_logits = x[mine].clone().requires_grad_(), logits[mine].clone().requires_grad_()
    static_dout = dout[mine].clone()

    def step():
        o = ep(static_x, static_logits)
        (o.out.float() * static_dout.float()).sum().add((o.score_sum * dsum).sum()).backward()
        return o

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up (and the buffers' allocation) outside the graph
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(side)
    leaves = [static_x, static_logits, *ep.experts.parameters()]
    for p in leaves:
        p.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_o = step()
    for seed in (21, 22):
        new = case._replace(seed=seed)
        x, logits, dout, dsum_new, bias, mine = (t.to(device) if isinstance(t, torch.Tensor) else t
                                                 for t in _data(new, rank))
        with torch.no_grad():
            static_x.copy_(x[mine])
            static_logits.copy_(logits[mine])
            static_dout.copy_(dout[mine])
            dsum.copy_(dsum_new)
        for p in leaves:
            p.grad.zero_()  # the graph's backward accumulates into these
        graph.replay()
        torch.cuda.synchronize()
        full.zero_grad(set_to_none=True)
        want = _run(full, x, logits, dout, dsum, bias, False)
        _compare(new, rank, world, ep, full, False, (static_o, static_x.grad, static_logits.grad), want, mine)


def _worker(rank, world, init_file, done_dir, cases, backend, exchange="nccl"):
    torch.set_num_threads(1)  # the processes share the machine's cores
    device, options = "cpu", {}
    if backend == "nccl":
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast stays off on the lent machines
        device = f"cuda:{rank}"
        torch.cuda.set_device(device)
        if exchange == "symmetric_memory":  # NVSHMEM's teams need the group bound to this GPU
            options = dict(device_id=torch.device(device))
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=LAUNCH_TIMEOUT_S), **options)
    try:
        import sparsetrain.torch.expert_parallel as ep  # noqa: PLC0415

        if backend == "gloo" and exchange == "symmetric_memory":
            _emulate_symmetric_memory(ep)
        ep._receive_buffer = _poisoned_buffer  # every received row must be written by the exchange
        ep._symmetric_empty = _poisoned_symmetric(ep._symmetric_empty)  # and every symmetric row read
        if world > 1:
            with pytest.raises(ValueError, match=f"num_experts: expected a multiple of the group's size {world}"):
                stt.ExpertParallelMoELayer(world + 1, H, F, 1)
            if exchange == "nccl":
                _check_symmetric_arguments(world)
            if exchange == CHUNKED:
                _check_chunk_arguments(world)
        if exchange == "symmetric_memory":
            layer = stt.ExpertParallelMoELayer(2 * world, H, F, 1, exchange=exchange, max_tokens_per_rank=4,
                                               params_dtype=torch.bfloat16, device=device)
            with pytest.raises(ValueError, match="x: expected at most max_tokens_per_rank = 4 tokens on this rank"):
                layer(torch.zeros(5, H, dtype=torch.bfloat16, device=device), torch.zeros(5, 2 * world, device=device))
        for case in cases:
            if case.name == GRAPH_CASE:
                _check_graph(rank, world, device)
            else:
                _check_case(case, rank, world, device, exchange)
            with open(os.path.join(done_dir, f"{case.name}.{rank}"), "w"):
                pass
    finally:
        dist.destroy_process_group()


_LAUNCHES = {}


def _launch(world, backend="gloo", exchange="nccl"):
    """Runs every case of this world size in one group of `world` processes (gloo on the CPU, or
    NCCL with one GPU each, the EP layer with `exchange`; with symmetric memory the CUDA-graph case
    last), once; returns the names of the cases every rank finished and the launch's error (None if
    it ended well)."""
    key = (world, backend, exchange)
    if key not in _LAUNCHES:
        cases = [c for c in CASES if c.world == world]
        if exchange == "symmetric_memory" and backend == "nccl":
            cases.append(Case(GRAPH_CASE, world, "bfloat16", "softmax", 2, 2 * world, ()))
        with tempfile.TemporaryDirectory() as tmp:
            error = None
            ctx = mp.start_processes(_worker, args=(world, os.path.join(tmp, "store"), tmp, cases, backend, exchange),
                                     nprocs=world, join=False, start_method="spawn")
            deadline = time.monotonic() + LAUNCH_TIMEOUT_S
            try:
                while not ctx.join(timeout=max(0.1, deadline - time.monotonic())):
                    if time.monotonic() >= deadline:
                        error = f"{world} processes still running after {LAUNCH_TIMEOUT_S} s (a deadlock?)"
                        break
            except Exception as e:  # noqa: BLE001  (ProcessRaisedException carries the child's traceback)
                error = f"{type(e).__name__}: {e}"
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
                    p.join()
            done = {c.name for c in cases if all(os.path.exists(os.path.join(tmp, f"{c.name}.{r}"))
                                                 for r in range(world))}
        _LAUNCHES[key] = (done, error)
    return _LAUNCHES[key]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"W{c.world}_{c.name}")
def test_expert_parallel_layer_equals_the_single_process_layer_bitwise(case):
    done, error = _launch(case.world)
    assert case.name in done, f"{case.name} did not pass on every rank:\n{error}"


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"W{c.world}_{c.name}")
def test_symmetric_memory_layer_logic_with_emulated_ops_on_gloo(case):
    """exchange="symmetric_memory" on gloo with torch's NVSHMEM ops emulated (their layout as
    nvshmem_extension.cu lays rows out, an empty expert's unwritten row included): the layer's
    groups, zeroed rows, offsets and autograd, bitwise against the full layer. The GPU test below
    runs the real ops."""
    done, error = _launch(case.world, "gloo", "symmetric_memory")
    assert case.name in done, f"{case.name} did not pass on every rank (emulated symmetric memory):\n{error}"


@pytest.mark.parametrize("case", [c for c in CASES if c.num_experts // c.world > 1],
                         ids=lambda c: f"W{c.world}_{c.name}")
def test_layer_with_overlap_chunks_equals_the_single_process_layer_bitwise(case):
    """overlap_chunks=2 (one expert a chunk at 2 experts a rank, uneven chunks of 1 and 2 at 3;
    the dispatches started ahead, their receive buffers poisoned): bitwise the full layer, as
    unchunked."""
    done, error = _launch(case.world, "gloo", CHUNKED)
    assert case.name in done, f"{case.name} did not pass on every rank (overlap_chunks):\n{error}"


def _nccl_gpus():
    """GPUs NCCL may use here (0 without CUDA or NCCL)."""
    if not (torch.cuda.is_available() and dist.is_nccl_available()):
        return 0
    return torch.cuda.device_count()


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"nccl_W{c.world}_{c.name}")
def test_expert_parallel_layer_on_gpus_equals_the_single_gpu_layer_bitwise(case):
    """The same cases with NCCL, one GPU per rank: the exchange moves device tensors, the experts
    run the CUDA GroupedMLP, the reference runs on each rank's GPU. Every expert GEMM runs one
    kernel shape without split-K (cuda/grouped_linear/sm90_tuning.h), so a row's result does not
    depend on how many experts or rows share the launch: bitwise, as on the CPU."""
    gpus = _nccl_gpus()
    if gpus < case.world:
        pytest.skip(f"NCCL with {case.world} GPUs: this machine has {gpus} usable by NCCL")
    done, error = _launch(case.world, "nccl")
    assert case.name in done, f"{case.name} did not pass on every rank (NCCL):\n{error}"


def _nvshmem_available():
    try:
        import torch.distributed._symmetric_memory as symm_mem  # noqa: PLC0415
    except ImportError:
        return False
    return symm_mem.is_nvshmem_available()


GRAPH_CASES = [Case(GRAPH_CASE, w, "bfloat16", "softmax", 2, 2 * w, ()) for w in (2, 4, 8)]


@pytest.mark.parametrize("case", [*CASES, *GRAPH_CASES], ids=lambda c: f"symm_W{c.world}_{c.name}")
def test_symmetric_memory_layer_on_gpus_equals_the_single_gpu_layer_bitwise(case):
    """exchange="symmetric_memory" on the same cases (NCCL group, one GPU per rank, NVSHMEM): the
    rows land grouped by local expert in a receive buffer padded to capacity (an empty expert's
    unwritten row zeroed), the experts run on it with device splits, fc2 writes the buffer the
    return exchange reads; bitwise equal to the full layer as with the NCCL exchange. Plus the
    layer's step captured in a CUDA graph and replayed with new routing."""
    gpus = _nccl_gpus()
    if gpus < case.world:
        pytest.skip(f"symmetric memory with {case.world} GPUs: this machine has {gpus} usable by NCCL")
    if not _nvshmem_available():
        pytest.skip("symmetric memory: torch.distributed._symmetric_memory.is_nvshmem_available() is False here")
    done, error = _launch(case.world, "nccl", "symmetric_memory")
    assert case.name in done, f"{case.name} did not pass on every rank (symmetric memory):\n{error}"


def test_layer_rejects_an_unknown_exchange():
    with pytest.raises(ValueError, match="exchange: expected one of nccl, symmetric_memory, got 'nvshmem'"):
        stt.ExpertParallelMoELayer(4, H, F, 1, exchange="nvshmem")


def test_layer_needs_an_initialised_process_group():
    if dist.is_initialized():
        pytest.skip("a process group is initialised in this process")
    with pytest.raises(RuntimeError, match="torch.distributed is not initialised"):
        stt.ExpertParallelMoELayer(4, H, F, 1)


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_torchrun_example_runs():
    """examples/moe_expert_parallel.py under torchrun (2 processes, gloo), as the README shows it. GPUs
    hidden: with CUDA the example binds one GPU per rank, which a one-GPU machine lacks (the NCCL
    runs are the tests above, skipped there)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2",
           "--master-addr", "127.0.0.1", "--master-port", str(_free_port()),
           str(REPO / "examples" / "moe_expert_parallel.py")]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=LAUNCH_TIMEOUT_S, cwd=REPO,
                       env={**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""})
    assert r.returncode == 0, f"torchrun exited {r.returncode}:\n{r.stdout}\n{r.stderr}"
    for rank in range(2):  # the process group's real backend named (gloo here), not the exchange's name
        assert f"rank {rank} of 2 (gloo process group, exchange=nccl)" in r.stdout, r.stdout
        assert "equals the single-process layer" in r.stdout, r.stdout
