"""CUDA graphs the way users capture them: GroupedLinear, GroupedMLP, MoELayer and
block_sparse_attention x {plain, fused main_grad, main_grad with grad_added_to_main_grad (the dummy
wgrad), delayed wgrad + backward_dw, caller out / grad_input buffers, bias} x {torch.cuda.graph after
eager steps on a side stream, torch.cuda.graph around the layer's very first call,
torch.cuda.make_graphed_callables, torch.compile(mode="reduce-overhead")}, where the combination is
meaningful (a delayed wgrad's queue lives on the host, so it is captured only with its
backward_dw inside the same graph; caller buffers are a torch.cuda.graph case). Splits are uneven,
with empty experts and experts of 1-7 rows, and change at every replay (the MoE layer: new logits,
so a new routing; attention: new document boundaries, the mask built on the device inside the
graph). Every replay's results (outputs, input grads, parameter grads, main_grads, caller buffers;
poisoned with NaN before it where the replay must write them) are compared bitwise with an eager
step on the same inputs. GPU only: skipped visibly without one (attention: without a Hopper GPU)."""

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed: CUDA graph tests skipped")

import sparsetrain as st  # noqa: E402
import sparsetrain.torch as stt  # noqa: E402
from training_steps import DEV, BF16, AttentionStep, LayerStep, assert_same, fp8_missing, splits  # noqa: E402

if not torch.cuda.is_available() or not st.built_with_cuda():
    pytest.skip("no CUDA device (or a CPU-only build): CUDA graph tests skipped", allow_module_level=True)

hopper = pytest.mark.skipif(torch.cuda.get_device_capability(0) != (9, 0),
                            reason="not a Hopper GPU (compute capability 9.0): attention capture tests skipped")

# The FP8 recipe's variants: a replay quantizes the weights it finds (nothing cached at capture).
fp8 = pytest.mark.skipif(fp8_missing() is not None, reason=f"FP8 capture tests skipped: {fp8_missing()}")
FP8_VARIANTS = [pytest.param("fp8", marks=fp8), pytest.param("fp8_fused", marks=fp8)]
LAYER_VARIANTS = ["plain", "fused", "fused_dummy", "delayed", "buffers", "bias", *FP8_VARIANTS]
# make_graphed_callables and torch.compile replay the backward without running our host code, so a
# delayed wgrad queued at capture would never be queued again; they take the other variants (the
# caller-buffer ones through torch.cuda.graph only: their in-place writes are the caller's).
GRAPHED_VARIANTS = ["plain", "fused", "fused_dummy", "bias", *FP8_VARIANTS]


def _compare(case, step, replayed, seed):
    """The replay's results against an eager step on the same inputs (bitwise; the
    nondeterministic attention backward's atomic dQ adds within bf16 rounding)."""
    step.reset(poison=False)
    eager = step.results(step.step())
    assert replayed.keys() == eager.keys(), f"{case}: {sorted(replayed)} vs {sorted(eager)}"
    for name in eager:
        if isinstance(step, AttentionStep) and not step.det and name == "q.grad":
            torch.testing.assert_close(replayed[name], eager[name], rtol=2e-2, atol=2e-2, msg=f"{case} seed {seed}")
        else:
            assert_same(name, replayed[name], eager[name], f"{case} seed {seed}")


def _run_graph(case, step, warm_up):
    """torch.cuda.graph: eager steps on a side stream first (warm_up), or the layer's very first
    call inside the capture; then two replays with new inputs, each compared with eager."""
    if warm_up:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for seed in (101, 102, 103):
                step.load(seed)
                step.reset(poison=False)
                step.step()
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
    step.clear_grads()  # the capture's backward makes them: each replay rewrites them
    if isinstance(step, LayerStep):
        step.reset(poison=False)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = step.step()
    y = step.detached(y)  # the graph's output memory, without the capture's autograd graph
    for seed in (7, 8):
        step.load(seed)
        step.reset(poison=True)
        graph.replay()
        torch.cuda.synchronize()
        _compare(case, step, step.results(y), seed)


