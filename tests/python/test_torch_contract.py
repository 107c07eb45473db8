"""The torch front's host-side contract: caller `out` / `grad_input` buffers through
backward (S-row buffers under host splits, grad_input refused at forward, buffers that require
grad refused), backward_dw without delayed wgrad (a no-op, hooks included, as TransformerEngine's),
the sticky status word of device splits (`splits_status`), the packed-wgrad stride the fake
implementations use, the error of an op whose module is gone, and the eager path that skips
torch's dispatcher (same bytes as the ops; the ops still seen by dispatch modes). GroupedLinear
and GroupedMLP alike, attention for the eager path. CPU tensors here; the CUDA cases skip visibly
without a GPU."""

import contextlib
import gc
import re

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed: torch tests skipped")

import sparsetrain  # noqa: E402
import sparsetrain.torch as stt  # noqa: E402
import sparsetrain.torch.native as stn  # noqa: E402
from op_log import OpLog  # noqa: E402

G, T, IN, OUT, FFN = 4, 37, 12, 10, 8
SPLITS = [9, 0, 17, 6]  # S = 32 < T: a padded tail, expert 1 empty
S = sum(SPLITS)
BF16 = torch.bfloat16


def _linear(**kw):
    torch.manual_seed(0)
    return stt.GroupedLinear(G, IN, OUT, bias=True, params_dtype=BF16, **kw)


def _mlp(**kw):
    torch.manual_seed(0)
    return stt.GroupedMLP(G, IN, FFN, OUT, bias=True, params_dtype=BF16, **kw)


