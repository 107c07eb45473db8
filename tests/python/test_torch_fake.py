"""The fake (meta) implementations of the grouped operators (sparsetrain::grouped_linear_* and
grouped_mlp_*, forward and backward, functional and `_into`), called directly: under FakeTensorMode
each op's outputs must have the sizes, strides, dtypes and devices of the real CPU call's (through
the C++ torch library), for every weight-grad disposition (wgrad, none, dummy,
delayed) and for packed weight grads whose per-group stride C++ pads (the fakes take it from
`_C.packed_wgrad_group_stride`). And torch.library.opcheck on each op: schema, autograd
registration, AOT dispatch with dynamic shapes. Storage offsets are not compared (opcheck's
test_faketensor is left out for this alone): the library's outputs start at the first 256-byte
boundary of a torch.empty allocation, which no fake can know."""

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed: torch tests skipped")

from torch._subclasses.fake_tensor import FakeTensorMode  # noqa: E402
from torch.utils import _pytree as pytree  # noqa: E402

import sparsetrain  # noqa: E402
import sparsetrain.torch as stt  # noqa: E402

G, T = 4, 37
SPLITS = [9, 0, 17, 6]  # S = 32 < T: a padded tail, expert 1 empty
BF16 = torch.bfloat16

# Layer options; sizes (in, out; the MLP's fc1 is in -> 2 * ffn, fc2 ffn -> out) chosen so that
# most packed weight grads need padding: bf16 [10, 12] groups are 120 elements, stored 128 apart.
CASES = {
    "bf16_in12_out10_wgrad": dict(),
    "bf16_in12_out10_packed_wgrad": dict(single_grouped_weight=True),
    "bf16_in3_out5_packed_wgrad_no_bias": dict(single_grouped_weight=True, bias=False, in_f=3, out_f=5, ffn=3),
    "bf16_in8_out16_unpadded_wgrad": dict(in_f=8, out_f=16, ffn=8),
    "fp32_in12_out10_packed_wgrad": dict(single_grouped_weight=True, params_dtype=torch.float32),
    "bf16_main_grad_none": dict(fuse_wgrad_accumulation=True),
    "bf16_main_grad_none_no_bias": dict(fuse_wgrad_accumulation=True, bias=False),
    "bf16_packed_main_grad_dummy": dict(single_grouped_weight=True, fuse_wgrad_accumulation=True, grad_added=True),
    "bf16_delayed": dict(delay_wgrad_compute=True),
}
KINDS = ["GroupedLinear", "GroupedMLP"]


def _make(kind, case):
    opts = dict(CASES[case])
    in_f, out_f, ffn = opts.pop("in_f", 12), opts.pop("out_f", 10), opts.pop("ffn", 6)
    grad_added = opts.pop("grad_added", False)
    kw = dict(bias=True, params_dtype=BF16)
    kw.update(opts)
    torch.manual_seed(0)
    m = stt.GroupedMLP(G, in_f, ffn, out_f, **kw) if kind == "GroupedMLP" else stt.GroupedLinear(G, in_f, out_f, **kw)
    for name, w in m.named_parameters():
        if "weight" in name and m.fuse_wgrad_accumulation:
            w.main_grad = torch.zeros(w.shape, dtype=torch.float32)
            if grad_added:
                w.grad_added_to_main_grad = False
    return m


def _layers(m):
    return (m.fc1, m.fc2) if isinstance(m, stt.GroupedMLP) else (m,)