def _run_graphed_callable(case, step):
    """torch.cuda.make_graphed_callables over the layer (or the attention function); the grads it
    returns accumulate eagerly. torch's stream-mismatch warning is off here: make_graphed_callables
    itself keeps autograd graphs alive across streams (its warm-up outputs through the captures, a
    `for v in [...]: del v` that deletes nothing, and the captured outputs for good), so the sample
    inputs' and parameters' AccumulateGrad nodes stay on its warm-up or capture stream for any
    module, nn.Linear as well; its graphs still capture and replay right, as checked here."""
    warn = torch._C._warn_on_accumulate_grad_stream_mismatch()
    torch.autograd.graph.set_warn_on_accumulate_grad_stream_mismatch(False)
    try:
        _graphed_callable_steps(case, step)
    finally:
        torch.autograd.graph.set_warn_on_accumulate_grad_stream_mismatch(warn)


def _graphed_callable_steps(case, step):
    sample = tuple(step.s[n] for n in ("x", "splits", "probs", "logits") if n in step.s) \
        if isinstance(step, LayerStep) else tuple(step.inputs())
    eager_forward = step.m.forward if isinstance(step, LayerStep) else step.attention
    graphed = torch.cuda.make_graphed_callables(step.m if isinstance(step, LayerStep) else step.attention, sample,
                                                allow_unused_input=True)  # fused main_grad: no weight grads
    fn = graphed if not isinstance(step, LayerStep) else graphed.forward
    for seed in (7, 8):
        step.load(seed)
        step.clear_grads()
        step.reset(poison=False)
        replayed = step.results(step.step(fn))
        step.clear_grads()
        step.reset(poison=False)
        if isinstance(step, LayerStep):
            step.m.forward = eager_forward  # the module's own forward for the eager step
            try:
                _compare(case, step, replayed, seed)
            finally:
                step.m.forward = graphed.forward
        else:
            _compare(case, step, replayed, seed)


