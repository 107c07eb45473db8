"""sparsetrain.torch.MoELayer and moe_route against a float64 torch composition written here:
softmax / sigmoid scores, the top-k by a stable descending sort of the (float32) scores plus bias,
optional normalisation, each chosen expert's MLP (fc1 -> SwiGLU -> fc2) scaled by its prob,
summed per token; gradients by autograd in float64 (the choice held) for x, the logits (through
the probs and the score sums) and the experts' weights; moe_route's outputs and logits gradient
alone (ties, NaN) against the same composition; torch.library.opcheck on the C++ operators
sparsetrain::moe_route, moe_route_backward and moe_combine_rows. Fresh random data each run (the
seed is in the failure message); bitwise repeatability; torch.compile(fullgraph=True) traces the
layer; bad arguments raise ValueError naming them."""

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch is not installed: torch tests skipped")

import sparsetrain.torch as stt  # noqa: E402

BF16 = torch.bfloat16


def leaves(layer):
    """The weights whose gradients are checked: the first expert's fc1, the last expert's fc2."""
    return [layer.experts.fc1.weights()[0], layer.experts.fc2.weights()[-1]]


@pytest.mark.parametrize("N,E,K,score,normalize,with_bias", [
    (19, 8, 2, "softmax", True, False),
    (23, 6, 1, "softmax", False, True),
    (17, 8, 4, "sigmoid", True, True),
    (7, 1, 1, "sigmoid", False, False),
    (13, 256, 8, "sigmoid", True, True),  # DeepSeek-V3's experts and top_k: most experts get no token
])
def test_moe_layer_matches_a_float64_composition(N, E, K, score, normalize, with_bias):
    seed = int(np.random.SeedSequence().entropy % 2**31)
    torch.manual_seed(seed)
    H, F = 16, 8
    layer = stt.MoELayer(E, H, F, K, score=score, normalize=normalize, params_dtype=BF16)
    x = torch.randn(N, H, dtype=BF16, requires_grad=True)
    logits = (2 * torch.randn(N, E)).requires_grad_()
    bias = 0.3 * torch.randn(E) if with_bias else None
    dout = torch.randn(N, H, dtype=BF16)
    dsum = torch.randn(E)

    got = layer(x, logits, bias)
    (got.out.float() * dout.float()).sum().add((got.score_sum * dsum).sum()).backward()
    g_lib = [x.grad, logits.grad] + [w.grad for w in leaves(layer)]

    xr = x.detach().double().requires_grad_()
    lr = logits.detach().double().requires_grad_()
    wd = [w.detach().double().requires_grad_() for w in leaves(layer)]
    ref_out, ref_sum, experts = reference(xr, lr, bias, layer, K, score, normalize, wd)
    assert torch.equal(got.counts, torch.bincount(experts.reshape(-1), minlength=E)), f"seed {seed}"
    torch.testing.assert_close(got.score_sum.double(), ref_sum.detach(), rtol=1e-5, atol=1e-5, msg=f"seed {seed}")
    # bf16 inputs and intermediates (fc1's output, the activation, the rows' outputs): a few units
    # of bf16's roundoff (2^-8) relative to the values' scale (unit normal data).
    torch.testing.assert_close(got.out.double(), ref_out.detach(), rtol=3e-2, atol=3e-2, msg=f"seed {seed}")
    (ref_out * dout.double()).sum().add((ref_sum * dsum.double()).sum()).backward()
    g_ref = [xr.grad, lr.grad] + [torch.zeros_like(w) if w.grad is None else w.grad for w in wd]  # None: no token
    for name, a, b in zip(("dx", "dlogits", "dW1[0]", "dW2[-1]"), g_lib, g_ref):
        assert a is not None and not torch.isnan(a).any(), f"{name}: missing or NaN (seed {seed})"
        torch.testing.assert_close(a.double(), b, rtol=4e-2, atol=4e-2, msg=f"{name}, seed {seed}")