def _op_args(kind, m):
    """{op name: its arguments} for module m: the op's inputs, as the autograd functions pass them."""
    layers = _layers(m)
    in_f, out_f = layers[0].in_features, layers[-1].out_features
    dtype = layers[0].weights()[0].dtype
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(T, in_f, generator=gen).to(dtype)
    dy = torch.randn(T, out_f, generator=gen).to(dtype)
    splits = torch.tensor(SPLITS)
    params, main_grads, flags = m._op_args()
    margs = ([p.detach() for p in params], main_grads, flags)

    def gin():
        return torch.zeros(T, in_f, dtype=dtype)

    def out():
        return torch.zeros(T, out_f, dtype=dtype)

    if kind == "GroupedLinear":
        return {
            "grouped_linear_forward": (m._id, x, splits, *margs),
            "grouped_linear_forward_into": (m._id, x, splits, *margs, out(), None, gin()),
            "grouped_linear_backward": (m._id, x, dy, splits, *margs),
            "grouped_linear_backward_into": (m._id, x, dy, splits, *margs, gin()),
        }
    probs = torch.rand(T, generator=gen)
    _, fc1_out = torch.ops.sparsetrain.grouped_mlp_forward(m._id, x, splits, probs, *margs)
    return {
        "grouped_mlp_forward": (m._id, x, splits, probs, *margs),
        "grouped_mlp_forward_into": (m._id, x, splits, probs, *margs, out(), None, gin()),
        "grouped_mlp_backward": (m._id, x, fc1_out, probs, dy, splits, *margs),
        "grouped_mlp_backward_into": (m._id, x, fc1_out, probs, dy, splits, *margs, gin()),
    }


def _drain(m):
    """Computes the delayed wgrads the calls queued, so that the module is left as it was made."""
    while m.pending_wgrads:
        m.backward_dw()


def _as_list(result):
    return [] if result is None else [result] if isinstance(result, torch.Tensor) else list(result)


def _meta(t):
    return tuple(t.shape), t.stride(), t.dtype, t.device


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("kind", KINDS)
def test_fake_outputs_have_the_real_outputs_layout(kind, case):
    m = _make(kind, case)
    packed_strides = set()
    for name, args in _op_args(kind, m).items():
        op = getattr(torch.ops.sparsetrain, name)
        real = _as_list(op(*args))
        with FakeTensorMode() as mode:
            fake = _as_list(op(*pytree.tree_map_only(torch.Tensor, mode.from_tensor, args)))
        assert len(fake) == len(real), name
        for i, (f, r) in enumerate(zip(fake, real)):
            assert _meta(f) == _meta(r), f"{name} output {i}: fake (shape, stride, dtype, device) vs the real call's"
            if r.dim() == 3:
                packed_strides.add(r.stride(0))
    _drain(m)
    # The packed weight grads were compared: their group stride is C++'s (padded where it pads).
    dtype = _layers(m)[0].weights()[0].dtype
    for layer in _layers(m):
        kind_now, _ = sparsetrain.weight_grad_disposition(layer.delay_wgrad_compute, layer.fuse_wgrad_accumulation,
                                                          layer._has_grad_added_attr())
        if kind_now == "wgrad":
            stride = sparsetrain._C.packed_wgrad_group_stride(layer.out_features, layer.in_features,
                                                              sparsetrain._arrays.dtype_name(torch.empty(0, dtype=dtype)))
            assert stride in packed_strides, (stride, packed_strides)


def test_the_cases_cover_padded_packed_wgrads():
    """At least one case's packed groups are stored further apart than out * in elements, so that a
    fake computing the stride itself would be caught."""
    assert sparsetrain._C.packed_wgrad_group_stride(10, 12, "bf16") > 10 * 12
    assert sparsetrain._C.packed_wgrad_group_stride(5, 3, "bf16") > 5 * 3
    assert sparsetrain._C.packed_wgrad_group_stride(16, 8, "bf16") == 16 * 8


@pytest.mark.parametrize("case", ["bf16_in12_out10_packed_wgrad", "bf16_main_grad_none", "bf16_delayed"])
@pytest.mark.parametrize("kind", KINDS)
def test_grouped_ops_pass_opcheck(kind, case):
    m = _make(kind, case)
    for name, args in _op_args(kind, m).items():
        if case == "bf16_delayed" and "backward" in name:
            # opcheck calls the op with copies of the parameters, several times: the first call's
            # delayed wgrad refers to its copies, and the layer refuses to rebind while it pends
            # (as it must). The other cases check the same backward ops.
            continue
        torch.library.opcheck(getattr(torch.ops.sparsetrain, name).default, args,
                              test_utils=("test_schema", "test_autograd_registration", "test_aot_dispatch_dynamic"))
    _drain(m)
