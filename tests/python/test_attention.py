"""sparsetrain.torch.block_sparse_attention and sparsetrain.BlockMask from torch: forward, lse and
gradients (through autograd) against a pure-torch dense masked reference in float64 for every
built-in mask kind, odd sizes (S not a multiple of the block, Sq != Skv), GQA and D = 64;
BlockMask.from_torch on flex_attention's masks (causal, sliding window, documents, arbitrary
mask_mods, full_kv_* absent) against the dense reference, our own builder and torch's
flex_attention itself (eager: it runs on the CPU in this torch); torch.compile(fullgraph=True)
of forward + backward; bad input; BlockMask.to(device). CPU tensors (the CUDA ones are in
test_attention_cuda.py); skipped visibly where torch is not installed."""

import contextlib
import sys
import types
import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch is not installed: torch tests skipped")

import sparsetrain as st  # noqa: E402
import sparsetrain.torch as stt  # noqa: E402
from dense_masks import dense_mask as _dense_mask  # noqa: E402
from op_log import OpLog  # noqa: E402

# -- the dense reference ---------------------------------------------------------------------------


def _reference(q, k, v, allowed, scale=None):
    """float64 masked attention under autograd: (o [B, Hq, Sq, D], lse [B, Hq, Sq]); q/k/v are
    leaf float64 tensors requiring grad. A row with no allowed key gives o = 0, lse = -inf and
    zero gradients (its scores are zeroed before the softmax and its probabilities dropped)."""
    G = q.shape[1] // k.shape[1]
    k2, v2 = k.repeat_interleave(G, dim=1), v.repeat_interleave(G, dim=1)
    scale = 1.0 / q.shape[-1] ** 0.5 if scale is None else scale
    s = (q @ k2.transpose(-1, -2)) * scale
    allowed = allowed.expand_as(s)
    any_row = allowed.any(-1, keepdim=True)
    lse = torch.where(allowed, s, float("-inf")).logsumexp(-1)
    s = torch.where(allowed, s, float("-inf"))
    s = torch.where(any_row, s, 0.0)
    p = torch.softmax(s, -1) * any_row
    return p @ v2, lse


def _inputs(B, Hq, Hkv, Sq, Skv, D, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Hq, Sq, D, generator=gen).to(dtype).requires_grad_()
    k = torch.randn(B, Hkv, Skv, D, generator=gen).to(dtype).requires_grad_()
    v = torch.randn(B, Hkv, Skv, D, generator=gen).to(dtype).requires_grad_()
    do = torch.randn(B, Hq, Sq, D, generator=gen).to(dtype)
    return q, k, v, do


def _leaf64(t):
    return t.detach().double().requires_grad_()


def _close(got, ref, tol, what):
    got, ref = got.detach().double(), ref.detach().double()
    assert got.shape == ref.shape, f"{what}: shape {list(got.shape)} vs {list(ref.shape)}"
    finite = torch.isfinite(ref)
    assert bool((torch.isfinite(got) == finite).all()), f"{what}: infinities differ"
    assert bool((got[~finite] == ref[~finite]).all()), f"{what}: infinities differ in sign"
    err = (got[finite] - ref[finite]).abs()
    bound = tol * (1 + ref[finite].abs())
    assert bool((err <= bound).all()), f"{what}: max error {err.max().item():.3e} (tol {tol:g})"


def _check_against_reference(mask, allowed, B, Hq, Hkv, Sq, Skv, D, dtype=torch.float32, tol=2e-5, scale=None):
    q, k, v, do = _inputs(B, Hq, Hkv, Sq, Skv, D, dtype)
    o, lse = stt.block_sparse_attention(q, k, v, mask, scale=scale, return_lse=True)
    o.backward(do)
    q64, k64, v64 = _leaf64(q), _leaf64(k), _leaf64(v)
    ro, rlse = _reference(q64, k64, v64, allowed, scale)
    ro.backward(do.double())
    assert o.shape == (B, Hq, Sq, D) and o.dtype == dtype and lse.dtype == torch.float32
    _close(o, ro, tol, "o")
    _close(lse, rlse, tol, "lse")
    _close(q.grad, q64.grad, tol, "dq")
    _close(k.grad, k64.grad, tol, "dk")
    _close(v.grad, v64.grad, tol, "dv")
    return o, lse