def _run_compiled(case, step):
    """torch.compile(mode="reduce-overhead"): CUDA graph trees over the compiled forward and
    backward; three warm-up steps, then two compared ones; no cudagraph skip allowed."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    fn = torch.compile(step.m if isinstance(step, LayerStep) else step.attention, mode="reduce-overhead")
    for seed in (101, 102, 103, 7, 8):
        step.load(seed)
        step.clear_grads()
        step.reset(poison=False)
        torch.compiler.cudagraph_mark_step_begin()
        replayed = step.results(step.step(fn))
        if seed < 100:
            step.clear_grads()
            _compare(case, step, replayed, seed)
    skips = dict(counters["inductor"]).get("cudagraph_skips", 0)
    assert skips == 0, f"{case}: torch.compile skipped CUDA graphs {skips} time(s)"


# -- the matrix ----------------------------------------------------------------------------------


@pytest.mark.parametrize("op", ["linear", "mlp", "moe"])
@pytest.mark.parametrize("variant", LAYER_VARIANTS)
@pytest.mark.parametrize("warm_up", [True, False], ids=["after_side_stream_steps", "first_call_captured"])
def test_torch_cuda_graph(op, variant, warm_up):
    if op == "moe" and variant == "buffers":
        pytest.skip("MoELayer takes no caller buffers")
    _run_graph(f"{op}/{variant}/graph", LayerStep(op, variant), warm_up)


@pytest.mark.parametrize("op", ["linear", "mlp", "moe"])
@pytest.mark.parametrize("variant", GRAPHED_VARIANTS)
def test_make_graphed_callables(op, variant):
    _run_graphed_callable(f"{op}/{variant}/make_graphed_callables", LayerStep(op, variant))


@pytest.mark.parametrize("op,variant", [("linear", "plain"), ("linear", "fused"), ("mlp", "bias"),
                                        ("mlp", "fused_dummy"), ("moe", "plain"),
                                        pytest.param("linear", "fp8", marks=fp8),
                                        pytest.param("moe", "fp8_fused", marks=fp8)])
def test_torch_compile_reduce_overhead(op, variant):
    _run_compiled(f"{op}/{variant}/reduce-overhead", LayerStep(op, variant))


@fp8
def test_moe_fp8_saved_activations_capture_every_way():
    """The MoE layer holding fc1's output in e4m3 (fp8_saved_activations): torch.cuda.graph after
    side-stream steps, make_graphed_callables and torch.compile(mode="reduce-overhead"), each replay
    bitwise an eager step on its new inputs (new routing)."""
    _run_graph("moe/fp8_saved/torch.cuda.graph", LayerStep("moe", "fp8_saved"), warm_up=True)
    _run_graphed_callable("moe/fp8_saved/make_graphed_callables", LayerStep("moe", "fp8_saved"))
    _run_compiled("moe/fp8_saved/reduce-overhead", LayerStep("moe", "fp8_saved"))


@fp8
@pytest.mark.parametrize("op,variant", [("mlp", "fp8"), ("moe", "fp8_fused"), ("moe", "fp8_saved")])
def test_fp8_backward_on_codes_captures_every_way(op, variant):
    """FP8 at an MLP width of 256 (a multiple of 128): the SwiGLU backward writes fc1's and fc2's
    codes itself (and, with fp8_saved_activations, reads fc1's saved codes): torch.cuda.graph after
    side-stream steps, make_graphed_callables and torch.compile(mode="reduce-overhead"), each replay
    bitwise an eager step on its new inputs."""
    _run_graph(f"{op}/{variant}/F256/torch.cuda.graph", LayerStep(op, variant, ffn=256), warm_up=True)
    _run_graphed_callable(f"{op}/{variant}/F256/make_graphed_callables", LayerStep(op, variant, ffn=256))
    _run_compiled(f"{op}/{variant}/F256/reduce-overhead", LayerStep(op, variant, ffn=256))


@hopper
@pytest.mark.parametrize("deterministic", [True, False], ids=["det", "nondet"])
@pytest.mark.parametrize("warm_up", [True, False], ids=["after_side_stream_steps", "first_call_captured"])
def test_attention_torch_cuda_graph(deterministic, warm_up):
    _run_graph(f"attention/{deterministic}/graph", AttentionStep(deterministic), warm_up)


@hopper
def test_attention_make_graphed_callables():
    _run_graphed_callable("attention/make_graphed_callables", AttentionStep(True, build_inside=False))


@hopper
def test_attention_torch_compile_reduce_overhead():
    _run_compiled("attention/reduce-overhead", AttentionStep(True, build_inside=False))


@fp8
def test_an_fp8_replay_reads_the_weights_as_they_are_now():
    """The FP8 weights are quantized inside the graph: an optimizer's in-place update between
    replays is seen by the next replay (compared bitwise with an eager step on the new weights)."""
    step = LayerStep("linear", "fp8")
    step.reset(poison=False)
    graph = torch.cuda.CUDAGraph()
    step.clear_grads()
    with torch.cuda.graph(graph):
        y = step.step()
    y = step.detached(y)
    for seed in (7, 8):
        with torch.no_grad():
            step.m.weight.mul_(0.5).add_(0.01 * seed)  # in place, as an optimizer step
        step.load(seed)
        step.reset(poison=True)
        graph.replay()
        torch.cuda.synchronize()
        _compare("linear/fp8/weights updated between replays", step, step.results(y), seed)


def test_the_issue_program_captures_and_replays():
    """The program a user reported (a GroupedLinear with fused main_grad captured after a warm-up
    on a side stream failed in backward with cudaErrorStreamCaptureIsolation: the parameters'
    AccumulateGrad nodes, held between steps, still ran on the warm-up's stream)."""
    layer = stt.GroupedLinear(19, 1544, 776, bias=False, params_dtype=BF16, device=DEV, single_grouped_weight=True,
                              fuse_wgrad_accumulation=True)
    w = layer.weight
    w.main_grad = torch.zeros(w.shape, device=DEV, dtype=torch.float32)
    x = torch.randn(8191, 1544, device=DEV, dtype=BF16, requires_grad=True)
    dy = torch.randn(8191, 776, device=DEV, dtype=BF16)
    sp = splits(11, 8191, groups=19).to(DEV)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            x.grad = None
            layer(x, sp).backward(dy)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    x.grad = None
    with torch.cuda.graph(graph):
        layer(x, sp).backward(dy)
    w.main_grad.zero_()
    graph.replay()
    torch.cuda.synchronize()
    replayed = (x.grad.clone(), w.main_grad.clone())
    x.grad.zero_()
    w.main_grad.zero_()
    layer(x, sp).backward(dy)
    assert_same("x.grad", replayed[0], x.grad, "issue program")
    assert_same("main_grad", replayed[1], w.main_grad, "issue program")
