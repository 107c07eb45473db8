"""The torch front's FP8 recipe (sparsetrain.torch.fp8): the `fp8` argument of GroupedLinear,
GroupedMLP and MoELayer and fp8_autocast, one rule behind both (the argument wins, None follows the
innermost autocast), a forward's choice kept by its backward and delayed wgrad, the recipe's
refusals by name, and the FP8 results against the bf16 module (a loose bound: the quantization;
the kernels' exact rules are the C++ tests'). On the CPU backend; the CUDA runs are the GPU suite's."""

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed: torch tests skipped")

import sparsetrain.torch as stt  # noqa: E402
from sparsetrain.torch.fp8 import fp8_autocast, fp8_enabled  # noqa: E402
from training_steps import assert_saves_fc1s_codes_instead, saved_for_backward  # noqa: E402

SPLITS = [40, 0, 3, 57]  # an empty and a 3-row expert
T, IN, OUT = 104, 64, 48  # rows past sum(SPLITS) are a padded tail


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def _linear(fp8=None, **kw):
    torch.manual_seed(0)
    return stt.GroupedLinear(len(SPLITS), IN, OUT, bias=False, params_dtype=torch.bfloat16, fp8=fp8, **kw)


def _step(m, x, dy, splits=SPLITS):
    x = x.detach().clone().requires_grad_(True)
    y = m(x, splits)
    y.backward(dy)
    return y.detach(), x.grad, [p.grad.clone() for p in m.parameters()]


def _data(seed=1):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(T, IN, generator=g).to(torch.bfloat16),
            torch.randn(T, OUT, generator=g).to(torch.bfloat16))


def test_the_rule_argument_wins_none_follows_the_innermost_autocast():
    assert fp8_enabled(None) is False
    with fp8_autocast():
        assert fp8_enabled(None) is True and fp8_enabled(False) is False
        with fp8_autocast(enabled=False):
            assert fp8_enabled(None) is False and fp8_enabled(True) is True
        assert fp8_enabled(None) is True
    assert fp8_enabled(None) is False


def test_grouped_linear_fp8_is_close_to_bf16_and_autocast_gives_the_same_bits():
    x, dy = _data()
    ref = _step(_linear(), x, dy)
    forced = _step(_linear(fp8=True), x, dy)
    with fp8_autocast():
        auto = _step(_linear(), x, dy)
        off = _step(_linear(fp8=False), x, dy)
    S = sum(SPLITS)
    for got, want, what in ((forced[0][:S], ref[0][:S], "y"), (forced[1][:S], ref[1][:S], "dx"),
                            (forced[2][0], ref[2][0], "dW")):
        e = _rel(got, want)
        assert 1e-3 < e < 0.06, f"{what}: relative error {e} (FP8 against bf16)"
    assert torch.equal(forced[0][S:], torch.zeros_like(forced[0][S:])), "the padded tail's rows are zero"
    for a, b in zip((auto[0], auto[1], *auto[2]), (forced[0], forced[1], *forced[2])):
        assert torch.equal(a, b), "fp8=None under fp8_autocast is fp8=True"
    for a, b in zip((off[0], off[1], *off[2]), (ref[0], ref[1], *ref[2])):
        assert torch.equal(a, b), "fp8=False ignores fp8_autocast"


def test_a_delayed_wgrad_follows_its_forward_after_the_autocast_ends():
    x, dy = _data(2)
    eager = _step(_linear(fp8=True), x, dy)
    m = _linear(delay_wgrad_compute=True)
    xx = x.detach().clone().requires_grad_(True)
    with fp8_autocast():
        y = m(xx, SPLITS)
    y.backward(dy)
    assert m.weight0.grad is None, "delayed"
    m.backward_dw()  # outside the block: the layer keeps its forward's choice
    assert torch.equal(xx.grad, eager[1])
    assert torch.equal(m.weight0.grad, eager[2][0])


