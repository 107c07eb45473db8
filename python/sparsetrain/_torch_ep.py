"""Expert parallelism for the MoE layer (sparsetrain.torch.ExpertParallelMoELayer): each rank of a
torch.distributed process group holds a contiguous slice of the experts; every rank routes its own
tokens (moe_route), the rows travel to their experts' ranks and back with all_to_all_single, and
each token's rows are summed in slot order. Invariant: the rows a rank's experts take are laid out
as MoELayer lays out the ranks' tokens concatenated in rank order (by expert, then by token), and
every step is a gather or an exchange, so the layer equals that MoELayer bitwise, forward and
backward. One host synchronisation per forward (the split sizes), none in the backward."""

from __future__ import annotations

import re
from typing import List, Mapping, NamedTuple, Optional, Sequence, Union

import torch
import torch.distributed as dist
from torch import Tensor, nn

from ._moe import ROUTER_SCORES
from ._torch_moe import MoEOutput, _check_layer_inputs, _combine, _expert_rows, _Rows, moe_route


def _receive_buffer(like: Tensor, rows: int) -> Tensor:
    """The exchange's output rows (every row is written by it; the tests poison this buffer)."""
    return like.new_empty((rows, *like.shape[1:]))


def _exchange(t: Tensor, send: Sequence[int], receive: Sequence[int], group: Optional[dist.ProcessGroup]) -> Tensor:
    """t's rows [sum(send), ...] out, send[d] of them to rank d in rank order; [sum(receive), ...]
    back, receive[s] from rank s in rank order. Every rank calls it, zero-size parts included."""
    out = _receive_buffer(t, sum(receive))
    dist.all_to_all_single(out, t.contiguous(), list(receive), list(send), group=group)
    return out


class _AllToAll(torch.autograd.Function):
    """_exchange of each tensor (the same splits for all); the backward exchanges the gradients in
    reverse (receive <-> send). Gradients of unused outputs arrive as zeros (autograd materialises
    them), so every rank joins every exchange of the backward."""

    @staticmethod
    def forward(ctx, group: Optional[dist.ProcessGroup], send: List[int], receive: List[int], *tensors: Tensor):
        ctx.group, ctx.send, ctx.receive = group, send, receive
        return tuple(_exchange(t, send, receive, group) for t in tensors)

    @staticmethod
    def backward(ctx, *grads: Tensor):
        return (None, None, None, *(_exchange(g, ctx.receive, ctx.send, ctx.group) for g in grads))


class _ExchangePlan(NamedTuple):
    """One step's exchange, from the per-expert counts of every rank. send[d]: rows this rank sends
    to rank d; receive[s]: rows it gets from rank s (in s's expert-major order: local expert 0's
    rows, then 1's, ...); local_counts[l]: rows of local expert l from all ranks. by_expert: the
    received rows' order regrouped by local expert, sources in rank order (a gather index into
    the received rows); by_source: its inverse."""
    send: List[int]
    receive: List[int]
    local_counts: List[int]
    by_expert: Tensor
    by_source: Tensor


def _exclusive_cumsum(t: Tensor) -> Tensor:
    return torch.cumsum(t, 0) - t


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
    total = sum(receive)
    # Row i of local expert l from source s sits at start[s, l] + i in the received order.
    by_source_counts = received.view(world_size, local)
    start = _exclusive_cumsum(by_source_counts.reshape(-1)).view(world_size, local)
    counts_le, start_le = by_source_counts.t().reshape(-1), start.t().reshape(-1)  # (l, s) order
    arange = torch.arange(total, device=counts.device)
    by_expert = torch.repeat_interleave(start_le - _exclusive_cumsum(counts_le), counts_le, output_size=total) + arange
    by_source = torch.empty_like(by_expert)
    by_source[by_expert] = arange
    return _ExchangePlan(send, receive, local_counts, by_expert, by_source)


_PER_EXPERT_KEY = re.compile(r"^(experts\.fc[12]\.(?:weight|bias))(\d+)$")
_GROUPED_KEYS = ("experts.fc1.weight", "experts.fc1.bias", "experts.fc2.weight", "experts.fc2.bias")


