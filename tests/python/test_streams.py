"""The array API's `stream=`: everything the library allocates for a call belongs to the stream its
kernels run on (seed 000's race). Kernels queued on a side stream behind a long sleep, while the
current stream at once allocates and zero-fills memory of the workspace's size: had the freed
workspace gone back to the current stream's pool, the fill would land in it before our kernels read
it (zeroed group offsets: every group empty, outputs zero). Results must be bitwise those of the
same calls on the current stream. GPU only: skipped visibly without one."""

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed: stream tests skipped")

import sparsetrain  # noqa: E402

cuda = pytest.mark.skipif(not torch.cuda.is_available() or not sparsetrain.built_with_cuda(),
                          reason="no CUDA device (or a CPU-only build): stream tests skipped")

G, T, IN, FFN, OUT = 8, 2048, 256, 128, 256
SPLITS = [300, 0, 257, 511, 64, 300, 200, 100]  # S = 1732 < T; an empty expert
BF16 = torch.bfloat16
SLEEP_CYCLES = 300_000_000  # ~0.15-0.2 s of GPU time: the host is long done before our kernels run


def _bits(t):
    return t.detach().contiguous().view(torch.int16 if t.element_size() == 2 else torch.int32)


def _flatten(result):
    """Every tensor of a call's result (grads are named tuples, possibly nested)."""
    if isinstance(result, torch.Tensor):
        return [result]
    if isinstance(result, (tuple, list)):
        return [t for r in result for t in _flatten(r)]
    return []


def _side_stream_run(workspace_bytes, calls):
    """Runs `calls(stream)` on a sleeping side stream while the current stream reuses freed
    memory at once; returns its results after both streams are done."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())  # the inputs are ready
    with torch.cuda.stream(side):
        torch.cuda._sleep(SLEEP_CYCLES)
    results = calls(side.cuda_stream)
    # Anything the calls freed and the current stream could take, taken and overwritten now.
    junk = [torch.zeros(workspace_bytes + 256, dtype=torch.uint8, device="cuda") for _ in range(16)]
    torch.cuda.synchronize()
    del junk
    return results


def _check_same(got, want):
    got, want = _flatten(got), _flatten(want)
    assert len(got) == len(want) and got
    for i, (a, b) in enumerate(zip(got, want)):
        assert a.shape == b.shape and torch.equal(_bits(a), _bits(b)), f"result {i} differs from the current-stream run"


@cuda
def test_grouped_linear_on_a_side_stream_keeps_its_memory_from_the_current_stream():
    torch.manual_seed(0)
    w = (torch.randn(G, OUT, IN, device="cuda") * 0.05).to(BF16)
    b = torch.randn(G, OUT, device="cuda").to(BF16)
    x = torch.randn(T, IN, device="cuda").to(BF16)
    dy = torch.randn(T, OUT, device="cuda").to(BF16)
    layer = sparsetrain.GroupedLinear(w, b)

    def calls(stream=None):
        kw = {} if stream is None else {"stream": stream}
        return layer.forward(x, SPLITS, **kw), layer.backward(x, dy, SPLITS, **kw)

    want = calls()
    torch.cuda.synchronize()
    _check_same(_side_stream_run(layer.workspace_size(T), calls), want)


@cuda
def test_grouped_mlp_on_a_side_stream_keeps_its_memory_from_the_current_stream():
    torch.manual_seed(1)
    w1 = (torch.randn(G, 2 * FFN, IN, device="cuda") * 0.05).to(BF16)
    w2 = (torch.randn(G, OUT, FFN, device="cuda") * 0.05).to(BF16)
    x = torch.randn(T, IN, device="cuda").to(BF16)
    probs = torch.rand(T, device="cuda")
    dy = torch.randn(T, OUT, device="cuda").to(BF16)
    mlp = sparsetrain.GroupedMLP(w1, w2)

    def calls(stream=None):
        kw = {} if stream is None else {"stream": stream}
        y, fc1_out = mlp.forward(x, SPLITS, probs, **kw)
        return y, fc1_out, mlp.backward(x, fc1_out, probs, dy, SPLITS, **kw)

    want = calls()
    torch.cuda.synchronize()
    _check_same(_side_stream_run(mlp.workspace_size(T), calls), want)