def _data(seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(T, IN, generator=gen).to(BF16).requires_grad_()
    probs = torch.rand(T, generator=gen).requires_grad_()
    dy = torch.randn(T, OUT, generator=gen).to(BF16)
    return x, probs, dy


def _call(m, x, probs, splits=SPLITS, **kw):
    return m(x, splits, probs, **kw) if isinstance(m, stt.GroupedMLP) else m(x, splits, **kw)


def _bits(t):
    return t.detach().view(torch.int16) if t.dtype == BF16 else t.detach().view(torch.int32)


MODULES = [pytest.param(_linear, id="GroupedLinear"), pytest.param(_mlp, id="GroupedMLP")]


@pytest.mark.parametrize("make", MODULES)
def test_buffers_of_S_rows_work_through_backward(make):
    """Host splits: out and grad_input need only S rows. Results bit-identical to the library
    path; x's grad has T rows, zero below S (the buffer ends at S); parameter grads identical."""
    ref, m = make(), make()
    x, probs, dy = _data(1)
    xr, pr = x.detach().clone().requires_grad_(), probs.detach().clone().requires_grad_()
    y_ref = _call(ref, xr, pr)
    y_ref.backward(dy)
    out = torch.full((S, OUT), float("nan"), dtype=BF16)
    gin = torch.full((S, IN), float("nan"), dtype=BF16)
    y = _call(m, x, probs, out=out, grad_input=gin)
    assert y.data_ptr() == out.data_ptr() and y.shape == (S, OUT)
    assert torch.equal(_bits(out), _bits(y_ref[:S])), "out: bit-identical to the library path"
    y.backward(dy[:S])
    assert x.grad.shape == x.shape
    assert torch.equal(_bits(gin), _bits(xr.grad[:S])), "grad_input: bit-identical to the library path"
    assert torch.equal(_bits(x.grad[:S]), _bits(gin))
    assert bool((x.grad[S:] == 0).all()), "rows of x past the buffer get zero gradient"
    if isinstance(m, stt.GroupedMLP):
        assert torch.equal(_bits(probs.grad[:S]), _bits(pr.grad[:S]))
    for (name, p), q in zip(m.named_parameters(), ref.parameters()):
        assert torch.equal(_bits(p.grad), _bits(q.grad)), name


@pytest.mark.parametrize("make", MODULES)
@pytest.mark.parametrize("rows", ["T_plus_3", "T", "S"])
@pytest.mark.parametrize("with_out", [False, True], ids=["functional", "into_out"])
def test_what_a_leaf_x_gets_from_a_grad_input_buffer(make, rows, with_out):
    """grad_input's rows below S are written in place (bit-identical to the library's dx), the rest
    are left as they were; what a leaf x's .grad then is depends on the buffer's rows, as
    GroupedLinear.forward's docstring says: more than T, a view of its first T rows (the buffer's
    storage, so a second backward into the same buffer overwrites x.grad before adding to it: 2 dx2,
    not dx1 + dx2); exactly T, torch's copy of it (AccumulateGrad copies a gradient someone else
    still holds: other storage, the same bytes, rows >= S the buffer's); S (host splits), a new
    [T, in] tensor, the buffer's rows then zeros."""
    n = {"T_plus_3": T + 3, "T": T, "S": S}[rows]
    ref, m = make(), make()
    x, probs, dy = _data(11)
    dy2 = _data(12)[2]
    dxs = []
    for d in (dy, dy2):  # the library's dx of each step, each into a fresh leaf
        xr, pr = x.detach().clone().requires_grad_(), probs.detach().clone().requires_grad_()
        _call(ref, xr, pr).backward(d)
        dxs.append(xr.grad)
    gin = torch.full((n, IN), float("nan"), dtype=BF16)

    def step(d):
        out = torch.full((T, OUT), float("nan"), dtype=BF16) if with_out else None
        _call(m, x, probs, grad_input=gin, out=out).backward(d)

    step(dy)
    assert torch.equal(_bits(gin[:S]), _bits(dxs[0][:S])), "rows < S: dx, bit-identical to the library's"
    assert bool(gin[S:].isnan().all()), "rows >= S: untouched"
    assert x.grad.shape == x.shape
    same_storage = x.grad.untyped_storage().data_ptr() == gin.untyped_storage().data_ptr()
    if rows == "T_plus_3":
        assert same_storage and x.grad.data_ptr() == gin.data_ptr(), "a view of the buffer's first T rows"
        assert torch.equal(_bits(x.grad), _bits(gin[:T]))
    elif rows == "T":
        assert not same_storage, "torch's copy of the buffer, not the buffer"
        assert torch.equal(_bits(x.grad), _bits(gin)), "the buffer's bytes, rows >= S included"
    else:
        assert not same_storage, "a new tensor"
        assert torch.equal(_bits(x.grad[:S]), _bits(gin)) and bool((x.grad[S:] == 0).all())
    step(dy2)  # x.grad is not None now: autograd adds the second dx into it, in place
    want = 2 * dxs[1] if rows == "T_plus_3" else dxs[0] + dxs[1]
    assert torch.equal(_bits(x.grad[:S]), _bits(want[:S])), "T_plus_3: 2 dx2 (x.grad is the buffer); else dx1 + dx2"


@pytest.mark.parametrize("make", MODULES)
def test_buffers_of_S_rows_are_refused_with_device_splits_shape(make):
    """The row rule names its reason: >= S with host splits (fewer is refused at forward)."""
    m = make()
    x, probs, _ = _data(2)
    out = torch.full((S - 1, OUT), float("nan"), dtype=BF16)
    with pytest.raises(ValueError, match=r"out: expected shape \[>= 32 \(S: host splits\), 10\], got \[31, 10\]"):
        _call(m, x, probs, out=out)
    assert bool(out.isnan().all()), "out untouched"


# Bad grad_input buffers: each refused by forward, before anything runs, with backward's message.
BAD_GRAD_INPUT = [
    pytest.param(lambda: torch.zeros(S - 1, IN, dtype=BF16),
                 r"grad_input: expected shape \[>= 32 \(S: host splits\), 12\], got \[31, 12\]", id="too_few_rows"),
    pytest.param(lambda: torch.zeros(T, IN + 1, dtype=BF16),
                 r"grad_input: expected shape \[>= 32 \(S: host splits\), 12\], got \[37, 13\]", id="wrong_width"),
    pytest.param(lambda: torch.zeros(T, IN, dtype=torch.float16),
                 r"grad_input: expected dtype bf16 \(the layer's dtype\), got fp16", id="wrong_dtype"),
    pytest.param(lambda: torch.zeros(IN, T, dtype=BF16).t(),
                 r"grad_input: expected a contiguous tensor", id="not_contiguous"),
    pytest.param(lambda: torch.zeros(T, IN, dtype=BF16, device="meta"),
                 r"grad_input: expected a tensor on cpu \(x's device\), got meta", id="wrong_device"),
]


@pytest.mark.parametrize("make", MODULES)
@pytest.mark.parametrize("bad,message", BAD_GRAD_INPUT)
def test_grad_input_is_checked_at_forward(make, bad, message):
    m = make(delay_wgrad_compute=True)
    x, probs, _ = _data(3)
    out = torch.full((T, OUT), float("nan"), dtype=BF16)
    with pytest.raises(ValueError, match=message):
        _call(m, x, probs, out=out, grad_input=bad())
    assert bool(out.isnan().all()), "forward wrote out before refusing grad_input"
    assert m.pending_wgrads == 0


@pytest.mark.parametrize("make", MODULES)
def test_out_on_another_device_is_refused(make):
    m = make()
    x, probs, _ = _data(3)
    with pytest.raises(ValueError, match=r"out: expected a tensor on cpu \(x's device\), got meta"):
        _call(m, x, probs, out=torch.empty(T, OUT, dtype=BF16, device="meta"))


@pytest.mark.parametrize("make", MODULES)
@pytest.mark.parametrize("which", ["out", "grad_input"])
def test_a_buffer_that_requires_grad_is_refused(make, which):
    m = make()
    x, probs, _ = _data(4)
    cols = OUT if which == "out" else IN
    buf = torch.zeros(T, cols, dtype=BF16, requires_grad=True)
    with pytest.raises(ValueError, match=rf"{which}: expected a tensor that does not require grad .*"
                                         r"got requires_grad=True"):
        _call(m, x, probs, **{which: buf})
    assert bool((buf == 0).all())


@pytest.mark.parametrize("make", MODULES)
@pytest.mark.parametrize("fuse", [False, True], ids=["wgrad", "main_grad"])
def test_backward_dw_without_delay_is_a_no_op(make, fuse):
    m = make(fuse_wgrad_accumulation=fuse)
    weights = [p for n, p in m.named_parameters() if "weight" in n]
    for w in weights:
        w.main_grad = torch.randn(w.shape, dtype=torch.float32)
    fired = []
    m.register_wgrad_accumulation_and_reduce_hooks(lambda: fired.append(1))
    x, probs, dy = _data(5)
    _call(m, x, probs).backward(dy)
    before = {n: (None if p.grad is None else p.grad.clone()) for n, p in m.named_parameters()}
    main_before = [w.main_grad.clone() for w in weights]
    assert not m.need_backward_dw()
    m.backward_dw()
    m.backward_dw()
    assert fired == [], "TransformerEngine's backward_dw returns before the hooks"
    for n, p in m.named_parameters():
        assert (p.grad is None) == (before[n] is None) and (p.grad is None or torch.equal(p.grad, before[n])), n
    for w, mb in zip(weights, main_before):
        assert torch.equal(w.main_grad, mb)


@pytest.mark.parametrize("make", MODULES)
def test_splits_status_is_a_module_buffer(make):
    m = make()
    st_word = m.splits_status
    assert st_word.dtype == torch.int32 and tuple(st_word.shape) == (1,) and int(st_word) == 0
    assert "splits_status" not in "".join(m.state_dict().keys()), "not part of the checkpoint"
    assert sparsetrain.SPLITS_NEGATIVE and sparsetrain.SPLITS_SUM_EXCEEDS_ROWS
    assert sparsetrain.SPLITS_NEGATIVE & sparsetrain.SPLITS_SUM_EXCEEDS_ROWS == 0
    # Host splits are checked at once: an error, and the word stays clear.
    x, probs, _ = _data(6)
    with pytest.raises(ValueError, match="splits: expected entries >= 0"):
        _call(m, x, probs, [1, -2, 3, 4])
    assert int(m.splits_status) == 0


def test_fake_packed_wgrad_stride_is_the_core_s():
    """The fake implementations take the stride from C++: compare with a real backward whose
    groups need padding (5 x 3 bf16 = 30 bytes -> 128 elements) and one that does not."""
    for out_f, in_f in ((5, 3), (16, 8)):
        torch.manual_seed(0)
        m = stt.GroupedLinear(2, in_f, out_f, bias=False, params_dtype=BF16, single_grouped_weight=True)
        x = torch.randn(6, in_f, dtype=BF16)
        _, dw, _ = torch.ops.sparsetrain.grouped_linear_backward(m._id, x, torch.randn(6, out_f, dtype=BF16),
                                                                 torch.tensor([2, 4]), *_op_args(m))
        assert dw.shape == (2, out_f, in_f)
        assert dw.stride(0) == sparsetrain._C.packed_wgrad_group_stride(out_f, in_f, "bf16")
    assert sparsetrain._C.packed_wgrad_group_stride(5, 3, "bf16") == 128


def test_an_op_of_a_freed_module_says_so():
    m = _linear()
    layer_id, args = m._id, _op_args(m)
    del m
    gc.collect()
    x = torch.randn(T, IN, dtype=BF16)
    with pytest.raises(RuntimeError, match=f"sparsetrain layer {layer_id} no longer exists"):
        torch.ops.sparsetrain.grouped_linear_forward(layer_id, x, torch.tensor(SPLITS), *args)


def _grads_of(run, m, x, probs, dy, mode=None):
    """(y, x.grad, probs.grad, parameter grads) of one forward + backward, under `mode` if given."""
    for p in m.parameters():
        p.grad = None
    xr, pr = x.detach().clone().requires_grad_(), probs.detach().clone().requires_grad_()
    with mode if mode is not None else contextlib.nullcontext():
        y = run(m, xr, pr)
        y.backward(dy)
    return [y.detach(), xr.grad, pr.grad if pr.grad is not None else pr.new_zeros(0),
            *[p.grad for p in m.parameters()]]


@pytest.mark.parametrize("make", MODULES)
@pytest.mark.parametrize("buffers", [False, True], ids=["library_buffers", "caller_buffers"])
def test_eager_calls_skip_the_dispatcher_with_the_ops_bytes(make, buffers):
    """Eager calls on plain tensors run the op implementations directly (the dispatcher's cost
    saved); under a dispatch mode the ops run and the mode sees them. Same bytes either way."""
    m = make()
    x, probs, dy = _data(3)

    def run(m, x, p):
        kw = dict(out=torch.full((T, OUT), float("nan"), dtype=BF16),
                  grad_input=torch.full((T, IN), float("nan"), dtype=BF16)) if buffers else {}
        return _call(m, x, p, **kw)

    direct = _grads_of(run, m, x, probs, dy)
    log = OpLog()
    assert stn.direct(x, dy) and not stn.direct(x, torch.empty(0, device="meta"))
    with log:
        assert not stn.direct(x, dy), "a dispatch mode is active: the ops must run"
    via_ops = _grads_of(run, m, x, probs, dy, log)
    kind = "grouped_mlp" if isinstance(m, stt.GroupedMLP) else "grouped_linear"
    suffix = "_into" if buffers else ""
    assert f"sparsetrain.{kind}_forward{suffix}" in log.names, log.names
    assert f"sparsetrain.{kind}_backward{suffix}" in log.names, log.names
    for i, (a, b) in enumerate(zip(direct, via_ops)):
        assert a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8)), i


