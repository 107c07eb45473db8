"""sparsetrain.torch.GroupedMLP through real autograd: output and gradients (x, probs, both
layers' weights and biases) against a float64 pure-torch composition (fc1 per expert with torch.mm,
silu(a) * b * probs, fc2, + probs * b2) under autograd, for fp32 and bf16, halves and interleaved
GLU blocks, empty experts and a padded tail; both layers under the weight-grad table, main_grad
accumulate / overwrite, delayed wgrad with backward_dw and hooks, caller buffers, bad input, what
autograd saves, torch.compile(fullgraph=True). CUDA variants (src/cuda/grouped_mlp) skip visibly
without a CUDA device, or where sparsetrain was built without CUDA (SPARSETRAIN_CUDA=OFF) under a
torch that has it. The C++ suites check the values against a tight oracle bound; here the bounds
only need to catch wrong wiring (an O(1) error), so they are scaled to each tensor's magnitude."""

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed: torch tests skipped")

import torch.nn.functional as F  # noqa: E402

import sparsetrain.torch as stt  # noqa: E402

G, T, IN, FFN, OUT = 4, 37, 12, 6, 10
SPLITS = [9, 0, 17, 6]  # S = 32 < T: a padded tail, expert 1 empty
S = sum(SPLITS)
# max |got - ref| / max |ref| allowed per tensor: fp32 rounding, and bf16's rounding of the
# intermediates (fc1_out, the activation, fc2's dgrad) that the float64 composition does not do.
REL_TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _close(got, ref, dtype, what):
    got, ref = got.detach().double().cpu(), ref.detach().double().cpu()
    assert got.shape == ref.shape, what
    tol = REL_TOL[dtype] * max(ref.abs().max().item(), 1e-6)
    err = (got - ref).abs()
    assert bool((err <= tol).all()), f"{what}: max error {err.max().item():.3e} > {tol:.3e}"  # NaN fails


def _make(dtype=torch.float32, bias=True, k=0, single=False, **kw):
    torch.manual_seed(0)
    return stt.GroupedMLP(G, IN, FFN, OUT, bias=bias, params_dtype=dtype, glu_interleave_size=k,
                          single_grouped_weight=single, **kw)


