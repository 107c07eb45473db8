"""GroupedLinear and GroupedMLP through the C++ torch library (sparsetrain._torch_ops, the torch
front's only route): the C++ layer following parameters that move and refusing while wgrads are
pending; eager no-grad calls that record nothing; recorded calls that take the C++ autograd node,
with a caller `out` too. And the import error where the library is not in the install or does not load.
Fresh random data on each run (the seed is in the failure message)."""

import os
import random
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed: torch tests skipped")

import sparsetrain  # noqa: E402
import sparsetrain.torch as stt  # noqa: E402
import sparsetrain.torch.native as stn  # noqa: E402

G, T, IN, OUT, FFN = 4, 37, 12, 10, 8
SPLITS = [9, 0, 17, 6]  # S = 32 < T: a padded tail, expert 1 empty
S = sum(SPLITS)
BF16 = torch.bfloat16

KINDS = ["GroupedLinear", "GroupedMLP"]


def _make(kind, seed, **opts):
    torch.manual_seed(seed)
    kw = dict(bias=True, params_dtype=BF16)
    kw.update(opts)
    if kind == "GroupedMLP":
        return stt.GroupedMLP(G, IN, FFN, OUT, glu_interleave_size=2, **kw)
    return stt.GroupedLinear(G, IN, OUT, **kw)


def _call(m, x, probs, splits=SPLITS, **kw):
    return m(x, splits, probs, **kw) if isinstance(m, stt.GroupedMLP) else m(x, splits, **kw)


def _bits(t):
    t = t.detach()
    return t.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def test_the_layer_follows_moved_parameters_and_refuses_while_wgrads_pend():
    """A parameter replaced in place (`.data =`), a new main_grad or a new grad_added_to_main_grad
    attribute is seen by the next call (the C++ layer is rebuilt over them; a new main_grad is
    pointed at in place); while a delayed wgrad is pending no parameter may move, but main_grad
    may (the pending wgrad goes to the new one)."""
    gen = torch.Generator().manual_seed(random.SystemRandom().randrange(2**31))
    m = _make("GroupedLinear", 0, fuse_wgrad_accumulation=True, delay_wgrad_compute=True)
    for w in m.weights():
        w.main_grad = torch.zeros(w.shape)
    x = torch.randn(T, IN, generator=gen).to(BF16)
    y0 = m(x, SPLITS).detach()
    m.weight2.data = torch.randn(OUT, IN, generator=gen).to(BF16)
    fresh = _make("GroupedLinear", 0)
    fresh.weight2.data = m.weight2.data
    assert torch.equal(_bits(m(x, SPLITS)), _bits(fresh(x, SPLITS))), "the moved weight is read"
    assert not torch.equal(_bits(m(x, SPLITS)), _bits(y0))

    def step():
        xg = x.detach().requires_grad_()
        y = m(xg, SPLITS)
        y.backward(torch.ones_like(y))
        m.backward_dw()

    step()
    assert all(w.grad is None for w in m.weights()), "fused: no weight grad"
    for w in m.weights():
        w.grad_added_to_main_grad = False
    step()
    assert all(w.grad is not None and not w.grad.any() and w.grad_added_to_main_grad for w in m.weights()), "dummy"
    old = m.weight2.main_grad  # expert 2 has rows (expert 1 none)
    m.weight2.main_grad = torch.zeros(m.weight2.shape)
    step()
    assert old.any() and m.weight2.main_grad.mul(2).equal(old), "the new main_grad written (same x, dy: same wgrad)"
    y = m(x.requires_grad_(), SPLITS)
    y.backward(torch.ones_like(y))
    assert m.pending_wgrads == 1
    bound = m.weight1.data
    m.weight1.data = bound.clone()
    with pytest.raises(RuntimeError, match="GroupedLinear: parameters changed while 1 delayed"):
        m(x, SPLITS)
    assert m.pending_wgrads == 1
    m.weight1.data = bound
    moved = m.weight2.main_grad = torch.zeros(m.weight2.shape)
    m.backward_dw()  # binds the moved main_grad, the wgrad pending
    assert m.pending_wgrads == 0 and moved.mul(2).equal(old), "the pending wgrad went to the moved main_grad"