def reference(x, logits, bias, layer, top_k, score, normalize, leaf_doubles):
    """(out, score_sum, experts) in float64 from the layer's parameters, the first expert's fc1
    weight and the last expert's fc2 weight replaced by the given float64 leaves (autograd reaches
    them); the choice as the library rules it (float32 scores plus bias, stable descending sort)."""
    fc1, fc2 = layer.experts.fc1, layer.experts.fc2
    w1 = [leaf_doubles[0]] + [w.double() for w in fc1.weights()[1:]]
    w2 = [w.double() for w in fc2.weights()[:-1]] + [leaf_doubles[1]]
    experts, probs, score_sum = reference_route(logits, bias, top_k, score, normalize)
    F = layer.experts.ffn_hidden_size
    rows = []
    for n in range(x.shape[0]):
        acc = 0
        for i in range(top_k):
            e = int(experts[n, i])
            h = x[n] @ w1[e].T
            acc = acc + probs[n, i] * ((torch.nn.functional.silu(h[:F]) * h[F:]) @ w2[e].T)
        rows.append(acc)
    return torch.stack(rows), score_sum, experts


def reference_route(logits, bias, top_k, score, normalize):
    """(experts, probs, score_sum) of float64 logits, differentiable in the logits: scores by
    softmax or sigmoid, the choice by a stable descending sort of the float32 scores plus bias with
    NaN last (the library's rules: ties to the lower expert id), probs the chosen scores,
    optionally divided by their sum."""
    s = torch.softmax(logits, dim=1) if score == "softmax" else torch.sigmoid(logits)
    with torch.no_grad():
        value = s.float() + (0 if bias is None else bias)
        value = value.masked_fill(value.isnan(), -float("inf"))  # NaN below every number (no score is -inf)
        experts = torch.sort(value, dim=1, descending=True, stable=True).indices[:, :top_k]
    probs = s.gather(1, experts)
    if normalize:
        probs = probs / probs.sum(1, keepdim=True)
    return experts, probs, s.sum(0)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no CUDA device: the CUDA case skipped"))])
def test_moe_layer_is_bitwise_repeatable(device):
    """20 forward + backward runs of one layer on the same data: the same bits every time."""
    torch.manual_seed(1)
    layer = stt.MoELayer(8, 16, 8, 2, normalize=True, params_dtype=BF16, device=device)
    x = torch.randn(29, 16, dtype=BF16, device=device)
    logits = torch.randn(29, 8, device=device)
    runs = []
    for _ in range(20):
        xi, li = x.clone().requires_grad_(), logits.clone().requires_grad_()
        for w in layer.parameters():
            w.grad = None
        o = layer(xi, li)
        (o.out.float().square().sum() + o.score_sum.sum()).backward()
        runs.append([o.out, xi.grad, li.grad, layer.experts.fc1.weights()[0].grad])
    for later in runs[1:]:
        for a, b in zip(runs[0], later):
            assert torch.equal(a, b)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no CUDA device: the CUDA case skipped"))])
def test_recompute_expert_input_frees_the_rows_and_gives_the_same_bits(device):
    """recompute_expert_input=True: x's gathered rows [N * top_k, hidden] are not among the tensors
    the layer's node saves for backward (saved-tensor hooks see every one; without the option they
    are), backward gathers them again, and out and every gradient are bitwise those of the layer
    that keeps them; with delayed wgrad too (the pending wgrad then keeps the rows)."""
    torch.manual_seed(4)
    # ffn 24: fc1's output [N * top_k, 48], which the node does save, has another shape than the rows.
    base = stt.MoELayer(8, 32, 24, 2, normalize=True, params_dtype=BF16, device=device)
    x = torch.randn(37, 32, dtype=BF16, device=device)
    logits = torch.randn(37, 8, device=device)
    results = []
    for recompute in (False, True):
        layer = stt.MoELayer(8, 32, 24, 2, normalize=True, params_dtype=BF16, device=device,
                             recompute_expert_input=recompute)
        layer.load_state_dict(base.state_dict())
        xi, li = x.clone().requires_grad_(), logits.clone().requires_grad_()
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(tuple(t.shape)) or t, lambda t: t):
            o = layer(xi, li)
        assert ((37 * 2, 32) in saved) != recompute, f"recompute {recompute}: saved shapes {saved}"
        (o.out.float().square().sum() + o.score_sum.sum()).backward()
        results.append([o.out, xi.grad, li.grad, layer.experts.fc1.weights()[0].grad,
                        layer.experts.fc2.weights()[-1].grad])
    delayed = stt.MoELayer(8, 32, 24, 2, normalize=True, params_dtype=BF16, device=device,
                           recompute_expert_input=True, delay_wgrad_compute=True)
    delayed.load_state_dict(base.state_dict())
    xi, li = x.clone().requires_grad_(), logits.clone().requires_grad_()
    o = delayed(xi, li)
    (o.out.float().square().sum() + o.score_sum.sum()).backward()
    delayed.backward_dw()
    results.append([o.out, xi.grad, li.grad, delayed.experts.fc1.weights()[0].grad,
                    delayed.experts.fc2.weights()[-1].grad])
    for later in results[1:]:
        for a, b in zip(results[0], later):
            assert torch.equal(a, b)


