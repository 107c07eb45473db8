"""GroupedLinear and GroupedMLP through the C++ torch library (sparsetrain._torch_ops, the default
where it is built) against the extension path (`_C`, SPARSETRAIN_TORCH_OPS=0): the same bytes
forward and backward, with bias, packed weights, caller out / grad_input buffers, main_grad
accumulation and overwrite, the dummy wgrad of Megatron's grad_added_to_main_grad and delayed
wgrad (two backwards queued, then backward_dw twice, first in first out; on CUDA on a side
stream, with device splits; those cases skip without a GPU); the C++ layer following
parameters that move and refusing while wgrads are pending; eager no-grad calls that skip the
autograd.Function. Fresh random data on each run (the seed is in the failure message)."""

import os
import random
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed: torch tests skipped")

import sparsetrain.torch as stt  # noqa: E402
import sparsetrain.torch.native as stn  # noqa: E402

G, T, IN, OUT, FFN = 4, 37, 12, 10, 8
SPLITS = [9, 0, 17, 6]  # S = 32 < T: a padded tail, expert 1 empty
S = sum(SPLITS)
BF16 = torch.bfloat16

needs_native = pytest.mark.skipif(stn.NATIVE is None, reason="the C++ torch library (sparsetrain/_torch_ops.so) "
                                  "is not built here, or SPARSETRAIN_TORCH_OPS=0: its parity tests skipped")

CASES = {
    "bias": dict(),
    "packed_caller_buffers": dict(single_grouped_weight=True, buffers=True),
    "main_grad_dummy": dict(fuse_wgrad_accumulation=True, main_grad="accumulate", grad_added=True),
    "packed_overwrite_main_grad_dummy": dict(single_grouped_weight=True, fuse_wgrad_accumulation=True,
                                             main_grad="overwrite", grad_added=True),
    "delayed": dict(delay_wgrad_compute=True, buffers=True),
    "delayed_fused_dummy": dict(delay_wgrad_compute=True, fuse_wgrad_accumulation=True, main_grad="accumulate",
                                grad_added=True),
    "fp32_no_bias": dict(bias=False, params_dtype=torch.float32),
    "delayed_grad_input_only": dict(delay_wgrad_compute=True, buffers="grad_input"),
}
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


def _run(kind, case, seed, device):
    """Two steps of forward + backward (then the delayed wgrads): every tensor that came out. On
    CUDA with device splits, and the delayed wgrads computed on a side stream."""
    opts = dict(CASES[case])
    buffers, main_grad, added = opts.pop("buffers", False), opts.pop("main_grad", None), opts.pop("grad_added", False)
    m = _make(kind, seed, device=device, **opts)
    dtype = m.fc1.weights()[0].dtype if kind == "GroupedMLP" else m.weights()[0].dtype
    splits = torch.tensor(SPLITS, device=device) if device == "cuda" else SPLITS
    gen = torch.Generator().manual_seed(seed + 1)
    weights = [p for n, p in m.named_parameters() if "weight" in n]
    for w in weights if main_grad else []:
        w.main_grad = torch.randn(w.shape, generator=gen).to(device)
        w.overwrite_main_grad = main_grad == "overwrite"
        if added:
            w.grad_added_to_main_grad = False
    got = []
    for _ in range(2):
        x = torch.randn(T, IN, generator=gen).to(device, dtype).requires_grad_()
        probs = torch.rand(T, generator=gen).to(device).requires_grad_()
        dy = torch.randn(T, OUT, generator=gen).to(device, dtype)
        kw = dict(out=torch.full((T, OUT), float("nan"), dtype=dtype, device=device),
                  grad_input=torch.full((T, IN), float("nan"), dtype=dtype, device=device)) if buffers else {}
        if buffers == "grad_input":
            del kw["out"]
        y = _call(m, x, probs, splits, **kw)
        y.backward(dy)
        got += [y, x.grad] + ([probs.grad] if kind == "GroupedMLP" else [])
    assert m.pending_wgrads == (2 if m.delay_wgrad_compute else 0)
    side = torch.cuda.Stream() if device == "cuda" else None
    for _ in range(2 if m.delay_wgrad_compute else 0):
        if side is None:
            m.backward_dw()
            continue
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            m.backward_dw()
        torch.cuda.current_stream().wait_stream(side)
    assert m.pending_wgrads == 0
    got += [p.grad if p.grad is not None else torch.zeros(0) for p in m.parameters()]
    got += [w.main_grad for w in weights if main_grad]
    flags = [getattr(w, "grad_added_to_main_grad", None) for w in weights]
    return m, got, flags


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(),
                                                                 reason="no CUDA device: the CUDA parity cases skip"))]