def test_an_in_place_weight_update_is_seen_by_the_next_forward():
    """The quantized weights are kept per parameter version: an optimizer's in-place step bumps it,
    so the next forward quantizes the new weights (as a fresh module with them computes)."""
    x, _ = _data(4)
    m = _linear(fp8=True)
    y1 = m(x, SPLITS)
    assert torch.equal(m(x, SPLITS), y1), "the same version: the same result"
    with torch.no_grad():
        for p in m.parameters():
            p.mul_(0.5)
    fresh = _linear(fp8=True)
    with torch.no_grad():
        for p, q in zip(fresh.parameters(), m.parameters()):
            p.copy_(q)
    y2 = m(x, SPLITS)
    assert not torch.equal(y2, y1)
    assert torch.equal(y2, fresh(x, SPLITS))


def test_eager_calls_reuse_the_quantized_weights_within_a_version():
    """A change made behind the version counter (through .data) is not seen until the counter
    moves: the weights quantized at a version are reused by the eager calls at that version."""
    x, _ = _data(5)
    m = _linear(fp8=True)
    y1 = m(x, SPLITS)
    m.weight0.data.mul_(0.5)  # .data: the parameter's version counter does not move
    assert torch.equal(m(x, SPLITS), y1), "the weights quantized at this version, reused"
    with torch.no_grad():
        m.weight0.add_(0.0)  # an in-place op moves it
    assert not torch.equal(m(x, SPLITS)[:40], y1[:40]), "expert 0's weights, quantized anew"


def test_a_compiled_graph_quantizes_the_weights_at_every_call():
    """torch.compile's calls keep nothing in the layer (a graph owns what it allocates; CUDA graph
    trees replay it): every call quantizes the weights it finds, .data changes included."""
    x, _ = _data(6)
    m = _linear(fp8=True)
    cm = torch.compile(m, fullgraph=True)
    y1 = cm(x, SPLITS)
    assert torch.equal(y1, m(x, SPLITS))
    m.weight0.data.mul_(0.5)
    assert not torch.equal(cm(x, SPLITS)[:40], y1[:40])


def test_the_array_front_runs_the_same_recipe():
    """sparsetrain.GroupedLinear(fp8=True) over the module's torch tensors: the same layer, the
    same bits as the torch module's FP8 forward."""
    import sparsetrain as st

    x, _ = _data(7)
    m = _linear(fp8=True)
    weights = [p.detach() for p in m.parameters()]
    core = st.GroupedLinear(weights, fp8=True)
    assert torch.equal(core.forward(x, SPLITS), m(x, SPLITS).detach())


def test_mlp_and_moe_layer_take_the_recipe():
    torch.manual_seed(0)
    mlp8 = stt.GroupedMLP(len(SPLITS), IN, 32, OUT, params_dtype=torch.bfloat16, fp8=True)
    torch.manual_seed(0)
    mlp = stt.GroupedMLP(len(SPLITS), IN, 32, OUT, params_dtype=torch.bfloat16)
    x, _ = _data(3)
    probs = torch.rand(T)
    S = sum(SPLITS)
    e = _rel(mlp8(x, SPLITS, probs)[:S], mlp(x, SPLITS, probs)[:S])
    assert 1e-3 < e < 0.08, f"GroupedMLP: relative error {e}"

    N, E, hidden = 50, 4, 64
    torch.manual_seed(1)
    moe = stt.MoELayer(E, hidden, 32, 2, params_dtype=torch.bfloat16)
    torch.manual_seed(1)
    moe8 = stt.MoELayer(E, hidden, 32, 2, params_dtype=torch.bfloat16)
    xs = torch.randn(N, hidden).to(torch.bfloat16)
    logits = torch.randn(N, E)
    with fp8_autocast():
        out8 = moe8(xs, logits).out
    out = moe(xs, logits).out
    e = _rel(out8, out)
    assert 1e-3 < e < 0.08, f"MoELayer: relative error {e}"


