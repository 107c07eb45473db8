"""Expert parallelism for the MoE layer (sparsetrain.torch.ExpertParallelMoELayer): each rank of a
torch.distributed process group holds a contiguous slice of the experts; every rank routes its own
tokens (moe_route), the rows travel to their experts' ranks and back with all_to_all_single, and
each token's rows are summed in slot order. Invariant: the rows a rank's experts take are laid out
as MoELayer lays out the ranks' tokens concatenated in rank order (by expert, then by token), and
every step is a gather or an exchange, so the layer equals that MoELayer bitwise, forward and
backward. exchange="nccl": one host synchronisation per forward (the split sizes), none in the
backward. exchange="symmetric_memory": torch's NVSHMEM all-to-all with device-side splits into
symmetric buffers of a fixed capacity, no host synchronisation at all (CUDA-graph capturable)."""

from __future__ import annotations

import re
from typing import List, Mapping, NamedTuple, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist
from torch import Tensor, nn

from .._arrays import name_of_dtype
from .._moe import ROUTER_SCORES
from .grouped_mlp import GroupedMLP
from .moe import MoEOutput, check_layer_inputs, moe_route
from .token_rows import Rows, RowMaps, combine, expert_rows, row_maps, take


def _receive_buffer(like: Tensor, rows: int) -> Tensor:
    """The exchange's output rows (every row is written by it; the tests poison this buffer)."""
    return like.new_empty((rows, *like.shape[1:]))


def _exchange(t: Tensor, send: Sequence[int], receive: Sequence[int], group: Optional[dist.ProcessGroup],
              works: Optional[list] = None) -> Tensor:
    """t's rows [sum(send), ...] out, send[d] of them to rank d in rank order; [sum(receive), ...]
    back, receive[s] from rank s in rank order. Every rank calls it, zero-size parts included. With
    `works`, the exchange is started, not waited for: its handle is appended there, to be waited on
    before the result is read."""
    out = _receive_buffer(t, sum(receive))
    work = dist.all_to_all_single(out, t.contiguous(), list(receive), list(send), group=group,
                                  async_op=works is not None)
    if works is not None:
        works.append(work)
    return out


class _AllToAll(torch.autograd.Function):
    """_exchange of each tensor (the same splits for all); the backward exchanges the gradients in
    reverse (receive <-> send), waited. Gradients of unused outputs arrive as zeros (autograd
    materialises them), so every rank joins every exchange of the backward. works: None (the
    forward's exchanges waited), or a list: they are started, not waited for, their handles
    appended there, to be waited on before the outputs are read (NCCL: the current stream waits,
    the host does not; gloo: the host waits); started exchanges run in the order they started."""

    @staticmethod
    def forward(ctx, group: Optional[dist.ProcessGroup], send: List[int], receive: List[int],
                works: Optional[list], *tensors: Tensor):
        ctx.group, ctx.send, ctx.receive = group, send, receive
        return tuple(_exchange(t, send, receive, group, works) for t in tensors)

    @staticmethod
    def backward(ctx, *grads: Tensor):
        return (None, None, None, None, *(_exchange(g, ctx.receive, ctx.send, ctx.group) for g in grads))


class _WaitInBackward(torch.autograd.Function):
    """Identity; its backward waits for the work handles in works[i] (appended later, by
    _ReturnAll's backward) before handing the gradient on: the wait sits just before the
    gradient's first reader."""

    @staticmethod
    def forward(ctx, works: list, i: int, t: Tensor) -> Tensor:
        ctx.works, ctx.i = works, i
        return t.view_as(t)

    @staticmethod
    def backward(ctx, g: Tensor):
        for w in ctx.works[ctx.i]:
            w.wait()
        return None, None, g


class _ReturnAll(torch.autograd.Function):
    """The chunks' return exchanges as one autograd node. Forward: they were started as each
    chunk's experts finished (`started`: chunk c's (send, receive, result, works)); here they are
    waited for and their results handed out. Backward: the reverse exchanges of every chunk are
    started at once, the last chunk's first (its experts' backward runs first), and not waited
    for: chunk c's handles go to bwd_works[c], which the chunk's _WaitInBackward waits on, so the
    backward of one chunk's experts runs while the next chunks' gradients travel."""

    @staticmethod
    def forward(ctx, group: Optional[dist.ProcessGroup], started: list, bwd_works: list, *rows: Tensor):
        ctx.group, ctx.plans, ctx.bwd_works = group, [(send, receive) for send, receive, _, _ in started], bwd_works
        outs = []
        for _, _, result, works in started:
            for w in works:
                w.wait()
            outs.append(result)
        return tuple(outs)

    @staticmethod
    def backward(ctx, *grads: Tensor):
        got = [None] * len(grads)
        for c in reversed(range(len(grads))):
            send, receive = ctx.plans[c]
            works = []
            got[c] = _exchange(grads[c], receive, send, ctx.group, works)  # the return exchange reversed
            ctx.bwd_works[c] = works
        return (None, None, None, *got)