def test_moe_route_under_compile_fullgraph():
    torch.manual_seed(2)
    logits = torch.randn(11, 6, requires_grad=True)

    def f(l):
        r = stt.moe_route(l, 2, score="sigmoid", normalize=True)
        return (r.probs * torch.arange(2.0)).sum() + r.score_sum.sum(), r.experts

    eager_loss, eager_experts = f(logits)
    (g_eager,) = torch.autograd.grad(eager_loss, logits)
    compiled_loss, compiled_experts = torch.compile(f, fullgraph=True, backend="aot_eager")(logits)
    (g_compiled,) = torch.autograd.grad(compiled_loss, logits)
    assert torch.equal(eager_experts, compiled_experts)
    torch.testing.assert_close(compiled_loss, eager_loss)
    torch.testing.assert_close(g_compiled, g_eager)


def route_inputs(N, E, nan=False):
    """Fresh fp32 router logits [N, E] and expert bias [E] that route unevenly (expert 0 favoured,
    the last expert nearly never chosen), with ties of score plus bias (experts 1 and 3 have the
    same bias; a token whose logits are all equal, one whose two best are those experts') and,
    with `nan`, a NaN logit (softmax: that token's probs all NaN; sigmoid: that expert's; NaN
    chosen last)."""
    logits = 2 * torch.randn(N, E)
    logits[:, 0] += 2
    logits[:, -1] -= 6
    logits[1] = 0.5
    logits[2, 1] = logits[2, 3] = 9.0
    if nan:
        logits[3, 2] = float("nan")
    bias = 0.3 * torch.randn(E)
    bias[3] = bias[1]
    return logits, bias


@pytest.mark.parametrize("score,normalize", [("softmax", False), ("softmax", True), ("sigmoid", False),
                                             ("sigmoid", True)])
@pytest.mark.parametrize("uses", ["probs", "score_sum", "both"])
@pytest.mark.parametrize("nan", [False, True], ids=["finite", "nan"])
def test_moe_route_gradient_matches_a_float64_composition(score, normalize, uses, nan):
    """moe_route's outputs and the logits' gradient through the C++ autograd against
    reference_route in float64, from probs alone (no score_sum gradient), from score_sum alone (an
    expanded one, the gradient of a sum; dprobs zeros) or from both; expert_bias, which requires
    grad, gets none. Tolerance: fp32's, with a few tens of roundoffs (sums over the tokens)."""
    seed = int(np.random.SeedSequence().entropy % 2**31)
    torch.manual_seed(seed)
    N, E, K = 37, 8, 3
    logits, bias = (t.requires_grad_() for t in route_inputs(N, E, nan))
    wp = torch.randn(N, K)

    def loss(probs, score_sum):
        return {"probs": (probs * wp).sum(), "score_sum": score_sum.sum(),
                "both": (probs * wp).sum() + score_sum.sum()}[uses]

    r = stt.moe_route(logits, K, score=score, normalize=normalize, expert_bias=bias)
    loss(r.probs, r.score_sum).backward()
    lr = logits.detach().double().requires_grad_()
    experts, probs, score_sum = reference_route(lr, bias.detach(), K, score, normalize)
    loss(probs, score_sum).backward()
    assert torch.equal(r.experts, experts.int()), f"seed {seed}"
    assert torch.equal(r.counts, torch.bincount(experts.reshape(-1), minlength=E)), f"seed {seed}"
    assert bias.grad is None, f"seed {seed}"
    tol = 64 * torch.finfo(logits.dtype).eps
    pairs = (("probs", r.probs, probs), ("score_sum", r.score_sum, score_sum), ("dlogits", logits.grad, lr.grad))
    for name, a, b in pairs:
        torch.testing.assert_close(a.double(), b.detach(), rtol=tol, atol=tol, equal_nan=True,
                                   msg=f"{name}, seed {seed}")


