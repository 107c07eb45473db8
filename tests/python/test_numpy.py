"""sparsetrain.GroupedLinear on numpy arrays: the path through the nanobind binding.

Covers what the C++ suites cannot: conversion of numpy inputs (bf16 through ml_dtypes as a
(uint16 view, "bf16") pair, read-only and row-strided arrays), results handed back as numpy views
of library allocations (dtype, zero tail, weight grads on 256-byte boundaries), caller buffers
written in place, host splits as lists / int32 / int64 arrays, DeviceSplits and their status word,
main_grad fusion, the weight-grad table through real calls, delayed wgrad FIFO, ValueError mapping
of bad input (no output touched), determinism. Values are checked against a float64 oracle from the
exact inputs: |got - ref| <= 2u|ref| + (n + 2) 2^-24 sum|terms| (u: unit roundoff of the output
dtype, n: terms of the fp32 reduction), written so that NaN never passes.
"""

import zlib
from types import SimpleNamespace as NS

import ml_dtypes
import numpy as np
import pytest

import sparsetrain as st

DTYPES = {"bf16": np.dtype(ml_dtypes.bfloat16), "fp16": np.dtype(np.float16), "fp32": np.dtype(np.float32)}
UNIT_ROUNDOFF = {"bf16": 2.0**-8, "fp16": 2.0**-11, "fp32": 2.0**-24}
SMALLEST_SUBNORMAL = {"bf16": 2.0**-133, "fp16": 2.0**-24, "fp32": 2.0**-149}

CASES = {  # odd shapes: prime T, in/out not multiples of 8, empty experts, padded tails
    "G1-T37-full-in13-out5": NS(G=1, T=37, in_f=13, out_f=5, splits=[37]),
    "G1-T61-tail-in3-out5": NS(G=1, T=61, in_f=3, out_f=5, splits=[50]),
    "G7-T61-empties-tail-in5-out13": NS(G=7, T=61, in_f=5, out_f=13, splits=[9, 0, 14, 0, 0, 20, 11]),
    "G4-T37-first-last-empty-in13-out3": NS(G=4, T=37, in_f=13, out_f=3, splits=[0, 17, 12, 0]),
}
SMALL = NS(G=4, T=23, in_f=6, out_f=5, splits=[7, 0, 11, 2])  # S = 20 < T, expert 1 empty
BF16 = DTYPES["bf16"]


@pytest.fixture
def rng(request):
    """A generator seeded from the test's own name: fixed per test, different across tests."""
    return np.random.default_rng(zlib.crc32(request.node.name.encode()))


def bits(a):
    """The raw bits of an array, for bitwise comparisons (NaN patterns and -0.0 included)."""
    a = np.ascontiguousarray(a)
    return a.view({2: np.uint16, 4: np.uint32}[a.dtype.itemsize])


def assert_bitwise_equal(a, b, what=""):
    assert a.shape == b.shape and a.dtype == b.dtype, what
    assert np.array_equal(bits(a), bits(b)), f"{what}: not bitwise identical"


def assert_zero(a, what=""):
    assert not bits(a).any(), f"{what}: expected all +0.0"


def assert_close(got, ref, abs_sum, n_terms, dtype, what):
    assert got.shape == ref.shape, what
    got = np.asarray(got).astype(np.float64)
    u = UNIT_ROUNDOFF[dtype]
    tol = 2 * u * np.abs(ref) + (n_terms + 2) * 2.0**-24 * abs_sum * (1 + 2 * u) + SMALLEST_SUBNORMAL[dtype]
    ok = np.abs(got - ref) <= tol  # False for NaN
    if not ok.all():
        i = tuple(np.argwhere(~ok)[0])
        pytest.fail(f"{what}: {(~ok).sum()} elements off; first {i}: got {got[i]!r}, ref {ref[i]!r}, tol {tol[i]!r}")