def test_attention_calls_its_operators_eagerly_and_under_a_dispatch_mode():
    """Attention has one route: its operators, which a dispatch mode sees (forward and backward),
    with the bytes of the eager call."""
    gen = torch.Generator().manual_seed(4)
    q, k, v, do = (torch.randn(1, 2, 200, 16, generator=gen) for _ in range(4))
    mask = sparsetrain.BlockMask.build("causal", 200)

    def run(mode=None):
        ins = [t.clone().requires_grad_() for t in (q, k, v)]
        with mode if mode is not None else contextlib.nullcontext():
            o = stt.block_sparse_attention(*ins, mask)
            o.backward(do)
        return [o.detach()] + [t.grad for t in ins]

    eager = run()
    log = OpLog()
    via_mode = run(log)
    assert "sparsetrain.block_sparse_attention" in log.names, log.names
    assert "sparsetrain.block_sparse_attention_backward" in log.names, log.names
    for a, b in zip(eager, via_mode):
        assert torch.equal(a.view(torch.int32), b.view(torch.int32))


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device: CUDA torch test skipped")


@cuda
@pytest.mark.parametrize("make", MODULES)
def test_cuda_invalid_device_splits_set_the_sticky_status_word(make):
    """Invalid CUDA m_splits cannot raise (no host read): every group empty (output zero) and the
    bits ORed into splits_status, which stays set across a later valid call until the caller
    clears it; all without a host synchronisation in the call."""
    m = make(device="cuda")
    x, probs, _ = (t.detach().cuda() for t in _data(7))
    status = m.splits_status
    assert status.is_cuda and int(status) == 0
    bad = torch.tensor([T, 1, 0, 0], device="cuda")  # sum T + 1 > T
    y = _call(m, x, probs, bad)
    assert m.splits_status.data_ptr() == status.data_ptr(), "the same word: graphs capture its address"
    assert int(status) & sparsetrain.SPLITS_SUM_EXCEEDS_ROWS
    assert bool((y == 0).all()), "invalid splits empty every group"
    good = torch.tensor(SPLITS, device="cuda")
    _call(m, x, probs, good)
    assert int(status) & sparsetrain.SPLITS_SUM_EXCEEDS_ROWS, "sticky: a valid call does not clear it"
    neg = torch.tensor([-1, 1, 0, 0], device="cuda")
    _call(m, x, probs, neg)
    assert int(status) == sparsetrain.SPLITS_SUM_EXCEEDS_ROWS | sparsetrain.SPLITS_NEGATIVE
    status.zero_()
    _call(m, x, probs, good)
    assert int(status) == 0


