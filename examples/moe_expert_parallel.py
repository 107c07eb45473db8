"""An expert-parallel MoE training step: `torchrun --nproc-per-node 2 examples/moe_expert_parallel.py`
(NCCL on GPUs, gloo on CPUs); `... examples/moe_expert_parallel.py --exchange symmetric_memory` on
GPUs takes torch's NVSHMEM all-to-all with device splits (no host synchronisation);
`--overlap-chunks 2` runs the NCCL exchange in two groups of experts, each group's experts under
the other's rows (overlap_chunks). Each rank holds num_experts / world_size experts, loaded from
one full MoELayer's weights, and passes its own tokens; the result is checked against that
MoELayer run on all ranks' tokens (bitwise: same routing, same weights).
tests/python/test_moe_ep.py runs it."""

import argparse
import os

import torch
import torch.distributed as dist

from sparsetrain.torch import ExpertParallelMoELayer, MoELayer

ap = argparse.ArgumentParser()
ap.add_argument("--exchange", default="nccl", choices=["nccl", "symmetric_memory"])
ap.add_argument("--overlap-chunks", type=int, default=1)
args = ap.parse_args()
exchange = args.exchange
if torch.cuda.is_available():                         # one GPU per rank, the group bound to it
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", device_id=device)
else:
    device = torch.device("cpu")
    dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
options = dict(num_experts=8, hidden_size=64, ffn_hidden_size=96, top_k=2, score="softmax", normalize=True,
               params_dtype=torch.bfloat16, device=device)

torch.manual_seed(0)                                  # the same full layer and data on every rank
full = MoELayer(**options)
tokens = [100 + 7 * r for r in range(world)]          # ranks may hold different numbers of tokens
moe = ExpertParallelMoELayer(**options, exchange=exchange,  # group=None: the default process group
                             max_tokens_per_rank=max(tokens),  # symmetric buffers' capacity (nccl ignores it)
                             overlap_chunks=args.overlap_chunks)
moe.load_full_state_dict(full.state_dict())           # this rank's experts: [rank * 8 / world, ...)
x_all = torch.randn(sum(tokens), 64, dtype=torch.bfloat16, device=device)
logits_all = torch.randn(sum(tokens), 8, device=device)
first = sum(tokens[:rank])
x = x_all[first:first + tokens[rank]].clone().requires_grad_()
logits = logits_all[first:first + tokens[rank]].clone().requires_grad_()

out = moe(x, logits)                                  # this rank's tokens: out [N_r, 64]
out.out.float().square().sum().backward()             # grads: x, logits, this rank's experts

ref = full(x_all, logits_all)
assert torch.equal(out.out, ref.out[first:first + tokens[rank]])
print(f"rank {rank} of {world} ({dist.get_backend()} process group, exchange={exchange}): {tokens[rank]} tokens, "
      f"experts [{moe.first_expert}, {moe.first_expert + moe.num_local_experts}), out equals the single-process "
      "layer's")
dist.destroy_process_group()
