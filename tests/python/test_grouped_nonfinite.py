"""NaN and inf in GroupedLinear, GroupedMLP and the MoE layer are never hidden, and reach exactly
the elements the math gives them: a NaN or inf goes into a row or an element of x, a weight, a
bias, dy or probs (or the padded tail of x, which nothing reads); the CPU backend's outputs and
gradients are non-finite exactly where a float64 per-expert torch composition's are, and on a GPU
the CUDA backend's exactly where the CPU backend's are (an expert's GEMM never reads another
expert's rows: a NaN there would leak across the boundary). Skipped visibly without torch (and
the CUDA part without a GPU)."""

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed: non-finite grouped tests skipped")

import sparsetrain as st  # noqa: E402
import sparsetrain.torch as stt  # noqa: E402

NAN, INF = float("nan"), float("inf")
G, T, IN, FFN, OUT = 5, 97, 24, 16, 40
SPLITS = [30, 0, 1, 41, 17]  # S = 89 < T: a padded tail; an empty and a one-row expert
S = sum(SPLITS)
# (what, where, value): "x" rows / elements (of expert 3; "x_tail": of the padded tail), a weight
# element of expert 3 (fc1's in the MLP), a bias element, a dy element, a probs entry.
INJECTIONS = [("x", "row", NAN), ("x", "element", INF), ("x_tail", "row", NAN), ("weight", "element", NAN),
              ("weight", "element", -INF), ("bias", "element", INF), ("dy", "element", NAN),
              ("probs", "element", NAN)]
IDS = [f"{a}_{b}_{c}" for a, b, c in INJECTIONS]


def _module(kind, device, seed=0):
    torch.manual_seed(seed)
    kw = dict(bias=True, params_dtype=torch.float32, device=device, single_grouped_weight=True)
    return stt.GroupedLinear(G, IN, OUT, **kw) if kind == "linear" else stt.GroupedMLP(G, IN, FFN, OUT, **kw)


def _inject(m, x, dy, probs, injection, seed):
    what, where, value = injection
    g = torch.Generator().manual_seed(seed)
    start = sum(SPLITS[:3])
    with torch.no_grad():
        if what in ("x", "x_tail"):
            row = start + 7 if what == "x" else S + 3
            if where == "row":
                x[row] = value
            else:
                x[row, int(torch.randint(0, IN, (1,), generator=g))] = value
        elif what == "weight":
            w = m.weight if hasattr(m, "weight") else m.fc1.weight
            w[3, int(torch.randint(0, w.shape[1], (1,), generator=g)), int(torch.randint(0, IN, (1,), generator=g))] = value
        elif what == "bias":
            b = m.bias if hasattr(m, "bias") else m.fc2.bias
            b[3, int(torch.randint(0, b.shape[1], (1,), generator=g))] = value
        elif what == "dy":
            dy[start + 2, int(torch.randint(0, OUT, (1,), generator=g))] = value
        elif probs is not None:
            probs[start + 4] = value


def _ours(m, x, dy, probs):
    x = x.detach().clone().requires_grad_()
    p = None if probs is None else probs.detach().clone().requires_grad_()
    y = m(x, SPLITS) if p is None else m(x, SPLITS, p)
    y.backward(dy)
    return _named(y, x, p, m.named_parameters())


def _named(y, x, probs, params):
    """A step's results by name: y, dx, dprobs (with probs), d<parameter>."""
    out = {"y": y.detach(), "dx": x.grad}
    if probs is not None:
        out["dprobs"] = probs.grad
    for name, t in params:
        out[f"d{name}"] = t.grad
    return out


def _oracle(m, x, dy, probs):
    """float64 per-expert composition under autograd (DESIGN.md sections 4 and 5)."""
    params = {n: t.detach().double().requires_grad_() for n, t in m.named_parameters()}
    x64 = x.detach().double().requires_grad_()
    p64 = None if probs is None else probs.detach().double().requires_grad_()
    ys, start = [], 0
    for e, n in enumerate(SPLITS):
        xe = x64[start:start + n]
        if "weight" in params:
            ye = xe @ params["weight"][e].t() + params["bias"][e]
        else:
            h = xe @ params["fc1.weight"][e].t() + params["fc1.bias"][e]
            a, b = h[:, :FFN], h[:, FFN:]
            act = torch.nn.functional.silu(a) * b
            ye = (act @ params["fc2.weight"][e].t() + params["fc2.bias"][e]) * p64[start:start + n, None]
        ys.append(ye)
        start += n
    y = torch.cat(ys + [x64.new_zeros(T - S, OUT)])
    y.backward(dy.double())
    return _named(y, x64, p64, params.items())