@pytest.mark.parametrize("score,normalize", [("softmax", False), ("softmax", True), ("sigmoid", True)])
def test_moe_ops_pass_opcheck(score, normalize):
    """The three operators on fresh CPU data (uneven routing, ties): schema (new outputs, none
    aliasing an input), autograd registration (moe_route's in C++, the others' "not implemented"),
    AOT dispatch with dynamic shapes; outputs that share no memory with each other either, and
    fakes with the real outputs' shapes, strides and dtypes. (test_faketensor would fail on the
    storage offset alone, as attention's; AOT dispatch is run on moe_route without a gradient,
    because opcheck sums every output into one tensor, which an int32 first output makes integer:
    its backward's trace is checked with make_fx here, its gradients in the test above. No NaN:
    opcheck compares without equal_nan.)"""
    from torch._subclasses.fake_tensor import FakeTensorMode  # noqa: PLC0415
    from torch.fx.experimental.proxy_tensor import make_fx  # noqa: PLC0415

    seed = int(np.random.SeedSequence().entropy % 2**31)
    torch.manual_seed(seed)
    N, E, K = 41, 8, 3
    ops = torch.ops.sparsetrain
    logits, bias = route_inputs(N, E)
    utils = ("test_schema", "test_autograd_registration", "test_aot_dispatch_dynamic")
    torch.library.opcheck(ops.moe_route.default, (logits.requires_grad_(), bias, K, score, normalize),
                          test_utils=utils[:2])
    logits = logits.detach()
    route_args = (logits, bias, K, score, normalize)
    torch.library.opcheck(ops.moe_route.default, route_args, test_utils=utils)
    r = ops.moe_route.default(*route_args)
    assert len({t.untyped_storage().data_ptr() for t in r}) == len(r), f"seed {seed}"
    backward_args = (logits, r[0], torch.randn(N, K), torch.randn(E), K, score, normalize)
    torch.library.opcheck(ops.moe_route_backward.default, backward_args, test_utils=utils)
    torch.library.opcheck(ops.moe_route_backward.default, (*backward_args[:3], None, *backward_args[4:]),
                          test_utils=utils)
    combine_args = (torch.randn(N * K, 16, dtype=BF16), r[3])
    torch.library.opcheck(ops.moe_combine_rows.default, combine_args, test_utils=utils)

    def layouts(outputs):
        return [(t.shape, t.stride(), t.dtype) for t in ((outputs,) if isinstance(outputs, torch.Tensor) else outputs)]

    for op, args in ((ops.moe_route.default, route_args), (ops.moe_route_backward.default, backward_args),
                     (ops.moe_combine_rows.default, combine_args)):
        with FakeTensorMode() as mode:
            fake = op(*(mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args))
        assert layouts(fake) == layouts(op(*args)), f"{op}: fake (shape, stride, dtype) vs the real call's"

    def grads(l, dprobs, dscore_sum):
        out = ops.moe_route.default(l, None, K, score, normalize)
        return torch.autograd.grad((out[1], out[5]), l, (dprobs, dscore_sum))

    traced = make_fx(grads, tracing_mode="symbolic")(logits.detach().requires_grad_(), torch.randn(N, K),
                                                     torch.randn(E))
    targets = {n.target for n in traced.graph.nodes}
    assert ops.moe_route.default in targets and ops.moe_route_backward.default in targets, targets


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="top_k: expected 1 <= top_k <= num_experts = 4, got 5"):
        stt.MoELayer(4, 16, 8, 5)
    with pytest.raises(ValueError, match="score: expected one of softmax, sigmoid, got tanh"):
        stt.MoELayer(4, 16, 8, 2, score="tanh")
    layer = stt.MoELayer(4, 16, 8, 2, params_dtype=BF16)
    x = torch.randn(5, 16, dtype=BF16)
    with pytest.raises(ValueError, match=r"logits: expected shape \[N = 5, E = 4\]"):
        layer(x, torch.randn(6, 4))
    with pytest.raises(ValueError, match=r"x: expected shape \[N, hidden = 16\]"):
        layer(torch.randn(5, 15, dtype=BF16), torch.randn(5, 4))
    with pytest.raises(ValueError, match=r"logits: expected shape \[N = 5, E = 4\], got \[5, 3\]"):
        layer(x, torch.randn(5, 3))
    with pytest.raises(ValueError, match="logits: expected dtype fp32"):
        layer(x, torch.randn(5, 4, dtype=BF16))
    with pytest.raises(ValueError, match=r"logits: expected a 2-d tensor \[N, E\] \(router logits\), got \[20\]"):
        stt.moe_route(torch.randn(20), 2)
    with pytest.raises(ValueError, match="score: expected softmax or sigmoid, got tanh"):
        stt.moe_route(torch.randn(5, 4), 2, score="tanh")
    with pytest.raises(ValueError, match=r"expert_bias: expected shape \[4\]"):
        stt.moe_route(torch.randn(5, 4), 2, expert_bias=torch.zeros(3))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no CUDA device: the CUDA case skipped"))])