class _ExchangePlan(NamedTuple):
    """One step's exchange, from the per-expert counts of every rank. send[d]: rows this rank sends
    to rank d; receive[s]: rows it gets from rank s (in s's expert-major order: local expert 0's
    rows, then 1's, ...); local_counts[l]: rows of local expert l from all ranks. by_expert: the
    received rows' order regrouped by local expert, sources in rank order (a gather index into
    the received rows); by_source: its inverse. mine: this rank's rows per expert [E]; received:
    the rows each source sends it, [source, local expert] on the device, theirs on the host."""
    send: List[int]
    receive: List[int]
    local_counts: List[int]
    by_expert: Tensor
    by_source: Tensor
    mine: List[int]
    theirs: List[int]
    received: Tensor


def _exclusive_cumsum(t: Tensor) -> Tensor:
    return torch.cumsum(t, 0) - t


def _by_expert(by_source_counts: Tensor, total: int) -> Tuple[Tensor, Tensor]:
    """Rows received as [source, local expert] blocks (by_source_counts [W, L], on the device),
    regrouped by local expert with the sources in rank order: the gather index and its inverse."""
    W, L = by_source_counts.shape
    start = _exclusive_cumsum(by_source_counts.reshape(-1)).view(W, L)  # row i of (s, l) at start[s, l] + i
    counts_le, start_le = by_source_counts.t().reshape(-1), start.t().reshape(-1)  # (l, s) order
    arange = torch.arange(total, device=by_source_counts.device)
    by_expert = torch.repeat_interleave(start_le - _exclusive_cumsum(counts_le), counts_le, output_size=total) + arange
    by_source = torch.empty_like(by_expert)
    by_source[by_expert] = arange
    return by_expert, by_source


def _exchange_plan(counts: Tensor, world_size: int, group: Optional[dist.ProcessGroup]) -> _ExchangePlan:
    """counts int64 [E] (this rank's rows per expert; rank d owns experts [d * El, (d + 1) * El)).
    The counts travel by one all_to_all; both sides reach the host together (the one sync)."""
    local = counts.numel() // world_size
    received = torch.empty_like(counts)  # [source, local expert], flattened
    dist.all_to_all_single(received, counts.contiguous(), group=group)
    host = torch.cat([counts, received]).tolist()
    mine, theirs = host[:counts.numel()], host[counts.numel():]
    send = [sum(mine[d * local:(d + 1) * local]) for d in range(world_size)]
    receive = [sum(theirs[s * local:(s + 1) * local]) for s in range(world_size)]
    local_counts = [sum(theirs[s * local + l] for s in range(world_size)) for l in range(local)]
    by_expert, by_source = _by_expert(received.view(world_size, local), sum(receive))
    return _ExchangePlan(send, receive, local_counts, by_expert, by_source, mine, theirs, received)


def _chunk_start(c, local: int, chunks: int):
    """The first local expert of chunk c (an int, or a tensor of them): chunk c holds the local
    experts [start(c), start(c + 1)), contiguous and as even as the count allows."""
    return c * local // chunks


def _chunk_bounds(local: int, chunks: int) -> List[Tuple[int, int]]:
    return [(_chunk_start(c, local, chunks), _chunk_start(c + 1, local, chunks)) for c in range(chunks)]


def _chunk_order(counts: Tensor, world: int, local: int, chunks: int, total: int) -> Tensor:
    """The rows this rank sends, chunk-major: for each chunk (_chunk_bounds), for each destination
    rank d, the expert-major rows of d's experts in the chunk (a contiguous run of them). Position
    i holds expert-major row order[i]; each chunk's rows to all ranks are then one contiguous
    slice. From the device counts [E] with device ops only (no copy from the host, no sync)."""
    dev = counts.device
    starts = torch.cat([counts.new_zeros(1), torch.cumsum(counts, 0)])  # expert e's rows from starts[e]
    c, d = torch.arange(chunks, device=dev)[:, None], torch.arange(world, device=dev)[None, :]
    first = _chunk_start(c, local, chunks) + d * local  # [chunk, d]: the run's first expert
    last = _chunk_start(c + 1, local, chunks) + d * local
    run_start, run_length = starts[first].reshape(-1), (starts[last] - starts[first]).reshape(-1)
    shift = run_start - _exclusive_cumsum(run_length)
    return torch.repeat_interleave(shift, run_length, output_size=total) + torch.arange(total, device=dev)