def make_data(case, dtype, rng, bias=True, T=None, splits=None):
    dt, T = DTYPES[dtype], case.T if T is None else T
    d = NS(dtype=dtype, T=T, splits=list(case.splits if splits is None else splits))
    d.S = sum(d.splits)
    d.w = rng.standard_normal((case.G, case.out_f, case.in_f)).astype(dt)
    d.b = rng.standard_normal((case.G, case.out_f)).astype(dt) if bias else None
    d.x = rng.standard_normal((T, case.in_f)).astype(dt)
    d.dy = rng.standard_normal((T, case.out_f)).astype(dt)
    return d


def oracle(d):
    """float64 reference, and sum|terms| of each element for the tolerance."""
    w, x, dy = (a.astype(np.float64) for a in (d.w, d.x, d.dy))
    b = np.zeros(w.shape[:2]) if d.b is None else d.b.astype(np.float64)
    r = NS(y=np.zeros((d.T, w.shape[1])), dx=np.zeros_like(x), dw=np.zeros_like(w), db=np.zeros_like(b))
    r.y_abs, r.dx_abs, r.dw_abs, r.db_abs = (np.zeros_like(a) for a in (r.y, r.dx, r.dw, r.db))
    offs = np.concatenate([[0], np.cumsum(d.splits)])
    for g in range(w.shape[0]):
        rows = slice(offs[g], offs[g + 1])
        xg, dyg = x[rows], dy[rows]
        r.y[rows], r.y_abs[rows] = xg @ w[g].T + b[g], np.abs(xg) @ np.abs(w[g]).T + np.abs(b[g])
        r.dx[rows], r.dx_abs[rows] = dyg @ w[g], np.abs(dyg) @ np.abs(w[g])
        r.dw[g], r.dw_abs[g] = dyg.T @ xg, np.abs(dyg).T @ np.abs(xg)
        r.db[g], r.db_abs[g] = dyg.sum(0), np.abs(dyg).sum(0)
    return r


def make_layer(d, packed=True, main_grad=None, **kw):
    w = d.w if packed else [wg.copy() for wg in d.w]
    b = d.b if (packed or d.b is None) else [bg.copy() for bg in d.b]
    return st.GroupedLinear(w, b, main_grad, **kw)


def grads_equal(g1, g2):
    assert g1.weight_kind == g2.weight_kind
    pairs = [(g1.grad_input, g2.grad_input), (g1.bias_grad, g2.bias_grad)]
    for a, b in pairs + list(zip(g1.weight_grads or [], g2.weight_grads or [])):
        assert (a is None) == (b is None)
        if a is not None:
            assert_bitwise_equal(a, b)


# 1. forward / backward against the oracle


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
@pytest.mark.parametrize("packed", [True, False], ids=["packed", "per-group"])
@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
@pytest.mark.parametrize("dtype", DTYPES)
def test_forward_backward_match_oracle(dtype, case, packed, bias, rng):
    d, dt = make_data(case, dtype, rng, bias), DTYPES[dtype]
    ref, layer, S, rows = oracle(d), make_layer(d, packed), d.S, max(d.splits)

    y = layer.forward(d.x, d.splits)
    assert isinstance(y, np.ndarray) and y.dtype == dt and y.shape == (case.T, case.out_f)
    assert_close(y[:S], ref.y[:S], ref.y_abs[:S], case.in_f + 1, dtype, "y")
    assert_zero(y[S:], "y tail")

    g = layer.backward(d.x, d.dy, d.splits)
    assert g.grad_input.dtype == dt and g.grad_input.shape == (case.T, case.in_f)
    assert_close(g.grad_input[:S], ref.dx[:S], ref.dx_abs[:S], case.out_f, dtype, "dx")
    assert_zero(g.grad_input[S:], "dx tail")

    assert g.weight_kind == "wgrad" and not g.grad_added_to_main_grad and len(g.weight_grads) == case.G
    packed_dw = g.weight_grad_packed
    assert isinstance(packed_dw, np.ndarray) and packed_dw.dtype == dt
    assert packed_dw.shape == (case.G, case.out_f, case.in_f)
    for i, dw in enumerate(g.weight_grads):
        assert isinstance(dw, np.ndarray) and dw.dtype == dt and dw.shape == (case.out_f, case.in_f)
        assert dw.ctypes.data % 256 == 0, f"dW[{i}] not on a 256-byte boundary"
        assert dw.ctypes.data == packed_dw[i].ctypes.data, f"dW[{i}] is not the packed buffer's slice"
        assert_bitwise_equal(dw, packed_dw[i], f"dW[{i}] vs packed")
        assert_close(dw, ref.dw[i], ref.dw_abs[i], rows, dtype, f"dW[{i}]")
        if d.splits[i] == 0:
            assert_zero(dw, f"dW[{i}] of an empty expert")
    if bias:
        assert g.bias_grad.dtype == dt and g.bias_grad.shape == (case.G, case.out_f)
        assert_close(g.bias_grad, ref.db, ref.db_abs, rows, dtype, "db")
    else:
        assert g.bias_grad is None