@pytest.mark.parametrize("kind", KINDS)
def test_no_grad_calls_skip_autograd_with_the_same_bytes(kind):
    """Under no_grad (or with nothing requiring grad) an eager call records nothing: the bytes of
    a recorded call, no graph, a caller buffer handed back with its version bumped once (as an
    in-place op's)."""
    gen = torch.Generator().manual_seed(random.SystemRandom().randrange(2**31))
    m = _make(kind, 0)
    x = torch.randn(T, IN, generator=gen).to(BF16)
    probs = torch.rand(T, generator=gen)
    recorded = _call(m, x, probs)
    assert recorded.grad_fn is not None
    with torch.no_grad():
        y = _call(m, x, probs)
        out = torch.full((T, OUT), float("nan"), dtype=BF16)
        version = out._version
        y_out = _call(m, x, probs, out=out)
    assert y.grad_fn is None and torch.equal(_bits(y), _bits(recorded))
    assert y_out is out and out._version == version + 1
    assert torch.equal(_bits(out[:S]), _bits(recorded[:S])) and bool(out[S:].isnan().all()), "rows >= S untouched"
    for p in m.parameters():
        p.requires_grad_(False)
    frozen = _call(m, x, probs.detach())
    assert frozen.grad_fn is None and not frozen.requires_grad and torch.equal(_bits(frozen), _bits(recorded))


# Imports sparsetrain.torch in a fresh interpreter and prints what the import raised. A meta path
# finder refuses sparsetrain._torch_ops where argv[1] is "unloadable" (a library built against
# another torch or Python: its import fails as dlopen's would).
_IMPORT = """
import sys
if sys.argv[1] == "unloadable":
    class Refuse:
        def find_spec(self, name, path=None, target=None):
            if name == "sparsetrain._torch_ops":
                raise ImportError("_torch_ops.so: undefined symbol: _ZN3c10stand_in")
    sys.meta_path.insert(0, Refuse())
import sparsetrain
sparsetrain.GroupedLinear  # the numpy / DLPack API is there without the torch library
print("package:", sparsetrain.__file__)
try:
    import sparsetrain.torch
except ImportError as e:
    print(f"{type(e).__name__} ({e.name}): {e}")
else:
    print("sparsetrain.torch imported")
"""


