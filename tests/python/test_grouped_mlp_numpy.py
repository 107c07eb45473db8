"""sparsetrain.GroupedMLP on numpy arrays (no torch needed): the binding's path for the fused MLP.
Forward and backward against a float64 numpy oracle with the backward written out by hand (the
torch suite checks the same against autograd), halves and interleaved GLU blocks, fp32 and bf16
(ml_dtypes), empty experts and a padded tail; results are views of library allocations; caller
buffers; delayed wgrad FIFO; probs errors name probs and leave outputs untouched."""

import ml_dtypes
import numpy as np
import pytest

import sparsetrain as st

G, T, IN, FFN, OUT = 3, 23, 7, 4, 5
SPLITS = [8, 0, 11]  # S = 19 < T
S = sum(SPLITS)
DTYPES = {"fp32": np.dtype(np.float32), "bf16": np.dtype(ml_dtypes.bfloat16)}
REL_TOL = {"fp32": 1e-5, "bf16": 2e-2}  # max error / max |ref| per tensor (wiring, not rounding)


def _close(got, ref, dtype, what):
    got = np.asarray(got).astype(np.float64)
    tol = REL_TOL[dtype] * max(np.abs(ref).max(), 1e-6)
    assert got.shape == ref.shape, what
    assert (np.abs(got - ref) <= tol).all(), f"{what}: max error {np.abs(got - ref).max():.3e} > {tol:.3e}"


