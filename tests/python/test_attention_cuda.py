"""GPU tests of block-sparse attention from torch (skipped, visibly, without a CUDA device or a
CUDA build): the CUDA forward against the library's CPU path on the same inputs (moved to the
host in fp32) for causal, sliding-window, document-causal (odd document lengths), full and
flex_attention bitmask masks, bf16 / fp16, D = 64 / 128, GQA 8:2, Sq != Skv, rows without keys,
strided [B, H, S, D] views, with outputs poisoned first (NaN never passes); bitwise determinism;
BlockMask.build on the device against the host build tensor by tensor (every kind, schedule and
sub-tile count), its capture in a CUDA graph (no host sync), BlockMask.to / from_torch on CUDA;
FlashAttention's cu_seqlens converted on the device (equal to the host conversion, capturable,
attention bitwise equal to the document-id form);
the CUDA backward: o, dq, dk, dv against flex_attention's in fp32 (causal, sliding window,
document-causal (also documents of lengths 1..129 and 3000 mixed per batch row, Sq != Skv
documents, documents from cu_seqlens), a random bitmask mask from a flex mask_mod, Sq != Skv, rows
without keys; GQA
8:2, MQA, D = 64 / 96 / 128, bf16 / fp16, S = 1000; deterministic and not), bitwise reproducible
deterministic gradients (5 runs; any sm_limit, in a child process with a time limit against
deadlocks; strided layouts; the array API), every walk of the deterministic backward on sinks
beside a window (GQA; against flex, bitwise over sm_limit), torch.use_deterministic_algorithms(True) forcing the
deterministic backward, torch.compile(fullgraph=True) of forward + backward; bad sm_limit and a
mask on the wrong device."""

import contextlib
import math
import subprocess
import sys
import warnings

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed: torch CUDA tests skipped")

import sparsetrain as st  # noqa: E402
import sparsetrain.torch as stt  # noqa: E402
from op_log import OpLog  # noqa: E402

if not torch.cuda.is_available():
    pytest.skip("no CUDA device (torch.cuda.is_available() is False): CUDA attention tests skipped",
                allow_module_level=True)
if not st.built_with_cuda():
    pytest.skip("sparsetrain was built without the CUDA backend: CUDA attention tests skipped",
                allow_module_level=True)
if torch.cuda.get_device_capability(0) != (9, 0):
    pytest.skip(f"GPU 0 ({torch.cuda.get_device_name(0)}) is not a Hopper (compute capability 9.0): the sm_90a "
                "attention tests skipped", allow_module_level=True)

flex = pytest.importorskip("torch.nn.attention.flex_attention",
                           reason="torch.nn.attention.flex_attention is not available in this torch")

DEV = torch.device("cuda", torch.cuda.current_device())
# Relative error bounds of the CUDA output against the fp32 CPU path on the same (rounded)
# inputs: the output's own rounding plus P rounded to the input dtype for the PV product.
TOL = {torch.bfloat16: 3e-2, torch.float16: 5e-3}
LSE_TOL = 1e-3
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


def _length_documents(B, S, lengths):
    """int32 document ids [B, S] from document lengths cycled to fill each row, row b starting at
    lengths[b % n] (a different mix per row)."""
    ids = torch.empty(B, S, dtype=torch.int32)
    for b in range(B):
        s = d = 0
        while s < S:
            n = lengths[(b + d) % len(lengths)]
            ids[b, s:s + n] = d
            s, d = s + n, d + 1
    return ids


# Document lengths around the 128 tile, and one of 3000.
LENGTHS = [1, 2, 63, 64, 3000, 65, 127, 128, 129]
SHORT_LENGTHS = [1, 2, 63, 64, 65, 127, 128, 129]
KEY_LENGTHS = [129, 65, 1, 128, 2, 127, 63, 64]


def _cu_seqlens(lengths):
    return torch.tensor([0] + list(lengths), dtype=torch.int32).cumsum(0).to(torch.int32)


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
    assert (dev.seq_q, dev.seq_kv, dev.block_q, dev.block_kv, dev.schedule, dev.spec.kind) == \
        (host.seq_q, host.seq_kv, host.block_q, host.block_kv, host.schedule, host.spec.kind)
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