@needs_native
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("kind", KINDS)
def test_native_layers_equal_the_extension_path(kind, case, device, monkeypatch):
    if device == "cuda" and CASES[case].get("params_dtype") == torch.float32:
        pytest.skip("fp32 layers run on the CPU reference only")
    seed = random.SystemRandom().randrange(2**31)
    native, got, flags = _run(kind, case, seed, device)
    assert native._native_layer is not None and native._core_layer is None, "ran through the C++ torch library"
    monkeypatch.setattr(stn, "NATIVE", None)
    extension, want, want_flags = _run(kind, case, seed, device)
    assert extension._core_layer is not None and extension._native_layer is None, "ran through _C"
    assert flags == want_flags, f"grad_added_to_main_grad, seed {seed}"
    assert len(got) == len(want)
    for i, (a, b) in enumerate(zip(got, want)):
        assert a.dtype == b.dtype and a.shape == b.shape and a.stride() == b.stride(), f"tensor {i}, seed {seed}"
        assert torch.equal(_bits(a), _bits(b)), f"tensor {i}: bytes differ, seed {seed}"


@pytest.mark.parametrize("path", ["native", "extension"])
def test_the_layer_follows_moved_parameters_and_refuses_while_wgrads_pend(path, monkeypatch):
    """A parameter replaced in place (`.data =`), a new main_grad or a new grad_added_to_main_grad
    attribute is seen by the next call (the C++ layer is rebuilt over them); while a delayed
    wgrad is pending nothing may move."""
    if path == "native" and stn.NATIVE is None:
        pytest.skip("the C++ torch library is not built here")
    if path == "extension":
        monkeypatch.setattr(stn, "NATIVE", None)
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
    m.weight1.data = m.weight1.data.clone()
    with pytest.raises(RuntimeError, match="GroupedLinear: parameters or main_grad changed while 1 delayed"):
        m(x, SPLITS)
    assert m.pending_wgrads == 1


@pytest.mark.parametrize("kind", KINDS)
def test_no_grad_calls_skip_autograd_with_the_same_bytes(kind):
    """Under no_grad (or with nothing requiring grad) an eager call skips the autograd.Function:
    the bytes of a recorded call, no graph, a caller buffer handed back with its version bumped
    once (as mark_dirty does)."""
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


def test_torch_ops_0_runs_the_extension_path():
    """SPARSETRAIN_TORCH_OPS=0 loads no C++ torch library and every call runs through `_C`."""
    code = ("import torch, sparsetrain.torch as stt, sparsetrain.torch.native as stn\n"
            "assert stn.NATIVE is None\n"
            "m = stt.GroupedMLP(2, 8, 4, bias=True, delay_wgrad_compute=True)\n"
            "x = torch.randn(5, 8, requires_grad=True)\n"
            "m(x, [2, 3], torch.rand(5)).sum().backward(); m.backward_dw()\n"
            "assert m._core_layer is not None and m._native_layer is None and x.grad is not None\n"
            "assert m.fc1.weight0.grad is not None\n")
    env = dict(os.environ, SPARSETRAIN_TORCH_OPS="0")
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr


@needs_native
@pytest.mark.parametrize("kind", KINDS)
def test_recorded_calls_take_the_cpp_node(kind):
    """An eager call that autograd records, without a caller `out`, skips the autograd.Function:
    the C++ torch library records its node (sparsetrain::PythonBackward) whose backward is the
    same Python code (bytes: the parity cases above). Its saved tensors are released after a
    backward (a second one is refused as autograd refuses it) or kept with retain_graph (the same
    grads again); an input that needs no grad gets none; an error in the backward reaches the
    caller with its type (a freed module's layer); the parameters' AccumulateGrad nodes are held
    between graphs."""
    gen = torch.Generator().manual_seed(random.SystemRandom().randrange(2**31))
    m = _make(kind, 0)
    x = torch.randn(T, IN, generator=gen).to(BF16).requires_grad_()
    probs = torch.rand(T, generator=gen).requires_grad_()
    dy = torch.randn(T, OUT, generator=gen).to(BF16)
    y = _call(m, x, probs)
    assert y.grad_fn.name() == "sparsetrain::PythonBackward"
    with_out = _call(m, x, probs, out=torch.empty(T, OUT, dtype=BF16))
    assert "PythonBackward" not in with_out.grad_fn.name(), "a caller `out` keeps the autograd.Function"
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
    assert frozen_x.grad_fn.name() == "sparsetrain::PythonBackward"
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
