"""sparsetrain.BlockMask and block-sparse attention over numpy arrays (no torch needed: runs in
CI): builders and their tensors, schedules, validation, and forward/backward in the core's
[B, S, H, D] layout against a float64 numpy dense reference, bad input."""

import numpy as np
import pytest

import sparsetrain as st
from sparsetrain._block_mask import TENSOR_NAMES as _TENSOR_NAMES


def _allowed(kind, sq, skv, **p):
    q, kv = np.arange(sq)[:, None], np.arange(skv)[None, :]
    return {"full": np.ones((sq, skv), bool), "causal": kv <= q, "causal_bottom_right": kv <= q + skv - sq,
            "prefix_lm": (kv <= q) | (kv < p.get("prefix_length", 0))}[kind]


def _reference(q, k, v, allowed, scale=None):
    """float64 (o [B, Sq, Hq, D], lse [B, Hq, Sq], and a backward closure) for [B, S, H, D] inputs."""
    G = q.shape[2] // k.shape[2]
    q, k, v = (a.astype(np.float64) for a in (q, k, v))
    k2, v2 = np.repeat(k, G, axis=2), np.repeat(v, G, axis=2)
    scale = 1 / np.sqrt(q.shape[-1]) if scale is None else scale
    s = np.einsum("bqhd,bkhd->bhqk", q, k2) * scale
    s = np.where(allowed, s, -np.inf)
    m = s.max(-1, keepdims=True)
    any_row = np.isfinite(m)
    p = np.where(any_row, np.exp(s - np.where(any_row, m, 0)), 0)
    denom = p.sum(-1, keepdims=True)
    p = np.where(any_row, p / np.where(any_row, denom, 1), 0)
    lse = np.where(any_row[..., 0], (m + np.log(np.where(any_row, denom, 1)))[..., 0], -np.inf)
    o = np.einsum("bhqk,bkhd->bqhd", p, v2)

    def backward(do):
        do = do.astype(np.float64)
        dp = np.einsum("bqhd,bkhd->bhqk", do, v2)
        ds = p * (dp - (dp * p).sum(-1, keepdims=True)) * scale
        dq = np.einsum("bhqk,bkhd->bqhd", ds, k2)
        dk2 = np.einsum("bhqk,bqhd->bkhd", ds, q)
        dv2 = np.einsum("bhqk,bqhd->bkhd", p, do)
        B, S, _, D = k.shape
        return dq, dk2.reshape(B, S, -1, G, D).sum(3), dv2.reshape(B, S, -1, G, D).sum(3)

    return o, lse, backward


@pytest.mark.parametrize("kind,sq,skv", [("causal", 45, 45), ("causal_bottom_right", 29, 61), ("full", 37, 53),
                                         ("prefix_lm", 50, 50)])
def test_forward_backward_vs_float64(kind, sq, skv):
    rng = np.random.default_rng(0)
    B, Hq, Hkv, D = 2, 4, 2, 16
    q = rng.standard_normal((B, sq, Hq, D), np.float32)
    k = rng.standard_normal((B, skv, Hkv, D), np.float32)
    v = rng.standard_normal((B, skv, Hkv, D), np.float32)
    do = rng.standard_normal((B, sq, Hq, D), np.float32)
    mask = st.BlockMask.build(kind, sq, skv, block_size=16, prefix_length=19)
    o, lse = st.block_sparse_attention_forward(q, k, v, mask)
    dq, dk, dv = st.block_sparse_attention_backward(q, k, v, o, lse, do, mask)
    ro, rlse, back = _reference(q, k, v, _allowed(kind, sq, skv, prefix_length=19))
    rdq, rdk, rdv = back(do)
    assert o.shape == (B, sq, Hq, D) and lse.shape == (B, Hq, sq) and o.dtype == np.float32
    for got, ref in ((o, ro), (lse, rlse), (dq, rdq), (dk, rdk), (dv, rdv)):
        np.testing.assert_allclose(got, ref, rtol=2e-5, atol=2e-5)


def test_builders_schedules_and_checks():
    m = st.BlockMask.build("causal", 64, block_size=16, schedule="left_to_right")
    assert (m.schedule, m.framework) == ("left_to_right", "numpy")
    assert not hasattr(m, "sub_tiles")  # turns are in the mask's block units: no kernel tile leaks in
    assert m.kv_num_blocks.tolist() == [[[1, 1, 1, 1]]] and m.full_kv_indices[0, 0, 3, :3].tolist() == [0, 1, 2]
    assert m.check_write_order() == ""
    m.validate()
    p = m.with_schedule([3, 1, 2, 0])
    assert p.schedule == "permutation" and p.schedule_permutation.tolist() == [3, 1, 2, 0]
    assert p.check_write_order() == "" and p.kv_indices is m.kv_indices
    d = st.BlockMask.build("document_causal", 40, document_ids=np.repeat([0, 1, 2], [10, 20, 10]), block_size=8)
    assert d.spec.doc_q.dtype == np.int32 and d.spec.doc_q.shape == (1, 40)
    d.validate()
    blocks = np.zeros((1, 1, 3, 3), np.uint8)
    blocks[0, 0, [0, 1, 2], [0, 1, 2]] = 1
    b = st.BlockMask.from_blocks(blocks, 48, 48, block_size=16)
    assert b.kv_num_blocks.tolist() == [[[1, 1, 1]]] and b.full_kv_num_blocks.tolist() == [[[0, 0, 0]]]