def _docs(B, S, seed):
    """Random document ids [B, S]: sorted segment ids with a few boundaries per row."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.zeros(B, S, dtype=torch.int64)
    for b in range(B):
        cuts = torch.randint(1, S, (3,), generator=gen)
        ids[b, cuts] = 1
    return ids.cumsum(-1)


# -- the built-in kinds ----------------------------------------------------------------------------

# (kind, params, Sq, Skv): S not a multiple of the block (16) everywhere, Sq != Skv where the kind
# allows it (document masks take doc_q and doc_kv of the two lengths).
KIND_CASES = {
    "full": ("full", {}, 37, 53),
    "causal": ("causal", {}, 45, 45),
    "causal_sq_lt_skv": ("causal", {}, 29, 61),
    "causal_bottom_right": ("causal_bottom_right", {}, 29, 61),
    "sliding_window": ("sliding_window", {"window_left": 9, "window_right": 0}, 53, 53),
    "sliding_window_two_sided": ("sliding_window", {"window_left": 5, "window_right": 20}, 41, 50),
    "document": ("document", {}, 47, 47),
    "document_causal": ("document_causal", {}, 47, 47),
    "prefix_lm": ("prefix_lm", {"prefix_length": 19}, 50, 50),
}


@pytest.mark.parametrize("case", list(KIND_CASES), ids=list(KIND_CASES))
def test_kind_matches_dense_reference(case):
    kind, params, Sq, Skv = KIND_CASES[case]
    B, Hq, Hkv, D = 2, 4, 2, 16
    if kind.startswith("document"):
        params = {"doc_q": _docs(B, Sq, 1), "doc_kv": _docs(B, Skv, 1)}
    mask = st.BlockMask.build(kind, Sq, Skv, block_size=16, framework="torch", **params)
    mask.validate(B, Hq)
    assert mask.check_write_order() == ""
    _check_against_reference(mask, _dense_mask(kind, Sq, Skv, **params), B, Hq, Hkv, Sq, Skv, D)


def test_gqa_8_to_1_head_dim_64():
    B, Hq, Hkv, S, D = 1, 8, 1, 70, 64
    mask = st.BlockMask.build("causal", S, block_size=32)
    _check_against_reference(mask, _dense_mask("causal", S, S), B, Hq, Hkv, S, S, D)


def test_rectangular_blocks_and_scale():
    Sq, Skv = 33, 57
    mask = st.BlockMask.build("sliding_window", Sq, Skv, window_left=12, window_right=3, block_size=(8, 16))
    _check_against_reference(mask, _dense_mask("sliding_window", Sq, Skv, window_left=12, window_right=3),
                             2, 2, 2, Sq, Skv, 16, scale=0.3)


def test_empty_rows_give_zero_output_and_gradients():
    # causal with Sq > Skv in FlashAttention's bottom-right convention: the first rows see no key.
    Sq, Skv = 40, 24
    mask = st.BlockMask.build("causal_bottom_right", Sq, Skv, block_size=16)
    o, lse = _check_against_reference(mask, _dense_mask("causal_bottom_right", Sq, Skv), 1, 2, 1, Sq, Skv, 16)
    assert bool((o[:, :, :Sq - Skv] == 0).all()) and bool(torch.isneginf(lse[:, :, :Sq - Skv]).all())


@pytest.mark.parametrize("dtype,tol", [(torch.bfloat16, 3e-2), (torch.float16, 4e-3)], ids=["bf16", "fp16"])
def test_half_precision(dtype, tol):
    S = 45
    mask = st.BlockMask.build("causal", S, block_size=16)
    _check_against_reference(mask, _dense_mask("causal", S, S), 2, 2, 1, S, S, 32, dtype=dtype, tol=tol)


def test_numpy_mask_and_schedules_give_identical_results():
    """A numpy-built mask is converted without copies; every schedule (and sub-tile count) gives
    bit-identical results, and so does a second run (the deterministic backward)."""
    S, B, H, D = 61, 1, 2, 16
    q, k, v, do = _inputs(B, H, H, S, S, D)
    outs = []
    base = st.BlockMask.build("causal", S, block_size=16)
    nk = base.num_kv_blocks
    masks = [base, base, base.with_schedule("left_to_right"), base.with_schedule("shortest_first"),
             base.with_schedule([2, 0, 3, 1][:nk])]
    assert masks[-1].schedule == "permutation" and list(masks[-1].schedule_permutation) == [2, 0, 3, 1]
    for m in masks:
        assert m.check_write_order() == ""
        q.grad = k.grad = v.grad = None
        o = stt.block_sparse_attention(q, k, v, m)
        o.backward(do)
        outs.append((o.detach().clone(), q.grad.clone(), k.grad.clone(), v.grad.clone()))
    for other in outs[1:]:
        for a, b in zip(outs[0], other):
            assert torch.equal(a, b)


def test_strided_inputs_are_not_copied_and_lse_matches():
    """[B, S, H, D] storage viewed as [B, H, S, D] (transpose(1, 2)) works as it is."""
    B, H, S, D = 2, 3, 35, 16
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(B, S, H, D, generator=gen).transpose(1, 2)
    k = torch.randn(B, S, H, D, generator=gen).transpose(1, 2)
    v = torch.randn(B, S, H, D, generator=gen).transpose(1, 2)
    mask = st.BlockMask.build("causal", S, block_size=16)
    o, lse = stt.block_sparse_attention(q, k, v, mask, return_lse=True)
    ro, rlse = _reference(q.double(), k.double(), v.double(), _dense_mask("causal", S, S))
    _close(o, ro, 2e-5, "o")
    _close(lse, rlse, 2e-5, "lse")


# -- BlockMask API ---------------------------------------------------------------------------------


def test_block_mask_arrays_and_conversions():
    m = st.BlockMask.build("causal", 64, block_size=16)
    assert m.framework == "numpy" and isinstance(m.kv_indices, np.ndarray)
    assert m.kv_indices.dtype == np.int32 and m.kv_indices.shape == (1, 1, 4, 4)
    assert m.kv_num_blocks.tolist() == [[[1, 1, 1, 1]]] and m.full_kv_num_blocks.tolist() == [[[0, 1, 2, 3]]]
    assert m.q_num_blocks.tolist() == [[[1, 1, 1, 1]]] and m.full_q_num_blocks.tolist() == [[[3, 2, 1, 0]]]
    assert (m.schedule, m.walk) == ("left_to_right", "descending_heads_inner")  # "auto" (block_mask.h)
    t = m.to_torch()
    assert t.framework == "torch" and isinstance(t.kv_indices, torch.Tensor)
    assert t.kv_indices.data_ptr() == m.kv_indices.ctypes.data  # shared, not copied
    assert t.to_numpy() is m
    mt = st.BlockMask.build("document", 32, document_ids=torch.tensor([0] * 10 + [1] * 22), block_size=8)
    assert mt.framework == "torch" and mt.spec.doc_q.dtype == torch.int32 and mt.spec.doc_q.shape == (1, 32)
    assert "spec=document" in repr(mt)


def test_from_blocks():
    blocks = np.array([[[[2, 0, 0], [1, 2, 0], [0, 1, 1]]]], np.uint8)
    m = st.BlockMask.from_blocks(blocks, 40, 40, block_size=16, schedule="left_to_right")
    assert m.kv_num_blocks.tolist() == [[[0, 1, 2]]] and m.full_kv_num_blocks.tolist() == [[[1, 1, 0]]]
    assert m.schedule == "left_to_right"
    m.validate()
    # Partial blocks compute like full ones under the default spec ("full"): the dense mask is the blocks.
    dense = torch.from_numpy(blocks > 0).repeat_interleave(16, -2).repeat_interleave(16, -1)[..., :40, :40]
    _check_against_reference(m, dense, 1, 2, 2, 40, 40, 16)
    # With a spec, it applies inside partial blocks only.
    mc = st.BlockMask.from_blocks(torch.from_numpy(blocks), 40, 40, block_size=16, spec=st.MaskSpec("causal"))
    assert mc.framework == "torch"
    allowed = dense & (torch.from_numpy(blocks == 2).repeat_interleave(16, -2).repeat_interleave(16, -1)[..., :40, :40]
                       | _dense_mask("causal", 40, 40))
    _check_against_reference(mc, allowed, 1, 2, 2, 40, 40, 16)


# -- torch's flex_attention BlockMask --------------------------------------------------------------

flex = pytest.importorskip("torch.nn.attention.flex_attention",
                           reason="torch.nn.attention.flex_attention is not available in this torch")


def _flex_dense(mask_mod, B, H, Sq, Skv):
    return flex.create_mask(mask_mod, B, H, Sq, Skv, device="cpu")


def _causal(b, h, q, kv):
    return q >= kv


def _sliding(b, h, q, kv):
    return (q - kv <= 10) & (kv <= q)


def _mod3(b, h, q, kv):
    return (q + kv) % 3 != 0


def _checker(b, h, q, kv):
    return ((q // 16) + (kv // 16)) % 2 == 0


def _document_mod(doc):
    def mask_mod(b, h, q, kv):
        return (doc[b, q] == doc[b, kv]) & (kv <= q)
    return mask_mod


def _head_dependent(b, h, q, kv):
    return (kv <= q + h * 7) & (kv + 20 >= q)


# Independent of one index: vmap hands the result back expanded along it (not contiguous).
def _rows_above(b, h, q, kv):
    return q < 30


def _every_third_key(b, h, q, kv):
    return kv % 3 == 0


# Not shown elementwise (sparsetrain/_mask_mod.py): evaluated through vmap, as flex does. Broadcast
# indices would give other values for the first two.
def _reads_its_shape(b, h, q, kv):
    return (q >= kv) if q.dim() == 0 else (q < kv)


def _reduces(b, h, q, kv):
    return (kv <= q.max()) & (kv + 9 >= q)


def _float_constant(b, h, q, kv):
    return (kv < torch.tensor(20.5)) | (q >= kv)


def _in_place(b, h, q, kv):
    k = kv.clone()
    k.add_(3)
    return q >= k


FLEX_CASES = {
    "causal": (_causal, 1, 1, 64, 64),
    "causal_odd": (_causal, 1, 1, 45, 45),
    "sliding_window": (_sliding, 1, 1, 64, 64),
    "mod3": (_mod3, 1, 1, 48, 37),
    "checkerboard": (_checker, 1, 1, 64, 80),
    "document_causal": ("document", 2, 1, 57, 57),
    "per_head": (_head_dependent, 1, 3, 50, 50),
    "rows_above": (_rows_above, 1, 1, 45, 45),
    "every_third_key": (_every_third_key, 1, 1, 40, 45),
    "reads_its_shape": (_reads_its_shape, 1, 1, 45, 45),
    "reduces": (_reduces, 1, 2, 45, 50),
    "float_constant": (_float_constant, 1, 1, 45, 45),
    "in_place": (_in_place, 1, 1, 45, 45),
}
NOT_ELEMENTWISE = ("reads_its_shape", "reduces", "float_constant", "in_place")


@pytest.mark.parametrize("mask_mod,elementwise", [
    (lambda b, h, q, kv: (q >= kv) if len(q.shape) == 0 else (q < kv), False),
    (lambda b, h, q, kv: (q >= kv) if q.ndim == 0 else (q < kv), False),
    (lambda b, h, q, kv: (q >= kv) & (kv < q.numel() * 5), False),
    (lambda b, h, q, kv: (q >= kv) if bool(q >= 0) else (q < kv), False),  # Python control flow on a value
    (lambda b, h, q, kv: torch.where(q >= kv, 1, 0), False),  # int64 constants beside a bool condition
    (lambda b, h, q, kv: True, False),  # not a tensor: vmap reports it
    (lambda b, h, q, kv: torch.where(q >= kv, True, False), True),
    (lambda b, h, q, kv: torch.maximum(q, kv) < 40, True),
    (lambda b, h, q, kv: (q - kv).abs() <= 3, True),
], ids=["shape", "ndim", "numel", "branch", "where_int", "python_bool", "where_bool", "maximum", "abs"])
def test_mask_mod_verdicts(mask_mod, elementwise):
    from sparsetrain import _mask_mod

    assert _mask_mod.is_elementwise(torch, mask_mod, torch.device("cpu")) == elementwise


@pytest.mark.parametrize("name", list(FLEX_CASES), ids=list(FLEX_CASES))
def test_mask_mod_evaluation_broadcasts_only_what_is_shown_elementwise(name):
    """The verdict of each case, and on random blocks (odd starts, every b and h) the broadcast
    evaluation equals vmap's where it is taken."""
    from sparsetrain import _mask_mod

    mask_mod, B, H, Sq, Skv = _flex_case(name)
    elementwise = _mask_mod.is_elementwise(torch, mask_mod, torch.device("cpu"))
    assert elementwise == (name not in NOT_ELEMENTWISE)
    g = torch.Generator().manual_seed(len(name))
    P, bq, bkv = 7, 8, 5
    b, h = torch.randint(0, B, (P,), generator=g), torch.randint(0, H, (P,), generator=g)
    q = torch.randint(0, Sq - bq + 1, (P, 1), generator=g) + torch.arange(bq)
    kv = torch.randint(0, Skv - bkv + 1, (P, 1), generator=g) + torch.arange(bkv)
    via_vmap = _mask_mod.evaluate(torch, mask_mod, b, h, q, kv, False)
    assert via_vmap.shape == (P, bq, bkv) and via_vmap.dtype == torch.bool
    if elementwise:
        assert torch.equal(_mask_mod.evaluate(torch, mask_mod, b, h, q, kv, True), via_vmap)


