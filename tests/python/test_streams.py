"""The array API's `stream=`: everything the library allocates for a call belongs to the stream its
kernels run on (seed 000's race). Kernels queued on a side stream behind a long sleep, while the
current stream at once allocates and zero-fills memory of every size the call allocated (torch's
allocator's trace): had anything the call freed gone back to the current stream's pool, the fill
would take it and our kernels, running later, would write into it (the filled memory must still
read zero) or read it after the fill. Results must be bitwise those of the same calls on the
current stream. GroupedLinear, GroupedMLP, the attention forward and backward over arrays, and
BlockMask.build on a CUDA device (whose stream is torch's current one; both of its routes). Also
the torch module's sticky status word of device splits read after CUDA-graph replays, a training
step's forward and backward on different streams, two layers' steps on concurrent streams, and a
layer never holding AccumulateGrad nodes made on a stream no longer current. GPU only: skipped
visibly without one (the attention without a Hopper GPU)."""

import contextlib

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed: stream tests skipped")

import sparsetrain  # noqa: E402
import sparsetrain.torch as stt  # noqa: E402
import sparsetrain.torch.native as stn  # noqa: E402
from training_steps import AttentionStep, LayerStep, assert_same  # noqa: E402

cuda = pytest.mark.skipif(not torch.cuda.is_available() or not sparsetrain.built_with_cuda(),
                          reason="no CUDA device (or a CPU-only build): stream tests skipped")
hopper = pytest.mark.skipif(
    not torch.cuda.is_available() or not sparsetrain.built_with_cuda() or torch.cuda.get_device_capability(0) != (9, 0),
    reason="no Hopper GPU (compute capability 9.0; or a CPU-only build): attention stream test skipped")

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