def _halves(z, k):
    if k == 0:
        return z[:, :FFN], z[:, FFN:]
    b = z.reshape(len(z), FFN // k, 2, k)
    return b[:, :, 0].reshape(-1, FFN), b[:, :, 1].reshape(-1, FFN)


def _join(da, db, k):
    if k == 0:
        return np.concatenate([da, db], 1)
    return np.stack([da.reshape(len(da), FFN // k, k), db.reshape(len(db), FFN // k, k)], 2).reshape(len(da), 2 * FFN)


def _oracle(d, k):
    f = lambda a: a.astype(np.float64)  # noqa: E731
    w1, b1, w2, b2, x, p, dy = map(f, (d.w1, d.b1, d.w2, d.b2, d.x, d.p, d.dy))
    r = {n: np.zeros(s) for n, s in (("y", (T, OUT)), ("dx", x.shape), ("dp", (T,)), ("dw1", w1.shape),
                                     ("db1", b1.shape), ("dw2", w2.shape), ("db2", b2.shape))}
    start = 0
    for g, n in enumerate(SPLITS):
        rows = slice(start, start + n)
        xg, pg, dyg = x[rows], p[rows, None], dy[rows]
        a, b = _halves(xg @ w1[g].T + b1[g], k)
        sig = 1 / (1 + np.exp(-a))
        act = a * sig * b
        h = pg * act
        r["y"][rows] = h @ w2[g].T + pg * b2[g]
        dh = dyg @ w2[g]
        r["dw2"][g], r["db2"][g] = dyg.T @ h, (pg * dyg).sum(0)
        r["dp"][rows] = (dh * act).sum(1) + (dyg * b2[g]).sum(1)
        dact = pg * dh
        dz = _join(dact * b * sig * (1 + a * (1 - sig)), dact * a * sig, k)
        r["dx"][rows], r["dw1"][g], r["db1"][g] = dz @ w1[g], dz.T @ xg, dz.sum(0)
        start += n
    return r


class Data:
    def __init__(self, dtype, seed=0):
        rng, dt = np.random.default_rng(seed), DTYPES[dtype]
        self.w1 = (rng.standard_normal((G, 2 * FFN, IN)) / 2).astype(dt)
        self.b1 = rng.standard_normal((G, 2 * FFN)).astype(dt)
        self.w2 = (rng.standard_normal((G, OUT, FFN)) / 2).astype(dt)
        self.b2 = rng.standard_normal((G, OUT)).astype(dt)
        self.x = rng.standard_normal((T, IN)).astype(dt)
        self.p = rng.random(T).astype(np.float32)
        self.dy = rng.standard_normal((T, OUT)).astype(dt)

    def layer(self, k=0, **kw):
        return st.GroupedMLP(self.w1, self.w2, fc1_bias=self.b1, fc2_bias=self.b2, glu_interleave_size=k, **kw)


@pytest.mark.parametrize("k", [0, 2], ids=["halves", "interleave2"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_forward_backward_match_oracle(dtype, k):
    d = Data(dtype)
    mlp, ref = d.layer(k), _oracle(d, k)
    y, fc1_out = mlp.forward(d.x, SPLITS, d.p)
    assert y.dtype == DTYPES[dtype] and fc1_out.shape == (T, 2 * FFN)
    _close(y, ref["y"], dtype, "y")
    g = mlp.backward(d.x, fc1_out, d.p, d.dy, SPLITS)
    assert g.dprobs.dtype == np.float32
    for name, got in (("dx", g.grad_input), ("dp", g.dprobs), ("db1", g.fc1.bias_grad), ("db2", g.fc2.bias_grad),
                      ("dw1", np.stack(g.fc1.weight_grads)), ("dw2", np.stack(g.fc2.weight_grads))):
        _close(got, ref[name], dtype, name)
    assert g.fc1.weight_kind == g.fc2.weight_kind == "wgrad"
    assert not np.asarray(y[S:]).astype(np.float32).any() and not g.dprobs[S:].any(), "zero tails"


def test_caller_buffers_and_delayed_wgrad_fifo():
    d = Data("fp32")
    eager, delayed = d.layer(), d.layer(delay_wgrad_compute=True)
    out = np.full((T, OUT), np.nan, np.float32)
    gin = np.full((T, IN), np.nan, np.float32)
    y, z = eager.forward(d.x, SPLITS, d.p)
    assert delayed.forward(d.x, SPLITS, d.p, out)[0] is out
    assert np.array_equal(out[:S], y[:S]) and np.isnan(out[S:]).all()
    ge = eager.backward(d.x, z, d.p, d.dy, SPLITS)
    gd = delayed.backward(d.x, z, d.p, d.dy, SPLITS, gin)
    assert gd.grad_input is gin and np.array_equal(gin[:S], ge.grad_input[:S]) and np.isnan(gin[S:]).all()
    assert np.array_equal(gd.dprobs, ge.dprobs)
    assert gd.fc1.weight_kind == gd.fc2.weight_kind == "none" and gd.fc2.bias_grad is None
    assert delayed.pending_wgrads == 1
    dw = delayed.backward_dw()
    assert dw.grad_input is None and dw.dprobs is None and delayed.pending_wgrads == 0
    for a, b in ((dw.fc1, ge.fc1), (dw.fc2, ge.fc2)):
        assert np.array_equal(a.bias_grad, b.bias_grad)
        assert all(np.array_equal(u, v) for u, v in zip(a.weight_grads, b.weight_grads))
    with pytest.raises(ValueError, match="none pending"):
        delayed.backward_dw()


def test_bad_probs_name_probs_and_write_nothing():
    d = Data("fp32")
    mlp = d.layer()
    out = np.full((T, OUT), np.nan, np.float32)
    for bad, msg in ((d.p[:-1], r"probs: expected shape \[23\]"), (d.p.astype(np.float64), "probs: expected dtype"),
                     (d.p.astype(np.float16), "probs: expected dtype fp32"), (d.p[:, None], "probs: expected shape")):
        with pytest.raises(ValueError, match=msg):
            mlp.forward(d.x, SPLITS, bad, out)
        assert np.isnan(out).all()
    with pytest.raises(ValueError, match="fc1.weight"):
        st.GroupedMLP(d.w1[:, :-1], d.w2)  # fc1 must have 2 * ffn_features rows
