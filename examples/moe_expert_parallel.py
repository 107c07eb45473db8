"""An expert-parallel MoE training step: `torchrun --nproc-per-node 2 examples/moe_expert_parallel.py`
(NCCL on GPUs, gloo on CPUs). Each rank holds num_experts / world_size experts, loaded from one
full MoELayer's weights, and passes its own tokens; the result is checked against that MoELayer run
on all ranks' tokens (bitwise: same routing, same weights). tests/python/test_moe_ep.py runs it."""

import torch
import torch.distributed as dist

from sparsetrain.torch import ExpertParallelMoELayer, MoELayer

dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
rank, world = dist.get_rank(), dist.get_world_size()
device = f"cuda:{rank % torch.cuda.device_count()}" if torch.cuda.is_available() else "cpu"
if device != "cpu":
    torch.cuda.set_device(device)
options = dict(num_experts=8, hidden_size=64, ffn_hidden_size=96, top_k=2, score="softmax", normalize=True,
               params_dtype=torch.bfloat16, device=device)

torch.manual_seed(0)                                  # the same full layer and data on every rank
full = MoELayer(**options)
moe = ExpertParallelMoELayer(**options)               # group=None: the default process group
moe.load_full_state_dict(full.state_dict())           # this rank's experts: [rank * 8 / world, ...)
tokens = [100 + 7 * r for r in range(world)]          # ranks may hold different numbers of tokens
x_all = torch.randn(sum(tokens), 64, dtype=torch.bfloat16, device=device)
logits_all = torch.randn(sum(tokens), 8, device=device)
first = sum(tokens[:rank])
x = x_all[first:first + tokens[rank]].clone().requires_grad_()
logits = logits_all[first:first + tokens[rank]].clone().requires_grad_()

out = moe(x, logits)                                  # this rank's tokens: out [N_r, 64]
out.out.float().square().sum().backward()             # grads: x, logits, this rank's experts

ref = full(x_all, logits_all)
assert torch.equal(out.out, ref.out[first:first + tokens[rank]])
print(f"rank {rank} of {world}: {tokens[rank]} tokens, experts [{moe.first_expert}, "
      f"{moe.first_expert + moe.num_local_experts}), out equals the single-process layer's")
dist.destroy_process_group()