@pytest.mark.parametrize("make", MODULES)
def test_wrong_dtype_or_device_of_out_and_main_grad(make):
    """Each refused at forward with the argument named, nothing written. Bias and dy: the tests
    below."""
    x, probs, _ = _data(8)
    m = make()
    out = torch.full((T, OUT), float("nan"))
    with pytest.raises(ValueError, match=r"out: expected dtype bf16 \(the layer's dtype\), got fp32"):
        _call(m, x, probs, out=out)
    assert bool(out.isnan().all())
    prefix = "fc1." if isinstance(m, stt.GroupedMLP) else ""
    for bad, message in ((lambda w: torch.zeros(w.shape, dtype=BF16), r"main_grad\[0\]: expected dtype fp32, got bf16"),
                         (lambda w: torch.zeros(w.shape, device="meta"),
                          r"weight0.main_grad: expected a tensor on cpu \(x's device\), got meta")):
        fused = make(fuse_wgrad_accumulation=True)
        for name, w in fused.named_parameters():
            if "weight" in name:
                w.main_grad = bad(w)
        with pytest.raises(ValueError, match=prefix + message):
            _call(fused, x, probs)


def _op_args(m):
    """The (params, main_grads, flags) arguments of m's ops, detached: each layer's weights then
    biases (fc1's, then fc2's), its main_grads, the flags."""
    params, main_grads, flags = m._op_args()
    return [p.detach() for p in params], main_grads, flags