# 2. caller buffers


@pytest.mark.parametrize("rows", ["T", "S", "T+3"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_caller_buffers_written_in_place(dtype, rows, rng):
    case = CASES["G7-T61-empties-tail-in5-out13"]
    d = make_data(case, dtype, rng)
    S, R = d.S, {"T": case.T, "S": d.S, "T+3": case.T + 3}[rows]
    layer = make_layer(d)
    out = np.full((R, case.out_f), np.nan, DTYPES[dtype])
    gin = np.full((R, case.in_f), np.nan, DTYPES[dtype])

    assert layer.forward(d.x, d.splits, out=out) is out
    g = layer.backward(d.x, d.dy, d.splits, grad_input=gin)
    assert g.grad_input is gin

    y_lib, g_lib = layer.forward(d.x, d.splits), layer.backward(d.x, d.dy, d.splits)
    assert_bitwise_equal(out[:S], y_lib[:S], "out rows < S")
    assert_bitwise_equal(gin[:S], g_lib.grad_input[:S], "grad_input rows < S")
    assert np.isnan(out[S:].astype(np.float32)).all() and np.isnan(gin[S:].astype(np.float32)).all()
    grads_equal(g._replace(grad_input=None), g_lib._replace(grad_input=None))


# 3. splits: host list / tuple / int64 / int32 arrays, DeviceSplits and their status word

SPLITS_FORMS = {
    "tuple": tuple,
    "int64-array": lambda s: np.array(s, np.int64),
    "int32-array": lambda s: np.array(s, np.int32),
    "whole-floats": lambda s: [float(v) for v in s],  # 7.0 is 7: the list rule reads values
    "device-status-0": lambda s: st.DeviceSplits(np.array(s, np.int64), np.zeros(1, np.int32)),
    "device-status-1": lambda s: st.DeviceSplits(np.array(s, np.int64), np.ones(1, np.int32)),
    "device-no-status": lambda s: st.DeviceSplits(np.array(s, np.int64)),
}


@pytest.mark.parametrize("form", SPLITS_FORMS.values(), ids=SPLITS_FORMS.keys())
@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_splits_forms_give_identical_results(dtype, form, rng):
    d = make_data(SMALL, dtype, rng)
    layer = make_layer(d)
    y_ref, g_ref = layer.forward(d.x, d.splits), layer.backward(d.x, d.dy, d.splits)  # host list
    splits = form(d.splits)
    status = getattr(splits, "status", None)
    status_before = None if status is None else status.copy()
    assert_bitwise_equal(layer.forward(d.x, splits), y_ref, "y")
    grads_equal(layer.backward(d.x, d.dy, splits), g_ref)
    if status is not None:  # sticky: valid splits neither set nor clear bits, nor read them
        assert_bitwise_equal(status, status_before, "status")


INVALID_DEVICE_SPLITS = {
    "negative": ([7, -1, 11, 2], st.SPLITS_NEGATIVE),
    "sum-exceeds-T": ([7, 0, 11, 6], st.SPLITS_SUM_EXCEEDS_ROWS),
    "huge-no-overflow": ([2**62] * 4, st.SPLITS_SUM_EXCEEDS_ROWS),
}


@pytest.mark.parametrize("values,bit", INVALID_DEVICE_SPLITS.values(), ids=INVALID_DEVICE_SPLITS.keys())
def test_invalid_device_splits_empty_everything_and_set_status(values, bit, rng):
    d = make_data(SMALL, "bf16", rng)
    layer = make_layer(d)
    status = np.zeros(1, np.int32)
    splits = st.DeviceSplits(np.array(values, np.int64), status)

    y = layer.forward(d.x, splits)  # no exception: the host never reads device splits
    assert y.shape == (SMALL.T, SMALL.out_f)
    assert_zero(y, "y")
    out = np.full((SMALL.T, SMALL.out_f), np.nan, BF16)
    assert layer.forward(d.x, splits, out=out) is out
    assert np.isnan(out.astype(np.float32)).all(), "S = 0: the caller's out stays as it was"
    g = layer.backward(d.x, d.dy, splits)
    assert g.weight_kind == "wgrad"
    for a in [g.grad_input, g.bias_grad, *g.weight_grads]:
        assert_zero(a, "grads of invalid splits")
    assert int(status[0]) == bit


def test_status_word_ors_two_kinds_over_a_preset_bit(rng):
    """The status word is ORed into, never assigned: a bit the caller set stays, and a negative
    entry in one call and a sum above T in the next (forward and backward) leave both bits. The CPU
    backend runs the device splits' set-up code (compute_group_offsets) on the host."""
    d = make_data(SMALL, "bf16", rng)
    layer = make_layer(d)
    preset = 1 << int(rng.integers(8, 28))  # a bit outside SplitsStatus
    status = np.array([preset], np.int32)
    negative = rng.integers(0, 5, SMALL.G)
    negative[rng.integers(SMALL.G)] = -int(rng.integers(1, 100))
    too_many = rng.integers(0, 5, SMALL.G)
    too_many[rng.integers(SMALL.G)] += SMALL.T + 1
    layer.forward(d.x, st.DeviceSplits(negative.astype(np.int64), status))
    assert int(status[0]) == preset | st.SPLITS_NEGATIVE
    layer.backward(d.x, d.dy, st.DeviceSplits(too_many.astype(np.int64), status))
    assert int(status[0]) == preset | st.SPLITS_NEGATIVE | st.SPLITS_SUM_EXCEEDS_ROWS
    layer.forward(d.x, st.DeviceSplits(np.array(d.splits, np.int64), status))
    assert int(status[0]) == preset | st.SPLITS_NEGATIVE | st.SPLITS_SUM_EXCEEDS_ROWS, "valid splits clear nothing"


# 4. main_grad fusion


@pytest.mark.parametrize("overwrite", [False, True], ids=["accumulate", "overwrite"])
@pytest.mark.parametrize("packed", [True, False], ids=["packed", "per-group"])
@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_main_grad_fusion(dtype, packed, overwrite, rng):
    d = make_data(SMALL, dtype, rng)
    ref = oracle(d)
    m0 = rng.standard_normal((SMALL.G, SMALL.out_f, SMALL.in_f)).astype(np.float32)
    m0[1, 0, 0] = m0[1, 2, 3] = -0.0  # expert 1 has no rows: accumulate must keep -0.0 bitwise
    main_grad = m0.copy() if packed else [m.copy() for m in m0]
    layer = make_layer(d, packed, main_grad, fuse_wgrad_accumulation=True, overwrite_main_grad=overwrite)

    g = layer.backward(d.x, d.dy, d.splits)
    assert g.weight_kind == "none" and g.weight_grads is None and g.weight_grad_packed is None
    assert not g.grad_added_to_main_grad
    assert_close(g.bias_grad, ref.db, ref.db_abs, max(d.splits), dtype, "db (never fused)")
    for i, n in enumerate(d.splits):
        what = f"main_grad[{i}] ({n} rows)"
        if n == 0 and overwrite:
            assert_zero(main_grad[i], what)
        elif n == 0:
            assert_bitwise_equal(main_grad[i], m0[i], what)
        elif overwrite:
            assert_close(main_grad[i], ref.dw[i], ref.dw_abs[i], n, "fp32", what)
        else:
            assert_close(main_grad[i], m0[i] + ref.dw[i], np.abs(m0[i]) + ref.dw_abs[i], n + 1, "fp32", what)


# 5. the weight-grad disposition table, delayed wgrad

TABLE = [  # delay, fuse, has grad_added_to_main_grad -> weight grad, bias grad now ("-" rows: both)
    (False, False, False, "wgrad", True), (False, False, True, "wgrad", True),
    (True, False, False, "none", False), (True, False, True, "none", False),
    (False, True, False, "none", True), (False, True, True, "dummy", True),
    (True, True, False, "none", False), (True, True, True, "dummy", False),
]
TABLE_IDS = [f"delay={int(r[0])}-fuse={int(r[1])}-attr={int(r[2])}" for r in TABLE]


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "per-group"])
@pytest.mark.parametrize("delay,fuse,attr,kind,bias_now", TABLE, ids=TABLE_IDS)
def test_weight_grad_disposition_through_layer(delay, fuse, attr, kind, bias_now, packed, rng):
    assert tuple(st.weight_grad_disposition(delay, fuse, attr)) == (kind, bias_now)  # the rule itself
    d = make_data(SMALL, "bf16", rng)
    main_grad = np.zeros((SMALL.G, SMALL.out_f, SMALL.in_f), np.float32) if fuse else None
    layer = make_layer(d, packed, main_grad, fuse_wgrad_accumulation=fuse, delay_wgrad_compute=delay,
                       has_grad_added_to_main_grad=attr)
    g = layer.backward(d.x, d.dy, d.splits)
    assert g.weight_kind == kind and g.grad_added_to_main_grad == (kind == "dummy")
    assert (g.bias_grad is not None) == bias_now and layer.pending_wgrads == int(delay)
    if kind == "none":
        assert g.weight_grads is None and g.weight_grad_packed is None
    else:
        assert [(w.shape, w.dtype) for w in g.weight_grads] == [((SMALL.out_f, SMALL.in_f), BF16)] * SMALL.G
        assert (g.weight_grad_packed is not None) == (packed or kind == "wgrad")
    if kind == "dummy":
        for w in [*g.weight_grads] + ([g.weight_grad_packed] if packed else []):
            assert_zero(w, "dummy wgrad")
    if fuse:
        assert main_grad.any() == (not delay), "main_grad is written by the wgrad, not before"
    if delay:
        dw = layer.backward_dw()
        assert dw.weight_kind == ("none" if fuse else "wgrad") and not dw.grad_added_to_main_grad
        assert dw.bias_grad is not None and layer.pending_wgrads == 0
        assert not fuse or main_grad.any()
    if delay:
        with pytest.raises(ValueError, match=r"backward_dw: expected .*none pending"):
            layer.backward_dw()
    else:  # nothing delayed: a no-op, as TransformerEngine's (main_grad untouched)
        before = None if main_grad is None else main_grad.copy()
        dw = layer.backward_dw()
        assert dw.weight_kind == "none" and dw.weight_grads is None and dw.weight_grad_packed is None
        assert dw.bias_grad is None and dw.grad_input is None
        assert main_grad is None or np.array_equal(main_grad, before)


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_delayed_wgrad_is_fifo_and_matches_eager(dtype, rng):
    d1 = make_data(SMALL, dtype, rng)
    d2 = make_data(SMALL, dtype, rng, T=19, splits=[0, 5, 5, 9])  # other x, dy, T and splits
    eager, delayed = make_layer(d1), make_layer(d1, delay_wgrad_compute=True)
    e1, e2 = eager.backward(d1.x, d1.dy, d1.splits), eager.backward(d2.x, d2.dy, d2.splits)

    # Temporaries: the binding must keep x, dy and device splits alive until backward_dw.
    g1 = delayed.backward(d1.x.copy(), d1.dy.copy(), d1.splits)
    g2 = delayed.backward(d2.x.copy(), d2.dy.copy(), st.DeviceSplits(np.array(d2.splits, np.int64)))
    _reuse_freed_memory = [np.full_like(a, np.nan) for a in (d1.x, d1.dy, d2.x, d2.dy) for _ in range(3)]
    assert delayed.pending_wgrads == 2
    for g, e in [(g1, e1), (g2, e2)]:
        assert g.weight_kind == "none" and g.bias_grad is None
        assert_bitwise_equal(g.grad_input, e.grad_input, "dx")
    for pending_after, e in [(1, e1), (0, e2)]:
        dw = delayed.backward_dw()
        assert delayed.pending_wgrads == pending_after
        grads_equal(dw._replace(grad_input=None), e._replace(grad_input=None))
    with pytest.raises(ValueError, match="none pending"):
        delayed.backward_dw()