def _side_stream_run(sizes, calls):
    """Runs `calls(stream)` on a sleeping side stream while the current stream reuses freed
    memory at once (16 blocks of each of `sizes`, as torch's allocator handed them out);
    returns its results after both streams are done, once that memory is seen to be untouched by
    the calls' kernels."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())  # the inputs are ready
    with torch.cuda.stream(side):
        torch.cuda._sleep(SLEEP_CYCLES)
    results = calls(side.cuda_stream)
    assert not side.query(), "the side stream was done before the calls returned: the host waited, nothing raced"
    # Anything the calls freed and the current stream could take, taken and overwritten now.
    junk = [torch.zeros(n, dtype=torch.uint8, device="cuda") for n in sizes for _ in range(16)]
    torch.cuda.synchronize()
    written = sum(int(j.count_nonzero()) for j in junk)
    assert written == 0, (f"{written} bytes of memory the current stream took while the calls' kernels were pending "
                          "were written later: something the calls freed went back to the current stream's pool")
    del junk
    return results


def _recording_allocations(calls):
    """calls() on the current stream, and the sorted distinct sizes of every block torch's caching
    allocator handed out meanwhile (its trace): results and workspaces alike, whether the library
    asked through its allocator callback (Framework.allocate) or allocated in its C++ torch library."""
    torch.cuda.synchronize()
    torch.cuda.memory._record_memory_history("all", context=None, stacks="python")
    try:
        results = calls()
        trace = torch.cuda.memory._snapshot()["device_traces"][torch.cuda.current_device()]
    finally:
        torch.cuda.memory._record_memory_history(None)
    sizes = sorted({int(e["size"]) for e in trace if e["action"] == "alloc"})
    assert sizes, "the calls allocated nothing through torch's allocator: nothing to race on"
    torch.cuda.synchronize()
    return results, sizes


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

    want, sizes = _recording_allocations(calls)
    _check_same(_side_stream_run(sizes, calls), want)


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

    want, sizes = _recording_allocations(calls)
    _check_same(_side_stream_run(sizes, calls), want)


@hopper
def test_attention_arrays_on_a_side_stream_keep_their_memory_from_the_current_stream():
    """block_sparse_attention_forward and the deterministic backward over torch CUDA arrays
    ([B, S, H, D], GQA 8:2, a document-causal mask built on the device) with stream= a sleeping
    side stream: o, lse, dq, dk, dv bitwise those of the current stream's run, and no memory the
    current stream takes at once (every size the calls allocate) written by their kernels."""
    B, S, HQ, HKV, D = 2, 1000, 8, 2, 128
    gen = torch.Generator().manual_seed(2)
    q, k, v, do = (torch.randn(B, S, h, D, generator=gen).to(BF16).cuda() for h in (HQ, HKV, HKV, HQ))
    lengths = torch.tensor([1, 127, 128, 129, 300, 315])  # S = 1000: around the 128-row tile
    doc = torch.repeat_interleave(torch.arange(len(lengths), dtype=torch.int32), lengths)[None].cuda()
    mask = sparsetrain.BlockMask.build("document_causal", S, document_ids=doc, device="cuda")

    def calls(stream=None):
        kw = {} if stream is None else {"stream": stream}
        o, lse = sparsetrain.block_sparse_attention_forward(q, k, v, mask, **kw)
        return o, lse, sparsetrain.block_sparse_attention_backward(q, k, v, o, lse, do, mask, **kw)

    want, sizes = _recording_allocations(calls)
    _check_same(_side_stream_run(sizes, calls), want)


@cuda
@pytest.mark.parametrize("route", ["torch library", "_C"])
def test_block_mask_build_on_a_side_stream_keeps_its_memory_from_the_current_stream(route, monkeypatch):
    """BlockMask.build(..., device="cuda") with a sleeping side stream as torch's current stream
    (document_causal over device document ids, shortest-first schedule; a two-sided sliding
    window, "auto" schedule): every tensor of both masks bitwise those of the same builds on the
    current stream, and no memory the current stream takes at once written by the build's kernels.
    Through the C++ torch library (its own allocations), and through `_C` (the allocator callback),
    the route of an install without that library."""
    if route == "_C":
        monkeypatch.setattr(sparsetrain._block_mask, "_torch_library", lambda: None)
    B, S = 2, 3000
    gen = torch.Generator().manual_seed(3)
    doc = torch.empty(B, S, dtype=torch.int32)
    for b in range(B):  # consecutive documents of random odd lengths 1..255
        s = d = 0
        while s < S:
            n = 2 * int(torch.randint(0, 128, (1,), generator=gen)) + 1
            doc[b, s:s + n] = d
            s, d = s + n, d + 1
    doc = doc.cuda()

    def calls(stream=None):
        current = contextlib.nullcontext() if stream is None else torch.cuda.stream(torch.cuda.ExternalStream(stream))
        with current:
            masks = [sparsetrain.BlockMask.build("document_causal", S, document_ids=doc, schedule="shortest_first",
                                                 device="cuda"),
                     sparsetrain.BlockMask.build("sliding_window", S, window_left=500, window_right=100, device="cuda")]
        return [t for m in masks for t in m.tensors().values() if t is not None]

    want, sizes = _recording_allocations(calls)
    _check_same(_side_stream_run(sizes, calls), want)


@cuda
def test_splits_status_is_read_after_cuda_graph_replays():
    """The torch GroupedLinear's forward with CUDA m_splits captured in a CUDA graph. Each replay
    is queued behind a sleep after the new split values were copied (device to device) into the
    captured splits tensor, and the host must get past it while the GPU still sleeps (nothing
    synchronises); splits_status is read after. Valid splits: the word stays clear and the output
    is the eager one bitwise; invalid values: the bits set, the output zero; valid again: the bits
    stay (sticky) and the output is restored; after zero_(), clear again."""
    torch.manual_seed(4)
    m = stt.GroupedLinear(G, IN, OUT, bias=True, params_dtype=BF16, device="cuda")
    static_x = torch.randn(T, IN, device="cuda").to(BF16)
    splits = torch.tensor(SPLITS, device="cuda")
    valid = splits.clone()
    too_many = torch.tensor([T + 1] + [0] * (G - 1), device="cuda")  # sum T + 1 > T rows
    negative = torch.tensor([-1, 1] + [0] * (G - 2), device="cuda")
    status = m.splits_status
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.no_grad(), torch.cuda.stream(side):  # warm-up outside the graph, as torch.cuda.graph asks
        for _ in range(2):
            eager = m(static_x, splits)
    torch.cuda.current_stream().wait_stream(side)
    assert int(status) == 0
    graph = torch.cuda.CUDAGraph()
    with torch.no_grad(), torch.cuda.graph(graph):
        static_y = m(static_x, splits)
    assert m.splits_status.data_ptr() == status.data_ptr(), "the word the graph captured"

    def replay(values):
        stream = torch.cuda.current_stream()
        torch.cuda._sleep(SLEEP_CYCLES)
        splits.copy_(values)
        static_y.fill_(float("nan"))  # every row rewritten by a replay (rows >= S zeroed)
        graph.replay()
        seen = status.clone()  # read in stream order, right after the replay
        y = static_y.clone()
        assert not stream.query(), "the host waited for the GPU during the copy or the replay"
        torch.cuda.synchronize()
        return int(seen), y

    seen, y = replay(valid)
    assert seen == 0 and int(status) == 0, "valid splits leave the word clear"
    assert torch.equal(_bits(y), _bits(eager)), "valid replay vs the eager forward"
    seen, y = replay(too_many)
    assert seen == sparsetrain.SPLITS_SUM_EXCEEDS_ROWS, f"status {seen} after a replay of splits summing to T + 1"
    assert bool((y == 0).all()), "invalid splits empty every group"
    seen, y = replay(valid)
    assert seen == sparsetrain.SPLITS_SUM_EXCEEDS_ROWS, "sticky: a valid replay does not clear it"
    assert torch.equal(_bits(y), _bits(eager)), "valid replay after an invalid one"
    seen, y = replay(negative)
    assert seen == sparsetrain.SPLITS_SUM_EXCEEDS_ROWS | sparsetrain.SPLITS_NEGATIVE
    assert bool((y == 0).all()), "negative splits empty every group"
    status.zero_()
    seen, y = replay(valid)
    assert seen == 0, "cleared by the caller, clear after a valid replay"
    assert torch.equal(_bits(y), _bits(eager))


# -- autograd's stream semantics -------------------------------------------------------------------


def _serial_then(steps, run):
    """Each step's results on the current stream, one after the other, then `run(steps)`'s (the
    same steps on other streams): both lists of {name: tensor}, grads zeroed before each."""
    serial = []
    for s in steps:
        s.clear_grads()
        s.reset(poison=False)
        serial.append(s.results(s.step()))
    for s in steps:
        s.clear_grads()
        s.reset(poison=False)
    torch.cuda.synchronize()
    return serial, run(steps)


def _check_same_results(got, want):
    for g, w in zip(got, want):
        assert g.keys() == w.keys()
        for name in w:
            assert_same(name, g[name], w[name], "streams")


def _steps(op):
    return [AttentionStep(True)] if op == "attention" else [LayerStep(op, "fused")]


@cuda
@pytest.mark.parametrize("op", ["linear", "mlp", "moe", pytest.param("attention", marks=hopper)])
def test_forward_on_one_stream_backward_on_another_gives_the_serial_bits(op):
    """The forward on stream a behind a sleep, the backward called on stream b with an incoming
    gradient made there behind another sleep: autograd runs the backward's kernels on a after the
    gradient is ready; the results (main_grad included) are bitwise the serial ones."""
    def run(steps):
        (s,) = steps
        a, b = torch.cuda.Stream(), torch.cuda.Stream()
        a.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(a):
            torch.cuda._sleep(SLEEP_CYCLES)
            y = s.forward()
        b.wait_stream(a)
        with torch.cuda.stream(b):
            torch.cuda._sleep(SLEEP_CYCLES)
            grad = s.s["dy" if "dy" in s.s else "do"] * 1  # made on b, after its sleep
            if op == "moe":
                (y.out.float() * grad.float()).sum().add(y.score_sum.sum()).backward()
            else:
                y.backward(grad)
        torch.cuda.current_stream().wait_stream(b)
        return [s.results(y)]

    _check_same_results(*reversed(_serial_then(_steps(op), run)))


@cuda
def test_two_layers_on_two_streams_concurrently_give_the_serial_bits():
    """A GroupedLinear and a GroupedMLP (and the attention on a Hopper GPU) each run a training
    step on a stream of its own, the first behind a sleep so that they overlap: bitwise the results
    of the same steps run one after the other."""
    steps = [LayerStep("linear", "fused"), LayerStep("mlp", "delayed", seed=3)]
    if torch.cuda.get_device_capability(0) == (9, 0):
        steps.append(AttentionStep(False))  # the atomic dQ adds: only k, v compared bitwise below

    def run(steps):
        streams = [torch.cuda.Stream() for _ in steps]
        out = []
        for i, (s, stream) in enumerate(zip(steps, streams)):
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                if i == 0:
                    torch.cuda._sleep(SLEEP_CYCLES)
                out.append(s.results(s.step()))
        for stream in streams:
            torch.cuda.current_stream().wait_stream(stream)
        return out

    serial, concurrent = _serial_then(steps, run)
    for got, want in zip(concurrent, serial):
        got.pop("q.grad", None)  # nondeterministic attention: atomic dQ adds
        want.pop("q.grad", None)
    _check_same_results(concurrent, serial)


@cuda
def test_nodes_kept_on_an_old_stream_are_not_held_by_the_layer():
    """A layer holds its parameters' AccumulateGrad nodes between steps, taken again when the
    current stream changes. Nodes that something else keeps alive on the old stream (here a
    forward's graph, kept) must not be held: once that graph is gone, the next step's nodes are
    made on the current stream, and its backward raises no stream-mismatch warning (an error in
    these tests) and needs no wait on the old stream."""
    s = LayerStep("linear", "plain")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        kept = s.forward()  # its graph keeps the nodes, made on `side`
    torch.cuda.current_stream().wait_stream(side)
    warn = torch._C._warn_on_accumulate_grad_stream_mismatch()
    torch.autograd.graph.set_warn_on_accumulate_grad_stream_mismatch(False)
    try:
        s.step()  # on the current stream with side's nodes: the mismatch this test sets up
    finally:
        torch.autograd.graph.set_warn_on_accumulate_grad_stream_mismatch(warn)
    del kept
    s.step()
    assert stn.TORCH_OPS.grad_accumulators_on_current_stream(s.params), \
        "the layer still holds AccumulateGrad nodes of the side stream"
    torch.cuda.synchronize()