def test_bad_input():
    rng = np.random.default_rng(1)
    q = rng.standard_normal((1, 40, 2, 16), np.float32)
    k = rng.standard_normal((1, 40, 1, 16), np.float32)
    m = st.BlockMask.build("causal", 40, block_size=16)
    with pytest.raises(ValueError, match="v: expected shape"):
        st.block_sparse_attention_forward(q, k, k[:, :30], m)
    with pytest.raises(ValueError, match="k: expected dtype fp32"):
        st.block_sparse_attention_forward(q, k.astype(np.float16), k, m)
    with pytest.raises(ValueError, match=r"mask.seq_q: expected 30 \(q's Sq\), got 40"):
        st.block_sparse_attention_forward(q[:, :30], k, k, m)
    bad = st.BlockMask.build("causal", 40, block_size=16)
    bad.q_indices[0, 0, 0, 0] = 2
    with pytest.raises(ValueError, match="q_indices"):
        bad.validate()
    with pytest.raises(ValueError, match=r"blocks\[0, 0, 0, 0\]: expected 0 \(skipped\), 1 \(partial\) or 2 \(full\)"):
        st.BlockMask.from_blocks(np.full((1, 1, 3, 3), 3, np.uint8), 40, 40, block_size=16)


# -- FlashAttention's packed documents (cu_seqlens) ---------------------------------------------------

_LENGTHS = [1, 2, 63, 64, 0, 65, 127, 128, 129, 30]  # an empty document included


def _ids_by_hand(lengths, seq, label, pad):
    """Document i -> label(i) over its positions, `pad` past the last one."""
    ids = np.full((1, seq), pad, np.int32)
    ids[0, :sum(lengths)] = np.repeat([label(i) for i in range(len(lengths))], lengths)
    return ids


@pytest.mark.parametrize("kind", ["document", "document_causal"])
@pytest.mark.parametrize("pad", [0, 21], ids=["exact", "padded"])
def test_cu_seqlens_equal_the_document_id_form(kind, pad):
    """The packed form gives the documented ids (document i -> i, padding n / n + 1), and the same
    mask tensors and bitwise the same attention as those documents given as ids in another
    labelling (7 i + 3, padding -1 / -2: the mask is the same, the id tensors are not)."""
    cu = np.cumsum([0] + _LENGTHS).astype(np.int32)
    S, n = int(cu[-1]) + pad, len(_LENGTHS)
    doc_q, doc_kv = st.document_ids_from_cu_seqlens(cu, cu, S, S)
    np.testing.assert_array_equal(doc_q, _ids_by_hand(_LENGTHS, S, lambda i: i, n))
    np.testing.assert_array_equal(doc_kv, _ids_by_hand(_LENGTHS, S, lambda i: i, n + 1))
    m = st.BlockMask.from_cu_seqlens(cu, cu, max(_LENGTHS), max(_LENGTHS), seq_q=S, causal=kind == "document_causal",
                                     block_size=(32, 16))
    assert m.spec.kind == kind and (m.seq_q, m.seq_kv) == (S, S)
    ref = st.BlockMask.build(kind, S, doc_q=_ids_by_hand(_LENGTHS, S, lambda i: 7 * i + 3, -1),
                             doc_kv=_ids_by_hand(_LENGTHS, S, lambda i: 7 * i + 3, -2), block_size=(32, 16))
    for name, t in m.tensors().items():
        if name not in ("doc_q", "doc_kv") and t is not None:
            np.testing.assert_array_equal(t, getattr(ref, name), err_msg=name)
    assert m.schedule == ref.schedule
    rng = np.random.default_rng(3)
    q, k, v, do = (rng.standard_normal((1, S, 2, 16), np.float32) for _ in range(4))
    o, lse = st.block_sparse_attention_forward(q, k, v, m)
    ro, rlse = st.block_sparse_attention_forward(q, k, v, ref)
    assert o.tobytes() == ro.tobytes() and lse.tobytes() == rlse.tobytes()
    grads = st.block_sparse_attention_backward(q, k, v, o, lse, do, m)
    rgrads = st.block_sparse_attention_backward(q, k, v, ro, rlse, do, ref)
    assert all(g.tobytes() == r.tobytes() for g, r in zip(grads, rgrads))
    assert np.isneginf(lse[0, :, int(cu[-1]):]).all() and (o[0, int(cu[-1]):] == 0).all()
    # The build() keyword, lists and the defaults (seq_q = cu[-1], cu_seqlens_k = cu_seqlens_q).
    b = st.BlockMask.build(kind, S, cu_seqlens_q=cu.tolist(), block_size=(32, 16))
    np.testing.assert_array_equal(b.kv_indices, m.kv_indices)
    d = st.BlockMask.from_cu_seqlens(cu)
    assert d.spec.kind == "document" and d.seq_q == d.seq_kv == int(cu[-1])