# --- exchange="symmetric_memory" ---------------------------------------------------------------
# torch 2.11's NVSHMEM ops (torch/csrc/distributed/c10d/symm_mem/nvshmem_extension.cu).
# all_to_all_vdev_2d(input, out, in_splits, out_splits_offsets, group): input's rows ordered by
# (destination rank, its local expert) with in_splits int64 [E] -- our expert-major rows and
# moe_route's counts; out's rows grouped by local expert, the sources in rank order inside an
# expert -- the order MoELayer gives these rows; out_splits_offsets int64 [2, E], indexed [local
# expert, source], receives the splits and the rows' offsets in out. An expert that receives no
# row still takes one row of out (the op rounds an empty expert up to major_align = 1 row, and
# nothing writes that row). all_to_all_vdev_2d_offset(input, out, in_splits_offsets,
# out_splits_offsets, group) is the reverse: input's rows given by [local expert, destination]
# splits and offsets, out's rows back in the sources' expert-major order, without gaps. Both pull
# from the peers' symmetric `input` and open with a barrier over the group, so a buffer that peers
# read in one exchange is written again only after a later exchange (every use below keeps that).
# The ops' limits: E / W <= 16 (all_to_all_vdev_2d) and W <= 16 (all_to_all_vdev_2d_offset).

EXCHANGES = ("nccl", "symmetric_memory")
_SYMMETRIC_MAX_LOCAL_EXPERTS = 16
_SYMMETRIC_MAX_WORLD = 16


def _symmetric_memory_unavailable(group: Optional[dist.ProcessGroup], device: torch.device) -> Optional[str]:
    """Why exchange="symmetric_memory" cannot run here, or None."""
    if not torch.cuda.is_available():
        return "CUDA is not available (torch's symmetric memory is CUDA-only)"
    backend = dist.get_backend(group)
    if backend != "nccl":
        return f"the process group's backend is {backend} (symmetric memory needs an NCCL group, one GPU per rank)"
    if device.type != "cuda":
        return f"the experts are on {device} (symmetric memory needs device='cuda:<the rank's GPU>')"
    try:
        import torch.distributed._symmetric_memory as symm_mem  # noqa: PLC0415
    except ImportError as e:
        return f"torch.distributed._symmetric_memory cannot be imported ({e})"
    if not symm_mem.is_nvshmem_available():
        return "NVSHMEM is not available in this torch build or on this machine (symm_mem.is_nvshmem_available())"
    return None


def _symmetric_empty(shape: Tuple[int, ...], dtype: torch.dtype, device: torch.device, group_name: str) -> Tensor:
    """One symmetric tensor of torch's NVSHMEM backend, rendezvoused over the group (collective:
    every rank allocates the same sizes in the same order). The tests poison the floating-point ones."""
    import torch.distributed._symmetric_memory as symm_mem  # noqa: PLC0415

    try:
        symm_mem.set_backend("NVSHMEM")  # before the first allocation; a no-op once chosen
    except RuntimeError as e:
        raise RuntimeError("ExpertParallelMoELayer(exchange='symmetric_memory'): torch's NVSHMEM "
                           f"symmetric-memory backend cannot be selected ({e})") from e
    t = symm_mem.empty(*shape, dtype=dtype, device=device)
    symm_mem.rendezvous(t, group_name)
    return t