def _import_torch_front(how, python_path):
    env = dict(os.environ, PYTHONPATH=str(python_path))
    r = subprocess.run([sys.executable, "-c", _IMPORT, how], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    return r.stdout


@pytest.mark.parametrize("how", ["absent", "unloadable"])
def test_the_import_says_why_without_the_cpp_torch_library(how, tmp_path):
    """No second route: where the C++ torch library is not in the install (a package without
    _torch_ops.so, as a wheel built without torch) or does not load, `import sparsetrain.torch`
    raises an ImportError that says which and how to build it, and the numpy / DLPack API still
    imports."""
    package = os.path.dirname(sparsetrain.__file__)
    if how == "absent":  # the package as it is, but the library
        copy = tmp_path / "sparsetrain"
        copy.mkdir()
        for name in os.listdir(package):
            if name.startswith("_torch_ops") or name == "__pycache__":
                continue
            src = os.path.join(package, name)
            if os.path.isdir(src):
                (copy / name).mkdir()
                for sub in os.listdir(src):
                    if sub.endswith(".py"):
                        (copy / name / sub).symlink_to(os.path.join(src, sub))
            else:
                (copy / name).symlink_to(src)
        python_path = tmp_path
    else:
        python_path = os.path.dirname(package)
    out = _import_torch_front(how, python_path)
    assert f"package: {os.path.join(str(python_path), 'sparsetrain', '__init__.py')}" in out, out
    assert "ImportError (sparsetrain._torch_ops): sparsetrain.torch: " in out, out
    if how == "absent":
        assert "the C++ torch library (sparsetrain._torch_ops) is not in this install" in out, out
    else:
        assert "_torch_ops.so does not load with torch " in out and "undefined symbol: _ZN3c10stand_in" in out, out
    assert "`pip install --no-build-isolation .` where torch is installed" in out and "scripts/setup" in out, out


def test_the_library_is_loaded():
    """The torch front's ops are the C++ torch library's (its operators registered, its module
    loaded): the control case of the import test above."""
    assert stn.TORCH_OPS.__name__ == "sparsetrain._torch_ops"
    assert hasattr(torch.ops.sparsetrain, "block_sparse_attention") and hasattr(stn.TORCH_OPS, "GroupedLinear")
    out = _import_torch_front("present", os.path.dirname(os.path.dirname(sparsetrain.__file__)))
    assert "sparsetrain.torch imported" in out, out


@pytest.mark.parametrize("kind", KINDS)
def test_recorded_calls_take_the_cpp_node(kind):
    """An eager call that autograd records gets the C++ torch library's node
    (sparsetrain::GroupedLinearBackward / GroupedMLPBackward), with or without a caller `out` (which
    takes it as its history, as an in-place op's output). Its saved tensors are released after a
    backward (a second one is refused as autograd refuses it) or kept with retain_graph (the same
    grads again); an input that needs no grad gets none; an error in the backward reaches the
    caller (a freed module's layer); the parameters' AccumulateGrad nodes are held between graphs."""
    gen = torch.Generator().manual_seed(random.SystemRandom().randrange(2**31))
    m = _make(kind, 0)
    x = torch.randn(T, IN, generator=gen).to(BF16).requires_grad_()
    probs = torch.rand(T, generator=gen).requires_grad_()
    dy = torch.randn(T, OUT, generator=gen).to(BF16)
    node = f"sparsetrain::{kind}Backward"
    y = _call(m, x, probs)
    assert y.grad_fn.name() == node
    with_out = _call(m, x, probs, out=torch.empty(T, OUT, dtype=BF16))
    assert with_out.grad_fn.name() == node
    y.backward(dy, retain_graph=True)
    first = [x.grad.clone()] + [p.grad.clone() for p in m.parameters()]
    y.backward(dy)
    assert torch.equal(_bits(x.grad), _bits(first[0] + first[0]))
    for p, g in zip(m.parameters(), first[1:]):
        assert torch.equal(_bits(p.grad), _bits(g + g))
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        y.backward(dy)
    for p in m.parameters():
        p.grad = None
    del y, with_out
    frozen_x = _call(m, x.detach(), probs.detach())
    assert frozen_x.grad_fn.name() == node
    # The parameters' AccumulateGrad nodes are held by the module between graphs (made once).
    held = m._grad_accumulators[1]
    edges = [e[0] for e in frozen_x.grad_fn.next_functions[2 if kind == "GroupedMLP" else 1:]]
    assert len(held) == len(edges) == len(list(m.parameters())) and all(a is b for a, b in zip(held, edges))
    frozen_x.backward(dy)
    assert all(p.grad is not None for p in m.parameters())
    orphan, layer_id = _call(m, x, probs), m._id
    del m
    import gc  # noqa: PLC0415

    gc.collect()
    with pytest.raises(RuntimeError, match=f"sparsetrain layer {layer_id} no longer exists"):
        orphan.backward(dy)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("fused", [False, True], ids=["plain", "main_grad"])
@pytest.mark.parametrize("buffers", [False, True], ids=["functional", "out_and_grad_input"])
def test_compiled_calls_match_eager(kind, fused, buffers):
    """torch.compile(fullgraph=True) over the same operators and their C++ autograd: with caller
    `out` and `grad_input` buffers (the `_into` operators, `out` taking the node as an in-place
    op's output does) and with fused main_grad accumulation (the backward operators' mutated
    main_grads), the loss, input grads and weight grads (or main_grads) equal eager's."""
    seed = random.SystemRandom().randrange(2**31)
    m = _make(kind, seed, params_dtype=torch.float32, fuse_wgrad_accumulation=fused)
    weights = [w for n, w in m.named_parameters() if "weight" in n]
    splits = torch.tensor(SPLITS)

    def step(compiled):
        gen = torch.Generator().manual_seed(seed)
        x = torch.randn(T, IN, generator=gen).requires_grad_()
        probs = torch.rand(T, generator=gen).requires_grad_()
        dy = torch.randn(T, OUT, generator=gen)
        # Zeros: the rows >= S of `out` stay as the buffer held them, and dx's are the buffer's.
        gin = torch.zeros(T + 3, IN) if buffers else None
        for w in weights:
            w.grad = None
            if fused:
                w.main_grad = torch.zeros(w.shape)

        def loss(x, probs):
            out = torch.zeros(T + 2, OUT)[1:T + 1] if buffers else None
            return (_call(m, x, probs, splits, out=out, grad_input=gin) * dy).sum()

        value = (torch.compile(loss, fullgraph=True) if compiled else loss)(x, probs)
        value.backward()
        got = [value.detach(), x.grad] + ([probs.grad] if kind == "GroupedMLP" else [])
        return got + [w.main_grad if fused else w.grad for w in weights]

    compiled, eager = step(True), step(False)
    for i, (c, e) in enumerate(zip(compiled, eager)):
        torch.testing.assert_close(c, e, rtol=1e-5, atol=1e-5, msg=f"result {i} (seed {seed})")


@pytest.mark.parametrize("kind", KINDS)
def test_pickled_module_makes_its_own_layer(kind, tmp_path):
    """torch.save / torch.load of a whole module that has run: the copy registers anew and makes
    its own C++ layer (the same outputs); refused while a delayed wgrad is pending."""
    gen = torch.Generator().manual_seed(random.SystemRandom().randrange(2**31))
    m = _make(kind, 0)
    x = torch.randn(T, IN, generator=gen).to(BF16)
    probs = torch.rand(T, generator=gen)
    y = _call(m, x, probs).detach()
    torch.save(m, tmp_path / "m.pt")
    copy = torch.load(tmp_path / "m.pt", weights_only=False)
    assert copy._id != m._id and torch.equal(_bits(_call(copy, x, probs)), _bits(y))
    delayed = _make(kind, 0, delay_wgrad_compute=True)
    _call(delayed, x.requires_grad_(), probs).sum().backward()
    with pytest.raises(RuntimeError, match="1 delayed wgrad"):
        torch.save(delayed, tmp_path / "d.pt")


@pytest.mark.parametrize("kind", KINDS)
def test_the_dummy_wgrad_is_cached_eagerly_and_new_from_the_operator(kind):
    """Megatron's dummy weight grad (fused main_grad, grad_added_to_main_grad): an eager backward
    hands autograd the layer's cached zero tensor (the same memory every step, as
    TransformerEngine's), while the backward operator called as a compiled graph calls it (no
    eager call) returns a new zero tensor each call: an operator's output never aliases memory
    the layer keeps (CUDA graph trees free a replay's outputs at the next one)."""
    m = _make(kind, 0, single_grouped_weight=True, fuse_wgrad_accumulation=True)
    weight = m.fc1.weight if kind == "GroupedMLP" else m.weight
    for name, w in m.named_parameters():
        if "weight" in name:
            w.main_grad = torch.zeros(w.shape)
            w.grad_added_to_main_grad = False
    x = torch.randn(T, IN).to(BF16)
    probs = torch.rand(T)
    ptrs = []
    for _ in range(2):
        weight.grad = None
        _call(m, x.requires_grad_(), probs).float().sum().backward()
        assert not weight.grad.any() and weight.grad_added_to_main_grad
        ptrs.append(weight.grad.data_ptr())
    assert ptrs[0] == ptrs[1], "the eager dummy is the cached one"
    params, main_grads, flags = m._op_args()
    args = ([p.detach() for p in params], main_grads, flags)
    splits, dy = torch.tensor(SPLITS), torch.randn(T, OUT).to(BF16)
    ops = torch.ops.sparsetrain
    if kind == "GroupedMLP":
        _, fc1_out = ops.grouped_mlp_forward(m._id, x.detach(), splits, probs, *args)
        calls = [ops.grouped_mlp_backward(m._id, x.detach(), fc1_out, probs, dy, splits, *args)[2] for _ in range(2)]
    else:
        calls = [ops.grouped_linear_backward(m._id, x.detach(), dy, splits, *args)[1] for _ in range(2)]
    assert all(not d.any() and d.shape == weight.shape for d in calls)
    assert len({d.data_ptr() for d in calls} | {ptrs[0]}) == 3, "each operator call's dummy is new"