@pytest.mark.parametrize("make", MODULES)
@pytest.mark.parametrize("packed", [False, True], ids=["per_expert", "packed"])
@pytest.mark.parametrize("bad", ["dtype", "device"])
@pytest.mark.parametrize("via", ["eager", "ops"])
def test_wrong_dtype_or_device_of_bias(make, packed, bad, via):
    """A bias of another dtype or on another device ("meta" stands in for a CUDA device here),
    refused at forward with the parameter named, expected and got, nothing written: eager calls and
    calls through torch.ops (torch.compile, dispatch modes: `ops`) alike, by the C++ checks for a
    dtype, and for a device by the fake implementation, which a meta argument selects (the C++
    never sees such a call)."""
    m = make(single_grouped_weight=packed)
    layer, prefix = (m.fc1, "fc1.") if isinstance(m, stt.GroupedMLP) else (m, "")
    name = "bias" if packed else "bias2"
    old = getattr(layer, name)
    new = old.detach().float() if bad == "dtype" else torch.empty(old.shape, dtype=BF16, device="meta")
    setattr(layer, name, torch.nn.Parameter(new))
    if bad == "dtype":
        message = prefix + ("bias" if packed else r"bias\[2\]") + ": expected dtype bf16, got fp32"
    else:
        message = rf"{prefix}{name}: expected a tensor on cpu \(x's device\), got meta"
    x, probs, _ = _data(9)
    out = torch.full((T, OUT), float("nan"), dtype=BF16)
    mode = OpLog() if via == "ops" else contextlib.nullcontext()
    with pytest.raises(ValueError, match=message), mode:
        _call(m, x, probs, out=out)
    assert bool(out.isnan().all()), "out written before the bias was refused"
    if via == "ops":
        assert mode.names, "the ops ran through the dispatcher"