def _inputs(dtype, seed=1, device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(T, IN, generator=gen).to(dtype)
    probs = torch.rand(T, generator=gen)
    dy = torch.randn(T, OUT, generator=gen).to(dtype)
    return x.to(device).requires_grad_(), probs.to(device).requires_grad_(), dy.to(device)


def _expert_params(layer):
    ws = list(layer.weight.unbind(0)) if layer.single_grouped_weight else layer.weights()
    if not layer.use_bias:
        return ws, [None] * G
    bs = list(layer.bias.unbind(0)) if layer.single_grouped_weight else layer.biases()
    return ws, bs


def _glu_halves(z, k):
    if k == 0:
        return z[:, :FFN], z[:, FFN:]
    blocks = z.reshape(z.shape[0], FFN // k, 2, k)
    return blocks[:, :, 0].reshape(-1, FFN), blocks[:, :, 1].reshape(-1, FFN)


def _reference(m, x, probs, dy, splits=SPLITS):
    """float64 pure-torch composition under autograd: (y, dx, dprobs, fc1 (dW, db), fc2 (dW, db))."""
    leaf = lambda t: None if t is None else t.detach().cpu().double().requires_grad_()  # noqa: E731
    (w1, b1), (w2, b2) = ([[leaf(t) for t in ts] for ts in _expert_params(layer)] for layer in (m.fc1, m.fc2))
    x64, p64 = leaf(x), leaf(probs)
    outs, start = [], 0
    for g, n in enumerate(splits):
        xg, pg = x64[start:start + n], p64[start:start + n, None]
        z = torch.mm(xg, w1[g].t()) + (0 if b1[g] is None else b1[g])
        a, b = _glu_halves(z, m.glu_interleave_size)
        h = F.silu(a) * b * pg
        outs.append(torch.mm(h, w2[g].t()) + (0 if b2[g] is None else pg * b2[g]))
        start += n
    y = torch.cat(outs + [x64.new_zeros(x.shape[0] - start, OUT)])
    y.backward(dy.detach().cpu().double())
    grads = lambda ts: [None if t is None else t.grad for t in ts]  # noqa: E731
    return y.detach(), x64.grad, p64.grad, (grads(w1), grads(b1)), (grads(w2), grads(b2))


def _param_grads(layer):
    ws, bs = _expert_params(layer)
    if layer.single_grouped_weight:
        wg = list(layer.weight.grad.unbind(0))
        bg = list(layer.bias.grad.unbind(0)) if layer.use_bias else [None] * G
    else:
        wg, bg = [w.grad for w in ws], [None if b is None else b.grad for b in bs]
    return wg, bg


def _check_all(m, x, probs, dy, y, dtype, splits=SPLITS):
    ry, rdx, rdp, r1, r2 = _reference(m, x, probs, dy, splits)
    s = sum(splits)
    _close(y, ry, dtype, "y")
    _close(x.grad, rdx, dtype, "dx")
    assert probs.grad.dtype == torch.float32
    _close(probs.grad, rdp, dtype, "dprobs")
    assert bool((y[s:] == 0).all()) and bool((x.grad[s:] == 0).all()) and bool((probs.grad[s:] == 0).all()), \
        "the padded tail of y, dx and dprobs is zero"
    for name, layer, (rw, rb) in (("fc1", m.fc1, r1), ("fc2", m.fc2, r2)):
        wg, bg = _param_grads(layer)
        for g in range(G):
            _close(wg[g], rw[g], dtype, f"{name} dW[{g}]")
            if layer.use_bias:
                _close(bg[g], rb[g], dtype, f"{name} db[{g}]")
        for g, n in enumerate(splits):
            if n == 0:
                assert bool((wg[g] == 0).all()), f"{name}: an expert with no rows has a zero wgrad"


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("k", [0, 3], ids=["halves", "interleave3"])
@pytest.mark.parametrize("single", [False, True], ids=["per_expert", "single_grouped_weight"])
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
def test_gradients_match_pure_torch(dtype, k, single, bias):
    m = _make(dtype, bias, k, single)
    x, probs, dy = _inputs(dtype)
    y = m(x, SPLITS, probs)
    y.backward(dy)
    _check_all(m, x, probs, dy, y, dtype)


def test_module_layout_and_defaults():
    m = stt.GroupedMLP(2, 8, 3)
    assert m.out_features == 8 and not m.use_bias, "out_features defaults to in_features, bias to False"
    assert [n for n, _ in m.named_parameters()] == ["fc1.weight0", "fc1.weight1", "fc2.weight0", "fc2.weight1"]
    assert m.fc1.weight0.shape == (6, 8) and m.fc2.weight0.shape == (8, 3)
    single = stt.GroupedMLP(2, 8, 3, 5, bias=True, single_grouped_weight=True)
    assert {n: tuple(p.shape) for n, p in single.named_parameters()} == {
        "fc1.weight": (2, 6, 8), "fc1.bias": (2, 6), "fc2.weight": (2, 5, 3), "fc2.bias": (2, 5)}


def test_saves_only_x_fc1_out_and_probs():
    m = _make(torch.float32)
    x, probs, dy = _inputs(torch.float32)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(tuple(t.shape)) or t, lambda t: t):
        y = m(x, SPLITS, probs)
    activations = [s for s in saved if s and s[0] == T]
    assert sorted(activations) == sorted([(T, IN), (T, 2 * FFN), (T,)]), saved
    y.backward(dy)


ROWS = [  # delay, fuse, has grad_added_to_main_grad -> weight grad, bias grad now
    (False, False, False, "wgrad", True),
    (True, False, False, "none", False),
    (False, True, False, "none", True),
    (False, True, True, "dummy", True),
    (True, True, False, "none", False),
    (True, True, True, "dummy", False),
]


@pytest.mark.parametrize("delay,fuse,attr,kind,bias_now", ROWS,
                         ids=[f"delay{int(r[0])}_fuse{int(r[1])}_attr{int(r[2])}" for r in ROWS])
def test_weight_grad_table_for_both_layers(delay, fuse, attr, kind, bias_now):
    m = _make(torch.bfloat16, fuse_wgrad_accumulation=fuse, delay_wgrad_compute=delay)
    for w in m.fc1.weights() + m.fc2.weights():
        w.main_grad = torch.zeros(w.shape, dtype=torch.float32)
        if attr:
            w.grad_added_to_main_grad = False
    x, probs, dy = _inputs(torch.bfloat16)
    m(x, SPLITS, probs).backward(dy)
    for layer in (m.fc1, m.fc2):
        for w in layer.weights():
            if kind == "none":
                assert w.grad is None
            elif kind == "dummy":
                assert w.grad is not None and bool((w.grad == 0).all()) and w.grad.shape == w.shape
                assert w.grad.untyped_storage().data_ptr() != w.main_grad.untyped_storage().data_ptr()
                assert w.grad_added_to_main_grad is True
            else:
                assert w.grad is not None
        if kind == "wgrad":
            assert all(bool((w.grad != 0).any()) == (n > 0) for w, n in zip(layer.weights(), SPLITS))
        for b in layer.biases():
            assert (b.grad is not None) == bias_now
        assert any(bool((w.main_grad != 0).any()) for w in layer.weights()) == (fuse and not delay)
    if delay:
        assert m.pending_wgrads == 1
        m.backward_dw()
        assert m.pending_wgrads == 0
        for layer in (m.fc1, m.fc2):
            assert all(b.grad is not None for b in layer.biases()), "the delayed bias grads come with backward_dw"
        # By value: bit-identical to the same MLP without delay.
        eager = _make(torch.bfloat16, fuse_wgrad_accumulation=fuse)
        for w in eager.fc1.weights() + eager.fc2.weights():
            w.main_grad = torch.zeros(w.shape, dtype=torch.float32)
        eager(x.detach(), SPLITS, probs.detach()).backward(dy)
        for (name, pd), pe in zip(m.named_parameters(), eager.parameters()):
            if fuse and "weight" in name:
                assert torch.equal(pd.main_grad, pe.main_grad), name
            else:
                assert torch.equal(pd.grad, pe.grad), name


@pytest.mark.parametrize("delay", [False, True], ids=["eager_wgrad", "delayed_wgrad"])
@pytest.mark.parametrize("overwrite", [False, True], ids=["accumulate", "overwrite"])
def test_main_grad_accumulate_and_overwrite(overwrite, delay):
    m = _make(torch.float32, fuse_wgrad_accumulation=True, delay_wgrad_compute=delay)
    for w in m.fc1.weights() + m.fc2.weights():
        w.main_grad = torch.full(w.shape, 0.5)
        w.overwrite_main_grad = overwrite
    x, probs, dy = _inputs(torch.float32)
    m(x, SPLITS, probs).backward(dy)
    if delay:
        assert all(bool((w.main_grad == 0.5).all()) for w in m.fc1.weights() + m.fc2.weights())
        m.backward_dw()
    _, _, _, (rw1, _), (rw2, _) = _reference(m, x, probs, dy)
    for layer, rw in ((m.fc1, rw1), (m.fc2, rw2)):
        for g, w in enumerate(layer.weights()):
            assert w.grad is None
            expected = rw[g] if overwrite else rw[g] + 0.5
            _close(w.main_grad, expected, torch.float32, f"main_grad[{g}]")
        empty = layer.weights()[1].main_grad
        assert bool((empty == (0 if overwrite else 0.5)).all()), "expert 1 (no rows): zeroed / untouched"
    for b in m.fc1.biases() + m.fc2.biases():
        assert b.grad is not None, "bias grads are never fused into main_grad"


def test_delayed_wgrad_is_fifo_matches_eager_and_runs_hooks_after():
    eager = _make(torch.float32)
    delayed = _make(torch.float32, delay_wgrad_compute=True)
    delayed.load_state_dict(eager.state_dict())
    fired = []
    delayed.register_wgrad_accumulation_and_reduce_hooks(lambda: fired.append(delayed.pending_wgrads))
    for seed, sp in ((3, SPLITS), (4, [1, 20, 0, 11])):
        x, probs, dy = _inputs(torch.float32, seed)
        eager(x, sp, probs).backward(dy)
        xd, pd = x.detach().clone().requires_grad_(), probs.detach().clone().requires_grad_()
        delayed(xd, sp, pd).backward(dy)
        assert torch.equal(xd.grad, x.grad) and torch.equal(pd.grad, probs.grad), "dgrad and dprobs at once"
    assert all(p.grad is None for p in delayed.parameters()) and not fired, "nothing before backward_dw"
    assert delayed.need_backward_dw() and delayed.pending_wgrads == 2
    delayed.backward_dw()
    delayed.backward_dw()
    assert fired == [1, 0], "the hooks run after each backward_dw"
    for (name, pe), pd in zip(eager.named_parameters(), delayed.parameters()):
        torch.testing.assert_close(pd.grad, pe.grad, rtol=1e-6, atol=1e-6, msg=name)
    with pytest.raises(ValueError, match="none pending"):
        delayed.backward_dw()


def test_caller_out_and_grad_input_buffers():
    m = _make(torch.bfloat16)
    x, probs, dy = _inputs(torch.bfloat16)
    out = torch.full((T + 2, OUT), float("nan"), dtype=torch.bfloat16)
    gin = torch.full((T + 2, IN), float("nan"), dtype=torch.bfloat16)
    x2, p2 = x.detach().clone().requires_grad_(), probs.detach().clone().requires_grad_()
    y_ref = m(x2, SPLITS, p2)
    y_ref.backward(dy)
    y = m(x, SPLITS, probs, out=out, grad_input=gin)
    assert y.data_ptr() == out.data_ptr()
    assert torch.equal(out[:S].view(torch.int16), y_ref[:S].view(torch.int16)), "bit-identical to the library path"
    assert bool(out[S:].isnan().all()), "rows >= S untouched"
    y.backward(torch.cat([dy, torch.zeros(2, OUT, dtype=dy.dtype)]))
    assert x.grad.data_ptr() == gin.data_ptr(), "dx is the caller's buffer"
    assert torch.equal(gin[:S].view(torch.int16), x2.grad[:S].view(torch.int16))
    assert bool(gin[S:].isnan().all()), "rows >= S of grad_input untouched"
    assert torch.equal(probs.grad, p2.grad)


def test_caller_out_that_is_a_view_keeps_dx():
    """A caller `out` that is a view (rows of a larger buffer): dx (leaf x, and through a non-leaf
    one) and dprobs are those of the call without `out`, bitwise (x.grad was None: CopySlices gives
    the node's first input's gradient to the buffer's base; found by
    tests/python/test_fuzz.py)."""
    m = _make(torch.bfloat16)
    x, probs, dy = _inputs(torch.bfloat16)
    rx, rp = x.detach().requires_grad_(), probs.detach().requires_grad_()
    m(rx, SPLITS, rp).backward(dy)
    for leaf in (True, False):
        x0, p0 = x.detach().requires_grad_(), probs.detach().requires_grad_()
        buf = torch.full((T + 4, OUT), float("nan"), dtype=torch.bfloat16)
        y = m(x0 if leaf else x0 * 1, SPLITS, p0, out=buf[1:1 + T])
        y.backward(dy)
        assert x0.grad is not None, f"leaf {leaf}: x got no gradient"
        assert torch.equal(x0.grad.view(torch.int16), rx.grad.view(torch.int16)), f"leaf {leaf}"
        assert torch.equal(p0.grad, rp.grad), f"leaf {leaf}"


def test_bad_input():
    m = _make(torch.float32)
    x, probs, _ = _inputs(torch.float32)
    with pytest.raises(ValueError, match=r"probs: expected shape \[37\]"):
        m(x, SPLITS, probs[:, None])
    with pytest.raises(ValueError, match=r"probs: expected shape \[37\]"):
        m(x, SPLITS, torch.rand(T + 1))
    with pytest.raises(ValueError, match="probs: expected dtype fp32"):
        m(x, SPLITS, probs.detach().to(torch.bfloat16))
    with pytest.raises(ValueError, match="probs: expected dtype"):
        m(x, SPLITS, probs.detach().double())
    with pytest.raises(ValueError, match=r"m_splits: expected shape \(4,\)"):
        m(x, [1, 2, 3], probs)
    with pytest.raises(ValueError, match="splits: expected entries >= 0"):
        m(x, [1, -2, 3, 4], probs)
    with pytest.raises(ValueError, match=r"x: expected shape \[T, 12 \(in_features\)\]"):
        m(torch.randn(T, 11), SPLITS, probs)
    with pytest.raises(ValueError, match="glu_interleave_size"):
        stt.GroupedMLP(G, IN, FFN, glu_interleave_size=4)(x, SPLITS, probs)
    fused = _make(torch.float32, fuse_wgrad_accumulation=True)
    with pytest.raises(ValueError, match="fc1.weight0.main_grad: expected an fp32 tensor"):
        fused(x, SPLITS, probs)
    for w in fused.fc1.weights() + fused.fc2.weights():
        w.main_grad = torch.zeros(w.shape)
    fused.fc1.weight0.overwrite_main_grad = True
    with pytest.raises(ValueError, match="overwrite_main_grad"):
        fused(x, SPLITS, probs)


def test_compiles_without_graph_breaks():
    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.router = torch.nn.Linear(IN, 1)
            self.mlp = _make(torch.float32, k=2)

        def forward(self, x, splits):
            probs = torch.sigmoid(self.router(x)).squeeze(-1)  # the router trains through dprobs
            return torch.nn.functional.gelu(self.mlp(x, splits, probs)).sum()

    model = Model()
    splits = torch.tensor(SPLITS)
    x, _, _ = _inputs(torch.float32)
    compiled = torch.compile(model, fullgraph=True)
    loss = compiled(x, splits)
    loss.backward()
    grads = [p.grad.clone() for p in model.parameters()]
    dx = x.grad.clone()
    model.zero_grad()
    x.grad = None
    eager_loss = model(x, splits)
    eager_loss.backward()
    torch.testing.assert_close(loss, eager_loss)
    torch.testing.assert_close(x.grad, dx)
    for g, (name, p) in zip(grads, model.named_parameters()):
        torch.testing.assert_close(g, p.grad, msg=name)
    assert bool((model.router.weight.grad != 0).any())


# --- CUDA: skipped visibly without a device, or in a sparsetrain build without CUDA ------------

@pytest.mark.parametrize("delay", [False, True], ids=["eager_wgrad", "delayed_wgrad"])
def test_fc1_out_carries_its_gradient_only_after_its_last_backward(delay):
    """Backward writes d fc1_out over the saved fc1_out (one [T, 2F] tensor less at the step's
    peak) only when no backward reads it again: a backward with retain_graph=True leaves it as it
    was, the last one overwrites it, and both give the same gradients, bitwise (with delayed wgrad:
    each followed by its backward_dw)."""
    m = _make(torch.float32, delay_wgrad_compute=delay)
    x, probs, dy = _inputs(torch.float32)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        y = m(x, SPLITS, probs)
    (fc1_out,) = [t for t in saved if tuple(t.shape) == (T, 2 * FFN) and t is not x]  # IN == 2 * FFN here
    before = fc1_out.clone()
    grads = []
    for retain in (True, False):
        for t in (x, probs, *m.parameters()):
            t.grad = None
        y.backward(dy, retain_graph=retain)
        if delay:
            m.backward_dw()
        grads.append([t.grad.clone() for t in (x, probs, *m.parameters())])
        assert torch.equal(fc1_out, before) == retain, f"retain_graph={retain}"
    for a, b in zip(*grads):
        assert torch.equal(a, b)


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device: CUDA GroupedMLP test skipped")


def _skip_without_cuda_backend(call):
    """call(); the library's 'no CUDA backend' error (a build without CUDA) skips the test with its
    message."""
    try:
        return call()
    except ValueError as e:
        if "no CUDA backend" in str(e):
            pytest.skip(f"GroupedMLP has no CUDA backend in this build: {e}")
        raise


@cuda
@pytest.mark.parametrize("splits_on_device", [False, True], ids=["list_splits", "cuda_splits"])
def test_cuda_gradients_match_pure_torch(splits_on_device):
    m = _make(torch.bfloat16, k=2, device="cuda")
    x, probs, dy = _inputs(torch.bfloat16, device="cuda")
    splits = torch.tensor(SPLITS, device="cuda") if splits_on_device else SPLITS
    y = _skip_without_cuda_backend(lambda: m(x, splits, probs))
    y.backward(dy)
    assert y.is_cuda and x.grad.is_cuda and probs.grad.is_cuda and m.fc2.weight0.grad.is_cuda
    _check_all(m, x, probs, dy, y, torch.bfloat16)


@cuda
def test_cuda_graph_capture_replays_with_new_split_values():
    m = _make(torch.bfloat16, device="cuda")
    static_x, static_p, static_dy = _inputs(torch.bfloat16, device="cuda")
    splits = torch.tensor(SPLITS, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up outside the graph, as torch.cuda.graph asks
        for _ in range(2):
            _skip_without_cuda_backend(lambda: m(static_x, splits, static_p)).backward(static_dy)
    torch.cuda.current_stream().wait_stream(side)
    leaves = [static_x, static_p, *m.parameters()]
    for p in leaves:
        p.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_y = m(static_x, splits, static_p)
        static_y.backward(static_dy)
    for new in ([10, 10, 10, 7], [0, 37, 0, 0], [20, 0, 0, 12]):
        splits.copy_(torch.tensor(new))
        for p in leaves:
            p.grad.zero_()  # the graph's backward accumulates into these
        graph.replay()
        torch.cuda.synchronize()
        _check_all(m, static_x, static_p, static_dy, static_y, torch.bfloat16, new)


@cuda
def test_cuda_step_peak_memory_is_at_most_the_torch_compositions():
    """A training step's peak memory beyond its inputs, bf16 weight grads on both sides: ours at
    most the composition's (torch._grouped_mm, SwiGLU x probs; autograd frees each saved tensor
    after its node, ours writes d fc1_out over the saved fc1_out and frees the recomputed fc2 input
    after fc2's wgrad)."""
    if torch.cuda.get_device_capability(0) != (9, 0):
        pytest.skip("torch._grouped_mm needs a Hopper GPU here")
    G_, T_, H_, F_ = 8, 8192, 1024, 1024
    torch.manual_seed(0)
    ours = stt.GroupedMLP(G_, H_, F_, H_, bias=False, params_dtype=torch.bfloat16, device="cuda",
                          single_grouped_weight=True)
    splits = torch.full((G_,), T_ // G_, device="cuda")
    offs = splits.cumsum(0).to(torch.int32)
    x = torch.randn(T_, H_, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    probs = torch.rand(T_, device="cuda", requires_grad=True)
    dy = torch.randn(T_, H_, device="cuda", dtype=torch.bfloat16)
    w1 = ours.fc1.weight.detach().clone().requires_grad_()
    w2 = ours.fc2.weight.detach().clone().requires_grad_()

    def composition():
        a, b = torch._grouped_mm(x, w1.transpose(-2, -1), offs=offs).chunk(2, dim=-1)
        h = F.silu(a) * b * probs.to(torch.bfloat16).unsqueeze(-1)
        torch._grouped_mm(h, w2.transpose(-2, -1), offs=offs).backward(dy)

    def peak(step):
        for t in (x, probs, w1, w2, *ours.parameters()):
            t.grad = None
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        step()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base

    for _ in range(2):  # warm-up: the layer's cached state, cuBLAS workspaces
        peak(lambda: ours(x, splits, probs).backward(dy))
        peak(composition)
    mine, theirs = peak(lambda: ours(x, splits, probs).backward(dy)), peak(composition)
    assert mine <= theirs, f"peak beyond the inputs: ours {mine / 2**20:.1f} MiB, the composition's {theirs / 2**20:.1f} MiB"