def _moe_step(m, x, logits, dout):
    x, logits = x.detach().clone().requires_grad_(True), logits.detach().clone().requires_grad_(True)
    r = m(x, logits)
    r.out.backward(dout)
    return r.out.detach(), x.grad, logits.grad


def _weight_grads(m):
    return torch.cat([p.grad.float().flatten() for p in m.parameters()])


def test_moe_layer_saves_fc1s_output_in_fp8_only_where_the_recipe_runs():
    """MoELayer(fp8_saved_activations=True): in an FP8 call the forward is the plain FP8 layer's
    (bitwise), it saves fc1's output's codes and scales for backward in place of the output, and the
    backward reads that output restored from e4m3 (the C++ tests check those bits against the codes
    decoded): gradients near the plain FP8 layer's, not equal to them; in a bf16 call the option
    does nothing (bitwise the bf16 layer). Eager and under torch.compile (the fakes give the codes'
    and scales' shapes), immediate and delayed wgrad."""
    N, E, hidden, F = 50, 4, 64, 80  # 2F = 160: a partial second 128-column tile
    g = torch.Generator().manual_seed(11)
    x = torch.randn(N, hidden, generator=g).to(torch.bfloat16)
    logits, dout = torch.randn(N, E, generator=g), torch.randn(N, hidden, generator=g).to(torch.bfloat16)

    def layer(saved, **kw):
        torch.manual_seed(2)
        return stt.MoELayer(E, hidden, F, 2, params_dtype=torch.bfloat16, fp8_saved_activations=saved, **kw)

    plain_saves = saved_for_backward(lambda: layer(False, fp8=True)(x, logits))[1]
    saving_saves = saved_for_backward(lambda: layer(True, fp8=True)(x, logits))[1]
    assert_saves_fc1s_codes_instead(plain_saves, saving_saves, rows=2 * N, fc1_columns=2 * F)
    for delay in (False, True):
        plain, saving = layer(False, fp8=True, delay_wgrad_compute=delay), layer(True, fp8=True,
                                                                                  delay_wgrad_compute=delay)
        a, b = _moe_step(plain, x, logits, dout), _moe_step(saving, x, logits, dout)
        if delay:
            plain.backward_dw(), saving.backward_dw()
        assert torch.equal(a[0], b[0]), "the forward is the plain FP8 layer's"
        for name, u, v in (("dx", a[1], b[1]), ("dlogits", a[2], b[2]),
                           ("weights", _weight_grads(plain), _weight_grads(saving))):
            e = _rel(v, u)
            assert 0 < e < 0.08, f"delay {delay}, {name}: relative difference {e}"
    compiled = torch.compile(layer(True, fp8=True), fullgraph=True)
    c = _moe_step(compiled, x, logits, dout)
    e = _moe_step(layer(True, fp8=True), x, logits, dout)
    for u, v in zip(c, e):
        assert torch.equal(u, v), "compiled: the eager bits"
    bf16, unused = _moe_step(layer(False), x, logits, dout), _moe_step(layer(True), x, logits, dout)
    assert all(torch.equal(u, v) for u, v in zip(bf16, unused)), "bf16 calls: the option does nothing"


def test_the_recipe_refuses_by_name():
    x, _ = _data()
    with pytest.raises(ValueError, match="bias: expected none with fp8"):
        stt.GroupedLinear(len(SPLITS), IN, OUT, bias=True, params_dtype=torch.bfloat16, fp8=True)(x, SPLITS)
    with pytest.raises(ValueError, match="in_features: expected a multiple of 16 with fp8, got 24"):
        stt.GroupedLinear(2, 24, 16, bias=False, params_dtype=torch.bfloat16, fp8=True)(
            torch.zeros(4, 24, dtype=torch.bfloat16), [2, 2])
    with pytest.raises(ValueError, match="dtype: expected bf16 with fp8"):
        stt.GroupedLinear(2, 16, 16, bias=False, params_dtype=torch.float16, fp8=True)(
            torch.zeros(4, 16, dtype=torch.float16), [2, 2])
