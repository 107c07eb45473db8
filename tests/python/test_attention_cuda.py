"""GPU tests of block-sparse attention from torch (skipped, visibly, without a CUDA device or a
CUDA build): the CUDA forward against the library's CPU path on the same inputs (moved to the
host in fp32) for causal, sliding-window, document-causal (odd document lengths), full and
flex_attention bitmask masks, bf16 / fp16, D = 64 / 128, GQA 8:2, Sq != Skv, rows without keys,
strided [B, H, S, D] views, with outputs poisoned first (NaN never passes); bitwise determinism;
BlockMask.build on the device against the host build tensor by tensor (every kind, schedule and
sub-tile count), its capture in a CUDA graph (no host sync), BlockMask.to / from_torch on CUDA;
the CUDA backward's NotImplementedError (eager and under torch.compile); a mask on the wrong
device."""

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed: torch CUDA tests skipped")

import sparsetrain as st  # noqa: E402
import sparsetrain.torch as stt  # noqa: E402

if not torch.cuda.is_available():
    pytest.skip("no CUDA device (torch.cuda.is_available() is False): CUDA attention tests skipped",
                allow_module_level=True)
if not st.built_with_cuda():
    pytest.skip("sparsetrain was built without the CUDA backend: CUDA attention tests skipped",
                allow_module_level=True)

flex = pytest.importorskip("torch.nn.attention.flex_attention",
                           reason="torch.nn.attention.flex_attention is not available in this torch")

DEV = torch.device("cuda", torch.cuda.current_device())
# Relative error bounds of the CUDA output against the fp32 CPU path on the same (rounded)
# inputs: the output's own rounding plus P rounded to the input dtype for the PV product.
TOL = {torch.bfloat16: 3e-2, torch.float16: 5e-3}
LSE_TOL = 1e-3
BACKWARD_MESSAGE = r"the CUDA backward is not implemented yet \(issue 8\)"
TENSOR_NAMES = ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices", "q_num_blocks",
                "q_indices", "full_q_num_blocks", "full_q_indices", "dq_write_order", "dq_write_order_full",
                "partial_bitmasks", "doc_q", "doc_kv")


# -- inputs, reference, comparison -----------------------------------------------------------------


def _inputs(B, Hq, Hkv, Sq, Skv, D, dtype, layout="bhsd", seed=0):
    """q [B, Hq, Sq, D], k, v [B, Hkv, Skv, D] on the GPU in `layout`: "bhsd" (contiguous),
    "bshd" (transpose(1, 2) views of [B, S, H, D] storage), "padded" (the first D of D + 64
    columns: a row stride of D + 64), "packed_qkv" (views of one [B, S, 3, H, D] tensor; needs
    Hq == Hkv and Sq == Skv)."""
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, generator=gen).to(dtype).to(DEV)

    if layout == "bhsd":
        return rand(B, Hq, Sq, D), rand(B, Hkv, Skv, D), rand(B, Hkv, Skv, D)
    if layout == "bshd":
        return (rand(B, Sq, Hq, D).transpose(1, 2), rand(B, Skv, Hkv, D).transpose(1, 2),
                rand(B, Skv, Hkv, D).transpose(1, 2))
    if layout == "padded":
        return rand(B, Hq, Sq, D + 64)[..., :D], rand(B, Hkv, Skv, D + 64)[..., :D], rand(B, Hkv, Skv, D + 64)[..., :D]
    if layout == "packed_qkv":
        assert Hq == Hkv and Sq == Skv
        qkv = rand(B, Sq, 3, Hq, D)
        return tuple(qkv[:, :, i].transpose(1, 2) for i in range(3))
    raise AssertionError(layout)


def _reference(q, k, v, mask, scale=None):
    """The library's CPU path on the same values in fp32: (o, lse) on the host."""
    with torch.no_grad():
        return stt.block_sparse_attention(q.cpu().float(), k.cpu().float(), v.cpu().float(), mask.cpu(),
                                          scale=scale, return_lse=True)


def _poison(*nbytes):
    """Frees 0xFF-filled blocks of the sizes the library is about to allocate (each request is
    nbytes + 256: the allocator callback aligns inside it), so that torch's caching allocator
    hands them out again: an element the kernel leaves unwritten reads as NaN (0xFF.. is NaN in
    bf16, fp16 and fp32). Best effort: it relies on the allocator reusing a freed block of the
    same size on the same stream."""
    blocks = [torch.full((n + 256,), 0xFF, dtype=torch.uint8, device=DEV) for n in nbytes]
    del blocks


_KERNELS = {}