@pytest.mark.parametrize("make", MODULES)
def test_dy_of_another_dtype_is_cast_and_on_another_device_refused_by_autograd(make):
    """What autograd hands our backward: an incoming gradient of another dtype is cast to the
    output's dtype first (same bytes as the bf16 gradient), one on another device is refused by
    autograd itself, naming the gradient, the expected device and the one it got."""
    x, probs, dy = _data(10)
    grads = []
    for g in (dy, dy.float()):
        m = make()
        xr, pr = x.detach().clone().requires_grad_(), probs.detach().clone().requires_grad_()
        _call(m, xr, pr).backward(g)
        grads.append([xr.grad, *(p.grad for p in m.parameters())])
    for i, (a, b) in enumerate(zip(*grads)):
        assert torch.equal(_bits(a), _bits(b)), i
    m = make(delay_wgrad_compute=True)
    y = _call(m, x, probs)
    with pytest.raises(RuntimeError, match="invalid gradient at index 0 - expected device cpu but got meta"):
        y.backward(torch.empty(T, OUT, dtype=BF16, device="meta"))
    assert m.pending_wgrads == 0


@pytest.mark.parametrize("make", MODULES)
@pytest.mark.parametrize("into", [False, True], ids=["functional", "into_grad_input"])
@pytest.mark.parametrize("bad", ["dtype", "device"])
def test_dy_of_wrong_dtype_or_device_through_the_backward_ops(make, into, bad):
    """Autograd makes neither reach our backward (above), but a direct call of a backward op can:
    refused with dy named, expected and got, before anything is written (grad_input untouched,
    no delayed wgrad queued). A meta dy selects the fake implementation, which checks devices."""
    m = make(delay_wgrad_compute=True)
    x, probs, dy = (t.detach() for t in _data(11))
    dy = dy.float() if bad == "dtype" else torch.empty(T, OUT, dtype=BF16, device="meta")
    message = (r"dy: expected dtype bf16 \(the layer's dtype\), got fp32" if bad == "dtype"
               else r"dy: expected a tensor on cpu \(x's device\), got meta")
    splits, margs = torch.tensor(SPLITS), _op_args(m)
    gin = torch.full((T, IN), float("nan"), dtype=BF16)
    ops = torch.ops.sparsetrain
    if isinstance(m, stt.GroupedMLP):
        _, fc1_out = ops.grouped_mlp_forward(m._id, x, splits, probs, *margs)
        args = (m._id, x, fc1_out, probs, dy, splits, *margs)
        op = ops.grouped_mlp_backward_into if into else ops.grouped_mlp_backward
    else:
        args = (m._id, x, dy, splits, *margs)
        op = ops.grouped_linear_backward_into if into else ops.grouped_linear_backward
    with pytest.raises(ValueError, match=message):
        op(*args, *((gin,) if into else ()))
    assert bool(gin.isnan().all()), "grad_input written before dy was refused"
    assert m.pending_wgrads == 0, "a delayed wgrad queued before dy was refused"


@pytest.mark.parametrize("kind", ["GroupedLinear", "GroupedMLP"])
def test_deepcopy_of_a_called_module(kind):
    """copy.deepcopy of a module that has run (an EMA / reference copy): the copy has its own
    parameters and C++ layer (same results, independent gradients); refused while a delayed wgrad
    is pending."""
    import copy

    torch.manual_seed(7)
    make = (lambda **kw: stt.GroupedLinear(4, 8, 6, params_dtype=torch.bfloat16, **kw)) if kind == "GroupedLinear" \
        else (lambda **kw: stt.GroupedMLP(4, 8, 6, params_dtype=torch.bfloat16, **kw))
    m = make()
    x = torch.randn(10, 8, dtype=torch.bfloat16)
    splits = [3, 0, 5, 2]
    args = (x, splits) if kind == "GroupedLinear" else (x, splits, torch.rand(10))
    m(*args).float().sum().backward()
    c = copy.deepcopy(m)
    assert c._id != m._id
    for p, q in zip(m.parameters(), c.parameters()):
        assert p is not q and torch.equal(p, q)
    assert torch.equal(c(*args), m(*args))
    with torch.no_grad():
        next(c.parameters()).add_(1)
    assert not torch.equal(c(*args), m(*args)), "the copy's layer reads the copy's parameters"
    d = make(delay_wgrad_compute=True)
    d(*args).float().sum().backward()
    with pytest.raises(RuntimeError, match="delayed wgrad"):
        copy.deepcopy(d)
    d.backward_dw()
    copy.deepcopy(d)


# --- Bad input a new user hit --------------------------------------------------------------------