# 6. bad input: ValueError naming the argument and what was expected; outputs untouched

S_ = 20  # SMALL's S
BAD_CALLS = {  # (method, arguments replaced (from the data d), message fragment)
    "splits-length": ("forward", lambda d: dict(splits=[7, 0, 11]), "splits: expected shape [4]"),
    "splits-negative": ("forward", lambda d: dict(splits=[7, -1, 11, 2]), "splits: expected entries >= 0"),
    "splits-fractional": ("forward", lambda d: dict(splits=[7, 0, 10.5, 2.5]),
                          "splits: expected whole numbers of rows (integers), got 10.5 at index 2"),
    "splits-nan": ("backward", lambda d: dict(splits=(7, float("nan"), 11, 2)),
                   "splits: expected whole numbers of rows (integers), got nan at index 1"),
    "splits-sum": ("forward", lambda d: dict(splits=[7, 0, 11, 6]), "splits: expected a sum <= 23"),
    "splits-float64": ("forward", lambda d: dict(splits=np.array(d.splits, np.float64)),
                       "splits: expected dtype int64 or int32, got fp64"),
    "x-fp32": ("forward", lambda d: dict(x=d.x.astype(np.float32)), "x: expected dtype bf16"),
    "x-float64": ("forward", lambda d: dict(x=d.x.astype(np.float64)),
                  "x: expected dtype bf16 (the layer's dtype), got fp64"),
    "x-bool": ("forward", lambda d: dict(x=d.x > 0), "x: expected dtype bf16 (the layer's dtype), got bool"),
    "x-in-features": ("forward", lambda d: dict(x=d.x[:, :5]), "x: expected shape [T, 6"),
    "x-column-stride": ("forward", lambda d: dict(x=np.repeat(d.x, 2, 1)[:, ::2]), "x: expected a unit stride"),
    "x-transposed": ("forward", lambda d: dict(x=np.ascontiguousarray(d.x.T).T),
                     "x: expected a unit stride in the last dimension (taken: any strides with the last dimension "
                     "contiguous, as in a contiguous tensor or a slice of one; a transposed tensor is not, pass "
                     "x.contiguous()), got 23"),
    "x-reversed-rows": ("forward", lambda d: dict(x=d.x[::-1]), "x: expected a row stride >= the row length"),
    "out-rows": ("forward", lambda d: dict(out=d.out[:S_ - 1]), f"out: expected shape [>= {S_} (S"),
    "out-dtype": ("forward", lambda d: dict(out=np.zeros((23, 5), np.float16)), "out: expected dtype bf16"),
    "out-strided": ("forward", lambda d: dict(out=np.repeat(d.out, 2, 1)[:, :5]), "out: expected a contiguous"),
    "device-splits-int32": ("forward", lambda d: dict(splits=st.DeviceSplits(np.array(d.splits, np.int32), d.status)),
                            "splits: expected dtype int64"),
    "device-splits-out-rows": ("forward", lambda d: dict(splits=st.DeviceSplits(np.array(d.splits), d.status),
                                                         out=d.out[:S_]), "out: expected shape [>= 23 (T"),
    "status-two-elements": ("forward", lambda d: dict(splits=st.DeviceSplits(np.array(d.splits), np.zeros(2, "i4"))),
                            "splits status: expected one element"),
    "dy-rows": ("backward", lambda d: dict(dy=d.dy[:-1]), "dy: expected shape [23"),
    "grad_input-rows": ("backward", lambda d: dict(grad_input=d.gin[:S_ - 1]), f"grad_input: expected shape [>= {S_}"),
    "grad_input-dtype": ("backward", lambda d: dict(grad_input=np.zeros((23, 6), np.float32)),
                         "grad_input: expected dtype bf16"),
}


