"""The built-in mask kinds as dense boolean matrices, straight from mask_spec.h's definitions and
written apart from the library: the attention tests' oracle of which (query, key) pairs a mask
allows."""

import torch


def dense_mask(kind, sq, skv, *, window_left=-1, window_right=-1, prefix_length=0, doc_q=None, doc_kv=None):
    """bool [B or 1, 1, Sq, Skv]: "full", "causal" (kv <= q), "causal_bottom_right" (kv <= q + Skv -
    Sq), "sliding_window" (q - window_left <= kv <= q + window_right, a negative bound unbounded),
    "prefix_lm" (kv <= q or kv < prefix_length), "document" / "document_causal" (equal ids of
    doc_q [B or 1, Sq] and doc_kv [B or 1, Skv], and kv <= q)."""
    q = torch.arange(sq)[:, None]
    kv = torch.arange(skv)[None, :]
    if kind == "full":
        m = torch.ones(sq, skv, dtype=torch.bool)
    elif kind == "causal":
        m = kv <= q
    elif kind == "causal_bottom_right":
        m = kv <= q + (skv - sq)
    elif kind == "sliding_window":
        m = torch.ones(sq, skv, dtype=torch.bool)
        if window_left >= 0:
            m = m & (kv >= q - window_left)
        if window_right >= 0:
            m = m & (kv <= q + window_right)
    elif kind == "prefix_lm":
        m = (kv <= q) | (kv < prefix_length)
    elif kind in ("document", "document_causal"):
        dq, dkv = torch.as_tensor(doc_q).reshape(-1, sq), torch.as_tensor(doc_kv).reshape(-1, skv)
        m = dq[:, :, None] == dkv[:, None, :]
        if kind == "document_causal":
            m = m & (kv <= q)
        return m[:, None]
    else:
        raise AssertionError(kind)
    return m[None, None]