class _SymmetricBuffers:
    """A layer's symmetric buffers, allocated at its first forward and kept. Rows: send = tokens
    * top_k (one rank's rows), receive = W * send + E / W + 1 (every source's rows, a row per
    empty local expert, and a scratch row that the gap-row zeroing of a non-empty expert hits).
    recv_x and recv_p are the experts' saved input until the backward; the others are free between
    exchanges and serve both directions (named by their forward use)."""

    def __init__(self, world: int, local: int, top_k: int, max_tokens: int, hidden: int, dtype: torch.dtype,
                 device: torch.device, group_name: str):
        send, receive = max_tokens * top_k, world * max_tokens * top_k + local + 1
        self.world, self.local, self.group_name, self.scratch = world, local, group_name, receive - 1
        f32, i64 = torch.float32, torch.int64

        def make(shape, dtype=dtype):
            return _symmetric_empty(shape, dtype, device, group_name)

        self.send_x = make((send, hidden))  # dispatch input: x's rows; backward: dout's rows
        self.send_p = make((send,), f32)
        self.recv_x = make((receive, hidden))  # the experts' x
        self.recv_p = make((receive,), f32)
        self.y = make((receive, hidden))  # fc2's out, the combine's input; backward: the rows' dy
        self.dx = make((receive, hidden))  # fc1's grad_input, the reverse exchange's input
        self.dp = make((receive,), f32)
        self.back_x = make((send, hidden))  # the combine's output; backward: the rows' dx back
        self.back_p = make((send,), f32)
        self.in_splits = make((world * local,), i64)
        self.splits_offsets = {name: make((2, world * local), i64) for name in ("x", "p", "y", "dy", "dx", "dp")}

    def dispatch(self, src: Tensor, dst: Tensor, name: str) -> None:
        """src's rows (counts in in_splits) to their experts' ranks: dst grouped by local expert."""
        torch.ops.symm_mem.all_to_all_vdev_2d(src, dst, self.in_splits, self.splits_offsets[name], self.group_name)

    def combine(self, src: Tensor, dst: Tensor, name: str) -> None:
        """The reverse of dispatch "x": src in its received layout, dst in the sources' order."""
        torch.ops.symm_mem.all_to_all_vdev_2d_offset(src, dst, self.splits_offsets["x"], self.splits_offsets[name],
                                                     self.group_name)

    def groups(self, name: str) -> Tuple[Tensor, Tensor]:
        """After dispatch `name`: each local expert's rows in the receive buffer as GroupedMLP's
        device splits (its received rows, plus the unwritten row after an empty expert that a later
        one follows), and that unwritten row per expert (the scratch row where there is none), which
        the caller zeroes so that the expert computes exact zeros there. Device-only (no sync)."""
        splits, offsets = self.splits_offsets[name].view(2, self.local, self.world).unbind(0)
        count, start = splits.sum(1), offsets[:, 0]
        group = torch.cat([start[1:], start[-1:] + count[-1:]]) - start
        gap = torch.where(group > count, start + count, torch.full_like(start, self.scratch))
        return group, gap


def _check_symmetric_args(local_experts: int, world_size: int, max_tokens_per_rank: Optional[int]) -> None:
    if isinstance(max_tokens_per_rank, bool) or not isinstance(max_tokens_per_rank, int) or max_tokens_per_rank < 1:
        raise ValueError("max_tokens_per_rank: expected a positive int with exchange='symmetric_memory' (the most "
                         "tokens a rank passes to forward: the symmetric buffers' capacity), "
                         f"got {max_tokens_per_rank!r}")
    if local_experts > _SYMMETRIC_MAX_LOCAL_EXPERTS:
        raise ValueError(f"num_experts: exchange='symmetric_memory' takes at most {_SYMMETRIC_MAX_LOCAL_EXPERTS} "
                         f"experts per rank (torch's all_to_all_vdev_2d), got {local_experts}")
    if world_size > _SYMMETRIC_MAX_WORLD:
        raise ValueError(f"group: exchange='symmetric_memory' takes at most {_SYMMETRIC_MAX_WORLD} ranks "
                         f"(torch's all_to_all_vdev_2d_offset), got {world_size}")


def _zero_rows(rows: Tensor, *buffers: Tensor) -> None:
    """Zero `rows` of each buffer, then mark the buffers written for autograd (a forward that
    overwrites the experts' saved input before its backward then fails there, loudly)."""
    for b in buffers:
        b.index_fill_(0, rows, 0)
        torch.autograd.graph.increment_version(b)


