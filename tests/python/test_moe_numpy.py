"""The MoE router through the array API (sparsetrain.route / route_backward, numpy on the CPU)
against an oracle written here in float64: scores, the choice by a stable sort (float32 score +
bias descending, ties to the lower expert), the layout by a stable sort of the (expert, token)
pairs, the logits' gradient by central differences. Fresh random data each run (the seed is in
the failure message); bad arguments raise ValueError naming them."""

import numpy as np
import pytest

import sparsetrain as st


def scores(l, score):
    if score == "sigmoid":
        return 1.0 / (1.0 + np.exp(-l))
    e = np.exp(l - l.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def oracle(logits, top_k, score, normalize, bias):
    l = logits.astype(np.float64)
    s = scores(l, score)
    value = s.astype(np.float32) + (0 if bias is None else bias)
    experts = np.stack([np.argsort(-v, kind="stable")[:top_k] for v in value])
    probs = np.take_along_axis(s, experts, axis=1)
    if normalize:
        probs = probs / probs.sum(axis=1, keepdims=True)
    N, E = logits.shape
    pairs = sorted(((experts[n, i], n, i) for n in range(N) for i in range(top_k)), key=lambda p: p[0])
    row_of = np.empty((N, top_k), np.int64)
    for r, (_, n, i) in enumerate(pairs):
        row_of[n, i] = r
    token_of_row = np.array([n for _, n, _ in pairs])
    counts = np.bincount(experts.ravel(), minlength=E)
    return experts, probs, counts, row_of, token_of_row, s.sum(axis=0)


def loss_grad(logits, experts, dprobs, dsum, score, normalize):
    l0 = logits.astype(np.float64)
    g = np.zeros_like(l0)
    h = 1e-6

    def loss(l):
        s = scores(l, score)
        p = np.take_along_axis(s, experts, axis=1)
        if normalize:
            p = p / p.sum(axis=1, keepdims=True)
        return (dprobs * p).sum() + (0 if dsum is None else (dsum * s.sum(axis=0)).sum())

    for idx in np.ndindex(*l0.shape):
        up, down = l0.copy(), l0.copy()
        up[idx] += h
        down[idx] -= h
        g[idx] = (loss(up) - loss(down)) / (2 * h)
    return g


@pytest.mark.parametrize("N,E,K,score,normalize,with_bias", [
    (23, 8, 2, "softmax", False, False),
    (23, 8, 2, "softmax", True, False),
    (17, 16, 4, "sigmoid", True, True),
    (9, 1, 1, "sigmoid", False, False),
    (6, 64, 8, "softmax", True, True),
])
def test_route_matches_the_oracle(N, E, K, score, normalize, with_bias):
    seed = int(np.random.SeedSequence().entropy % 2**31)
    rng = np.random.default_rng(seed)
    logits = rng.normal(scale=2.0, size=(N, E)).astype(np.float32)
    bias = rng.normal(scale=0.3, size=E).astype(np.float32) if with_bias else None
    r = st.route(logits, K, score=score, normalize=normalize, expert_bias=bias)
    experts, probs, counts, row_of, token_of_row, score_sum = oracle(logits, K, score, normalize, bias)
    np.testing.assert_array_equal(r.experts, experts, err_msg=f"seed {seed}")
    np.testing.assert_allclose(r.probs, probs, rtol=2e-6, atol=1e-7, err_msg=f"seed {seed}")
    np.testing.assert_array_equal(r.counts, counts, err_msg=f"seed {seed}")
    np.testing.assert_array_equal(r.row_of, row_of, err_msg=f"seed {seed}")
    np.testing.assert_array_equal(r.token_of_row, token_of_row, err_msg=f"seed {seed}")
    np.testing.assert_allclose(r.score_sum, score_sum, rtol=1e-5, atol=1e-6 * N, err_msg=f"seed {seed}")
    assert r.experts.dtype == np.int32 and r.counts.dtype == np.int64 and r.probs.dtype == np.float32

    dprobs = rng.normal(size=(N, K)).astype(np.float32)
    dsum = rng.normal(size=E).astype(np.float32)
    for ds in (None, dsum):
        got = st.route_backward(logits, r.experts, dprobs, K, score=score, normalize=normalize, dscore_sum=ds)
        want = loss_grad(logits, experts, dprobs.astype(np.float64), None if ds is None else ds.astype(np.float64),
                         score, normalize)
        assert not np.isnan(got).any()
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=2e-5, err_msg=f"seed {seed}, dscore_sum {ds is not None}")


def test_route_errors_name_the_argument():
    logits = np.zeros((4, 6), np.float32)
    with pytest.raises(ValueError, match="top_k: expected 1 <= top_k <= num_experts = 6, got 7"):
        st.route(logits, 7)
    with pytest.raises(ValueError, match="score: expected softmax or sigmoid, got relu"):
        st.route(logits, 2, score="relu")
    with pytest.raises(ValueError, match=r"logits: expected a 2-d array \[N, E\]"):
        st.route(np.zeros(6, np.float32), 2)
    with pytest.raises(ValueError, match="logits: expected dtype fp32"):
        st.route(np.zeros((4, 6), np.int32), 2)
    with pytest.raises(ValueError, match=r"expert_bias: expected shape \[6\]"):
        st.route(logits, 2, expert_bias=np.zeros(5, np.float32))
    r = st.route(logits, 2)
    with pytest.raises(ValueError, match=r"dprobs: expected shape \[N = 4, top_k = 2\]"):
        st.route_backward(logits, r.experts, np.zeros((4, 3), np.float32), 2)


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_combine_rows_sums_each_tokens_rows_in_slot_order(dtype):
    """sparsetrain.combine_rows: out[n] = rows[row_of[n, 0]] + ... in float32 from 0, slot by
    slot, rounded once (written here as that loop); rows used by several tokens or by none."""
    seed = int(np.random.SeedSequence().entropy % 2**32)
    rng = np.random.default_rng(seed)
    N, R, H, K = 29, 41, 11, 3
    rows = (rng.standard_normal((R, H)) * 3).astype(dtype)
    row_of = rng.integers(0, R, (N, K)).astype(np.int32)
    acc = np.zeros((N, H), np.float32)
    for i in range(K):
        acc = acc + rows[row_of[:, i]].astype(np.float32)
    got = st.combine_rows(rows, row_of)
    assert got.dtype == rows.dtype and got.shape == (N, H)
    assert np.array_equal(got, acc.astype(dtype)), f"seed {seed}"


def test_combine_rows_errors_name_the_argument():
    rows = np.ones((4, 3), np.float32)
    with pytest.raises(ValueError, match="row_of.*int32"):
        st.combine_rows(rows, np.zeros((2, 2), np.int64))
    with pytest.raises(ValueError, match=r"row_of.*\[0, R = 4\)"):
        st.combine_rows(rows, np.array([[0, 4]], np.int32))
    with pytest.raises(ValueError, match="rows.*bf16, fp16 or fp32"):
        st.combine_rows(np.ones((4, 3), np.int32), np.zeros((2, 2), np.int32))
