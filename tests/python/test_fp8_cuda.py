"""The FP8 recipe on CUDA through the torch front: GroupedLinear against the same module on the CPU
reference (both quantize to the same codes and scales, bitwise; the GEMMs differ only in fp32
summation order, so a bf16 tolerance), GroupedMLP and MoELayer against their bf16 selves (a loose
bound: the quantization), 20 runs bitwise equal, device splits with empty, 1-row and 127-row
experts and a padded tail, NaN in an input reaching the output, the MoE layer's rows quantized as
they are gathered bitwise the kept rows'. GPU only (a Hopper GPU and an ALL
build: the FP8 GEMMs are sm90a kernels), skipped visibly otherwise; CUDA-graph capture of the
recipe is test_cuda_graphs.py's fp8 variants."""

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed: CUDA FP8 tests skipped")

import sparsetrain as st  # noqa: E402
import sparsetrain.torch as stt  # noqa: E402

if not torch.cuda.is_available() or not st.built_with_cuda():
    pytest.skip("no CUDA device (or a CPU-only build): CUDA FP8 tests skipped", allow_module_level=True)

from training_steps import assert_saves_fc1s_codes_instead, fp8_missing, saved_for_backward  # noqa: E402

if fp8_missing() is not None:
    pytest.skip(f"CUDA FP8 tests skipped: {fp8_missing()}", allow_module_level=True)

BF16 = torch.bfloat16
SPLITS = [0, 1, 127, 300, 0, 129, 45]  # empty, 1-row, 127-row experts; 602 rows
T = 640  # rows past sum(SPLITS): a padded tail the layer zeroes
IN, OUT = 272, 176


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def _linear_step(device, splits, x, dy, seed=0):
    """y, dx, dW of one step, on the CPU; the weights drawn on the CPU whatever the device."""
    torch.manual_seed(seed)
    w = torch.empty(len(SPLITS), OUT, IN).uniform_(-IN**-0.5, IN**-0.5).to(BF16)
    m = stt.GroupedLinear(len(SPLITS), IN, OUT, bias=False, params_dtype=BF16, single_grouped_weight=True,
                          device=device, fp8=True)
    with torch.no_grad():
        m.weight.copy_(w)
    x = x.to(device).detach().requires_grad_(True)  # a leaf of its own on either device
    y = m(x, splits.to(device) if isinstance(splits, torch.Tensor) else splits)
    y.backward(dy.to(device))
    return [t.detach().cpu() for t in (y, x.grad, m.weight.grad)]


def _data(seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(T, IN, generator=g).to(BF16), torch.randn(T, OUT, generator=g).to(BF16)


def test_grouped_linear_matches_the_cpu_reference_of_the_recipe():
    x, dy = _data()
    splits = torch.tensor(SPLITS)
    cpu = _linear_step("cpu", splits, x, dy)
    cuda = _linear_step("cuda", splits, x, dy)  # device splits: no host read
    S = sum(SPLITS)
    for name, got, want in zip(("y", "dx", "dW"), cuda, cpu):
        assert torch.isfinite(got).all(), f"{name}: non-finite values"
        if name != "dW":
            assert torch.equal(got[S:], torch.zeros_like(got[S:])), f"{name}: the padded tail is not zero"
            got, want = got[:S], want[:S]
        # The same codes and scales: only the fp32 summation order differs, then one bf16 rounding.
        tol = 2.0**-7
        torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol * want.float().abs().max().item(),
                                   msg=lambda m: f"{name}: CUDA against the CPU reference: {m}")
    assert torch.equal(cuda[2][0], torch.zeros_like(cuda[2][0])), "an empty expert's weight grad is zero"


def test_twenty_runs_are_bitwise_equal():
    x, dy = _data(2)
    splits = torch.tensor(SPLITS)
    first = _linear_step("cuda", splits, x, dy)
    for run in range(19):
        again = _linear_step("cuda", splits, x, dy)
        for name, a, b in zip(("y", "dx", "dW"), again, first):
            assert torch.equal(a, b), f"run {run + 2}: {name} differs from the first run"


def test_moe_layer_is_close_to_bf16_and_repeatable():
    N, E, H, F, K = 777, 16, 256, 144, 4
    g = torch.Generator().manual_seed(3)
    x = torch.randn(N, H, generator=g).to(BF16).cuda()
    logits = (torch.randn(N, E, generator=g) * 2).cuda()
    logits[:, 5] = -1e4  # expert 5 never chosen: an empty expert
    dy = torch.randn(N, H, generator=g).to(BF16).cuda()
    outs = {}
    for fp8 in (False, True, True):
        torch.manual_seed(0)
        m = stt.MoELayer(E, H, F, K, normalize=True, params_dtype=BF16, device="cuda", fp8=fp8)
        xi = x.clone().requires_grad_(True)
        y = m(xi, logits)
        y.out.backward(dy)
        r = [y.out.detach(), xi.grad, next(m.experts.parameters()).grad]
        if fp8 in outs:
            for a, b in zip(r, outs[fp8]):
                assert torch.equal(a, b), "two FP8 runs differ"
        outs[fp8] = r
    for name, a, b in zip(("out", "dx", "fc1 dW"), outs[True], outs[False]):
        assert torch.isfinite(a).all(), f"{name}: non-finite values"
        e = _rel(a, b)
        assert 1e-3 < e < 0.08, f"MoELayer {name}: relative error {e} (FP8 against bf16)"