class _SymmetricDispatch(torch.autograd.Function):
    """x's rows (x[token_of_row]) and their probs gathered into the send buffers and exchanged:
    the experts' rows and probs (the receive buffers, grouped by local expert) and the groups'
    sizes. Backward: the rows' and probs' gradients go back by the reverse exchange; each token's
    top_k rows are summed in slot order (dx), the probs' put back in (token, slot) order."""

    @staticmethod
    def forward(ctx, bufs: _SymmetricBuffers, maps: RowMaps, counts: Tensor, x: Tensor, probs: Tensor):
        n = maps.token_of_row.numel()
        torch.index_select(x, 0, maps.token_of_row, out=bufs.send_x[:n])
        torch.index_select(probs, 0, maps.flat_of_row, out=bufs.send_p[:n])
        bufs.in_splits.copy_(counts)
        bufs.dispatch(bufs.send_x, bufs.recv_x, "x")
        bufs.dispatch(bufs.send_p, bufs.recv_p, "p")
        group, gap = bufs.groups("x")
        _zero_rows(gap, bufs.recv_x, bufs.recv_p)
        ctx.bufs, ctx.maps = bufs, maps
        ctx.mark_non_differentiable(group)
        # Aliases, not the buffers: autograd's marks land on them, the version counter is shared.
        return bufs.recv_x.detach(), bufs.recv_p.detach(), group

    @staticmethod
    def backward(ctx, dx_rows: Tensor, dprobs_rows: Tensor, _):
        bufs, maps = ctx.bufs, ctx.maps
        if dx_rows.data_ptr() != bufs.dx.data_ptr():  # fc1's dgrad wrote bufs.dx unless autograd summed
            bufs.dx.copy_(dx_rows)
        bufs.dp.copy_(dprobs_rows)  # GroupedMLP returns dprobs in a tensor of its own: one copy
        bufs.combine(bufs.dx, bufs.back_x, "dx")
        bufs.combine(bufs.dp, bufs.back_p, "dp")
        n = maps.token_of_row.numel()
        return None, None, None, take(bufs.back_x[:n], maps.row_of), take(bufs.back_p[:n], maps.flat_row)


class _SymmetricCombine(torch.autograd.Function):
    """The experts' output rows (in bufs.y, where fc2 wrote them) back to their tokens' ranks, each
    token's top_k rows summed in slot order. Backward: dout's rows (dout[token_of_row]) to the
    experts, as dispatch sends x's, into bufs.y (the rows' dy; its unwritten rows zeroed)."""

    @staticmethod
    def forward(ctx, bufs: _SymmetricBuffers, maps: RowMaps, counts: Tensor, y: Tensor):
        if y.data_ptr() != bufs.y.data_ptr():
            bufs.y.copy_(y)
        bufs.combine(bufs.y, bufs.back_x, "y")
        ctx.bufs, ctx.maps, ctx.counts = bufs, maps, counts
        return take(bufs.back_x[:maps.token_of_row.numel()], maps.row_of)

    @staticmethod
    def backward(ctx, dout: Tensor):
        bufs, maps = ctx.bufs, ctx.maps
        torch.index_select(dout, 0, maps.token_of_row, out=bufs.send_x[:maps.token_of_row.numel()])
        bufs.in_splits.copy_(ctx.counts)
        bufs.dispatch(bufs.send_x, bufs.y, "dy")
        _zero_rows(bufs.groups("dy")[1], bufs.y)
        return None, None, None, bufs.y.detach()


_PER_EXPERT_KEY = re.compile(r"^(experts\.fc[12]\.(?:weight|bias))(\d+)$")
_GROUPED_KEYS = ("experts.fc1.weight", "experts.fc1.bias", "experts.fc2.weight", "experts.fc2.bias")