@pytest.mark.parametrize("method,bad,message", BAD_CALLS.values(), ids=BAD_CALLS.keys())
def test_bad_call_raises_value_error_and_writes_nothing(method, bad, message, rng):
    d = make_data(SMALL, "bf16", rng)
    d.out = rng.integers(0, 2**16, (SMALL.T, SMALL.out_f), dtype=np.uint16).view(BF16)  # any bits, NaNs too
    d.gin = rng.integers(0, 2**16, (SMALL.T, SMALL.in_f), dtype=np.uint16).view(BF16)
    d.status = np.zeros(1, np.int32)
    before = [a.copy() for a in (d.out, d.gin, d.status)]
    layer = make_layer(d, delay_wgrad_compute=True)
    args = dict(x=d.x, splits=d.splits, out=d.out) if method == "forward" else \
        dict(x=d.x, dy=d.dy, splits=d.splits, grad_input=d.gin)
    with pytest.raises(ValueError) as e:
        getattr(layer, method)(**{**args, **bad(d)})
    assert message in str(e.value) and "expected" in str(e.value), str(e.value)
    for a, b in zip((d.out, d.gin, d.status), before):
        assert_bitwise_equal(a, b, "buffer after a failed call")
    assert layer.pending_wgrads == 0


W = np.zeros((4, 5, 6), np.float32)
BAD_LAYERS = {
    "weight-2d": (lambda: st.GroupedLinear(W[0]), "weight: expected shape [G, out, in]"),
    # The message names "dtype", not "weight": see the report.
    "weight-float64": (lambda: st.GroupedLinear(W.astype(np.float64)), "dtype: expected bf16, fp16 or fp32, got fp64"),
    "weight-list-shape": (lambda: st.GroupedLinear([W[0], W[1, :, :5].copy()]), "weight[1]: expected shape [5, 6]"),
    "bias-shape": (lambda: st.GroupedLinear(W, np.zeros((4, 6), np.float32)), "bias: expected packed shape [4"),
    "main_grad-dtype": (lambda: st.GroupedLinear(W, None, W.astype(np.float16), fuse_wgrad_accumulation=True),
                        "main_grad: expected dtype fp32"),
    "main_grad-missing": (lambda: st.GroupedLinear(W, fuse_wgrad_accumulation=True), "main_grad: expected fp32"),
    "overwrite-without-fuse": (lambda: st.GroupedLinear(W, overwrite_main_grad=True),
                               "overwrite_main_grad: expected false"),
}