class ExpertParallelMoELayer(nn.Module):
    """MoELayer with its experts spread over a torch.distributed process group (NCCL on GPUs, gloo
    on CPUs): rank r of W holds experts [r * E / W, (r + 1) * E / W) as a GroupedMLP (`experts`,
    its options as MoELayer's: main_grad, delayed wgrad with backward_dw, hooks on `experts`).
    Each rank passes its own tokens x [N_r, hidden] and logits [N_r, E] (N_r may differ by rank,
    and may be 0); routing is MoELayer's; the rows go to their experts' ranks (all_to_all_single
    after the per-expert counts are exchanged: one host synchronisation a forward), are regrouped
    by local expert, go through the local experts, return, and each token's top_k rows are summed
    in slot order. The result equals a MoELayer holding all the experts, run on the ranks' tokens
    concatenated in rank order, bitwise (out, dx, dlogits, the experts' gradients). score_sum and
    counts are over this rank's tokens (all-reduce them for a global balancing loss).

    Every rank must call forward and backward for every step (the exchanges are collectives), with
    the same requires_grad on its inputs. Not done: torch's symmetric-memory all-to-all with
    device-side splits (torch 2.11's symm_mem.all_to_all_vdev / all_to_all_vdev_2d: CUDA-only
    NVSHMEM ops, not built: no multi-GPU machine to test them), so the forward is not CUDA-graph
    capturable; overlap of the exchanges with expert compute; torch.compile (host splits).
    """

    def __init__(self, num_experts: int, hidden_size: int, ffn_hidden_size: int, top_k: int, *,
                 group: Optional[dist.ProcessGroup] = None, score: str = "softmax", normalize: bool = False,
                 bias: bool = False, params_dtype: Optional[torch.dtype] = None,
                 device: Union[torch.device, str, None] = None, glu_interleave_size: int = 0,
                 single_grouped_weight: bool = False, fuse_wgrad_accumulation: bool = False,
                 delay_wgrad_compute: bool = False):
        super().__init__()
        from .torch import GroupedMLP  # noqa: PLC0415  (sparsetrain.torch imports this module)

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
        self.group, self.world_size, self.rank = group, world_size, rank
        self.num_experts, self.hidden_size, self.top_k = num_experts, hidden_size, top_k
        self.num_local_experts = num_experts // world_size
        self.first_expert = rank * self.num_local_experts
        self.score, self.normalize = score, normalize
        self.experts = GroupedMLP(self.num_local_experts, hidden_size, ffn_hidden_size, hidden_size, bias=bias,
                                  params_dtype=params_dtype, device=device, glu_interleave_size=glu_interleave_size,
                                  single_grouped_weight=single_grouped_weight,
                                  fuse_wgrad_accumulation=fuse_wgrad_accumulation,
                                  delay_wgrad_compute=delay_wgrad_compute)

    def forward(self, x: Tensor, logits: Tensor, expert_bias: Optional[Tensor] = None) -> MoEOutput:
        """x [N, hidden] (the experts' dtype), logits fp32 [N, E], expert_bias optional fp32 [E]:
        this rank's tokens. MoEOutput over this rank's tokens (score_sum, counts: [E])."""
        _check_layer_inputs(self, x, logits)
        r = moe_route(logits, self.top_k, score=self.score, normalize=self.normalize, expert_bias=expert_bias)
        rows = _expert_rows(x, r)  # expert-major, so destination-rank-major
        plan = _exchange_plan(r.counts, self.world_size, self.group)
        got_x, got_probs = _AllToAll.apply(self.group, plan.send, plan.receive, rows.x, rows.probs)
        y = self.experts(_Rows.apply(got_x, plan.by_expert, plan.by_source), plan.local_counts,
                         _Rows.apply(got_probs, plan.by_expert, plan.by_source))
        (back,) = _AllToAll.apply(self.group, plan.receive, plan.send, _Rows.apply(y, plan.by_source, plan.by_expert))
        return MoEOutput(_combine(back, rows), r.score_sum, r.counts)

    def backward_dw(self) -> None:
        """The local experts' delayed wgrads (GroupedMLP.backward_dw)."""
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
                f"top_k={self.top_k}, score={self.score}, normalize={self.normalize}")