def test_cu_seqlens_cross_attention_documents():
    """Sq != Skv documents (other key lengths): "document" is FlashAttention's non-causal varlen
    mask; "document_causal" is kv <= q in packed positions (not FlashAttention's bottom-right,
    which it equals only when cu_seqlens_q == cu_seqlens_k)."""
    cu_q = np.cumsum([0, 5, 70, 1, 40]).astype(np.int32)
    cu_k = np.cumsum([0, 9, 3, 60, 33]).astype(np.int32)
    doc_q, doc_kv = st.document_ids_from_cu_seqlens(cu_q, cu_k)
    assert doc_q.shape == (1, 116) and doc_kv.shape == (1, 105)
    q_doc = np.searchsorted(cu_q, np.arange(116), side="right") - 1
    k_doc = np.searchsorted(cu_k, np.arange(105), side="right") - 1
    flash = q_doc[:, None] == k_doc[None, :]
    np.testing.assert_array_equal(doc_q[0][:, None] == doc_kv[0][None, :], flash)
    m = st.BlockMask.from_cu_seqlens(cu_q, cu_k, block_size=16)
    rng = np.random.default_rng(4)
    q = rng.standard_normal((1, 116, 2, 16), np.float32)
    k, v = (rng.standard_normal((1, 105, 1, 16), np.float32) for _ in range(2))
    o, lse = st.block_sparse_attention_forward(q, k, v, m)
    ro, rlse, _ = _reference(q, k, v, flash)
    np.testing.assert_allclose(o, ro, rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(lse, rlse, rtol=2e-5, atol=2e-5)


def test_cu_seqlens_bad_input():
    cu = np.array([0, 3, 7], np.int32)
    with pytest.raises(ValueError, match="cu_seqlens_q: expected dtype int32"):
        st.document_ids_from_cu_seqlens(cu.astype(np.int64), cu, 8, 8)
    with pytest.raises(ValueError, match="cu_seqlens_k: expected as many documents as cu_seqlens_q"):
        st.document_ids_from_cu_seqlens(cu, np.array([0, 7], np.int32), 8, 8)
    with pytest.raises(ValueError, match="cu_seqlens_q: expected a 1-d tensor"):
        st.document_ids_from_cu_seqlens(cu[None], cu, 8, 8)
    with pytest.raises(ValueError, match=r"cu_seqlens_q\[-1\]: expected <= seq_q = 6"):
        st.document_ids_from_cu_seqlens(cu, cu, 6, 8)
    with pytest.raises(ValueError, match=r"cu_seqlens_k\[2\]: expected >= the previous offset 3"):
        st.document_ids_from_cu_seqlens(cu, np.array([0, 3, 2], np.int32), 8, 8)
    with pytest.raises(ValueError, match="cu_seqlens_q: expected none for kind 'causal'"):
        st.BlockMask.build("causal", 8, cu_seqlens_q=cu)
    with pytest.raises(ValueError, match="expected either cu_seqlens or document ids, got both"):
        st.BlockMask.build("document", 8, cu_seqlens_q=cu, document_ids=np.zeros(8, np.int32))
    with pytest.raises(ValueError, match="cu_seqlens_q: expected the query offsets with cu_seqlens_k"):
        st.BlockMask.build("document", 8, cu_seqlens_k=cu)
    with pytest.raises(ValueError, match="max_seqlen_q: expected an int >= 0 or None"):
        st.BlockMask.from_cu_seqlens(cu, cu, -1, 4)


def test_mask_descriptors_follow_the_masks_tensors():
    """The extension's view of a mask is cached on it (every call reads it); a mask whose tensors
    are replaced is read with its new tensors, never the old ones."""
    rng = np.random.default_rng(1)
    q, k, v = (rng.standard_normal((1, 48, 2, 16), np.float32) for _ in range(3))
    mask = st.BlockMask.build("causal", 48, block_size=16)
    full = st.BlockMask.build("full", 48, block_size=16)
    o1, _ = st.block_sparse_attention_forward(q, k, v, mask)
    assert np.array_equal(st.block_sparse_attention_forward(q, k, v, mask)[0], o1)
    for name in _TENSOR_NAMES:
        setattr(mask, name, getattr(full, name))
    o2, _ = st.block_sparse_attention_forward(q, k, v, mask)
    assert np.array_equal(o2, st.block_sparse_attention_forward(q, k, v, full)[0])
    assert not np.array_equal(o2, o1)