def _flex_case(name):
    mask_mod, B, H, Sq, Skv = FLEX_CASES[name]
    if mask_mod == "document":
        mask_mod = _document_mod(_docs(B, Sq, 3))
    return mask_mod, B, H, Sq, Skv


@pytest.mark.parametrize("name", list(FLEX_CASES), ids=list(FLEX_CASES))
def test_from_torch_matches_dense_reference(name):
    mask_mod, B, H, Sq, Skv = _flex_case(name)
    fm = flex.create_block_mask(mask_mod, B, H, Sq, Skv, device="cpu", BLOCK_SIZE=16)
    m = st.BlockMask.from_torch(fm)
    assert m.framework == "torch" and m.spec.kind == "bitmask"
    assert (m.seq_q, m.seq_kv, m.block_q, m.block_kv) == (Sq, Skv, 16, 16)
    m.validate(B, H)
    dense = _flex_dense(mask_mod, B, H, Sq, Skv)
    # The bitmasks hold mask_mod exactly: rebuild the dense mask from the lists and bits.
    rebuilt = torch.zeros(B, H, -(-Sq // 16) * 16, -(-Skv // 16) * 16, dtype=torch.bool)
    bits = m.partial_bitmasks
    for b in range(B):
        for h in range(H):
            for r in range(m.num_q_blocks):
                for i in range(int(m.kv_num_blocks[b, h, r])):
                    n = int(m.kv_indices[b, h, r, i])
                    by = bits[b, h, r, i]
                    block = ((by[:, None] >> torch.arange(8)) & 1).reshape(16, 16).bool()
                    rebuilt[b, h, r * 16:(r + 1) * 16, n * 16:(n + 1) * 16] = block
                for i in range(int(m.full_kv_num_blocks[b, h, r])):
                    n = int(m.full_kv_indices[b, h, r, i])
                    rebuilt[b, h, r * 16:(r + 1) * 16, n * 16:(n + 1) * 16] = True
    assert torch.equal(rebuilt[..., :Sq, :Skv], dense)
    assert not rebuilt[..., Sq:, :].any() or Sq % 16 == 0  # bits past the sequence are 0 in partial blocks
    _check_against_reference(m, dense, B, H, 1, Sq, Skv, 16)


@pytest.mark.parametrize("kind,mask_mod,params", [
    ("causal", _causal, {}),
    ("sliding_window", _sliding, {"window_left": 10, "window_right": 0}),
], ids=["causal", "sliding_window"])
def test_from_torch_blocks_match_our_builder(kind, mask_mod, params):
    S = 128  # a multiple of the block: flex and our builder classify every block the same way
    fm = flex.create_block_mask(mask_mod, 1, 1, S, S, device="cpu", BLOCK_SIZE=16)
    ours = st.BlockMask.build(kind, S, block_size=16, framework="torch", **params)
    conv = st.BlockMask.from_torch(fm)
    for name in ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices", "q_num_blocks",
                 "q_indices", "full_q_num_blocks", "full_q_indices", "dq_write_order", "dq_write_order_full"):
        assert torch.equal(getattr(conv, name), getattr(ours, name)), name
    assert conv.schedule == ours.schedule


def test_from_torch_documents_match_our_builder():
    S, B = 96, 2
    doc = _docs(B, S, 4)
    fm = flex.create_block_mask(_document_mod(doc), B, 1, S, S, device="cpu", BLOCK_SIZE=16)
    conv = st.BlockMask.from_torch(fm)
    ours = st.BlockMask.build("document_causal", S, document_ids=doc, block_size=16)
    for name in ("kv_num_blocks", "full_kv_num_blocks", "q_num_blocks", "full_q_num_blocks"):
        assert torch.equal(getattr(conv, name), getattr(ours, name)), name


def test_from_torch_without_full_blocks_and_compact_indices():
    """from_kv_blocks with no full_kv_* (every listed block partial) and a compact width."""
    kv_num = torch.tensor([[[1, 2, 2]]], dtype=torch.int32)
    kv_idx = torch.tensor([[[[0, 0], [0, 1], [1, 2]]]], dtype=torch.int32)  # width 2 < Nk = 3
    fm = flex.BlockMask.from_kv_blocks(kv_num, kv_idx, BLOCK_SIZE=16, mask_mod=_mod3, seq_lengths=(40, 40))
    m = st.BlockMask.from_torch(fm)
    assert m.full_kv_num_blocks.sum() == 0
    blocks = torch.zeros(3, 3, dtype=torch.bool)
    blocks[0, 0] = blocks[1, 0] = blocks[1, 1] = blocks[2, 1] = blocks[2, 2] = True
    allowed = blocks.repeat_interleave(16, 0).repeat_interleave(16, 1)[:40, :40] & _flex_dense(_mod3, 1, 1, 40, 40)[0, 0]
    _check_against_reference(m, allowed[None, None], 1, 2, 2, 40, 40, 16)


def _blocks_dense(counts, indices, Sq, Skv, bs):
    """The element positions of the blocks a (counts, indices) list pair names: bool [B, H, Sq, Skv]."""
    B, H, mq = counts.shape
    nk = -(-Skv // bs)
    d = torch.zeros(B, H, mq, nk, dtype=torch.bool)
    for b in range(B):
        for h in range(H):
            for r in range(mq):
                d[b, h, r, indices[b, h, r, :int(counts[b, h, r])].long()] = True
    return d.repeat_interleave(bs, 2).repeat_interleave(bs, 3)[:, :, :Sq, :Skv]


def test_from_torch_broadcast_mask_evaluated_per_head():
    """A B = H = 1 flex mask whose mask_mod reads h: flex's fused kernel evaluates mask_mod with
    each head's index inside the (head-0) partial blocks and skips it in full ones; heads=
    reproduces that (flex's eager path would apply mask_mod densely instead, ignoring the lists)."""
    fm = flex.create_block_mask(_head_dependent, 1, 1, 50, 50, device="cpu", BLOCK_SIZE=16)
    m = st.BlockMask.from_torch(fm, heads=3)
    assert m.kv_num_blocks.shape == (1, 3, 4) and m.partial_bitmasks.shape[:3] == (1, 3, 4)
    m.validate(1, 3)
    partial = _blocks_dense(fm.kv_num_blocks, fm.kv_indices, 50, 50, 16)
    full = _blocks_dense(fm.full_kv_num_blocks, fm.full_kv_indices, 50, 50, 16)
    allowed = (partial & _flex_dense(_head_dependent, 1, 3, 50, 50)) | full
    assert not torch.equal(allowed, _flex_dense(_head_dependent, 1, 3, 50, 50))  # the case is not trivial
    _check_against_reference(m, allowed, 1, 3, 3, 50, 50, 16)
    with pytest.raises(ValueError, match="heads: expected a size the block mask's leading dim 3 broadcasts to"):
        st.BlockMask.from_torch(flex.create_block_mask(_head_dependent, 1, 3, 50, 50, device="cpu", BLOCK_SIZE=16),
                                heads=2)


def test_from_torch_auto_walk_follows_the_problem():
    """Attention sinks (64 keys) beside a causal 1024-key window, S = 8192: "auto" runs the
    scheduler model on auto_problem; for B2 H16 it takes the ascending walk, heads innermost (kv column 0 reaches
    every q block, and walking bottom-up it would reach the window columns' blocks last), for the
    mask's own 1 x 1 the descending one (block_mask.h choose_schedule). Bad problems are refused."""
    S = 8192

    def sinks_window(b, h, q, kv):
        return (q >= kv) & ((q - kv <= 1024) | (kv < 64))

    fm = flex.create_block_mask(sinks_window, None, None, S, S, device="cpu")
    big = st.BlockMask.from_torch(fm, auto_problem=(2, 16, 16, 132))
    assert (big.schedule, big.walk) == ("left_to_right", "ascending_heads_inner")
    assert big.check_write_order() == ""
    assert st.BlockMask.from_torch(fm).walk == "descending_heads_inner"
    fixed = st.BlockMask.from_torch(fm, schedule="left_to_right", auto_problem=(2, 16, 16, 132))
    assert fixed.walk == "descending_heads_inner"  # auto_problem matters for "auto" alone
    with pytest.raises(ValueError, match="auto_problem"):
        st.BlockMask.from_torch(fm, auto_problem=(2, 16, 16))


def _flex_like(kv_num, kv_idx, full_num=None, full_idx=None, seq=(32, 32)):
    """An object with a flex BlockMask's attributes (flex's own constructors reject some bad lists first)."""
    t = lambda x: None if x is None else torch.tensor(x, dtype=torch.int32)  # noqa: E731
    return types.SimpleNamespace(kv_num_blocks=t(kv_num), kv_indices=t(kv_idx), full_kv_num_blocks=t(full_num),
                                 full_kv_indices=t(full_idx), BLOCK_SIZE=(16, 16), seq_lengths=seq,
                                 mask_mod=lambda b, h, q, kv: q >= kv)


@pytest.mark.parametrize("route", ["torch_library", "c"])
def test_from_torch_rejects_bad_lists(route, monkeypatch):
    """Every rule of block_matrix_from_flex (block_mask.h), through both routes, before anything is built."""
    if route == "c":
        monkeypatch.setattr(sys.modules["sparsetrain._block_mask"], "_TORCH_LIBRARY", [None])
    kv_num = torch.tensor([[[1, 3]]], dtype=torch.int32)
    kv_idx = torch.tensor([[[[0, 0], [0, 1]]]], dtype=torch.int32)
    fm = flex.BlockMask.from_kv_blocks(kv_num, kv_idx, BLOCK_SIZE=16, seq_lengths=(32, 32))
    with pytest.raises(ValueError, match=r"kv_num_blocks\[b=0, h=0, q block 1\]: expected a count in \[0, 2\] "
                                         r"\(the width of kv_indices\), got 3"):
        st.BlockMask.from_torch(fm)
    kv_idx = torch.tensor([[[[0, 0], [1, 1]]]], dtype=torch.int32)
    fm = flex.BlockMask.from_kv_blocks(torch.tensor([[[1, 2]]], dtype=torch.int32), kv_idx, BLOCK_SIZE=16,
                                       seq_lengths=(32, 32))
    with pytest.raises(ValueError, match=r"kv_indices\[b=0, h=0, q block 1\] entry 1: expected no duplicate kv "
                                         "blocks in a row, got kv block 1 twice"):
        st.BlockMask.from_torch(fm)
    cases = [
        (_flex_like([[[1, 1]]], [[[[0], [2]]]]), r"kv_indices\[b=0, h=0, q block 1\] entry 0: expected a kv block "
                                                 r"in \[0, 2\), got 2"),
        (_flex_like([[[1, -1]]], [[[[0], [1]]]]), r"kv_num_blocks\[b=0, h=0, q block 1\]: expected a count in"),
        (_flex_like([[[1, 1]]], [[[[0], [1]]]], [[[1, 0]]], [[[[0], [0]]]]),
         r"full_kv_indices\[b=0, h=0, q block 0\] entry 0: expected kv blocks that are not also partial "
         r"\(in kv_indices\), got kv block 0 in both"),
        (_flex_like([[[1, 1]]], [[[[0], [1]]]], [[[1, 0]]], None), "full_kv_indices"),
        (_flex_like([[[1, 1]]] * 2, [[[[0], [1]]]] * 3), r"kv_num_blocks: expected leading dims broadcastable to "
                                                         r"\[B=3, H=1\], got \[2, 1, 2\]"),
        (_flex_like([[[1, 1, 1]]], [[[[0], [1], [1]]]]), r"block_mask.kv_num_blocks: expected \[B, H, Mq=2\]"),
        (_flex_like([[[1, 1]]], [[[[0]], [[1]]]]), r"block_mask.kv_indices: expected \[B, H, Mq=2, W\]"),
    ]
    for m, match in cases:
        with pytest.raises(ValueError, match=match):
            st.BlockMask.from_torch(m)
    assert st.BlockMask.from_torch(_flex_like([[[1, 1]]], [[[[0], [1]]]])).kv_num_blocks.tolist() == [[[1, 1]]]
    with pytest.raises(ValueError, match="block_mask: expected a torch.nn.attention.flex_attention.BlockMask"):
        st.BlockMask.from_torch(object())


@pytest.mark.parametrize("name", ["causal_odd", "mod3", "document_causal", "per_head"])
def test_matches_torch_flex_attention(name):
    """torch's own flex_attention (eager: the unfused implementation, the one that runs on the
    CPU; it applies mask_mod densely, which equals the block semantics for a mask that
    create_block_mask built from the same mask_mod) on the same BlockMask, forward and lse in
    float64. Its backward does not run on the CPU
    in torch 2.11 ("FlexAttention does not support backward on CPU"): gradients are compared with
    the dense reference (test_from_torch_matches_dense_reference), which matches flex's forward."""
    mask_mod, B, H, Sq, Skv = _flex_case(name)
    fm = flex.create_block_mask(mask_mod, B, H, Sq, Skv, device="cpu", BLOCK_SIZE=16)
    q, k, v, _ = _inputs(B, H, H, Sq, Skv, 16)
    q, k, v = q.detach(), k.detach(), v.detach()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ref, ref_lse = flex.flex_attention(q.double(), k.double(), v.double(), block_mask=fm, return_lse=True)
    except Exception as e:  # pragma: no cover - depends on the torch build
        pytest.skip(f"flex_attention does not run on the CPU in this torch ({torch.__version__}): {e}")
    o, lse = stt.block_sparse_attention(q, k, v, st.BlockMask.from_torch(fm), return_lse=True)
    _close(o, ref, 2e-5, "o")
    _close(lse, ref_lse, 2e-5, "lse")


# -- torch.compile ---------------------------------------------------------------------------------


def test_torch_compile_fullgraph_forward_backward():
    S, D = 45, 16
    mask = st.BlockMask.build("causal", S, block_size=16, framework="torch")
    q, k, v, do = _inputs(1, 2, 1, S, S, D)

    def step(q, k, v, do):
        o = stt.block_sparse_attention(q, k, v, mask)
        (o * do).sum().backward()
        return o.detach()

    ref_o = step(q, k, v, do)
    ref = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None

    @torch.compile(fullgraph=True)
    def loss(q, k, v, do):
        o = stt.block_sparse_attention(q, k, v, mask)
        return (o * do).sum(), o

    l, o = loss(q, k, v, do)
    l.backward()
    assert torch.equal(o.detach(), ref_o)
    for t, r in zip((q, k, v), ref):
        assert torch.equal(t.grad, r)


def test_a_numpy_mask_stays_usable_eagerly_after_a_compiled_call():
    """A mask built over numpy arrays (framework "numpy", or a CPU build's default) converts to torch
    inside the op; a trace must leave no such conversion behind on the mask: replayed after the
    call it came back with an empty MaskSpec, and the mask's next eager use failed."""
    S, D = 45, 16
    mask = st.BlockMask.build("causal", S, block_size=16, framework="numpy")
    q, k, v, _ = _inputs(1, 2, 1, S, S, D)
    compiled = torch.compile(lambda q, k, v: stt.block_sparse_attention(q, k, v, mask), fullgraph=True,
                             backend="aot_eager")
    got = compiled(q, k, v)
    assert torch.equal(stt.block_sparse_attention(q, k, v, mask), got)
    assert len(mask.to_torch().spec) == len(mask.spec)


def test_traced_graphs_hold_the_attention_ops():
    """torch.compile(fullgraph=True) through AOT autograd: its forward graph calls
    sparsetrain.block_sparse_attention and its backward graph sparsetrain.block_sparse_attention_backward
    (the fakes give the shapes, the C++ autograd node the backward), bitwise the eager results;
    make_fx of the operator's forward + backward with symbolic shapes holds both too."""
    from functorch.compile import make_boxed_func  # noqa: PLC0415
    from torch._dynamo.backends.common import aot_autograd  # noqa: PLC0415
    from torch.fx.experimental.proxy_tensor import make_fx  # noqa: PLC0415

    forward, backward = torch.ops.sparsetrain.block_sparse_attention.default, \
        torch.ops.sparsetrain.block_sparse_attention_backward.default
    mask = st.BlockMask.build("causal", 45, block_size=16, framework="torch")
    q, k, v, do = _inputs(1, 2, 1, 45, 45, 16, seed=2)

    def attention(q, k, v):
        return stt.block_sparse_attention(q, k, v, mask)

    def run(fn):
        ins = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        o = fn(*ins)
        o.backward(do)
        return [o.detach()] + [t.grad for t in ins]

    graphs = []

    def keep(gm, example_inputs):
        graphs.append({n.target for n in gm.graph.nodes})
        return make_boxed_func(gm.forward)

    compiled = torch.compile(attention, backend=aot_autograd(fw_compiler=keep, bw_compiler=keep), fullgraph=True)
    for a, b in zip(run(compiled), run(attention)):
        assert _bitwise(a, b)
    assert len(graphs) == 2, graphs
    assert forward in graphs[0] and backward not in graphs[0], graphs[0]
    assert backward in graphs[1] and forward not in graphs[1], graphs[1]

    tensors, sizes, kinds = st._block_mask.wire(mask)

    def grads(q, k, v, do, *tensors):  # the mask's tensors inputs too: make_fx fakes every tensor it meets
        o, _ = forward(q, k, v, list(tensors), sizes, kinds, 0.0, True, 0)
        return torch.autograd.grad(o, (q, k, v), do)

    traced = make_fx(grads, tracing_mode="symbolic")(*(t.detach().requires_grad_() for t in (q, k, v)), do, *tensors)
    targets = {n.target for n in traced.graph.nodes}
    assert forward in targets and backward in targets, targets


def test_attention_ops_pass_opcheck():
    """Both operators: schema, autograd registration (the forward's Autograd kernel in C++, the
    backward's "not implemented" one), AOT dispatch with dynamic shapes (the forward with inputs
    that require grad, so its backward is traced too). (test_faketensor would fail on the storage
    offset alone: the outputs start at the first 256-byte boundary of a torch.empty allocation, as
    every tensor the library allocates does; sizes and strides match the fake.)"""
    S = 40
    mask = st.BlockMask.build("causal", S, block_size=16, framework="torch")
    q, k, v, do = _inputs(1, 2, 1, S, S, 16)
    tensors, sizes, kinds = st._block_mask.wire(mask)
    utils = ("test_schema", "test_autograd_registration", "test_aot_dispatch_dynamic")
    ops = torch.ops.sparsetrain
    torch.library.opcheck(ops.block_sparse_attention.default, (q, k, v, tensors, sizes, kinds, 0.0, True, 0),
                          test_utils=utils)
    q, k, v = q.detach(), k.detach(), v.detach()
    o, lse = ops.block_sparse_attention.default(q, k, v, tensors, sizes, kinds, 0.0, True, 0)
    torch.library.opcheck(ops.block_sparse_attention_backward.default,
                          (q, k, v, o, lse, do, tensors, sizes, kinds, 0.0, True, 0), test_utils=utils)


# -- bad input -------------------------------------------------------------------------------------


def _good(S=40):
    q, k, v, _ = _inputs(1, 2, 1, S, S, 16)
    return q, k, v, st.BlockMask.build("causal", S, block_size=16)


BAD = {
    "q_3d": (lambda q, k, v, m: (q[0], k, v, m), r"q: expected a 4-d tensor \[B, H, S, D\]"),
    "k_batch": (lambda q, k, v, m: (q, torch.cat([k, k]), v, m), r"k: expected shape \[1 \(q's B\)"),
    "k_head_dim": (lambda q, k, v, m: (q, k[..., :8], v, m), r"k: expected shape \[1 \(q's B\), Hkv, Skv, 16"),
    "k_heads_not_dividing": (lambda q, k, v, m: (q, torch.cat([k] * 3, 1), torch.cat([v] * 3, 1), m),
                             "k: expected a head count Hkv that divides q's Hq = 2"),
    "k_no_heads": (lambda q, k, v, m: (q, k[:, :0], v[:, :0], m),
                   "k: expected a head count Hkv that divides q's Hq = 2 .GQA / MQA., got 0"),
    "v_shape": (lambda q, k, v, m: (q, k, v[:, :, :30], m), r"v: expected shape \[1, 1, 40, 16\] \(k's shape\)"),
    "q_dtype_float64": (lambda q, k, v, m: (q.double(), k.double(), v.double(), m),
                        "q: expected dtype fp32, bf16 or fp16, got fp64"),
    "k_dtype": (lambda q, k, v, m: (q, k.half(), v, m), "k: expected dtype fp32 .q's dtype., got fp16"),
    "mask_seq": (lambda q, k, v, m: (q[:, :, :30], k, v, m), r"block_mask: expected seq lengths \(30, 40\)"),
    "mask_type": (lambda q, k, v, m: (q, k, v, "causal"), "block_mask: expected a sparsetrain.BlockMask, got str"),
    "q_last_dim_strided": (lambda q, k, v, m: (q.transpose(2, 3).contiguous().transpose(2, 3)[..., :40, :], k, v, m),
                           r"q: expected a unit stride in the last dimension \(D\) \(taken: any strides with the last "
                           r"dimension contiguous, .*pass q\.contiguous\(\)\), got \d+$"),
}


@pytest.mark.parametrize("case", list(BAD), ids=list(BAD))
def test_bad_input_raises_value_error_naming_the_argument(case):
    make, message = BAD[case]
    q, k, v, m = make(*_good())
    with pytest.raises(ValueError, match=message):
        stt.block_sparse_attention(q, k, v, m)


@pytest.mark.parametrize("sq,skv,hq,hkv", [(40, 40, 2, 1), (32, 48, 4, 2), (48, 32, 3, 3)],
                         ids=["self_gqa", "cross_gqa", "cross_mha"])
def test_bshd_inputs_are_named_as_a_layout_mistake_not_blamed_on_the_mask(sq, skv, hq, hkv):
    """q, k, v in [B, S, H, D] (the C++ layout; flex and SDPA take [B, H, S, D]): the block mask's
    seq lengths then sit at dim 1 of q and k. Said so, naming the fix, before the head or mask
    checks that the swapped dims would trip first (a head count that does not divide, "block_mask:
    expected seq lengths (H, H)"); the fix then runs."""
    q, k, v, _ = _inputs(2, hq, hkv, sq, skv, 16)
    m = st.BlockMask.build("causal", sq, skv, block_size=16)
    bshd = [t.detach().transpose(1, 2).contiguous() for t in (q, k, v)]
    message = (rf"^q: expected FlexAttention's layout \[B, H, S, D\], got shape \[2, {sq}, {hq}, 16\], whose dim 1 "
               rf"holds the block mask's seq length {sq} \(k's dim 1 its {skv}\): \[B, S, H, D\] tensors\? pass "
               r"q\.transpose\(1, 2\), k\.transpose\(1, 2\) and v\.transpose\(1, 2\) \(views, no copies\)$")
    with pytest.raises(ValueError, match=message):
        stt.block_sparse_attention(*bshd, m)
    o = stt.block_sparse_attention(*(t.transpose(1, 2) for t in bshd), m)
    assert torch.equal(o, stt.block_sparse_attention(q.detach(), k.detach(), v.detach(), m))


def test_flex_block_mask_passed_directly_says_how_to_convert():
    q, k, v, _ = _good()
    fm = flex.create_block_mask(_causal, 1, 1, 40, 40, device="cpu", BLOCK_SIZE=16)
    with pytest.raises(ValueError, match=r"BlockMask.from_torch"):
        stt.block_sparse_attention(q, k, v, fm)


def test_bad_scale_and_builder_arguments():
    q, k, v, m = _good()
    for bad in (float("nan"), 0.0, -0.125):
        with pytest.raises(ValueError, match="scale: expected a finite positive number"):
            stt.block_sparse_attention(q, k, v, m, scale=bad)
    with pytest.raises(ValueError, match="kind: expected one of full, causal"):
        st.BlockMask.build("diagonal", 40)
    with pytest.raises(ValueError, match="schedule: expected 'auto'"):
        st.BlockMask.build("causal", 40, schedule="fastest")
    with pytest.raises(ValueError, match="schedule.permutation: expected a permutation of the 3 kv block columns"):
        st.BlockMask.build("causal", 40, block_size=16, schedule=[0, 0, 1])
    with pytest.raises(ValueError, match="document_ids: expected document ids"):
        st.BlockMask.build("document", 40)
    with pytest.raises(ValueError, match="doc_q: expected integer document ids"):
        st.BlockMask.build("document", 4, document_ids=torch.tensor([0.0, 0.0, 1.0, 1.0]))


def test_corrupted_mask_is_rejected_by_validation():
    q, k, v, _ = _good()
    m = st.BlockMask.build("causal", 40, block_size=16, framework="torch")
    m.kv_indices[0, 0, 1, 0] = 7  # out of range
    with pytest.raises(ValueError, match=r"mask.kv_indices\[b=0, h=0, q block 1\] entry 0: expected a kv block in \[0, 3\)"):
        stt.block_sparse_attention(q, k, v, m)
    m2 = st.BlockMask.build("causal", 40, block_size=16, framework="torch")
    # kv column 1 writes q block 2 (full) second, after column 0: turn 1. Turn 0 twice is invalid.
    assert m2.full_q_indices[0, 0, 1, 0] == 2 and m2.dq_write_order_full[0, 0, 1, 0] == 1
    m2.dq_write_order_full[0, 0, 1, 0] = 0
    assert m2.check_write_order() != ""


def test_unsupported_devices_and_mixed_devices_raise_a_clear_error():
    """CPU and CUDA tensors are accepted (tests/python/test_attention_cuda.py runs CUDA); other
    devices, k / v away from q, and a mask away from q name what to do."""
    q, k, v, m = _good()
    q, k, v = (t.detach() for t in (q, k, v))
    with pytest.raises(NotImplementedError, match="block_sparse_attention: q is on meta; expected CPU or CUDA"):
        stt.block_sparse_attention(*(t.to("meta") for t in (q, k, v)), m)
    with pytest.raises(ValueError, match=r"v: expected a tensor on cpu \(q's device\), got meta"):
        stt.block_sparse_attention(q, k, v.to("meta"), m)
    with pytest.raises(ValueError, match=r"block_mask.kv_num_blocks: expected a tensor on cpu \(q's device\), got "
                                         r"meta \(move the mask once with block_mask.to\(q.device\)"):
        stt.block_sparse_attention(q, k, v, m.to("meta"))
    md = st.BlockMask.build("document_causal", 40, document_ids=_docs(1, 40, 2), block_size=16, framework="torch")
    md.spec = md.spec._replace(doc_q=md.spec.doc_q.to("meta"))
    with pytest.raises(ValueError, match=r"block_mask.spec.doc_q: expected a tensor on cpu"):
        stt.block_sparse_attention(q, k, v, md)


def test_block_mask_to_device_and_back():
    """to() moves every tensor (document ids and bitmasks too) and keeps the schedule permutation on
    the host; to() the device a mask is on is the mask itself. "meta" stands in for a CUDA device."""
    m = st.BlockMask.build("document_causal", 70, document_ids=_docs(2, 70, 5), block_size=16,
                           schedule=[3, 1, 0, 4, 2], framework="numpy")
    assert m.device == "cpu" and m.to("cpu") is m.to_torch() and m.cpu() is m
    mt = m.to_torch()
    assert mt.device == torch.device("cpu") and mt.to("cpu") is mt and mt.cpu() is mt
    moved = m.to("meta")
    assert moved.framework == "torch" and moved.device == torch.device("meta") and "device=meta" in repr(moved)
    for name, t in moved.tensors().items():
        if t is not None:
            assert t.device.type == "meta", name
            assert t.shape == mt.tensors()[name].shape and t.dtype == mt.tensors()[name].dtype, name
    assert moved.spec.doc_q.device.type == "meta" and moved.schedule_permutation.device.type == "cpu"
    assert moved.to("meta") is moved
    assert (moved.schedule, moved.seq_q, moved.block_kv) == ("permutation", 70, 16)
    fm = flex.create_block_mask(_mod3, 1, 1, 48, 37, device="cpu", BLOCK_SIZE=16)
    bm = st.BlockMask.from_torch(fm)
    assert bm.device == torch.device("cpu")
    assert bm.to("meta").partial_bitmasks.device.type == "meta"
    assert torch.equal(st.BlockMask.from_torch(fm, device="cpu").partial_bitmasks, bm.partial_bitmasks)


def test_device_build_arguments():
    """build(device=...) on the host is the default build; CUDA builds are tested in
    test_attention_cuda.py, their argument errors here."""
    a = st.BlockMask.build("causal", 300, framework="torch")
    b = st.BlockMask.build("causal", 300, framework="torch", device="cpu")
    assert a.schedule == b.schedule == "left_to_right"  # "auto" stays the host default
    for name, t in a.tensors().items():
        assert (t is None and b.tensors()[name] is None) or torch.equal(t, b.tensors()[name]), name
    with pytest.raises(ValueError, match="device: expected 'cpu' for framework 'numpy'"):
        st.BlockMask.build("causal", 300, framework="numpy", device="cuda")
    with pytest.raises(ValueError, match="device: expected 'cpu' or a CUDA device, got meta"):
        st.BlockMask.build("causal", 300, device="meta")
    with pytest.raises(ValueError, match="device: expected 'cpu', 'cuda', 'cuda:N' or a torch.device"):
        st.BlockMask.build("causal", 300, device="gpu0")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match=r"device: expected an available CUDA device, got cuda"):
            st.BlockMask.build("causal", 300, device="cuda")


# -- FlashAttention's packed documents (cu_seqlens) ---------------------------------------------------


@pytest.mark.parametrize("causal", [False, True], ids=["document", "document_causal"])
def test_cu_seqlens_give_the_document_id_form(causal):
    """BlockMask.from_cu_seqlens on torch int32 offsets (a flash_attn_varlen_func call's tensors):
    torch tensors throughout, the same mask tensors as the document-id form of the same documents,
    bitwise the same outputs and gradients, and the dense reference's values (padded rows: o = 0,
    lse = -inf)."""
    lengths = [1, 2, 63, 64, 65, 3, 40]
    cu = torch.tensor([0] + lengths, dtype=torch.int32).cumsum(0).to(torch.int32)
    S = int(cu[-1]) + 9  # padded to a static length
    m = stt.BlockMask.from_cu_seqlens(cu, cu, max(lengths), max(lengths), seq_q=S, causal=causal, block_size=16)
    assert m.framework == "torch" and m.spec.doc_q.dtype == torch.int32 and m.spec.doc_q.shape == (1, S)
    ids = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    doc_q = torch.cat([ids, torch.full((9,), 100)])[None]
    doc_kv = torch.cat([ids, torch.full((9,), 101)])[None]
    kind = "document_causal" if causal else "document"
    ref = st.BlockMask.build(kind, S, doc_q=doc_q, doc_kv=doc_kv, block_size=16)
    for name, t in m.tensors().items():
        if name not in ("doc_q", "doc_kv") and t is not None:
            assert torch.equal(t, getattr(ref, name)), name
    dq_host, dkv_host = st.document_ids_from_cu_seqlens(cu, cu, S, S)
    assert torch.equal(dq_host, torch.cat([ids, torch.full((9,), len(lengths))])[None].to(torch.int32))
    assert torch.equal(dkv_host, torch.cat([ids, torch.full((9,), len(lengths) + 1)])[None].to(torch.int32))
    allowed = _dense_mask(kind, S, S, doc_q=doc_q, doc_kv=doc_kv)
    o, lse = _check_against_reference(m, allowed, 1, 2, 1, S, S, 16)
    q, k, v, do = _inputs(1, 2, 1, S, S, 16)
    ro, rlse = stt.block_sparse_attention(q, k, v, ref, return_lse=True)
    assert torch.equal(o, ro) and torch.equal(lse, rlse)
    assert bool(torch.isneginf(lse[..., int(cu[-1]):]).all()) and bool((o[:, :, int(cu[-1]):] == 0).all())


def test_cu_seqlens_arguments():
    cu = torch.tensor([0, 5, 9], dtype=torch.int32)
    with pytest.raises(ValueError, match="cu_seqlens_q: expected dtype int32"):
        stt.BlockMask.from_cu_seqlens(cu.long())
    with pytest.raises(ValueError, match="cu_seqlens_k: expected as many documents as cu_seqlens_q"):
        stt.BlockMask.from_cu_seqlens(cu, cu[:2], seq_q=9, seq_kv=9)
    m = stt.BlockMask.from_cu_seqlens(cu, causal=True, device="cpu")
    assert m.seq_q == 9 and m.device == torch.device("cpu") and m.spec.kind == "document_causal"
    if torch.cuda.is_available():  # offsets on a CUDA device need the lengths (no host read)
        with pytest.raises(ValueError, match="seq_q: expected the packed query length"):
            stt.BlockMask.from_cu_seqlens(cu.cuda())


NATIVE_CASES = {
    "causal_gqa": (dict(kind="causal", seq_q=200, block_size=64), (2, 4, 2, 200, 200, 16)),
    "window_perm": (dict(kind="sliding_window", seq_q=150, window_left=40, window_right=10, block_size=32,
                         schedule=[4, 0, 3, 1, 2]), (1, 2, 2, 150, 150, 8)),
    "doc_causal": (dict(kind="document_causal", seq_q=96, block_size=16,
                        document_ids=torch.tensor([0] * 30 + [1] * 5 + [2] * 61)), (1, 2, 1, 96, 96, 16)),
    "prefix_rect": (dict(kind="prefix_lm", seq_q=70, seq_kv=70, prefix_length=23, block_size=(16, 32)),
                    (2, 1, 1, 70, 70, 8)),
    "full_sq_ne_skv": (dict(kind="full", seq_q=33, seq_kv=90, block_size=16), (1, 3, 1, 33, 90, 16)),
}


@pytest.mark.parametrize("name", list(NATIVE_CASES))
def test_native_torch_ops_equal_the_array_front(name):
    """Attention through the C++ torch operators gives the bytes of the array front over the same
    torch tensors and mask (sparsetrain.block_sparse_attention_forward / _backward: the extension
    `_C`, its own reading of the mask), forward and backward; their errors are ValueErrors naming
    the argument."""
    spec, shape = NATIVE_CASES[name]
    spec = dict(spec)
    kind, sq = spec.pop("kind"), spec.pop("seq_q")
    skv = spec.pop("seq_kv", None)
    mask = st.BlockMask.build(kind, sq, skv, framework="torch", **spec)

    q, k, v, do = _inputs(*shape, seed=5)
    o, lse = stt.block_sparse_attention(q, k, v, mask, return_lse=True)
    o.backward(do)
    native = [o.detach(), lse, q.grad, k.grad, v.grad]
    bshd = [t.detach().transpose(1, 2) for t in (q, k, v, o, do)]
    o_c, lse_c = st.block_sparse_attention_forward(*bshd[:3], mask)
    grads = st.block_sparse_attention_backward(*bshd[:3], o_c, lse_c, bshd[4], mask)
    extension = [o_c.transpose(1, 2), lse_c, *(g.transpose(1, 2) for g in grads)]
    assert len(native) == len(extension)
    for i, (a, b) in enumerate(zip(native, extension)):
        assert a.shape == b.shape and torch.equal(a.view(torch.int32), b.view(torch.int32)), f"output {i}"
        # o and lse as the library hands them back (the gradients are autograd's, laid out as q, k, v)
        assert i >= 2 or a.stride() == b.stride(), f"output {i}"
    q, k, v, _ = _inputs(*shape)
    bad = st.BlockMask.build(kind, sq, skv, framework="torch", **spec)
    bad.kv_num_blocks[0, 0, 0] = 99
    with pytest.raises(ValueError, match=r"mask.kv_num_blocks"):
        stt.block_sparse_attention(q, k, v, bad)


def _bitwise(a, b):
    return a.shape == b.shape and a.stride() == b.stride() and torch.equal(a.view(torch.int32), b.view(torch.int32))


def _mode(eager):
    """No mode for an eager call, else an OpLog: the way tracing (make_fx, torch.compile's AOT
    autograd) meets the attention operators."""
    return contextlib.nullcontext() if eager else OpLog()


def test_attention_eager_and_under_a_dispatch_mode():
    """An eager call records the C++ node (AttentionFunction) and gives the bytes of the same call
    under a dispatch mode, which sees both operators; the mask's tensors replaced or moved in place
    seen, in-place edits between forward and backward caught as autograd catches them, lse without a
    gradient, only the inputs that require grad get one."""
    seed = int(torch.randint(0, 2**31 - 1, ()).item())
    mask = st.BlockMask.build("sliding_window", 96, window_left=20, window_right=5, block_size=16, framework="torch")
    q, k, v, do = _inputs(1, 4, 2, 96, 96, 8, seed=seed)

    def run(m, needs=(True, True, True), eager=True):
        with _mode(eager) as mode:
            ins = [t.detach().clone().requires_grad_(r) for t, r in zip((q, k, v), needs)]
            o, lse = stt.block_sparse_attention(*ins, m, return_lse=True)
            assert not lse.requires_grad and lse.grad_fn is None
            assert "AttentionFunction" in o.grad_fn.name(), o.grad_fn.name()
            o.backward(do)
        if mode is not None:
            assert mode.names.count("sparsetrain.block_sparse_attention") == 1, mode.names
            assert mode.names.count("sparsetrain.block_sparse_attention_backward") == 1, mode.names
        return [o.detach(), lse] + [t.grad for t in ins]

    def same(a, b):
        assert len(a) == len(b)
        for i, (x, y) in enumerate(zip(a, b)):
            assert (x is None and y is None) or _bitwise(x, y), f"output {i} (seed {seed})"

    same(run(mask), run(mask, eager=False))
    same(run(mask, needs=(False, True, False)), run(mask, needs=(False, True, False), eager=False))
    # Another mask's tensors put in: a replaced attribute, and a tensor moved in place (set_).
    other = st.BlockMask.build("causal", 96, block_size=16, framework="torch")
    expected = run(other)
    for name in st._block_mask.TENSOR_NAMES:
        setattr(mask, name, getattr(other, name))
    mask.spec = other.spec
    same(run(mask), expected)
    # (A window spec over the causal mask's blocks: the walk is the blocks', the mask inside the spec's.)
    moved, ref = (st.BlockMask.build("sliding_window", 96, window_left=20, window_right=5, block_size=16,
                                     framework="torch") for _ in range(2))
    before = run(moved)  # its arguments cached
    cache = moved._torch_cache
    for name in st._block_mask.TENSOR_NAMES:
        t = getattr(moved, name)
        if t is not None:
            t.set_(getattr(other, name).clone())
            setattr(ref, name, getattr(other, name))
    expected = run(ref)
    assert not torch.equal(before[0], expected[0]), "the donor's blocks must change the result"
    same(run(moved), expected)
    assert moved._torch_cache is cache, "the Python cache must hold here: the operator reads the moved tensor"
    # A mask tensor edited in place between forward and backward: autograd's version check, both ways.
    for eager in (True, False):
        m = st.BlockMask.build("causal", 96, block_size=16, framework="torch")
        with _mode(eager):
            o = stt.block_sparse_attention(q.detach().clone().requires_grad_(), k, v, m)
            m.kv_num_blocks.add_(0)
            with pytest.raises(RuntimeError, match="modified by an inplace operation"):
                o.backward(do)


def test_padded_backward_form_of_a_document_mask():
    """BlockMask.build(..., doc_padding=128) adds the mask's padded backward form (block_mask.h
    backward_padded: documents of >= 128 tokens on 128-token boundaries, which the CUDA backward
    runs on): its real_rows place every token once and in order; it moves and converts with the
    mask; on the CPU (whose reference reads the mask itself) forward and gradients are bitwise those
    of the mask without it, eagerly, under a dispatch mode (as tracing meets the operators) and
    through the numpy front; the library checks the padded form on every path (a token placed twice is refused naming
    mask.backward_padded.real_rows, so it did cross); bad doc_padding arguments raise naming it."""
    rng = np.random.default_rng(15)
    B, S = 2, 700
    ids = np.concatenate([np.repeat(np.arange(S), rng.integers(1, 300, size=S))[:S] for _ in range(B)]).reshape(B, S)
    ids = torch.as_tensor(ids, dtype=torch.int32)
    plain = st.BlockMask.build("document_causal", S, document_ids=ids, framework="torch")
    mask = st.BlockMask.build("document_causal", S, document_ids=ids, framework="torch", doc_padding=128)
    p = mask.backward_padded
    assert plain.backward_padded is None and p is not None and p.backward_padded is None
    assert p.seq_q == p.seq_kv and p.seq_q % 128 == 0 and p.seq_q >= S and (p.schedule, p.walk) == (mask.schedule, mask.walk)
    for b in range(B):
        rows = p.real_rows[b]
        assert torch.equal(rows[rows >= 0], torch.arange(S, dtype=torch.int32))
        assert torch.equal(p.spec.doc_q[b][rows >= 0], ids[b])
    assert (p.real_rows >= 0).sum() == B * S and (p.real_rows < 0).any(), "no document was padded: nothing tested"
    p.validate()
    assert set(mask.to_numpy().tensors()) == set(mask.tensors()) and "backward_padded.real_rows" in mask.tensors()
    # Another schedule: the form follows it (its own transposes and write orders rebuilt), and a
    # permutation, which names the unpadded mask's columns, drops it.
    sf = mask.with_schedule("shortest_first")
    assert (sf.backward_padded.schedule, sf.backward_padded.walk) == (sf.schedule, sf.walk) == ("shortest_first",
                                                                                               mask.walk)
    assert torch.equal(sf.backward_padded.real_rows, p.real_rows)
    sf.backward_padded.validate()
    nk = -(-S // 128)
    assert mask.with_schedule(list(range(nk))[::-1]).backward_padded is None

    def run(m, eager=True):
        with _mode(eager):
            q, k, v, do = _inputs(B, 4, 2, S, S, 16, seed=3)
            o, lse = stt.block_sparse_attention(q, k, v, m, return_lse=True)
            o.backward(do)
            return [o.detach(), lse, q.grad, k.grad, v.grad]

    want = run(plain)
    for eager in (True, False):
        for a, b in zip(run(mask, eager), want):
            assert _bitwise(a, b), f"eager {eager}"
    q, k, v, do = (t.detach().transpose(1, 2).contiguous().numpy() for t in _inputs(B, 4, 2, S, S, 16, seed=3))
    o, lse = st.block_sparse_attention_forward(q, k, v, mask.to_numpy())
    grads = st.block_sparse_attention_backward(q, k, v, o, lse, do, mask.to_numpy())
    want_np = st.block_sparse_attention_backward(q, k, v, o, lse, do, plain.to_numpy())
    for a, b in zip(grads, want_np):
        assert np.array_equal(a, b)
    # A padded form that places a token twice crosses every front and is refused there.
    bad = st.BlockMask.build("document_causal", S, document_ids=ids, framework="torch", doc_padding=128)
    rows = bad.backward_padded.real_rows
    first = int(torch.nonzero(rows[0] > 0)[0])
    rows[0, first] = rows[0, first] - 1
    for eager in (True, False):
        with _mode(eager):
            q, k, v, do = _inputs(B, 4, 2, S, S, 16)
            with pytest.raises((ValueError, RuntimeError), match=r"mask.backward_padded.real_rows"):
                stt.block_sparse_attention(q, k, v, bad).backward(do)
    with pytest.raises(ValueError, match=r"min_length"):
        st.BlockMask.build("document_causal", S, document_ids=ids, doc_padding=64)
    with pytest.raises(ValueError, match=r"doc_padding"):
        st.BlockMask.build("causal", S, doc_padding=128)


def test_padded_backward_form_from_cu_seqlens():
    """from_cu_seqlens(..., doc_padding=128): FlashAttention's packed documents with positions
    past the last offset (each side's own padding id there, so the query and key ids differ) get
    a padded form laid out by the query side's documents with each side's ids moved with its
    tokens; it validates, and on the CPU the results are bitwise those without it."""
    S = 900
    cu = torch.tensor([0, 130, 131, 400, 700], dtype=torch.int32)  # positions 700..899: no document
    plain = st.BlockMask.from_cu_seqlens(cu, cu, seq_q=S, causal=True)
    mask = st.BlockMask.from_cu_seqlens(cu, cu, seq_q=S, causal=True, doc_padding=128)
    p = mask.backward_padded
    assert not torch.equal(plain.spec.doc_q, plain.spec.doc_kv), "the sides' ids should differ past the last offset"
    rows = p.real_rows[0]
    assert torch.equal(rows[rows >= 0], torch.arange(S, dtype=torch.int32)) and (rows < 0).any()
    assert torch.equal(p.spec.doc_q[0][rows >= 0], plain.spec.doc_q[0])
    assert torch.equal(p.spec.doc_kv[0][rows >= 0], plain.spec.doc_kv[0])
    pos = torch.nonzero(rows >= 0).flatten()  # each token's padded position
    assert all(int(pos[t]) % 128 == 0 for t in (0, 131, 400, 700)), "documents of >= 128 tokens (and the tail) start tiles"
    p.validate()
    q, k, v, do = _inputs(1, 4, 2, S, S, 16, seed=5)
    results = []
    for m in (plain, mask):
        qq, kk, vv = (t.detach().clone().requires_grad_() for t in (q, k, v))
        o = stt.block_sparse_attention(qq, kk, vv, m)
        o.backward(do)
        results.append([o.detach(), qq.grad, kk.grad, vv.grad])
    for a, b in zip(*results):
        assert _bitwise(a, b)
    with pytest.raises(ValueError, match=r"doc_padding"):
        st.BlockMask.from_cu_seqlens(cu, torch.tensor([0, 500, 800], dtype=torch.int32), seq_q=S, seq_kv=800,
                                     doc_padding=128)