def _require_kernel(dtype, D):
    """Skips (visibly) a dtype / head dim this build has no CUDA kernel for (a MINIMAL CUTLASS
    build has bf16 D = 128 only); the library says so in its error."""
    if (dtype, D) not in _KERNELS:
        q = torch.zeros(1, 1, 128, D, dtype=dtype, device=DEV)
        try:
            stt.block_sparse_attention(q, q, q, st.BlockMask.build("causal", 128, device=DEV))
            _KERNELS[dtype, D] = None
        except ValueError as e:
            if "with a CUDA kernel in this build" not in str(e):
                raise
            _KERNELS[dtype, D] = str(e)
    if _KERNELS[dtype, D] is not None:
        pytest.skip(f"no CUDA kernel for {dtype} D = {D} in this build: {_KERNELS[dtype, D]}")


def _forward(q, k, v, mask, **kw):
    """The CUDA forward with its outputs poisoned first."""
    B, Hq, Sq, D = q.shape
    _poison(B * Sq * Hq * D * q.element_size(), B * Hq * Sq * 4)
    o, lse = stt.block_sparse_attention(q, k, v, mask, return_lse=True, **kw)
    torch.cuda.synchronize()
    return o, lse


def _close(got, ref, tol, what):
    assert got.device.type == "cuda", f"{what}: expected a CUDA result, got one on {got.device}"
    got = got.detach().cpu().double()
    ref = ref.detach().double()
    assert got.shape == ref.shape, f"{what}: shape {list(got.shape)} vs {list(ref.shape)}"
    assert not bool(torch.isnan(got).any()), f"{what}: {int(torch.isnan(got).sum())} NaN elements (unwritten?)"
    finite = torch.isfinite(ref)
    assert bool((torch.isfinite(got) == finite).all()), f"{what}: infinities differ"
    assert bool((got[~finite] == ref[~finite]).all()), f"{what}: infinities differ in sign"
    err = (got[finite] - ref[finite]).abs()
    bound = tol * (1 + ref[finite].abs())
    assert bool((err <= bound).all()), f"{what}: max error {err.max().item():.3e} (tol {tol:g} x (1 + |ref|))"


def _check(q, k, v, mask, scale=None):
    """The CUDA forward (mask moved to q's device) against the CPU path; rows without an allowed
    key must give o = 0 exactly and lse = -inf."""
    o, lse = _forward(q, k, v, mask.to(q.device), scale=scale)
    ro, rlse = _reference(q, k, v, mask, scale)
    assert o.shape == q.shape and o.dtype == q.dtype and lse.dtype == torch.float32
    assert lse.shape == q.shape[:3]
    _close(o, ro, TOL[q.dtype], "o")
    _close(lse, rlse, LSE_TOL, "lse")
    empty = torch.isneginf(rlse)
    if bool(empty.any()):
        assert bool((o.cpu()[empty] == 0).all()), "o: rows without an allowed key must be exactly 0"
    return o, lse


# -- masks -----------------------------------------------------------------------------------------