def test_moe_layer_rows_quantized_as_gathered_give_the_kept_rows_bits():
    """recompute_expert_input=True (the default): fc1's quantizer reads x's tokens in the layout's
    order, the rows never written in bf16; False: the rows gathered in bf16 and quantized after.
    The same bits forward and backward (uneven top-4 routing, an empty expert, H over two
    128-channel tiles and a part)."""
    N, E, H, F, K = 555, 16, 272, 144, 4
    g = torch.Generator().manual_seed(5)
    x = torch.randn(N, H, generator=g).to(BF16).cuda()
    logits = (torch.randn(N, E, generator=g) * 2).cuda()
    logits[:, 3] = -1e4  # expert 3 never chosen
    dy = torch.randn(N, H, generator=g).to(BF16).cuda()
    runs = []
    for recompute in (False, True):
        torch.manual_seed(0)
        m = stt.MoELayer(E, H, F, K, normalize=True, params_dtype=BF16, device="cuda", fp8=True,
                         recompute_expert_input=recompute)
        xi = x.clone().requires_grad_(True)
        y = m(xi, logits)
        y.out.backward(dy)
        runs.append([y.out.detach(), xi.grad] + [p.grad for p in m.experts.parameters()])
    for name, a, b in zip(("out", "dx", "fc1 dW", "fc2 dW"), *runs):
        assert torch.isfinite(a).all(), f"{name}: non-finite values"
        assert torch.equal(a, b), f"{name}: the rows quantized as gathered differ from the kept rows'"


def test_moe_layer_fp8_saved_activations_hold_less_and_stay_close():
    """fp8_saved_activations=True on the GPU: the forward's bits are the plain FP8 layer's, what the
    forward saves for backward is the plain FP8 layer's with fc1's bf16 output replaced by its e4m3
    codes and their 1x128 scales (0.52x its bytes here), the gradients stay near the plain FP8
    layer's (fc1's output restored from e4m3; the C++ CUDA test checks those bits exactly) and two
    runs agree bitwise. bench_fp8.py measures the memory this holds at scale."""
    N, E, H, F, K = 555, 16, 256, 144, 4  # 2F = 288: two 128-column tiles and a part
    g = torch.Generator().manual_seed(7)
    x = torch.randn(N, H, generator=g).to(BF16).cuda()
    logits = (torch.randn(N, E, generator=g) * 2).cuda()
    dy = torch.randn(N, H, generator=g).to(BF16).cuda()
    runs, saves = [], []
    for saved in (False, True, True):
        torch.manual_seed(0)
        m = stt.MoELayer(E, H, F, K, normalize=True, params_dtype=BF16, device="cuda", fp8=True,
                         fp8_saved_activations=saved)
        xi = x.clone().requires_grad_(True)
        y, s = saved_for_backward(lambda: m(xi, logits))
        saves.append(s)
        y.out.backward(dy)
        runs.append([y.out.detach(), xi.grad] + [p.grad for p in m.experts.parameters()])
    assert_saves_fc1s_codes_instead(saves[0], saves[1], rows=N * K, fc1_columns=2 * F)
    assert torch.equal(runs[0][0], runs[1][0]), "the forward is the plain FP8 layer's"
    for name, a, b, c in zip(("out", "dx", "fc1 dW", "fc2 dW"), *runs):
        assert torch.isfinite(b).all(), f"{name}: non-finite values"
        assert torch.equal(b, c), f"{name}: two runs differ"
        if name != "out":
            e = _rel(b, a)
            assert 0 < e < 0.08, f"{name}: relative difference {e} to the plain FP8 layer"


def test_nan_in_an_input_row_reaches_that_row_only():
    x, _ = _data(4)
    x[200, 7] = float("nan")  # in the 300-row expert (rows 128..427)
    torch.manual_seed(0)
    m = stt.GroupedLinear(len(SPLITS), IN, OUT, bias=False, params_dtype=BF16, device="cuda", fp8=True)
    y = m(x.cuda(), SPLITS).cpu()
    # The NaN's 1x128 tile gets a NaN scale and NaN codes: its row's outputs are NaN, no other's.
    assert torch.isnan(y[200]).all(), "the NaN row's output is not NaN"
    rest = torch.cat([y[:200], y[201:]])
    assert torch.isfinite(rest).all(), "a NaN leaked into another row"