_NAMES = {torch.float64: "fp64", torch.float32: "fp32", torch.float16: "fp16", torch.int64: "int64", torch.bool: "bool"}
_WRONG_X = [pytest.param(dt, grad, with_out, id=f"{name}-{'grad' if grad else 'no_grad'}-{'out' if with_out else 'y'}")
            for dt, name in _NAMES.items() for grad in (False, True) for with_out in (False, True)
            if dt.is_floating_point or not grad]


@pytest.mark.parametrize("make", MODULES)
@pytest.mark.parametrize("dtype,grad,with_out", _WRONG_X)
def test_a_wrong_x_dtype_gets_one_message_in_the_librarys_names(make, dtype, grad, with_out):
    """x of a dtype the library computes with (fp32, fp16) or not (fp64, int64, bool) gets the same
    message: the layer's dtype expected, the library's names for both (torch's float64 is fp64),
    whichever eager route the call takes; nothing written."""
    m = make()
    x, probs, _ = _data(13)
    x = x.detach().to(dtype).requires_grad_(grad)
    out = torch.full((T, OUT), float("nan"), dtype=BF16) if with_out else None
    with pytest.raises(ValueError, match=rf"^x: expected dtype bf16 \(the layer's dtype\), got {_NAMES[dtype]}$"):
        _call(m, x, probs, out=out)
    assert out is None or bool(out.isnan().all())


@pytest.mark.parametrize("make", MODULES)
def test_a_transposed_x_is_refused_with_the_layouts_taken_and_the_fix(make):
    m = make()
    x, probs, _ = _data(14)
    xt = x.detach().t().contiguous().t()  # x's values, strides (1, T): a transposed [IN, T] tensor
    message = ("x: expected a unit stride in the last dimension (taken: any strides with the last dimension "
               "contiguous, as in a contiguous tensor or a slice of one; a transposed tensor is not, pass "
               f"x.contiguous()), got {T}")
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        _call(m, xt, probs)
    assert torch.equal(_bits(_call(m, xt.contiguous(), probs)), _bits(_call(m, x.detach(), probs))), "the fix works"


_FRACTIONAL = [9.5, 0, 17, 5.5]  # sums to S: int() would run [9, 0, 17, 5] without a word


@pytest.mark.parametrize("make", MODULES)
@pytest.mark.parametrize("form", ["list", "list_after_ints", "fp32_tensor", "fp64_tensor", "bool_tensor"])
def test_fractional_or_float_splits_are_refused_not_truncated(make, form):
    """m_splits are whole numbers of rows: a list with a fractional entry is refused naming the
    entry and its index (also right after a call whose integer list the module reuses), a float or
    bool tensor by its dtype; nothing written either way."""
    m = make()
    x, probs, _ = _data(15)
    if form == "list_after_ints":
        _call(m, x, probs, [9, 0, 17, 5])
    out = torch.full((T, OUT), float("nan"), dtype=BF16)
    if form.startswith("list"):
        splits, message = _FRACTIONAL, r"^m_splits: expected whole numbers of rows \(integers\), got 9\.5 at index 0$"
    else:
        dtype = {"fp32_tensor": torch.float32, "fp64_tensor": torch.float64, "bool_tensor": torch.bool}[form]
        splits = torch.tensor(SPLITS).to(dtype)
        message = (rf"^m_splits: expected an integer tensor \(int64, or another integer dtype, converted\), got "
                   rf"{_NAMES[dtype]} \(judged by its dtype, its values unread; if they are whole numbers, pass "
                   r"m_splits\.long\(\)\)$")
    with pytest.raises(ValueError, match=message):
        _call(m, x, probs, splits, out=out)
    assert bool(out.isnan().all()), "out written before the splits were refused"


@pytest.mark.parametrize("make", MODULES)
def test_whole_float_and_integer_tensor_splits_are_the_integers(make):
    """30.0 in a list is 30 (the rule reads list values), and an int32 or int16
    tensor is converted: the same bytes as the int list, in a fresh module and right after ints."""
    x, probs, _ = _data(16)
    ref = _call(make(), x.detach(), probs.detach())
    for splits in ([float(s) for s in SPLITS], torch.tensor(SPLITS, dtype=torch.int32),
                   torch.tensor(SPLITS, dtype=torch.int16)):
        assert torch.equal(_bits(_call(make(), x.detach(), probs.detach(), splits)), _bits(ref)), splits
    m = make()
    _call(m, x.detach(), probs.detach())
    assert torch.equal(_bits(_call(m, x.detach(), probs.detach(), [float(s) for s in SPLITS])), _bits(ref))