@pytest.mark.parametrize("make,message", BAD_LAYERS.values(), ids=BAD_LAYERS.keys())
def test_bad_layer_raises_value_error(make, message):
    with pytest.raises(ValueError) as e:
        make()
    assert message in str(e.value) and "expected" in str(e.value), str(e.value)


# 7. determinism, 8. read-only and row-strided inputs


@pytest.mark.parametrize("dtype", DTYPES)
def test_identical_calls_are_bitwise_identical(dtype, rng):
    d = make_data(CASES["G7-T61-empties-tail-in5-out13"], dtype, rng)
    a, b = make_layer(d), make_layer(d)
    assert_bitwise_equal(a.forward(d.x, d.splits), a.forward(d.x, d.splits), "y, same layer")
    assert_bitwise_equal(a.forward(d.x, d.splits), b.forward(d.x, d.splits), "y, two layers")
    grads_equal(a.backward(d.x, d.dy, d.splits), a.backward(d.x, d.dy, d.splits))
    grads_equal(a.backward(d.x, d.dy, d.splits), b.backward(d.x, d.dy, d.splits))


def read_only(a):
    a = a.copy()
    a.setflags(write=False)
    return a


def strided(a, row_step=1, extra_cols=0):
    """The same values in a view whose row stride is larger than its row length."""
    big = np.zeros((a.shape[0] * row_step, a.shape[1] + extra_cols), a.dtype)
    big[::row_step, :a.shape[1]] = a
    return big[::row_step, :a.shape[1]]