def test_the_combine_sums_in_slot_order_without_a_copy_of_the_rows(device, monkeypatch):
    """token_rows.take, the expert-parallel layer's combine (and the rows' gather's adjoint), goes
    through sparsetrain::moe_combine_rows, not index_select into an [N * top_k, hidden] copy then
    sum: each token's rows summed in fp32 in slot order, rounded once (written here as that loop),
    bitwise. (MoELayer's combine is the core's own, inside its operator.)"""
    import sparsetrain.torch.token_rows as tm  # noqa: PLC0415

    calls = []
    real = tm._COMBINE_ROWS

    def spy(x, index):
        calls.append((tuple(x.shape), tuple(index.shape)))
        return real(x, index)

    monkeypatch.setattr(tm, "_COMBINE_ROWS", spy)
    torch.manual_seed(5)
    N, H, K = 37, 32, 3
    y = torch.randn(N * K, H, dtype=BF16, device=device)
    row_of = torch.stack([torch.randperm(N * K)[:K] for _ in range(N)]).to(device)
    want = torch.zeros(N, H, device=device)
    for i in range(K):
        want = want + y[row_of[:, i]].float()
    assert torch.equal(tm.take(y, row_of), want.to(BF16))
    assert calls == [((N * K, H), (N, K))]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device: the CUDA MoE layer test skipped")
def test_cuda_moe_layer_equals_the_cpu_layer():
    torch.manual_seed(3)
    cpu = stt.MoELayer(8, 64, 32, 2, normalize=True, params_dtype=BF16)
    gpu = stt.MoELayer(8, 64, 32, 2, normalize=True, params_dtype=BF16, device="cuda")
    gpu.load_state_dict(cpu.state_dict())
    x = torch.randn(301, 64, dtype=BF16)
    logits = torch.randn(301, 8)
    results = []
    for layer, dev in ((cpu, "cpu"), (gpu, "cuda")):
        # detach: x.to("cpu") is x itself, so without it the CPU pass left x requiring grad and the
        # CUDA copies were non-leaves (no .grad).
        xi, li = x.detach().to(dev).requires_grad_(), logits.detach().to(dev).requires_grad_()
        o = layer(xi, li)
        (o.out.float().square().sum() + o.score_sum.sum()).backward()
        results.append([o.out, o.counts, xi.grad, li.grad, layer.experts.fc1.weights()[0].grad])
    for name, a, b in zip(("out", "counts", "dx", "dlogits", "dW1[0]"), *results):
        if name == "counts":
            assert torch.equal(a, b.cpu())
        else:
            torch.testing.assert_close(b.cpu().double(), a.double(), rtol=3e-2, atol=3e-2, msg=name)


