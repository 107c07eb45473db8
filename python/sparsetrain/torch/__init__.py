"""The PyTorch front, one module per feature: `GroupedLinear` (grouped_linear) and `GroupedMLP`
(grouped_mlp), torch.nn.Modules with TransformerEngine's options and semantics (main_grad
accumulation, delayed wgrad with backward_dw, caller out / grad_input buffers, device splits);
`block_sparse_attention` (attention: FlexAttention's layout, a sparsetrain.BlockMask); `MoELayer`
and `moe_route` (moe: the router, the experts as a GroupedMLP, the deterministic combine, with the
row movements in token_rows); `ExpertParallelMoELayer` (expert_parallel: the MoE layer's experts
over a torch.distributed group). All on top of torch operators with fake implementations (the
grouped layers' `torch.library` custom ops; attention's and the MoE router's and combine's defined
in C++, attention's and the router's autograd too), so that models compile with
torch.compile(fullgraph=True).

Everything runs through the C++ torch library (sparsetrain._torch_ops, loaded by native): the
grouped layers eagerly and in their custom ops' implementations, attention, the MoE router and the
combine as their operators; without it in the install, importing this package raises an
ImportError that says how to build it. Memory: every tensor the library allocates comes from
torch's caching allocator on the current stream (at::empty in the C++ torch library) and is handed
back as a tensor over that memory."""

from .._block_mask import BlockMask
from .attention import block_sparse_attention
from .expert_parallel import ExpertParallelMoELayer
from .grouped_linear import GroupedLinear
from .grouped_mlp import GroupedMLP
from .moe import MoELayer, MoEOutput, RoutedTokens, moe_route

__all__ = ["GroupedLinear", "GroupedMLP", "BlockMask", "block_sparse_attention", "MoELayer", "moe_route",
           "ExpertParallelMoELayer", "MoEOutput", "RoutedTokens"]