LAYOUTS = {"read-only": read_only, "column-slice": lambda a: strided(a, extra_cols=3),
           "every-other-row": lambda a: strided(a, row_step=2)}


@pytest.mark.parametrize("layout", LAYOUTS.keys())
@pytest.mark.parametrize("dtype", DTYPES)
def test_input_layouts_match_contiguous(dtype, layout, rng):
    d = make_data(SMALL, dtype, rng)
    x, dy = LAYOUTS[layout](d.x), LAYOUTS[layout](d.dy)
    assert x.flags.writeable == (layout != "read-only") and x.flags.c_contiguous == (layout == "read-only")
    layer = make_layer(d)
    if layout == "read-only":  # read-only parameters too
        layer = make_layer(NS(**{**vars(d), "w": read_only(d.w), "b": read_only(d.b)}))
    assert_bitwise_equal(layer.forward(x, d.splits), make_layer(d).forward(d.x, d.splits), "y")
    grads_equal(layer.backward(x, dy, d.splits), make_layer(d).backward(d.x, d.dy, d.splits))


@pytest.mark.parametrize("which", ["out", "grad_input", "main_grad"])
def test_read_only_output_is_rejected(which, rng):
    d = make_data(SMALL, "fp32", rng)
    shape = {"out": (SMALL.T, SMALL.out_f), "grad_input": (SMALL.T, SMALL.in_f),
             "main_grad": (SMALL.G, SMALL.out_f, SMALL.in_f)}[which]
    buf = read_only(np.zeros(shape, np.float32))
    with pytest.raises(ValueError, match=which):
        if which == "out":
            make_layer(d).forward(d.x, d.splits, out=buf)
        elif which == "grad_input":
            make_layer(d).backward(d.x, d.dy, d.splits, grad_input=buf)
        else:
            make_layer(d, True, buf, fuse_wgrad_accumulation=True).backward(d.x, d.dy, d.splits)
    assert_zero(buf, f"read-only {which}")