@pytest.mark.parametrize("schedule", ["left_to_right", "shortest_first", "permutation"])
@pytest.mark.parametrize("name", list(DEVICE_BUILDS), ids=list(DEVICE_BUILDS))
def test_device_built_mask_equals_the_host_built_mask(name, schedule):
    kind, Sq, Skv, bs, B, params = DEVICE_BUILDS[name]
    if kind.startswith("document"):
        params = {"document_ids": _odd_documents(B, Sq, 7)}
    nk = -(-Skv // (bs if isinstance(bs, int) else bs[1]))
    sched = _schedule(schedule, nk)
    host = st.BlockMask.build(kind, Sq, Skv, block_size=bs, schedule=sched, framework="torch",
                              **params)
    dev = st.BlockMask.build(kind, Sq, Skv, block_size=bs, schedule=sched, device="cuda", **params)
    torch.cuda.synchronize()
    assert dev.framework == "torch" and dev.device == DEV
    _assert_same_mask(dev, host)
    dev.validate(B, 1)  # on a host copy
    assert dev.check_write_order() == ""


def test_device_build_defaults_and_arguments():
    S = 1000
    dev = st.BlockMask.build("causal", S, device=DEV)
    # "auto" (the default, as on the host): left to right with the descending walk.
    assert (dev.schedule, dev.walk) == ("left_to_right", "descending_heads_inner")
    _assert_same_mask(dev, st.BlockMask.build("causal", S, schedule="left_to_right", framework="torch"))
    _assert_same_mask(st.BlockMask.build("causal", S, device="cuda", schedule="auto"), st.BlockMask.build("causal", S))
    with pytest.raises(ValueError, match="device: expected 'cpu' for framework 'numpy'"):
        st.BlockMask.build("causal", S, device="cuda", framework="numpy")
    # Document ids from anywhere (host numpy, host or device torch, int64) are moved there as int32.
    doc = _odd_documents(2, S, 3)
    ref = st.BlockMask.build("document_causal", S, document_ids=doc, schedule="shortest_first")
    for ids in (doc.numpy(), doc.long(), doc.to(DEV), doc.long().to(DEV)):
        m = st.BlockMask.build("document_causal", S, document_ids=ids, schedule="shortest_first", device=DEV)
        assert m.spec.doc_q.device == DEV and m.spec.doc_q.dtype == torch.int32
        _assert_same_mask(m, ref)
    # Without device=, ids on the GPU are built on there (no copy to the host), host ids on the host;
    # framework="numpy" always builds on the host.
    for ids, where in ((doc.to(DEV), DEV), (doc, torch.device("cpu"))):
        m = st.BlockMask.build("document_causal", S, document_ids=ids, schedule="shortest_first")
        assert m.device == where and m.spec.doc_q.device == where
        _assert_same_mask(m, ref, device=where)
    m = st.BlockMask.build("document_causal", S, doc_q=doc.to(DEV), doc_kv=doc.to(DEV), doc_padding=128)
    assert m.device == DEV and m.backward_padded.device == DEV
    m = st.BlockMask.build("document_causal", S, document_ids=doc.to(DEV), framework="numpy")
    assert m.device == "cpu" and not torch.is_tensor(m.kv_indices)


def test_device_built_document_masks_carry_the_padded_form_by_default():
    """doc_padding's default (None): a document mask built on the GPU with seq_q == seq_kv >= 1024
    and a left-to-right / shortest-first schedule carries its padded backward form at 1024, the
    same tensors as doc_padding=1024 asks for; 0 turns it off; host builds, shorter or unequal
    lengths and permutation schedules carry none."""
    S = 2500
    doc = _odd_documents(2, S, 9).to(DEV)
    for kind in ("document_causal", "document"):
        m = st.BlockMask.build(kind, S, document_ids=doc)
        want = st.BlockMask.build(kind, S, document_ids=doc, doc_padding=1024)
        assert m.backward_padded is not None and m.backward_padded.device == DEV
        got, exp = m.backward_padded.tensors(), want.backward_padded.tensors()
        assert set(got) == set(exp)
        for name in exp:
            if exp[name] is not None:
                assert torch.equal(got[name], exp[name]), name
        assert int((m.backward_padded.real_rows >= 0).sum()) == 2 * S
    assert st.BlockMask.build("document_causal", S, document_ids=doc, doc_padding=0).backward_padded is None
    assert st.BlockMask.build("document_causal", S, document_ids=doc.cpu()).backward_padded is None
    assert st.BlockMask.build("document_causal", 1000, document_ids=doc[:, :1000]).backward_padded is None
    assert st.BlockMask.build("document_causal", S, S + 1, doc_q=doc, doc_kv=torch.cat(
        [doc, doc[:, -1:]], 1)).backward_padded is None
    perm = torch.randperm(-(-S // 128)).tolist()
    assert st.BlockMask.build("document_causal", S, document_ids=doc, schedule=perm).backward_padded is None
    # Another schedule later: the form follows it, or is dropped for a permutation (no error).
    m = st.BlockMask.build("document_causal", S, document_ids=doc)
    sf = m.with_schedule("shortest_first")
    assert sf.backward_padded.schedule == "shortest_first" and sf.backward_padded.device == DEV
    assert m.with_schedule(perm).backward_padded is None


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


# -- FlashAttention's packed documents (cu_seqlens) on the device --------------------------------------


@pytest.mark.parametrize("causal", [False, True], ids=["document", "document_causal"])
def test_cu_seqlens_on_the_device_equal_the_host_conversion_and_mask(causal):
    """Offsets on the GPU: ids converted there (no host read) equal the host conversion, and
    BlockMask.from_cu_seqlens builds the host builder's mask there; Sq != Skv with other key
    documents too."""
    for lq, lk, Sq, Skv in ((LENGTHS + [0, 5], LENGTHS + [0, 5], 3700, 3700),
                            (SHORT_LENGTHS, KEY_LENGTHS, 700, 1000)):
        cu_q, cu_k = _cu_seqlens(lq), _cu_seqlens(lk)
        dev_ids = st.document_ids_from_cu_seqlens(cu_q.to(DEV), cu_k.to(DEV), Sq, Skv)
        host_ids = st.document_ids_from_cu_seqlens(cu_q, cu_k, Sq, Skv)
        for d, h in zip(dev_ids, host_ids):
            assert d.device == DEV and d.dtype == torch.int32 and torch.equal(d.cpu(), h)
        m = st.BlockMask.from_cu_seqlens(cu_q.to(DEV), cu_k.to(DEV), max(lq), max(lk), seq_q=Sq, seq_kv=Skv,
                                         causal=causal)
        assert m.device == DEV and m.schedule == "left_to_right"
        kind = "document_causal" if causal else "document"
        _assert_same_mask(m, st.BlockMask.build(kind, Sq, Skv, doc_q=host_ids[0], doc_kv=host_ids[1],
                                                schedule="left_to_right"))


def test_cu_seqlens_conversion_and_build_are_capturable_in_a_cuda_graph():
    """No host synchronisation: converting the offsets and building the mask capture into a CUDA
    graph; a replay with other offsets (same document count) in the same buffer rebuilds both."""
    S = 1031
    cu_a, cu_b = _cu_seqlens([1, 2, 63, 64, 65, 127, 128, 129, 400]), _cu_seqlens([300, 129, 1, 500, 2, 63, 0, 1, 35])
    cu = cu_a.to(DEV)
    st.BlockMask.from_cu_seqlens(cu, seq_q=S, causal=True)  # warm-up
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        m = st.BlockMask.from_cu_seqlens(cu, seq_q=S, causal=True)
    for offsets in (cu_a, cu_b):
        cu.copy_(offsets)
        graph.replay()
        torch.cuda.synchronize()
        doc_q, doc_kv = st.document_ids_from_cu_seqlens(offsets, offsets, S, S)
        assert torch.equal(m.spec.doc_q.cpu(), doc_q) and torch.equal(m.spec.doc_kv.cpu(), doc_kv)
        _assert_same_mask(m, st.BlockMask.build("document_causal", S, doc_q=doc_q, doc_kv=doc_kv,
                                                schedule="left_to_right"))


def test_cu_seqlens_attention_equals_the_document_id_form_bitwise():
    """The forward and the deterministic backward through a mask from device cu_seqlens equal,
    bit for bit, those through the same documents given as (relabelled) ids; padded rows give
    o = 0 and lse = -inf."""
    _require_kernel(torch.bfloat16, 128)
    lengths = [1, 2, 63, 64, 0, 65, 127, 128, 129, 3000]
    S = sum(lengths) + 121
    cu = _cu_seqlens(lengths).to(DEV)
    ids = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths)) * 7 + 3
    doc_q = torch.cat([ids, torch.full((121,), -1)])[None].to(DEV)
    doc_kv = torch.cat([ids, torch.full((121,), -2)])[None].to(DEV)
    packed = st.BlockMask.from_cu_seqlens(cu, cu, 3000, 3000, seq_q=S, causal=True)
    by_ids = st.BlockMask.build("document_causal", S, doc_q=doc_q, doc_kv=doc_kv, device=DEV)
    q, k, v, do = _grad_inputs(1, 8, 2, S, S, 128, torch.bfloat16)
    a, b = _grads(q, k, v, do, packed), _grads(q, k, v, do, by_ids)
    for what, x, y in zip(("o", "dq", "dk", "dv"), a, b):
        assert torch.equal(x, y), what
    o, lse = _forward(q, k, v, packed)
    assert bool(torch.isneginf(lse[..., S - 121:]).all()) and bool((o[:, :, S - 121:] == 0).all())
    assert bool(torch.isfinite(lse[..., :S - 121]).all())


def test_block_mask_to_cuda_and_back():
    host = st.BlockMask.build("document_causal", 500, document_ids=_odd_documents(2, 500, 8), schedule=[3, 0, 2, 1],
                              framework="numpy")
    dev = host.to(DEV)
    assert dev.device == DEV and host.cuda().device == DEV and dev.to(DEV) is dev and dev.cuda() is dev
    assert dev.schedule_permutation.device.type == "cpu"
    _assert_same_mask(dev, host)
    # One copy a move: every tensor a view of one buffer, at a multiple of 256 bytes from its start (on the
    # device, whose buffers the caching allocator aligns, at a 256-byte address).
    for m in (dev, dev.cpu()):
        tensors = [t for t in m.tensors().values() if t is not None]
        assert len({t.untyped_storage().data_ptr() for t in tensors}) == 1
        assert all((t.data_ptr() - t.untyped_storage().data_ptr()) % 256 == 0 for t in tensors)
    assert all(t.data_ptr() % 256 == 0 for t in dev.tensors().values() if t is not None)
    back = dev.cpu()
    assert back.device == torch.device("cpu")
    _assert_same_mask(back, host, torch.device("cpu"))
    assert dev.to_numpy().kv_indices.tolist() == host.kv_indices.tolist()  # copied to the host
    ws = dev.with_schedule("shortest_first")  # rebuilt on a host copy, back on the device
    assert ws.device == DEV and ws.schedule == "shortest_first" and ws.check_write_order() == ""


@pytest.mark.parametrize("mask_mod,B", [(_mod3, None), ("document", 2)], ids=["mod3", "document_causal"])
def test_from_torch_on_a_cuda_flex_mask_gives_device_tensors(mask_mod, B, monkeypatch):
    S = 640
    if mask_mod == "document":
        doc = _odd_documents(2, S, 9)
        mod_cpu, mod_dev = _flex_document_causal(doc), _flex_document_causal(doc.to(DEV))
    else:
        mod_cpu = mod_dev = mask_mod
    fm_dev = flex.create_block_mask(mod_dev, B, None, S, S, device=DEV, BLOCK_SIZE=128)
    on_dev = st.BlockMask.from_torch(fm_dev)
    on_host = st.BlockMask.from_torch(flex.create_block_mask(mod_cpu, B, None, S, S, device="cpu", BLOCK_SIZE=128))
    assert on_dev.device == DEV and on_host.device == torch.device("cpu")
    _assert_same_mask(on_dev, on_host)
    # Built on the host and moved in one copy (the torch library's route): every list a view of one buffer, at
    # 256-byte offsets. The route without the library (through `_C`) gives the same mask.
    lists = [t for n, t in on_dev.tensors().items() if t is not None and n != "partial_bitmasks"]
    assert len({t.untyped_storage().data_ptr() for t in lists}) == 1
    assert all((t.data_ptr() - t.untyped_storage().data_ptr()) % 256 == 0 for t in lists)
    monkeypatch.setattr(sys.modules["sparsetrain._block_mask"], "_TORCH_LIBRARY", [None])
    _assert_same_mask(st.BlockMask.from_torch(fm_dev), on_host)
    to_host = st.BlockMask.from_torch(flex.create_block_mask(mod_dev, B, None, S, S, device=DEV, BLOCK_SIZE=128),
                                      device="cpu")
    _assert_same_mask(to_host, on_host, torch.device("cpu"))


# -- backward against flex_attention ---------------------------------------------------------------

# Gradient error bounds per element (_close_per_element), against flex_attention in fp32 on the
# same (rounded) inputs: P and dS are rounded to the input dtype for the tensor-core products, the
# gradients once more at the end, so each element may be off by a few unit roundoffs of the sum of
# |terms| it adds up (_abs_sums) and of its own magnitude, never by a share of the tensor's maximum.
GRAD_S = 1000  # not a multiple of the 128-row block


def _random_blocks(B, H, Sq, Skv, seed):
    """A flex mask_mod with random structure at two scales, per (b, h): a 128 x 128 table (about
    40% of the blocks empty) and, inside, a 32 x 32 one (each cell allowed with p = 0.95: about
    44% of the remaining blocks full, the others partial, i.e. bitmasks)."""
    gen = torch.Generator().manual_seed(seed)
    coarse = (torch.rand(B, H, -(-Sq // 128), -(-Skv // 128), generator=gen) < 0.6).to(DEV)
    fine = (torch.rand(B, H, -(-Sq // 32), -(-Skv // 32), generator=gen) < 0.95).to(DEV)

    def mask_mod(b, h, q, kv):
        return coarse[b, h, q // 128, kv // 128] & fine[b, h, q // 32, kv // 32]
    return mask_mod


def _grad_case(name, B, H, S):
    """(our mask on DEV, flex mask_mod, flex's B and H (None: broadcast), Sq, Skv) for a mask
    name: ours from our builders (or from_torch for the bitmask one), flex's the same mask."""
    if name == "causal":
        return st.BlockMask.build("causal", S, device=DEV), lambda b, h, q, kv: q >= kv, None, None, S, S
    if name == "sliding_window":
        w = 256
        return (st.BlockMask.build("sliding_window", S, window_left=w, window_right=0, device=DEV),
                lambda b, h, q, kv: (q >= kv) & (q - kv <= w), None, None, S, S)
    if name == "sliding_window_two_sided_Sq_ne_Skv":
        Skv, left, right = S + 300, 200, 100
        return (st.BlockMask.build("sliding_window", S, Skv, window_left=left, window_right=right, device=DEV),
                lambda b, h, q, kv: (kv >= q - left) & (kv <= q + right), None, None, S, Skv)
    if name == "causal_bottom_right_empty_rows":  # Sq > Skv: the first Sq - Skv rows see no key
        Skv = 3 * S // 5
        return (st.BlockMask.build("causal_bottom_right", S, Skv, device=DEV),
                lambda b, h, q, kv: kv <= q - (S - Skv), None, None, S, Skv)
    if name == "document_causal":
        doc = _odd_documents(B, S, 11)
        doc_dev = doc.to(DEV)
        return (st.BlockMask.build("document_causal", S, document_ids=doc, device=DEV),
                _flex_document_causal(doc_dev), B, None, S, S)
    if name == "document_causal_lens1to3000":  # S = 3700 whatever S says: the 3000 must fit
        doc = _length_documents(B, 3700, LENGTHS)
        return (st.BlockMask.build("document_causal", 3700, document_ids=doc, device=DEV),
                _flex_document_causal(doc.to(DEV)), B, None, 3700, 3700)
    if name == "document_Sq_ne_Skv_lens":  # other key documents: the k-th query one meets the k-th key one
        Skv = S + 300
        doc_q, doc_kv = _length_documents(B, S, SHORT_LENGTHS), _length_documents(B, Skv, KEY_LENGTHS)
        dq_dev, dkv_dev = doc_q.to(DEV), doc_kv.to(DEV)
        return (st.BlockMask.build("document", S, Skv, doc_q=doc_q, doc_kv=doc_kv, device=DEV),
                lambda b, h, q, kv: dq_dev[b, q] == dkv_dev[b, kv], B, None, S, Skv)
    if name == "document_causal_cu_seqlens":  # one packed row of documents (broadcast over B), padded
        lengths = [1, 2, 63, 64, 0, 65, 127, 128, 129, S - 700]
        cu = _cu_seqlens(lengths).to(DEV)
        ids = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
        doc = torch.cat([ids, torch.full((S - len(ids),), -1)]).to(DEV)

        def mod(b, h, q, kv):
            return (doc[q] == doc[kv]) & (doc[q] >= 0) & (kv <= q)
        return st.BlockMask.from_cu_seqlens(cu, seq_q=S, causal=True), mod, None, None, S, S
    if name == "random_bitmask_every_block":  # each element allowed with p = 1/2: every block partial
        allowed = (torch.rand(B, H, S, S, generator=torch.Generator().manual_seed(13)) < 0.5).to(DEV)

        def mod(b, h, q, kv):
            return allowed[b, h, q, kv]
        fm = flex.create_block_mask(mod, B, H, S, S, device=DEV, BLOCK_SIZE=128)
        return st.BlockMask.from_torch(fm), mod, B, H, S, S
    if name == "random_bitmask":
        mod = _random_blocks(B, H, S, S, 12)
        fm = flex.create_block_mask(mod, B, H, S, S, device=DEV, BLOCK_SIZE=128)
        return st.BlockMask.from_torch(fm), mod, B, H, S, S
    raise AssertionError(name)


GRAD_MASKS = ["causal", "sliding_window", "document_causal", "random_bitmask", "sliding_window_two_sided_Sq_ne_Skv",
              "causal_bottom_right_empty_rows", "document_causal_lens1to3000", "document_Sq_ne_Skv_lens",
              "document_causal_cu_seqlens"]


def _flex_reference(q, k, v, do, mask_mod, B, H, Sq, Skv, scale=None):
    """flex_attention (eager: the unfused implementation, fp32 matmuls) on q, k, v, do upcast to
    fp32, with a block mask from the same mask_mod: (o, dq, dk, dv) in fp32."""
    fm = flex.create_block_mask(mask_mod, B, H, Sq, Skv, device=DEV, BLOCK_SIZE=128)
    qf, kf, vf = (t.detach().float().requires_grad_() for t in (q, k, v))
    limits = {n: 1 << 20 for n in ("recompile_limit", "accumulated_recompile_limit")
              if hasattr(torch._dynamo.config, n)}  # eager flex traces once per mask_mod and shape
    with warnings.catch_warnings(), torch._dynamo.config.patch(**limits):
        warnings.simplefilter("ignore")
        o = flex.flex_attention(qf, kf, vf, block_mask=fm, scale=scale, enable_gqa=q.shape[1] != k.shape[1])
        dq, dk, dv = torch.autograd.grad(o, (qf, kf, vf), do.float())
    return o.detach(), dq, dk, dv


_UNIT_ROUNDOFF = {torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11}


_ABS_SUM_ROWS = 1024  # query rows per step of _abs_sums: float64 temporaries of [rows, key columns]


def _abs_sums(q, k, v, do, mask_mod, B, H, Sq, Skv, scale=None):
    """Per element, in float64, the sum of |terms| each of o, dq, dk and dv adds up: the scale of
    its rounding error in a kernel that rounds P and dS to the input dtype and sums in fp32.
    o_i = sum_j P_ij v_j; dv_j = sum_i P_ij do_i; dq_i = scale sum_j dS_ij k_j, dk_j = scale
    sum_i dS_ij q_i with dS_ij = P_ij (dP_ij - Delta_i), dP_ij = do_i.v_j (fp32: exact enough),
    so each dS term counts A_ij = P_ij (|dP_ij - Delta_i| + |do_i|.|o_i|): dS rounded, and Delta
    computed from a rounded o. One (batch, head) and _ABS_SUM_ROWS query rows at a time, over the
    key columns the chunk's rows may see (mask_mod, flex's B and H (None: broadcast), evaluated on
    the chunk's index grid): a 128k-token row of short documents costs what its documents do."""
    Bq, Hq, _, D = q.shape
    group = Hq // k.shape[1]
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    sums = [torch.zeros(t.shape, dtype=torch.float64, device=DEV) for t in (q, q, k, v)]  # o, dq, dk, dv
    counts = [torch.zeros_like(t) for t in sums]  # the same sums with every p, dS term taken as 1
    kv_idx = torch.arange(Skv, device=DEV)
    for b in range(Bq):
        for h in range(Hq):
            hk = h // group
            qq, kk, vv, dd = (t[b, hh].double() for t, hh in ((q, h), (k, hk), (v, hk), (do, h)))
            for r0 in range(0, Sq, _ABS_SUM_ROWS):
                r1 = min(Sq, r0 + _ABS_SUM_ROWS)
                rows = torch.arange(r0, r1, device=DEV)
                allowed = torch.broadcast_to(mask_mod(b if B else 0, h if H else 0, rows[:, None], kv_idx[None, :]),
                                             (r1 - r0, Skv))
                cols = allowed.any(0).nonzero()
                if cols.numel() == 0:
                    continue  # no row of the chunk sees a key: every term is 0
                c0, c1 = int(cols[0]), int(cols[-1]) + 1
                allowed = allowed[:, c0:c1]
                qc, dc, kc, vc = qq[r0:r1], dd[r0:r1], kk[c0:c1], vv[c0:c1]
                p = torch.softmax((scale * qc @ kc.T).masked_fill(~allowed, float("-inf")), -1).nan_to_num(0.0)
                o = p @ vc
                delta = (dc * o).sum(-1, keepdim=True)
                a = p * ((dc @ vc.T - delta).abs() + (dc.abs() * o.abs()).sum(-1, keepdim=True))
                sums[0][b, h, r0:r1] += p @ vc.abs()
                sums[1][b, h, r0:r1] += scale * a @ kc.abs()
                sums[2][b, hk, c0:c1] += scale * a.T @ qc.abs()
                sums[3][b, hk, c0:c1] += p.T @ dc.abs()
                ones = allowed.double()
                counts[0][b, h, r0:r1] += ones @ vc.abs()
                counts[1][b, h, r0:r1] += scale * ones @ kc.abs()
                counts[2][b, hk, c0:c1] += scale * ones.T @ qc.abs()
                counts[3][b, hk, c0:c1] += ones.T @ dc.abs()
    return sums, counts


def _per_element_bound(ref, abs_sum, count_sum, dtype):
    """2 u abs_sum + 2 u |ref| + s (count_sum + 1) per element (u: the unit roundoff of dtype, s:
    its smallest subnormal): twice the first-order worst case of one rounding per term (P or dS
    to the input dtype, off by at most u |x| + s / 2 each) plus the output's own rounding; fp32
    accumulation adds orders of magnitude less. The s terms matter only where values underflow to
    subnormals (fp16 below 6e-5), where rounding is absolute, not relative. float64 tensors on
    ref's device; the one rule every gradient check of this file applies."""
    u = _UNIT_ROUNDOFF[dtype]
    s = torch.finfo(dtype).smallest_normal * torch.finfo(dtype).eps
    return 2 * u * abs_sum + 2 * u * ref.abs() + s * (count_sum + 1)


def _close_per_element(got, ref, abs_sum, count_sum, dtype, what, ref_from_kernel=False):
    """|got - ref| <= _per_element_bound per element; NaN and inf never pass. ref_from_kernel: ref
    is another run of our kernels (another sm_limit or the deterministic backward), not the fp32
    reference: each of the two lies within its bound of the exact value, so the bound is doubled."""
    assert got.device.type == "cuda", f"{what}: expected a CUDA result, got one on {got.device}"
    assert got.shape == ref.shape, f"{what}: shape {list(got.shape)} vs {list(ref.shape)}"
    got, ref = got.detach().double(), ref.detach().double().to(got.device)
    assert bool(torch.isfinite(ref).all()), f"{what}: the reference is not finite"
    assert bool(torch.isfinite(got).all()), f"{what}: {int((~torch.isfinite(got)).sum())} NaN / inf elements"
    err, bound = (got - ref).abs(), _per_element_bound(ref, abs_sum, count_sum, dtype)
    if ref_from_kernel:
        bound = 2 * bound
    bad = err > bound
    if bool(bad.any()):
        i = int((err - bound).flatten().argmax())
        raise AssertionError(f"{what}: {int(bad.sum())} elements past their bound; worst at flat index {i}: "
                             f"|{got.flatten()[i].item():.6g} - {ref.flatten()[i].item():.6g}| > "
                             f"{bound.flatten()[i].item():.3e}")


def _grads(q, k, v, do, mask, **kw):
    """Our forward and backward on fresh leaves of q, k, v: (o, dq, dk, dv), synchronised."""
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    o = stt.block_sparse_attention(q, k, v, mask, **kw)
    dq, dk, dv = torch.autograd.grad(o, (q, k, v), do)
    torch.cuda.synchronize()
    return o.detach(), dq, dk, dv


def _grad_inputs(B, Hq, Hkv, Sq, Skv, D, dtype, layout="bhsd", seed=0):
    q, k, v = _inputs(B, Hq, Hkv, Sq, Skv, D, dtype, layout, seed)
    gen = torch.Generator().manual_seed(seed + 1000)
    do = torch.randn(B, Hq, Sq, D, generator=gen).to(dtype).to(DEV)
    return q, k, v, do


def _check_grads(name, dtype, D, Hq, Hkv, B=2, S=GRAD_S, **kw):
    mask, mod, fB, fH, Sq, Skv = _grad_case(name, B, Hq, S)
    q, k, v, do = _grad_inputs(B, Hq, Hkv, Sq, Skv, D, dtype)
    got = _grads(q, k, v, do, mask, **kw)
    ref = _flex_reference(q, k, v, do, mod, fB, fH, Sq, Skv, kw.get("scale"))
    sums, counts = _abs_sums(q, k, v, do, mod, fB, fH, Sq, Skv, kw.get("scale"))
    for what, g, r, a, c in zip(("o", "dq", "dk", "dv"), got, ref, sums, counts):
        assert g.dtype == dtype and g.shape == r.shape, what
        _close_per_element(g, r, a, c, dtype, what)
    return got


@pytest.mark.parametrize("deterministic", [True, False], ids=["det", "nondet"])
@pytest.mark.parametrize("D", [64, 128], ids=["D64", "D128"])
@pytest.mark.parametrize("name", GRAD_MASKS, ids=GRAD_MASKS)
def test_backward_matches_flex_attention(name, D, deterministic):
    """bf16, GQA 8:2, B = 2, S = 1000: o, dq, dk, dv against flex_attention's in fp32."""
    _require_kernel(torch.bfloat16, D)
    _check_grads(name, torch.bfloat16, D, 8, 2, deterministic=deterministic)


@pytest.mark.parametrize("D", [64, 128], ids=["D64", "D128"])
def test_backward_bitmask_in_its_workspace_or_in_dq(D):
    """A bitmask with every block partial, S = 1536: its transposed copy (2 KiB a block, 24 KiB a q
    block row) is larger than dq's rows at D = 64 (16 KiB) and stays in the backward's workspace;
    at D = 128 (32 KiB) it goes into dq's bytes with lse_log2 and delta (BwdScratch, checked on the
    CPU by test_attention_bwd_plan). Both against flex, both modes."""
    _require_kernel(torch.bfloat16, D)
    for deterministic in (True, False):
        _check_grads("random_bitmask_every_block", torch.bfloat16, D, 8, 2, S=1536, deterministic=deterministic)


@pytest.mark.parametrize("dtype,D,Hq,Hkv,name", [
    (torch.float16, 128, 4, 4, "causal"),
    (torch.float16, 64, 6, 1, "document_causal"),  # MQA
    (torch.bfloat16, 96, 4, 4, "sliding_window"),
    (torch.float16, 96, 8, 2, "random_bitmask"),
], ids=["fp16_D128_mha_causal", "fp16_D64_mqa_document_causal", "bf16_D96_mha_window", "fp16_D96_gqa_bitmask"])
def test_backward_other_dtypes_head_dims_and_head_ratios(dtype, D, Hq, Hkv, name):
    _require_kernel(dtype, D)
    _check_grads(name, dtype, D, Hq, Hkv)


def test_backward_scale_and_single_batch():
    _require_kernel(torch.bfloat16, 128)
    _check_grads("causal", torch.bfloat16, 128, 4, 2, B=1, S=517, scale=0.3)


def test_backward_rows_without_keys_get_zero_gradients():
    """Sq > Skv bottom-right causal: the first Sq - Skv query rows see no key, so o, lse and dq
    there are exactly 0 (resp. -inf), and nothing is NaN."""
    _require_kernel(torch.bfloat16, 128)
    mask, _, _, _, Sq, Skv = _grad_case("causal_bottom_right_empty_rows", 2, 8, GRAD_S)
    q, k, v, do = _grad_inputs(2, 8, 2, Sq, Skv, 128, torch.bfloat16)
    for det in (True, False):
        o, dq, dk, dv = _grads(q, k, v, do, mask, deterministic=det)
        empty = Sq - Skv
        assert bool((o[:, :, :empty] == 0).all()) and bool((dq[:, :, :empty] == 0).all())
        for t in (o, dq, dk, dv):
            assert bool(torch.isfinite(t).all())


@pytest.mark.parametrize("layout", ["bshd", "padded"])
def test_backward_strided_layouts_give_the_same_gradients(layout):
    """[B, H, S, D] views of other storage (and a transposed dout): bitwise the same deterministic
    gradients as contiguous inputs."""
    S, D = 640, 128
    mask = st.BlockMask.build("causal", S, device=DEV)
    q, k, v, do = _grad_inputs(2, 8, 2, S, S, D, torch.bfloat16)
    ref = _grads(q, k, v, do, mask)
    sq, sk, sv, _ = _grad_inputs(2, 8, 2, S, S, D, torch.bfloat16, layout)
    for dst, src in ((sq, q), (sk, k), (sv, v)):
        dst.copy_(src)
    assert not sq.is_contiguous()
    do_t = do.transpose(1, 2).contiguous().transpose(1, 2)
    got = _grads(sq, sk, sv, do_t, mask)
    for what, g, r in zip(("o", "dq", "dk", "dv"), got, ref):
        assert torch.equal(g, r), what


def test_array_api_backward_on_cuda_tensors():
    """sparsetrain.block_sparse_attention_backward (the framework-neutral API, [B, S, H, D]) on
    torch CUDA tensors, with sm_limit: bitwise the torch front's deterministic gradients."""
    S = 777
    mask = st.BlockMask.build("document_causal", S, document_ids=_odd_documents(2, S, 13), device=DEV)
    q, k, v, do = _grad_inputs(2, 8, 2, S, S, 128, torch.bfloat16)
    o, dq, dk, dv = _grads(q, k, v, do, mask)
    t = [x.transpose(1, 2) for x in (q, k, v)]
    o2, lse2 = st.block_sparse_attention_forward(*t, mask, sm_limit=3)
    g = st.block_sparse_attention_backward(*t, o2, lse2, do.transpose(1, 2), mask, deterministic=True, sm_limit=5)
    torch.cuda.synchronize()
    assert torch.equal(o2.transpose(1, 2), o)
    for what, a, b in zip(("dq", "dk", "dv"), g, (dq, dk, dv)):
        assert a.device == DEV and torch.equal(a.transpose(1, 2), b), what


# -- the deterministic backward --------------------------------------------------------------------


@pytest.mark.parametrize("name", ["causal", "document_causal", "random_bitmask"])
def test_deterministic_backward_is_bitwise_reproducible(name):
    """5 backward runs of the same inputs: dq, dk, dv bitwise equal (many kv columns add into each
    q block: S = 3000, GQA 8:2)."""
    S = 3000
    mask = _grad_case(name, 2, 8, S)[0]
    q, k, v, do = _grad_inputs(2, 8, 2, S, S, 128, torch.bfloat16, seed=3)
    first = _grads(q, k, v, do, mask, deterministic=True)
    for t in first:
        assert bool(torch.isfinite(t).all())
    for run in range(4):
        again = _grads(q, k, v, do, mask, deterministic=True)
        for what, a, b in zip(("o", "dq", "dk", "dv"), again, first):
            assert torch.equal(a, b), f"run {run + 2}: {what} differs from run 1"


@pytest.mark.parametrize("walk", ["descending_heads_inner", "ascending_heads_outer", "ascending_heads_inner"])
def test_every_walk_matches_flex_and_is_independent_of_the_grid(walk):
    """Each walk the deterministic backward runs ("auto" takes the ascending one, heads innermost,
    behind a long first column: block_mask.h choose_schedule), on attention sinks (64 keys) beside
    a causal 300-key window from a flex mask_mod (partial blocks as bitmasks), GQA 8:2, bf16,
    D = 128, S = 1500: o, dq, dk, dv against flex_attention's in fp32 per element, and bitwise
    equal over sm_limit 0, 1, 7 and a repeat (the walk fixes the order of dK / dV's sums, the
    write order that of dQ's; neither depends on the grid)."""
    _require_kernel(torch.bfloat16, 128)
    B, Hq, Hkv, S = 2, 8, 2, 1500

    def mod(b, h, q, kv):
        return (q >= kv) & ((q - kv <= 300) | (kv < 64))

    mask = st.BlockMask.from_torch(flex.create_block_mask(mod, None, None, S, S, device=DEV, BLOCK_SIZE=128))
    mask = mask.with_schedule("left_to_right", walk=walk)
    assert mask.walk == walk and mask.check_write_order() == ""
    q, k, v, do = _grad_inputs(B, Hq, Hkv, S, S, 128, torch.bfloat16, seed=7)
    first = _grads(q, k, v, do, mask, deterministic=True)
    ref = _flex_reference(q, k, v, do, mod, None, None, S, S)
    sums, counts = _abs_sums(q, k, v, do, mod, None, None, S, S)
    for what, g, r, a, c in zip(("o", "dq", "dk", "dv"), first, ref, sums, counts):
        _close_per_element(g, r, a, c, torch.bfloat16, what)
    for sm_limit in (1, 7, 0):
        again = _grads(q, k, v, do, mask, deterministic=True, sm_limit=sm_limit)
        for what, a, b in zip(("o", "dq", "dk", "dv"), again, first):
            assert torch.equal(a, b), f"walk {walk}, sm_limit {sm_limit}: {what} differs bitwise"


@pytest.mark.parametrize("name", ["causal", "document_causal"])
def test_sectioned_handout_gives_the_same_bits(name, monkeypatch):
    """The backward's hand-out in L2 sections of (batch, kv head) groups (SPARSETRAIN_ATTN_BWD_ORDER:
    auto, the default rule; sections, the L2 budget alone; sections:3, a last section short)
    changes which CTA takes which column and when, never the turns: dq, dk and dv equal the plain
    column hand-out's bitwise. At S = 3000 the 4 (batch, kv head) groups fit one section; at
    S = 20000 a group's Q and dO (41 MB) exceed 2/3 of an H100's L2: sections of one group."""
    for S, B in ((3000, 2), (20000, 4)):
        mask = _grad_case(name, B, 8, S)[0]
        q, k, v, do = _grad_inputs(B, 8, 2, S, S, 128, torch.bfloat16, seed=5)
        monkeypatch.setenv("SPARSETRAIN_ATTN_BWD_ORDER", "columns")
        ref = _grads(q, k, v, do, mask, deterministic=True)
        for order in ("auto", "sections", "sections:3"):
            monkeypatch.setenv("SPARSETRAIN_ATTN_BWD_ORDER", order)
            got = _grads(q, k, v, do, mask, deterministic=True)
            for what, a, b in zip(("o", "dq", "dk", "dv"), got, ref):
                assert bool(torch.isfinite(a).all()), what
                assert torch.equal(a, b), f"S {S}: {what} differs with the hand-out {order}"


def _backward_flags(log):
    """The `deterministic` argument of every sparsetrain.block_sparse_attention_backward call an
    OpLog saw (the forward's resolved flag; the operator also reads torch's deterministic mode
    itself when it runs)."""
    backward = torch.ops.sparsetrain.block_sparse_attention_backward.default
    return [args[10] for func, args in log.calls if func is backward]  # args[10]: after q ... mask_kinds, scale


def test_default_is_deterministic():
    S = 2000
    mask = st.BlockMask.build("causal", S, device=DEV)
    q, k, v, do = _grad_inputs(2, 8, 2, S, S, 128, torch.bfloat16, seed=4)
    ref = _grads(q, k, v, do, mask, deterministic=True)
    with OpLog() as log:
        got = _grads(q, k, v, do, mask)
    for what, a, b in zip(("o", "dq", "dk", "dv"), got, ref):
        assert torch.equal(a, b), what
    assert _backward_flags(log) == [True]


# The sm_limit runs happen in a child process with a time limit: a deadlock of the dQ semaphores
# (the case a small grid would expose) fails the test instead of hanging the session. The child
# compares and prints one line per difference; it loads this file (argv[4]) for the per-element
# bounds (_abs_sums, _close_per_element) rather than holding a copy of the rule.
_SM_LIMIT_SCRIPT = r"""
import importlib.util
import sys
import torch
import sparsetrain as st
import sparsetrain.torch as stt

import os
sys.path.insert(0, os.path.dirname(sys.argv[4]))  # the test file's own helpers (op_log)
spec = importlib.util.spec_from_file_location("attention_cuda_bounds", sys.argv[4])
bounds = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bounds)

dev, S, packed = torch.device(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "packed"
gen = torch.Generator().manual_seed(5)
def rand(*shape):
    return torch.randn(*shape, generator=gen).to(torch.bfloat16).to(dev)
B, Hq, Hkv = (1, 8, 2) if packed else (2, 8, 2)
q, k, v, do = rand(B, Hq, S, 128), rand(B, Hkv, S, 128), rand(B, Hkv, S, 128), rand(B, Hq, S, 128)
if packed:  # one long packed row of documents of 1..8192 tokens
    lengths = torch.randint(1, 8193, (S,), generator=gen)
    n = int((lengths.cumsum(0) < S).sum()) + 1
    doc = torch.repeat_interleave(torch.arange(n), lengths[:n])[:S].int()[None]
    doc_mod = bounds._flex_document_causal(doc.to(dev))
    masks = {"packed_documents_auto_schedule": (st.BlockMask.build("document_causal", S, document_ids=doc,
                                                                   auto_problem=(B, Hq, Hkv, 0)).to(dev), doc_mod, 1),
             "packed_documents_left_to_right": (st.BlockMask.build("document_causal", S, document_ids=doc,
                                                                   device=dev), doc_mod, 1)}
    sm_limits = (0, 7, 0)
else:
    doc = torch.randint(0, 6, (2, S), generator=gen).sort(dim=1).values.int()
    causal_mod, doc_mod = (lambda b, h, q, kv: q >= kv), bounds._flex_document_causal(doc.to(dev))
    masks = {"causal_auto_schedule": (st.BlockMask.build("causal", S).to(dev), causal_mod, None),  # host: "auto"
             "causal_left_to_right": (st.BlockMask.build("causal", S, device=dev), causal_mod, None),
             "document_causal_shortest_first": (st.BlockMask.build("document_causal", S, document_ids=doc,
                                                                   schedule="shortest_first", device=dev), doc_mod, 2)}
    sm_limits = (0, 1, 2, 7, 0)
scales = {}  # id(mask_mod) -> bounds._abs_sums(...): each element's rounding scale for these inputs
failures = 0
for name, (mask, mod, mod_batch) in masks.items():
    ref = None
    for sm_limit in sm_limits:
        for det in (True, False):
            qq, kk, vv = (t.detach().requires_grad_() for t in (q, k, v))
            o = stt.block_sparse_attention(qq, kk, vv, mask, deterministic=det, sm_limit=sm_limit)
            got = (o.detach(), *torch.autograd.grad(o, (qq, kk, vv), do))
            if dev.type == "cuda":
                torch.cuda.synchronize()
            ref = got if ref is None else ref
            for i, (what, a, b) in enumerate(zip(("o", "dq", "dk", "dv"), got, ref)):
                where = f"{name} sm_limit={sm_limit} deterministic={det}: {what}"
                if not bool(torch.isfinite(a).all()):
                    print("FAIL", where, "is not finite", flush=True)
                    failures += 1
                elif (det or what == "o") and not torch.equal(a, b):
                    print("FAIL", where, "differs bitwise from sm_limit=0 deterministic=True", flush=True)
                    failures += 1
                elif not det and what != "o":  # atomic dQ adds: within the per-element bounds of the det. run
                    if id(mod) not in scales:
                        scales[id(mod)] = bounds._abs_sums(q, k, v, do, mod, mod_batch, None, S, S)
                    sums, counts = scales[id(mod)]
                    try:
                        bounds._close_per_element(a, b, sums[i], counts[i], torch.bfloat16, what, ref_from_kernel=True)
                    except AssertionError as e:
                        print("FAIL", where, f"vs the deterministic result: {e}", flush=True)
                        failures += 1
    print(name, "done", flush=True)
sys.exit(1 if failures else 0)
"""


def _run_sm_limit_child(device, S, case="small", timeout=300):
    try:
        proc = subprocess.run([sys.executable, "-c", _SM_LIMIT_SCRIPT, str(device), str(S), case, __file__],
                              capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"the sm_limit runs did not finish in {timeout} s (a deadlock?); output so far: {e.stdout!r}")
    assert proc.returncode == 0, f"sm_limit runs (exit {proc.returncode}):\n{proc.stdout}\n{proc.stderr[-4000:]}"


def test_sm_limit_gives_bitwise_equal_deterministic_gradients():
    """sm_limit 1, 2 and 7 against 0 (every SM), 3 masks and schedules, S = 2000, GQA 8:2: the
    deterministic o, dq, dk, dv bitwise equal to sm_limit = 0's, the non-deterministic o too and
    their dq, dk, dv within twice the per-element bound (_close_per_element: both are our runs)
    of the deterministic ones. In a child process with a 300 s limit (a deadlock fails instead
    of hanging)."""
    _require_kernel(torch.bfloat16, 128)
    _run_sm_limit_child(DEV, 2000)


def test_long_packed_sequence_gives_bitwise_equal_deterministic_gradients():
    """A 128k-token packed row of documents of 1..8192 tokens, GQA 4:1 (B = 1, Hq = 8, Hkv = 2):
    the deterministic gradients bitwise equal at sm_limit 7 and on every SM, twice, with the "auto"
    schedule (host build) and left to right (device build); long dQ turn chains along long columns,
    the case that would deadlock or race first. In a child process with a 300 s limit."""
    _require_kernel(torch.bfloat16, 128)
    _run_sm_limit_child(DEV, 131072, "packed")


def test_bad_sm_limit_raises_value_error():
    S = 256
    mask = st.BlockMask.build("causal", S, device=DEV)
    q, k, v = _inputs(1, 2, 2, S, S, 128, torch.bfloat16)
    for bad in (-1, 2**31, 1.5, True, "4"):
        with pytest.raises(ValueError, match=r"sm_limit: expected an int >= 0 \(0: every SM\)"):
            stt.block_sparse_attention(q, k, v, mask, sm_limit=bad)


@contextlib.contextmanager
def _deterministic_algorithms():
    prev = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(prev, warn_only=warn_only)


def test_torch_deterministic_mode_forces_the_deterministic_backward():
    """Under torch.use_deterministic_algorithms(True), deterministic=False still runs the
    deterministic backward (the flag the core gets, and bitwise the deterministic gradients),
    whether the mode is on at the forward or only when the backward runs."""
    S = 2000
    mask = st.BlockMask.build("causal", S, device=DEV)
    q, k, v, do = _grad_inputs(2, 8, 2, S, S, 128, torch.bfloat16, seed=6)
    ref = _grads(q, k, v, do, mask, deterministic=True)
    with OpLog() as log:
        _grads(q, k, v, do, mask, deterministic=False)
        assert _backward_flags(log) == [False]
        with _deterministic_algorithms():
            runs = [_grads(q, k, v, do, mask, deterministic=False) for _ in range(2)]
        # On only for the backward:
        qq, kk, vv = (t.detach().requires_grad_() for t in (q, k, v))
        o = stt.block_sparse_attention(qq, kk, vv, mask, deterministic=False)
        with _deterministic_algorithms():
            g = torch.autograd.grad(o, (qq, kk, vv), do)
        torch.cuda.synchronize()
    runs.append((o.detach(), *g))
    # The last backward op was given the forward's False; it reads the mode itself when it runs,
    # so there the bits below are the check.
    assert _backward_flags(log) == [False, True, True, False]
    for i, run in enumerate(runs):
        for what, a, b in zip(("o", "dq", "dk", "dv"), run, ref):
            assert torch.equal(a, b), f"run {i}: {what}"


# -- torch.compile ---------------------------------------------------------------------------------


@pytest.mark.parametrize("deterministic", [True, False], ids=["det", "nondet"])
def test_torch_compile_fullgraph_forward_and_backward(deterministic):
    """torch.compile(fullgraph=True) of a training step: forward and torch.autograd.grad inside
    one graph (dynamo's trace_autograd_ops), and a compiled forward whose loss.backward() runs
    the compiled backward; the same results as eager (bitwise in the deterministic mode; in the
    other, o bitwise and dq, dk, dv within _check_grads's per-element bounds of flex_attention's)."""
    if not hasattr(torch._dynamo.config, "trace_autograd_ops"):
        pytest.skip(f"torch {torch.__version__} has no torch._dynamo.config.trace_autograd_ops")
    S, W = 1000, 300
    mask = st.BlockMask.build("sliding_window", S, window_left=W, window_right=0, device=DEV)
    q, k, v, do = _grad_inputs(2, 8, 2, S, S, 128, torch.bfloat16, seed=7)
    eager = _grads(q, k, v, do, mask, deterministic=deterministic, sm_limit=4)

    def step(q, k, v, do):
        o = stt.block_sparse_attention(q, k, v, mask, deterministic=deterministic, sm_limit=4)
        dq, dk, dv = torch.autograd.grad(o, (q, k, v), do)
        return o.detach(), dq, dk, dv

    def loss(q, k, v, do):
        o = stt.block_sparse_attention(q, k, v, mask, deterministic=deterministic, sm_limit=4)
        return (o.float() * do.float()).sum(), o

    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    with torch._dynamo.config.patch(trace_autograd_ops=True):
        got = torch.compile(step, fullgraph=True)(*leaves, do)
    l, o = torch.compile(loss, fullgraph=True)(*leaves, do)
    l.backward()
    torch.cuda.synchronize()
    if not deterministic:  # atomic dQ adds: the bounds _check_grads applies, against flex_attention in fp32
        def mod(b, h, q_idx, kv_idx):
            return (q_idx >= kv_idx) & (q_idx - kv_idx <= W)
        flex_ref = _flex_reference(q, k, v, do, mod, None, None, S, S)
        sums, counts = _abs_sums(q, k, v, do, mod, None, None, S, S)
    for results in (got, (o, *(t.grad for t in leaves))):
        for i, (what, a, b) in enumerate(zip(("o", "dq", "dk", "dv"), results, eager)):
            assert a.shape == b.shape and a.dtype == b.dtype, what
            if deterministic or what == "o":
                assert torch.equal(a.detach(), b), what
            else:
                _close_per_element(a, flex_ref[i], sums[i], counts[i], torch.bfloat16, what)


# -- errors ----------------------------------------------------------------------------------------


def test_mask_on_another_device_raises():
    S = 300
    q, k, v = _inputs(1, 2, 2, S, S, 128, torch.bfloat16)
    with pytest.raises(ValueError, match=r"block_mask.kv_num_blocks: expected a tensor on cuda:\d+ \(q's device\), "
                                         r"got cpu \(move the mask once with block_mask.to\(q.device\)"):
        stt.block_sparse_attention(q, k, v, st.BlockMask.build("causal", S))
    with pytest.raises(ValueError, match=r"k: expected a tensor on cuda:\d+ \(q's device\), got cpu"):
        stt.block_sparse_attention(q, k.cpu(), v, st.BlockMask.build("causal", S, device=DEV))