def _odd_documents(B, S, seed):
    """int32 document ids [B, S]: consecutive documents of random odd lengths (1..255), per batch row."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.empty(B, S, dtype=torch.int32)
    for b in range(B):
        s = d = 0
        while s < S:
            n = 2 * int(torch.randint(0, 128, (1,), generator=gen)) + 1
            ids[b, s:s + n] = d
            s, d = s + n, d + 1
    return ids


def _mod3(b, h, q, kv):
    return (q + kv) % 3 != 0


def _flex_document_causal(doc):
    def mask_mod(b, h, q, kv):
        return (doc[b, q] == doc[b, kv]) & (kv <= q)
    return mask_mod


# name: (mask builder, Sq, Skv). Masks use 128 x 128 blocks (the CUDA kernels need multiples of
# 128); sizes are not multiples of the block. Flex masks are built by create_block_mask on the GPU
# and converted there (from_torch keeps the flex mask's device).
MASKS = {
    "causal_300x517": (lambda: st.BlockMask.build("causal", 300, 517, framework="torch"), 300, 517),
    "causal_640": (lambda: st.BlockMask.build("causal", 640, framework="torch"), 640, 640),
    "causal_bottom_right_517x300": (  # the first 217 rows see no key
        lambda: st.BlockMask.build("causal_bottom_right", 517, 300, framework="torch"), 517, 300),
    "sliding_window_700": (lambda: st.BlockMask.build("sliding_window", 700, window_left=200, window_right=0,
                                                      framework="torch"), 700, 700),
    "sliding_window_two_sided_300x517": (
        lambda: st.BlockMask.build("sliding_window", 300, 517, window_left=150, window_right=60, framework="torch"),
        300, 517),
    "document_causal_odd_777": (
        lambda: st.BlockMask.build("document_causal", 777, document_ids=_odd_documents(2, 777, 1)), 777, 777),
    "full_300x517": (lambda: st.BlockMask.build("full", 300, 517, framework="torch"), 300, 517),
    "flex_bitmask_mod3_300x517": (
        lambda: st.BlockMask.from_torch(flex.create_block_mask(_mod3, None, None, 300, 517, device=DEV,
                                                               BLOCK_SIZE=128)), 300, 517),
    "flex_bitmask_document_causal_640": (
        lambda: st.BlockMask.from_torch(flex.create_block_mask(
            _flex_document_causal(_odd_documents(2, 640, 2).to(DEV)), 2, None, 640, 640, device=DEV,
            BLOCK_SIZE=128)), 640, 640),
}


# -- forward against the CPU path ------------------------------------------------------------------


@pytest.mark.parametrize("D", [64, 96, 128], ids=["D64", "D96", "D128"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("name", list(MASKS), ids=list(MASKS))
def test_forward_matches_the_cpu_path(name, dtype, D):
    _require_kernel(dtype, D)
    build, Sq, Skv = MASKS[name]
    mask = build()
    q, k, v = _inputs(2, 8, 2, Sq, Skv, D, dtype)  # GQA 8:2
    _check(q, k, v, mask)


@pytest.mark.parametrize("layout", ["bshd", "padded", "packed_qkv"])
def test_forward_strided_layouts(layout):
    """[B, H, S, D] views of other storage reach the kernels as they are (no copies)."""
    S, H, D = 640, 4, 128
    q, k, v = _inputs(2, H, H, S, S, D, torch.bfloat16, layout)
    assert not q.is_contiguous()
    _check(q, k, v, st.BlockMask.build("causal", S, framework="torch"))


def test_forward_mqa_and_scale():
    S, D = 384, 64
    _require_kernel(torch.float16, D)
    q, k, v = _inputs(1, 6, 1, S, S, D, torch.float16)
    _check(q, k, v, st.BlockMask.build("sliding_window", S, window_left=100, window_right=100), scale=0.2)


def test_forward_is_deterministic():
    _, Sq, Skv = MASKS["document_causal_odd_777"]
    mask = MASKS["document_causal_odd_777"][0]().to(DEV)
    q, k, v = _inputs(2, 8, 2, Sq, Skv, 128, torch.bfloat16)
    o1, lse1 = _forward(q, k, v, mask)
    for _ in range(3):
        o2, lse2 = _forward(q, k, v, mask)
        assert torch.equal(o1, o2) and torch.equal(lse1, lse2)


def test_array_api_forward_on_cuda_tensors():
    """sparsetrain.block_sparse_attention_forward (the framework-neutral API, [B, S, H, D]) on torch
    CUDA tensors: the same results as the torch front."""
    S = 300
    q, k, v = _inputs(1, 4, 2, S, S, 128, torch.bfloat16, "bshd")
    mask = st.BlockMask.build("causal", S, device=DEV)
    o, lse = st.block_sparse_attention_forward(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), mask)
    o2, lse2 = _forward(q, k, v, mask)
    assert o.device == DEV and torch.equal(o.transpose(1, 2), o2) and torch.equal(lse, lse2)


# -- block masks on the device ---------------------------------------------------------------------

# name: (kind, Sq, Skv, block_size, batch, params)
DEVICE_BUILDS = {
    "full": ("full", 300, 300, 128, 1, {}),
    "causal": ("causal", 1000, 1000, 128, 1, {}),
    "causal_bottom_right": ("causal_bottom_right", 333, 700, (64, 128), 1, {}),
    "sliding_window": ("sliding_window", 900, 900, (128, 64), 1, {"window_left": 200, "window_right": 0}),
    "sliding_window_two_sided": ("sliding_window", 513, 777, 64, 1, {"window_left": 100, "window_right": 50}),
    "document": ("document", 611, 611, 128, 3, {}),
    "document_causal": ("document_causal", 1031, 1031, 128, 2, {}),
    "prefix_lm": ("prefix_lm", 800, 800, 128, 1, {"prefix_length": 300}),
}


def _schedule(name, nk):
    if name == "permutation":
        return torch.randperm(nk, generator=torch.Generator().manual_seed(nk)).tolist()
    return name


def _assert_same_mask(dev, host, device=DEV):
    assert (dev.seq_q, dev.seq_kv, dev.block_q, dev.block_kv, dev.sub_tiles, dev.schedule, dev.spec.kind) == \
        (host.seq_q, host.seq_kv, host.block_q, host.block_kv, host.sub_tiles, host.schedule, host.spec.kind)
    if host.schedule_permutation is not None:
        assert torch.equal(torch.as_tensor(dev.schedule_permutation), torch.as_tensor(host.schedule_permutation))
    d, h = dev.tensors(), host.tensors()
    for name in TENSOR_NAMES:
        assert (d[name] is None) == (h[name] is None), name
        if h[name] is not None:
            want = torch.as_tensor(h[name]).cpu()
            assert d[name].device == device, f"{name} is on {d[name].device}"
            assert d[name].dtype == want.dtype and d[name].shape == want.shape, name
            assert torch.equal(d[name].cpu(), want), name


@pytest.mark.parametrize("sub_tiles", [1, 2])
@pytest.mark.parametrize("schedule", ["left_to_right", "shortest_first", "permutation"])
@pytest.mark.parametrize("name", list(DEVICE_BUILDS), ids=list(DEVICE_BUILDS))
def test_device_built_mask_equals_the_host_built_mask(name, schedule, sub_tiles):
    kind, Sq, Skv, bs, B, params = DEVICE_BUILDS[name]
    if kind.startswith("document"):
        params = {"document_ids": _odd_documents(B, Sq, 7)}
    nk = -(-Skv // (bs if isinstance(bs, int) else bs[1]))
    sched = _schedule(schedule, nk)
    host = st.BlockMask.build(kind, Sq, Skv, block_size=bs, schedule=sched, sub_tiles=sub_tiles,
                              framework="torch", **params)
    dev = st.BlockMask.build(kind, Sq, Skv, block_size=bs, schedule=sched, sub_tiles=sub_tiles, device="cuda",
                             **params)
    torch.cuda.synchronize()
    assert dev.framework == "torch" and dev.device == DEV
    _assert_same_mask(dev, host)
    dev.validate(B, 1)  # on a host copy
    assert dev.check_write_order() == ""


def test_device_build_defaults_and_arguments():
    S = 1000
    dev = st.BlockMask.build("causal", S, device=DEV)
    assert dev.schedule == "left_to_right"  # "auto" needs the host: the device default is explicit
    _assert_same_mask(dev, st.BlockMask.build("causal", S, schedule="left_to_right", framework="torch"))
    with pytest.raises(ValueError, match=r"schedule: expected 'left_to_right', 'shortest_first' or a permutation "
                                         r"for a build on cuda:\d+ \(\"auto\" runs the scheduler model on the host"):
        st.BlockMask.build("causal", S, device="cuda", schedule="auto")
    with pytest.raises(ValueError, match="device: expected 'cpu' for framework 'numpy'"):
        st.BlockMask.build("causal", S, device="cuda", framework="numpy")
    # Document ids from anywhere (host numpy, host or device torch, int64) are moved there as int32.
    doc = _odd_documents(2, S, 3)
    ref = st.BlockMask.build("document_causal", S, document_ids=doc, schedule="shortest_first")
    for ids in (doc.numpy(), doc.long(), doc.to(DEV), doc.long().to(DEV)):
        m = st.BlockMask.build("document_causal", S, document_ids=ids, schedule="shortest_first", device=DEV)
        assert m.spec.doc_q.device == DEV and m.spec.doc_q.dtype == torch.int32
        _assert_same_mask(m, ref)


def test_device_build_is_capturable_in_a_cuda_graph():
    """No host synchronisation: the build (explicit schedule) captures into a CUDA graph; a replay
    with other document ids in the same buffer rebuilds the mask for them."""
    S = 1031
    doc_a, doc_b = _odd_documents(2, S, 4), _odd_documents(2, S, 5)
    ids = doc_a.to(DEV)
    st.BlockMask.build("document_causal", S, document_ids=ids, schedule="shortest_first", device=DEV)  # warm-up
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        m = st.BlockMask.build("document_causal", S, document_ids=ids, schedule="shortest_first", device=DEV)
    for doc in (doc_a, doc_b):
        ids.copy_(doc)
        graph.replay()
        torch.cuda.synchronize()
        _assert_same_mask(m, st.BlockMask.build("document_causal", S, document_ids=doc, schedule="shortest_first"))


def test_device_built_mask_gives_the_same_attention_as_a_moved_host_mask():
    S = 777
    doc = _odd_documents(2, S, 6)
    q, k, v = _inputs(2, 8, 2, S, S, 128, torch.bfloat16)
    built = st.BlockMask.build("document_causal", S, document_ids=doc, device=DEV)
    moved = st.BlockMask.build("document_causal", S, document_ids=doc, schedule="left_to_right").to(DEV)
    o1, lse1 = _forward(q, k, v, built)
    o2, lse2 = _forward(q, k, v, moved)
    assert torch.equal(o1, o2) and torch.equal(lse1, lse2)


def test_block_mask_to_cuda_and_back():
    host = st.BlockMask.build("document_causal", 500, document_ids=_odd_documents(2, 500, 8), schedule=[3, 0, 2, 1],
                              framework="numpy")
    dev = host.to(DEV)
    assert dev.device == DEV and host.cuda().device == DEV and dev.to(DEV) is dev and dev.cuda() is dev
    assert dev.schedule_permutation.device.type == "cpu"
    _assert_same_mask(dev, host)
    back = dev.cpu()
    assert back.device == torch.device("cpu")
    _assert_same_mask(back, host, torch.device("cpu"))
    assert dev.to_numpy().kv_indices.tolist() == host.kv_indices.tolist()  # copied to the host
    ws = dev.with_schedule("shortest_first")  # rebuilt on a host copy, back on the device
    assert ws.device == DEV and ws.schedule == "shortest_first" and ws.check_write_order() == ""


@pytest.mark.parametrize("mask_mod,B", [(_mod3, None), ("document", 2)], ids=["mod3", "document_causal"])
def test_from_torch_on_a_cuda_flex_mask_gives_device_tensors(mask_mod, B):
    S = 640
    if mask_mod == "document":
        doc = _odd_documents(2, S, 9)
        mod_cpu, mod_dev = _flex_document_causal(doc), _flex_document_causal(doc.to(DEV))
    else:
        mod_cpu = mod_dev = mask_mod
    on_dev = st.BlockMask.from_torch(flex.create_block_mask(mod_dev, B, None, S, S, device=DEV, BLOCK_SIZE=128))
    on_host = st.BlockMask.from_torch(flex.create_block_mask(mod_cpu, B, None, S, S, device="cpu", BLOCK_SIZE=128))
    assert on_dev.device == DEV and on_host.device == torch.device("cpu")
    _assert_same_mask(on_dev, on_host)
    to_host = st.BlockMask.from_torch(flex.create_block_mask(mod_dev, B, None, S, S, device=DEV, BLOCK_SIZE=128),
                                      device="cpu")
    _assert_same_mask(to_host, on_host, torch.device("cpu"))


# -- what does not run (yet) -----------------------------------------------------------------------


def test_backward_raises_not_implemented():
    S = 300
    mask = st.BlockMask.build("causal", S, device=DEV)
    q, k, v = (t.requires_grad_() for t in _inputs(1, 4, 2, S, S, 128, torch.bfloat16))
    o = stt.block_sparse_attention(q, k, v, mask)  # the forward runs, and records a backward
    assert o.requires_grad
    with torch.no_grad():
        assert torch.equal(o.detach(), stt.block_sparse_attention(q, k, v, mask))
    with pytest.raises(NotImplementedError, match=BACKWARD_MESSAGE):
        o.sum().backward()
    assert q.grad is None and k.grad is None and v.grad is None


def test_torch_compile_fullgraph_forward_and_the_backward_error():
    S = 384
    mask = st.BlockMask.build("sliding_window", S, window_left=128, window_right=0, device=DEV)
    q, k, v = _inputs(2, 8, 2, S, S, 128, torch.bfloat16)

    @torch.compile(fullgraph=True)
    def attend(q, k, v):
        return stt.block_sparse_attention(q, k, v, mask)

    with torch.no_grad():
        eager = stt.block_sparse_attention(q, k, v, mask)
        assert torch.equal(attend(q, k, v), eager)
    # Compiling a training forward traces the backward without running it; running it raises.
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
    o = attend(qg, kg, vg)
    assert torch.equal(o.detach(), eager)
    with pytest.raises(NotImplementedError, match=BACKWARD_MESSAGE):
        o.sum().backward()


def test_mask_on_another_device_raises():
    S = 300
    q, k, v = _inputs(1, 2, 2, S, S, 128, torch.bfloat16)
    with pytest.raises(ValueError, match=r"block_mask.kv_num_blocks: expected a tensor on cuda:\d+ \(q's device\), "
                                         r"got cpu \(move the mask once with block_mask.to\(q.device\)"):
        stt.block_sparse_attention(q, k, v, st.BlockMask.build("causal", S))
    with pytest.raises(ValueError, match=r"k: expected a tensor on cuda:\d+ \(q's device\), got cpu"):
        stt.block_sparse_attention(q, k.cpu(), v, st.BlockMask.build("causal", S, device=DEV))