def test_zero_rows(rng):
    # numpy gives new empty arrays strides (0, 0): nothing is read, so they are accepted.
    d = make_data(SMALL, "fp32", rng, T=0, splits=[0, 0, 0, 0])
    layer = make_layer(d)
    assert layer.forward(d.x, d.splits).shape == (0, SMALL.out_f)
    g = layer.backward(d.x, d.dy, d.splits)
    assert g.grad_input.shape == (0, SMALL.in_f)
    for a in [g.bias_grad, *g.weight_grads]:
        assert_zero(a, "grads with no rows")


def test_caller_workspace_any_writable_byte_array(rng):
    d = make_data(SMALL, "fp32", rng)
    layer = make_layer(d)
    ws = np.zeros(layer.workspace_size(SMALL.T) + 256, np.uint8)
    start = (-ws.ctypes.data) % 256  # the workspace must start on a 256-byte boundary
    aligned = ws[start:start + layer.workspace_size(SMALL.T)]
    y = layer.forward(d.x, d.splits, workspace=aligned)
    np.testing.assert_array_equal(y.view(np.uint32), layer.forward(d.x, d.splits).view(np.uint32))
    with pytest.raises(ValueError, match="workspace: expected >= "):
        layer.forward(d.x, d.splits, workspace=aligned[:16])


def test_build_info_describes_this_build():
    """build_info(): what a user checks to know whether an install holds the Hopper kernels."""
    import re
    info = st.build_info()
    assert set(info) == {"version", "cuda", "cuda_archs", "sm90_kernels"}
    assert info["version"] == st.__version__ and re.fullmatch(r"\d+\.\d+\.\d+", info["version"])
    assert info["cuda"] is st.built_with_cuda()
    if info["cuda"]:
        assert re.fullmatch(r"\d\d+a?(,\d\d+a?)*", info["cuda_archs"]), info
    else:
        assert info["cuda_archs"] == "" and info["sm90_kernels"] == "none: built without CUDA", info
    # A build given SPARSETRAIN_ATTN_INSTANCES says so after the set's name.
    assert re.fullmatch(r"(an ALL build|a MINIMAL build)(, attention instances from SPARSETRAIN_ATTN_INSTANCES)?"
                        r"|none: .+", info["sm90_kernels"]), info