def _inputs(kind, seed):
    g = torch.Generator().manual_seed(seed)
    x, dy = torch.randn(T, IN, generator=g), torch.randn(T, OUT, generator=g)
    probs = None if kind == "linear" else torch.rand(T, generator=g)
    return x, dy, probs


def _check_pattern(got, want, case):
    assert got.keys() == want.keys(), case
    for name in want:
        g, w = ~torch.isfinite(got[name].cpu()), ~torch.isfinite(want[name].cpu())
        missing, extra = int((w & ~g).sum()), int((g & ~w).sum())
        assert missing == 0 and extra == 0, (f"{case}: {name}: {missing} element(s) finite that must not be, "
                                             f"{extra} non-finite that must not be")


@pytest.mark.parametrize("injection", INJECTIONS, ids=IDS)
@pytest.mark.parametrize("kind", ["linear", "mlp"])
def test_cpu_non_finite_elements_are_the_compositions(kind, injection):
    if injection[0] == "probs" and kind == "linear":
        pytest.skip("GroupedLinear takes no probs")
    m = _module(kind, "cpu")
    x, dy, probs = _inputs(kind, 1)
    _inject(m, x, dy, probs, injection, 2)
    got, want = _ours(m, x, dy, probs), _oracle(m, x, dy, probs)
    _check_pattern(got, want, f"cpu {kind} {injection}")
    assert any(not bool(torch.isfinite(t).all()) for t in got.values()) or injection[0] == "x_tail"


cuda = pytest.mark.skipif(not torch.cuda.is_available() or not st.built_with_cuda(),
                          reason="no CUDA device (or a CPU-only build): CUDA non-finite grouped tests skipped")


@cuda
@pytest.mark.parametrize("injection", INJECTIONS, ids=IDS)
@pytest.mark.parametrize("kind", ["linear", "mlp"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_cuda_non_finite_elements_are_the_cpu_backends(kind, injection, dtype):
    if injection[0] == "probs" and kind == "linear":
        pytest.skip("GroupedLinear takes no probs")
    cpu, gpu = _module(kind, "cpu"), _module(kind, "cuda")
    x, dy, probs = _inputs(kind, 1)
    _inject(cpu, x, dy, probs, injection, 2)
    cpu, gpu = cpu.to(dtype), gpu.to(dtype)
    gpu.load_state_dict(cpu.state_dict())
    x, dy = x.to(dtype), dy.to(dtype)
    want = _ours(cpu, x, dy, probs)
    got = _ours(gpu, x.cuda(), dy.cuda(), None if probs is None else probs.cuda())
    _check_pattern(got, want, f"cuda {kind} {dtype} {injection}")


@cuda
@pytest.mark.parametrize("what", ["x_row", "x_element", "logits_row", "weight", "dout"])
def test_cuda_moe_layer_non_finite_elements_are_the_cpu_layers(what):
    torch.manual_seed(3)
    cpu = stt.MoELayer(8, 64, 32, 2, normalize=True, params_dtype=torch.bfloat16)
    gpu = stt.MoELayer(8, 64, 32, 2, normalize=True, params_dtype=torch.bfloat16, device="cuda")
    x, logits, dout = torch.randn(301, 64, dtype=torch.bfloat16), torch.randn(301, 8), torch.randn(301, 64)
    with torch.no_grad():
        if what == "x_row":
            x[17] = NAN
        elif what == "x_element":
            x[40, 5] = INF
        elif what == "logits_row":
            logits[9] = NAN
        elif what == "weight":
            cpu.experts.fc2.weights()[3][7, 11] = NAN
        else:
            dout[100, 3] = NAN
    gpu.load_state_dict(cpu.state_dict())
    results = []
    for layer, dev in ((cpu, "cpu"), (gpu, "cuda")):
        xi, li = x.detach().to(dev).requires_grad_(), logits.detach().to(dev).requires_grad_()
        o = layer(xi, li)
        (o.out.float() * dout.to(dev)).sum().add(o.score_sum.sum()).backward()
        w = layer.experts.fc1.weights()[0]
        results.append({"out": o.out.detach(), "dx": xi.grad, "dlogits": li.grad, "dW1": w.grad,
                        "dW2": layer.experts.fc2.weights()[0].grad})
    _check_pattern(results[1], results[0], f"moe {what}")
    assert any(not bool(torch.isfinite(t).all()) for t in results[0].values()), f"moe {what}: nothing non-finite"
