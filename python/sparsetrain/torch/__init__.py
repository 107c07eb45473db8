"""The PyTorch front, one module per feature: `GroupedLinear` (grouped_linear) and `GroupedMLP`
(grouped_mlp), torch.nn.Modules with TransformerEngine's options and semantics (main_grad
accumulation, delayed wgrad with backward_dw, caller out / grad_input buffers, device splits);
`block_sparse_attention` (attention: FlexAttention's layout, a sparsetrain.BlockMask); `MoELayer`
and `moe_route` (moe: the router, the experts' fused MLP, the deterministic combine, one operator
per direction over the core's MoELayer); `ExpertParallelMoELayer` (expert_parallel: the MoE layer's
experts over a torch.distributed group, its row movements in token_rows); `fp8_autocast` (fp8: the
grouped layers' FP8 recipe, also their `fp8` argument). All on top of the C++
torch library's operators (sparsetrain._torch_ops, loaded by native; their autograd in C++, their
fake implementations in these modules), one route for eager calls, torch.compile(fullgraph=True),
dispatch modes and CUDA graphs; without the library in the install, importing this package raises an
ImportError that says how to build it. Memory: every tensor the library allocates comes from torch's
caching allocator on the current stream (at::empty) and is handed back as a tensor over that memory."""

from .._block_mask import BlockMask
from .attention import block_sparse_attention
from .expert_parallel import ExpertParallelMoELayer
from .fp8 import fp8_autocast
from .grouped_linear import GroupedLinear
from .grouped_mlp import GroupedMLP
from .moe import MoELayer, MoEOutput, RoutedTokens, moe_route

__all__ = ["GroupedLinear", "GroupedMLP", "BlockMask", "block_sparse_attention", "MoELayer", "moe_route",
           "ExpertParallelMoELayer", "MoEOutput", "RoutedTokens", "fp8_autocast"]