class ExpertParallelMoELayer(nn.Module):
    """MoELayer with its experts spread over a torch.distributed process group (NCCL on GPUs, gloo
    on CPUs): rank r of W holds experts [r * E / W, (r + 1) * E / W) as a GroupedMLP (`experts`,
    its options as MoELayer's: main_grad, delayed wgrad with backward_dw, hooks on `experts`).
    Each rank passes its own tokens x [N_r, hidden] and logits [N_r, E] (N_r may differ by rank,
    and may be 0); routing is MoELayer's; the rows go to their experts' ranks, are grouped by local
    expert, go through the local experts, return, and each token's top_k rows are summed in slot
    order. The result equals a MoELayer holding all the experts, run on the ranks' tokens
    concatenated in rank order, bitwise (out, dx, dlogits, the experts' gradients). score_sum and
    counts are over this rank's tokens (all-reduce them for a global balancing loss).

    exchange="nccl" (default): the per-expert counts travel by all_to_all_single, the host reads
    the split sizes (one host synchronisation a forward), the rows and probs travel by
    all_to_all_single and are regrouped by local expert with a gather.
    exchange="symmetric_memory": torch's NVSHMEM all-to-all with device-side splits
    (torch.ops.symm_mem.all_to_all_vdev_2d, and all_to_all_vdev_2d_offset back), no host
    synchronisation in the forward or the backward: the layer's step is CUDA-graph capturable and
    a captured graph replays with new routing. It needs an NCCL group with one GPU per rank (start
    it with init_process_group(..., device_id=torch.device("cuda", local_rank))), torch with NVSHMEM
    (symm_mem.is_nvshmem_available()), E / W <= 16 and W <= 16 (the ops' limits), and
    max_tokens_per_rank: the most tokens any rank passes to forward, the capacity of the symmetric
    buffers (the same on every rank; a larger N_r is a ValueError before anything runs). The
    buffers are allocated at the first forward, rendezvoused over the group (every rank must
    build the layer identically) and kept: (2 * max_tokens_per_rank * top_k + 3 * R) rows of hidden
    in the experts' dtype plus fp32 probs, R = W * max_tokens_per_rank * top_k + E / W + 1, from
    NVSHMEM's symmetric heap (1 GiB unless NVSHMEM_SYMMETRIC_SIZE, read at its first use, says
    more). The rows arrive already grouped by local expert (no regrouping gather), the experts run on the
    receive buffer as it is (device splits, padded tail), fc2 writes into the buffer the return
    exchange reads (GroupedMLP's out) and fc1's dgrad into the one the backward returns
    (grad_input). The receive buffer is the experts' saved input: one forward in flight per layer
    (a second forward before the first one's backward makes that backward fail, loudly), and
    backward_dw before the next forward.

    overlap_chunks=C > 1 (NCCL exchange): the local experts in C contiguous groups, each its own
    exchange and expert call; all C dispatches start at once (async all_to_all_single, on NCCL's
    stream), chunk c's experts run once its rows are in, while later chunks' rows travel, and its
    combine exchange starts behind them. Each expert still takes the same rows in the same order,
    so results stay bitwise the unchunked layer's. Each chunk's expert call gives a weight gradient
    for all local experts, zero outside the chunk, so autograd adds C of them (main_grad: C
    accumulations, and `overwrite_main_grad` is refused). Backward: the C return exchanges are
    reversed all at once (one autograd node, _ReturnAll) and each chunk's experts wait only for
    their own gradients (_WaitInBackward), so the experts' backward of one chunk runs while the
    next chunks' gradients travel; the dispatch's reverse exchanges run as autograd reaches them,
    after the experts. On two H200s (NVLink) it is slower than one exchange: the exchange is a
    small part of a step there, and the chunks' GEMMs take fewer rows a launch (docs/PERF.md).

    Every rank must call forward and backward for every step (the exchanges are collectives), with
    the same requires_grad on its inputs. The symmetric exchange measured 18-20 % slower a step
    than NCCL's, so it is the option for CUDA graphs, not the default. (bench/bench_moe_ep.py
    --overlap, two half batches with the second half's NCCL dispatch under the first half's
    experts, was slower than one batch: halves of tokens change the experts' GEMMs and sums.) Not
    done: the dispatch's reverse exchanges under the experts' backward; torch.compile (the NCCL exchange's host splits;
    the symmetric exchange is not tried under it); packing the probs into the rows' exchange (they
    travel by exchanges of their own: three exchanges a forward, three a backward).
    """

    def __init__(self, num_experts: int, hidden_size: int, ffn_hidden_size: int, top_k: int, *,
                 group: Optional[dist.ProcessGroup] = None, score: str = "softmax", normalize: bool = False,
                 bias: bool = False, params_dtype: Optional[torch.dtype] = None,
                 device: Union[torch.device, str, None] = None, glu_interleave_size: int = 0,
                 single_grouped_weight: bool = False, fuse_wgrad_accumulation: bool = False,
                 delay_wgrad_compute: bool = False, exchange: str = "nccl",
                 max_tokens_per_rank: Optional[int] = None, fp8: Optional[bool] = None, overlap_chunks: int = 1):
        super().__init__()
        if exchange not in EXCHANGES:
            raise ValueError(f"exchange: expected one of {', '.join(EXCHANGES)}, got {exchange!r}")
        if not isinstance(overlap_chunks, int) or overlap_chunks < 1:
            raise ValueError(f"overlap_chunks: expected an int >= 1, got {overlap_chunks!r}")
        if overlap_chunks > 1 and exchange != "nccl":
            raise ValueError(f"overlap_chunks: expected 1 with exchange={exchange!r} (chunks are the NCCL "
                             f"exchange's), got {overlap_chunks}")
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("ExpertParallelMoELayer: torch.distributed is not initialised "
                               "(call torch.distributed.init_process_group first)")
        if score not in ROUTER_SCORES:
            raise ValueError(f"score: expected one of {', '.join(ROUTER_SCORES)}, got {score}")
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"top_k: expected 1 <= top_k <= num_experts = {num_experts}, got {top_k}")
        world_size, rank = dist.get_world_size(group), dist.get_rank(group)
        if num_experts % world_size != 0:
            raise ValueError(f"num_experts: expected a multiple of the group's size {world_size}, got {num_experts}")
        if exchange == "symmetric_memory":
            _check_symmetric_args(num_experts // world_size, world_size, max_tokens_per_rank)
        self.group, self.world_size, self.rank = group, world_size, rank
        self.num_experts, self.hidden_size, self.top_k = num_experts, hidden_size, top_k
        self.num_local_experts = num_experts // world_size
        if overlap_chunks > self.num_local_experts:
            raise ValueError(f"overlap_chunks: expected at most the {self.num_local_experts} experts of a rank "
                             f"(a chunk is a group of them), got {overlap_chunks}")
        self.overlap_chunks = overlap_chunks
        self.first_expert = rank * self.num_local_experts
        self.score, self.normalize = score, normalize
        self.experts = GroupedMLP(self.num_local_experts, hidden_size, ffn_hidden_size, hidden_size, bias=bias,
                                  params_dtype=params_dtype, device=device, glu_interleave_size=glu_interleave_size,
                                  single_grouped_weight=single_grouped_weight,
                                  fuse_wgrad_accumulation=fuse_wgrad_accumulation,
                                  delay_wgrad_compute=delay_wgrad_compute, fp8=fp8)
        self.exchange, self.max_tokens_per_rank = exchange, max_tokens_per_rank
        self._symmetric: Optional[_SymmetricBuffers] = None
        if exchange == "symmetric_memory":
            weight = next(self.experts.parameters())
            reason = _symmetric_memory_unavailable(group, weight.device)
            if reason is not None:
                raise RuntimeError(f"ExpertParallelMoELayer: exchange='symmetric_memory' is not available here: "
                                   f"{reason}; use exchange='nccl'")
            self._dtype = weight.dtype

    def forward(self, x: Tensor, logits: Tensor, expert_bias: Optional[Tensor] = None) -> MoEOutput:
        """x [N, hidden] (the experts' dtype), logits fp32 [N, E], expert_bias optional fp32 [E]:
        this rank's tokens. MoEOutput over this rank's tokens (score_sum, counts: [E])."""
        check_layer_inputs(self, x, logits)
        if self.exchange == "symmetric_memory":
            self._check_symmetric_inputs(x)
        if self.overlap_chunks > 1 and any(getattr(p, "overwrite_main_grad", False) for p in self.experts.parameters()):
            raise ValueError("overlap_chunks: expected expert parameters without overwrite_main_grad (each chunk's "
                             "call would overwrite the experts of the others with zeros), got it set")
        r = moe_route(logits, self.top_k, score=self.score, normalize=self.normalize, expert_bias=expert_bias)
        if self.exchange == "symmetric_memory":
            bufs, maps = self._symmetric_buffers(x.device), row_maps(r)
            got_x, got_probs, groups = _SymmetricDispatch.apply(bufs, maps, r.counts, x, r.probs.reshape(-1))
            y = self.experts(got_x, groups, got_probs, out=bufs.y.detach(), grad_input=bufs.dx.detach())
            return MoEOutput(_SymmetricCombine.apply(bufs, maps, r.counts, y), r.score_sum, r.counts)
        plan = _exchange_plan(r.counts, self.world_size, self.group)
        if self.overlap_chunks > 1:
            return MoEOutput(self._chunked(x, r, plan), r.score_sum, r.counts)
        rows = expert_rows(x, r)  # expert-major, so destination-rank-major
        got_x, got_probs = _AllToAll.apply(self.group, plan.send, plan.receive, None, rows.x, rows.probs)
        y = self.experts(Rows.apply(got_x, plan.by_expert, plan.by_source), plan.local_counts,
                         Rows.apply(got_probs, plan.by_expert, plan.by_source))
        (back,) = _AllToAll.apply(self.group, plan.receive, plan.send, None,
                                  Rows.apply(y, plan.by_source, plan.by_expert))
        return MoEOutput(combine(back, rows), r.score_sum, r.counts)

    def _chunked(self, x: Tensor, r, plan: _ExchangePlan) -> Tensor:
        """The NCCL exchange in overlap_chunks chunks of local experts: every chunk's dispatch is
        started first, then chunk c's experts run as soon as its rows are in while the later
        chunks' rows travel, and its combine exchange starts behind them. Each expert's rows are
        the same as unchunked, in the same order, so every result is bitwise the same."""
        W, El = self.world_size, self.num_local_experts
        bounds = _chunk_bounds(El, self.overlap_chunks)
        rows = expert_rows(x, r, _chunk_order(r.counts, W, El, len(bounds), sum(plan.mine)))  # chunk-major
        received = plan.received.view(W, El)
        dispatched, works, offset = [], [], 0
        for a, b in bounds:
            send = [sum(plan.mine[d * El + a:d * El + b]) for d in range(W)]
            receive = [sum(plan.theirs[s * El + a:s * El + b]) for s in range(W)]
            part = slice(offset, offset + sum(send))
            offset = part.stop
            first = len(works)
            got = _AllToAll.apply(self.group, send, receive, works, rows.x[part], rows.probs[part])
            dispatched.append((send, receive, works[first:], got))
        returning, started = [], []
        bwd_works = [[] for _ in bounds]  # the backward's handles, chunk by chunk (_ReturnAll)
        for c, ((a, b), (send, receive, arrived, (got_x, got_probs))) in enumerate(zip(bounds, dispatched)):
            for w in arrived:
                w.wait()
            by_expert, by_source = _by_expert(received[:, a:b], sum(receive))
            counts = [n if a <= l < b else 0 for l, n in enumerate(plan.local_counts)]
            y = self.experts(Rows.apply(got_x, by_expert, by_source), counts,
                             Rows.apply(got_probs, by_expert, by_source))
            y_rows = _WaitInBackward.apply(bwd_works, c, Rows.apply(y, by_source, by_expert))
            returned = []  # the return exchange: this chunk's dispatch reversed, started now
            started.append((receive, send, _exchange(y_rows.detach(), receive, send, self.group, returned), returned))
            returning.append(y_rows)
        back = _ReturnAll.apply(self.group, started, bwd_works, *returning)
        return combine(torch.cat(back), rows)

    def _check_symmetric_inputs(self, x: Tensor) -> None:
        if x.shape[0] > self.max_tokens_per_rank:
            raise ValueError(f"x: expected at most max_tokens_per_rank = {self.max_tokens_per_rank} tokens on this "
                             f"rank (the symmetric buffers' capacity), got {x.shape[0]}")
        if x.dtype != self._dtype:
            raise ValueError(f"x: expected dtype {name_of_dtype(self._dtype)} (the experts' dtype), "
                             f"got {name_of_dtype(x.dtype)}")

    def _symmetric_buffers(self, device: torch.device) -> _SymmetricBuffers:
        if self._symmetric is None:
            group_name = (self.group if self.group is not None else dist.group.WORLD).group_name
            self._symmetric = _SymmetricBuffers(self.world_size, self.num_local_experts, self.top_k,
                                                self.max_tokens_per_rank, self.hidden_size, self._dtype, device,
                                                group_name)
        return self._symmetric

    def backward_dw(self) -> None:
        """The local experts' delayed wgrads (GroupedMLP.backward_dw; one a chunk's call with
        overlap_chunks)."""
        for _ in range(self.overlap_chunks):
            self.experts.backward_dw()

    def load_full_state_dict(self, state_dict: Mapping[str, Tensor], strict: bool = True):
        """Loads this rank's experts from the state dict of the whole layer (a MoELayer's with the
        same options, or one whose per-expert names count all E experts): experts.fc1.weight{e}
        for e in this rank's slice become experts.fc1.weight{e - first_expert}; with
        single_grouped_weight, the slice [first_expert, first_expert + E / W) of each [E, ...]."""
        first, local = self.first_expert, self.num_local_experts
        mine = {}
        for key in self.state_dict():
            m = _PER_EXPERT_KEY.match(key)
            if m:
                mine[key] = state_dict[f"{m.group(1)}{first + int(m.group(2))}"]
            elif key in _GROUPED_KEYS:
                mine[key] = state_dict[key][first:first + local]
            else:
                mine[key] = state_dict[key]
        return self.load_state_dict(mine, strict=strict)

    def extra_repr(self) -> str:
        return (f"num_experts={self.num_experts}, experts [{self.first_expert}, "
                f"{self.first_expert + self.num_local_experts}) on rank {self.rank} of {self.world_size}, "
                f"top_k={self.top_k}, score={self.score}, normalize={self.normalize}, exchange={self.exchange}"
                + (f", max_tokens_per_rank={self.max_tokens_per_rank}" if self.exchange != "nccl" else ""))