@pytest.mark.parametrize("recompute", [True, False], ids=["recompute", "keep_rows"])
@pytest.mark.parametrize("fused", [False, True], ids=["plain", "main_grad"])
def test_moe_layer_ops_pass_opcheck_and_compile(recompute, fused):
    """The layer's operators sparsetrain::moe_layer_forward and _backward on fresh CPU data: opcheck
    (schema: main_grads the only written arguments; autograd registration; AOT dispatch with dynamic
    shapes), fakes with the real outputs' shapes, strides and dtypes, and the layer under
    torch.compile(fullgraph=True) equal to eager: out, score_sum, x's and the logits' gradients, the
    weights' grads (or main_grads)."""
    from torch._subclasses.fake_tensor import FakeTensorMode  # noqa: PLC0415
    from torch.utils import _pytree as pytree  # noqa: PLC0415

    seed = int(np.random.SeedSequence().entropy % 2**31)
    torch.manual_seed(seed)
    N, E, K, H, F = 29, 6, 2, 16, 8
    layer = stt.MoELayer(E, H, F, K, normalize=True, bias=True, fuse_wgrad_accumulation=fused,
                         recompute_expert_input=recompute)
    weights = [w for n, w in layer.named_parameters() if "weight" in n]
    for w in weights if fused else ():
        w.main_grad = torch.zeros(w.shape)
    x, logits = torch.randn(N, H), torch.randn(N, E)
    ops = torch.ops.sparsetrain
    params, main_grads, flags = layer._op_args()
    margs = ([p.detach() for p in params], main_grads, flags)
    fwd_args = (layer._id, x, logits, None, *margs)
    utils = ("test_schema", "test_autograd_registration", "test_aot_dispatch_dynamic")
    torch.library.opcheck(ops.moe_layer_forward.default, fwd_args, test_utils=utils)
    f = ops.moe_layer_forward.default(*fwd_args)
    bwd_args = (layer._id, x, logits, f[1], f[3], f[4], f[5], f[7], f[8], f[9], f[10], torch.randn(N, H),
                torch.randn(E), *margs)
    torch.library.opcheck(ops.moe_layer_backward.default, bwd_args, test_utils=utils)

    def layouts(outputs):
        return [(t.shape, t.stride(), t.dtype) for t in outputs]

    for op, args in ((ops.moe_layer_forward.default, fwd_args), (ops.moe_layer_backward.default, bwd_args)):
        with FakeTensorMode() as mode:
            fake = op(*pytree.tree_map_only(torch.Tensor, mode.from_tensor, args))
        assert layouts(fake) == layouts(op(*args)), f"{op}: fake (shape, stride, dtype) vs the real call's"

    dout, dsum = torch.randn(N, H), torch.randn(E)

    def step(compiled):
        for w in weights:
            w.grad = None
            if fused:
                w.main_grad.zero_()
        xi, li = x.clone().requires_grad_(), logits.clone().requires_grad_()

        def loss(xi, li):
            o = layer(xi, li)
            return (o.out * dout).sum() + (o.score_sum * dsum).sum(), o.counts

        value, counts = (torch.compile(loss, fullgraph=True) if compiled else loss)(xi, li)
        value.backward()
        return [value.detach(), counts, xi.grad, li.grad] + [w.main_grad if fused else w.grad for w in weights]

    for i, (c, e) in enumerate(zip(step(True), step(False))):
        torch.testing.assert_close(c.clone(), e.clone(), rtol=1e-5, atol=1e-5, msg=f"result {i} (seed {seed})")


@pytest.mark.parametrize("recompute", [True, False], ids=["recompute", "keep_rows"])
def test_moe_layer_with_no_tokens(recompute):
    """N = 0 (a rank or micro-batch without tokens): empty outputs, empty x and logits gradients,
    zero weight gradients, whether the (empty) rows are kept or gathered again."""
    layer = stt.MoELayer(6, 16, 8, 2, bias=True, params_dtype=BF16, recompute_expert_input=recompute)
    x = torch.zeros(0, 16, dtype=BF16, requires_grad=True)
    logits = torch.zeros(0, 6, requires_grad=True)
    o = layer(x, logits)
    assert o.out.shape == (0, 16) and o.counts.tolist() == [0] * 6 and o.score_sum.tolist() == [0.0] * 6
    (o.out.float().sum() + o.score_sum.sum()).backward()
    assert x.grad.shape == (0, 16) and logits.grad.shape == (0, 6)
    for name, p in layer.named_parameters():
        assert p.grad is not None and not bool(p.grad.any()), name
