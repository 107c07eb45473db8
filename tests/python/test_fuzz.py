"""A fuzz campaign: random GroupedLinear, GroupedMLP, MoELayer and block_sparse_attention cases from
a seeded generator, each run forward + backward through the torch front and checked against float64
oracles written here from docs/DESIGN.md's formulas (no library code: per-expert matmuls; SwiGLU x
probs; the router's choice, probs and combine; dense masked softmax attention with the mask from its
definition, a block matrix, a mask_mod or cu_seqlens).

What a case draws: shapes (odd sizes, G from 1 to 128, Sq != Skv, GQA), dtypes (fp32, bf16, fp16),
splits (empty experts, 1-row experts, all rows in one expert, none at all, sums below T (a padded
tail) and at T; a list, an int64 / int32 CPU tensor, a CUDA tensor), x with padded rows, caller
`out` / `grad_input` buffers of S, T and more than T rows (also off a 16-byte boundary), bias,
single_grouped_weight, fuse_wgrad_accumulation into main_grad (accumulate / overwrite,
grad_added_to_main_grad), delayed wgrad with backward_dw, probs, GLU interleaving; masks of every
built-in kind (random documents, windows, prefixes), from random block matrices (with a spec inside
partial blocks), from flex_attention mask_mods (formulas, random per-element tables, per batch /
head ones, random kv block lists), from cu_seqlens; schedules, walks, determinism, scale, strided
q / k / v.

Checks: every value within a first-order error bound carried by the oracle (fp32 accumulation of
the sum of |terms|, one rounding to the dtype per stored intermediate: the C++ oracles'
tests/support/*_oracle.h analysis, twice over) for GroupedLinear, GroupedMLP and attention; the MoE
layer against its float64 composition within dtype tolerances relative to each tensor's scale.
NaN never passes. Caller buffers are NaN where the library must write and hold random values,
compared bit for bit afterwards, where it must not; library-allocated tails must be zero; the weight
grads follow docs/DESIGN.md section 4's table (written here again); experts without rows leave
main_grad bit for bit.

CPU: SPARSETRAIN_FUZZ_CASES cases (default 1500, about 30 s on CI's two cores; each case runs with
one torch thread), seed SPARSETRAIN_FUZZ_SEED (default 56, so CI runs the same cases; "random" draws
one, printed with every failure and in the tally). CUDA (skipped visibly without a device or a CUDA
build): the same generator with the device's rules (attention bf16 / fp16, D 64 / 96 / 128,
128-multiple blocks, the kernels this build has; GEMM sizes the sm90 kernels take half the time,
device splits), each case run on the GPU and on the CPU reference on the same inputs, both against
the oracle (attention's bound with P and dS rounded to the dtype, as the kernels feed the second
GEMM) and against each other; library outputs NaN-poisoned through torch's caching allocator (best
effort); default 400 cases, each small enough for `compute-sanitizer --tool memcheck`
(scripts/gpu-check's memcheck-fuzz step). Every failure message names the case, its parameters
and the command that reruns it; tests/python/conftest.py prints "fuzz: N cases run, F failures"
per device at the end of the session."""

import contextlib
import math
import os

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch is not installed: the fuzz campaign skipped")

import torch.nn.functional as F  # noqa: E402

import sparsetrain as st  # noqa: E402
import sparsetrain.torch as stt  # noqa: E402
from dense_masks import dense_mask  # noqa: E402


def _env_int(name, default):
    value = os.environ.get(name, "")
    return int(value) if value.strip() else default


def _seed():
    value = os.environ.get("SPARSETRAIN_FUZZ_SEED", "").strip()
    if value == "random":
        return int(np.random.SeedSequence().entropy % 2**31)
    return int(value) if value else 56


SEED = _seed()
CPU_CASES = _env_int("SPARSETRAIN_FUZZ_CASES", 1500)  # about 30 s on CI's 2 cores
CUDA_CASES = _env_int("SPARSETRAIN_FUZZ_CASES", 400)
HAVE_CUDA = torch.cuda.is_available()

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
U32 = 2.0 ** -24
_U = {torch.float32: U32, torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11}  # unit roundoff


# -- comparisons -----------------------------------------------------------------------------------


# An absolute floor on every bound: fp32 intermediates (exp of a score far below the row's max, and
# what it multiplies) underflow to zero; with unit-scale inputs and at most thousands of terms their
# true values stay far below this (a value fp32 cannot hold, e.g. 1e-54, must read as about 0).
FLOOR = 1e-30


def _rounding_error(dtype, value):
    """One rounding of `value` to `dtype`: its unit roundoff relative, plus half fp16's subnormal step."""
    return _U[dtype] * value.abs() + (2.0 ** -25 if dtype == torch.float16 else 0.0)


def _where(t):
    return ", ".join(str(int(i)) for i in t)


def _check_bounded(got, value, err, dtype, what):
    """`got` (any device, any float dtype) within 2 x (err + the final rounding to `dtype`) of the
    float64 `value` (first-order bound: the factor absorbs second-order terms, as
    tests/support/bounded.h). Infinities must match exactly; NaN never passes."""
    got = got.detach().to("cpu", torch.float64)
    assert got.shape == value.shape, f"{what}: shape {list(got.shape)}, expected {list(value.shape)}"
    inf = torch.isinf(value)
    if bool(inf.any()):
        assert bool((got[inf] == value[inf]).all()), f"{what}: infinities differ"
        value, err, got = value[~inf], err[~inf], got[~inf]
    bound = 2.0 * (err + _rounding_error(dtype, value)) + FLOOR
    diff = (got - value).abs()
    ok = diff <= bound
    if not bool(ok.all()):
        bad = (~ok).nonzero()[0]
        i = tuple(int(j) for j in bad)
        ratio = (diff / bound).max().item()
        raise AssertionError(f"{what}: {int((~ok).sum())} of {ok.numel()} elements outside the bound (worst "
                             f"|err| / bound {ratio:.3g}); first at [{_where(bad)}]: got {got[i].item():.9g}, "
                             f"expected {value[i].item():.9g} +- {bound[i].item():.3g}")


def _check_pair(got, other, value, err, dtype, what):
    """Two backends' results on the same inputs: each within the bound, so within twice it of each
    other (named apart so that a failure says which of the two disagrees with the other)."""
    got, other = got.detach().to("cpu", torch.float64), other.detach().to("cpu", torch.float64)
    inf = torch.isinf(value)
    assert torch.equal(torch.isinf(got), torch.isinf(other)), f"{what}: infinities differ between the backends"
    bound = 4.0 * (err + _rounding_error(dtype, value))[~inf] + 2 * FLOOR
    diff = (got - other)[~inf].abs()
    ok = diff <= bound
    assert bool(ok.all()), (f"{what}: CUDA and the CPU reference differ by up to {diff.max().item():.3g} "
                            f"({int((~ok).sum())} elements past the bound)")


def _check_relative(got, ref, tol, what):
    """|got - ref| <= tol x (|ref| + max |ref|): the MoE layer's dtype tolerance, relative to the
    tensor's scale (its composite error has no bound carried here). NaN never passes."""
    got, ref = got.detach().to("cpu", torch.float64), ref.detach().to("cpu", torch.float64)
    assert got.shape == ref.shape, f"{what}: shape {list(got.shape)}, expected {list(ref.shape)}"
    scale = ref.abs().max().item() if ref.numel() else 0.0
    bound = tol * (ref.abs() + scale) + 1e-30
    diff = (got - ref).abs()
    ok = diff <= bound
    if not bool(ok.all()):
        bad = (~ok).nonzero()[0]
        i = tuple(int(j) for j in bad)
        raise AssertionError(f"{what}: {int((~ok).sum())} of {ok.numel()} elements past the tolerance {tol:g}; "
                             f"first at [{_where(bad)}]: got {got[i].item():.9g}, expected {ref[i].item():.9g}")


def _same_bits(got, want, what):
    got, want = got.detach().cpu(), want.detach().cpu()
    assert got.shape == want.shape and got.dtype == want.dtype, f"{what}: shape or dtype changed"
    a, b = (t.reshape(-1).clone().view(torch.uint8) for t in (got, want))  # any strides, size-1 dims too
    assert torch.equal(a, b), f"{what}: changed (must be left bit for bit as it was)"


def _zero(got, what):
    got = got.detach().cpu()
    assert bool((got == 0).all()), f"{what}: expected zeros, got {int((got != 0).sum())} nonzero (NaN counts)"


# -- the cases -------------------------------------------------------------------------------------


class Case:
    """One fuzz case: what the generator drew for (device, index) under SEED."""

    def __init__(self, device, index, family, params):
        self.device, self.index, self.family, self.params = device, index, family, params
        self.id = f"{index:04d}-{family}"

    def repro(self):
        node = f"tests/python/test_fuzz.py::test_fuzz_{self.device}[{self.id}]"
        return (f"fuzz case {self.device} {self.id}, seed {SEED} (rerun: SPARSETRAIN_FUZZ_SEED={SEED} "
                f"SPARSETRAIN_FUZZ_CASES={self.index + 1} python -m pytest '{node}')\n  params: {self.params}")


def _choice(rng, options, p=None):
    i = int(rng.choice(len(options), p=p))
    return options[i]


def _gen_splits(rng, G, T):
    """(splits, pattern): S = T or a padded tail below it; experts empty, of one row, all rows in one."""
    pattern = _choice(rng, ["random", "empty", "one_row", "all_in_one", "zero"], [0.3, 0.25, 0.2, 0.17, 0.08])
    S = 0 if pattern == "zero" or T == 0 else (T if rng.random() < 0.5 else int(rng.integers(0, T)))
    splits = np.zeros(G, dtype=np.int64)
    if pattern == "all_in_one":
        splits[int(rng.integers(G))] = S
    elif pattern == "one_row":
        ones = rng.choice(G, size=min(S, int(rng.integers(1, G + 1))), replace=False)
        splits[ones] = 1
        rest = S - len(ones)
        others = [g for g in range(G) if g not in set(ones.tolist())] or list(range(G))
        if rest:
            splits[int(rng.choice(others))] += rest
    elif pattern != "zero":
        w = rng.dirichlet(np.full(G, float(rng.uniform(0.3, 3.0))))
        if pattern == "empty" and G > 1:
            w[rng.choice(G, size=int(rng.integers(1, G)), replace=False)] = 0
            w = w / w.sum()
        splits = rng.multinomial(S, w)
    return [int(s) for s in splits], pattern


def _gen_buffer(rng, host_splits, S, T):
    """A caller buffer: None, or its rows (S (< T) only with host splits, T, T + a few) and whether
    its base is off a 16-byte boundary."""
    if rng.random() < 0.5:
        return None
    kinds = ["T", "T+"] + (["S"] if host_splits and S < T else [])
    kind = _choice(rng, kinds)
    rows = T if kind == "T" else T + int(rng.integers(1, 6)) if kind == "T+" else S
    return {"rows": rows, "misaligned": bool(rng.random() < 0.25)}


def _gen_grouped_common(rng, cuda, sizes):
    """What GroupedLinear and GroupedMLP cases share; `sizes` draws the feature sizes."""
    G = int(_choice(rng, [1, 2, 3, 4, 5, 6, 8, 12, 16, 33, 128],
                    [.1, .12, .12, .14, .1, .08, .12, .08, .07, .04, .03]))
    aligned = cuda and rng.random() < 0.5  # sizes the sm90 kernels take (multiples of 8, > 2^16 MACs)
    T = 0 if rng.random() < 0.03 else int(rng.integers(1, (300 if aligned else 100) if cuda else 65))
    splits, pattern = _gen_splits(rng, G, T)
    form = _choice(rng, ["list", "int64", "int32"] + (["cuda", "cuda_int32"] if cuda else []))
    host = not form.startswith("cuda")
    S = sum(splits)
    fuse = bool(rng.random() < 0.4)
    p = dict(G=G, T=T, **sizes(rng, aligned), dtype=_choice(rng, ["fp32", "bf16", "fp16"]),
             bias=bool(rng.random() < 0.5), single=bool(rng.random() < 0.5), splits=splits, pattern=pattern, form=form,
             fuse=fuse, overwrite=fuse and bool(rng.random() < 0.25), attr=bool(rng.random() < 0.5),
             delay=bool(rng.random() < 0.3), x_grad=bool(rng.random() < 0.9),
             x_rows_padded=bool(rng.random() < 0.15), scale=float(np.exp(rng.uniform(-1.5, 1.5))),
             data_seed=int(rng.integers(2**31)))
    p["out"] = _gen_buffer(rng, host, S, T)
    p["grad_input"] = _gen_buffer(rng, host, S, T) if p["x_grad"] else None
    return p


def _gen_linear(rng, cuda):
    def sizes(rng, aligned):
        if aligned:
            return dict(IN=8 * int(rng.integers(1, 17)), OUT=8 * int(rng.integers(1, 17)))
        hi = 100 if cuda else 49
        return dict(IN=int(rng.integers(1, hi)), OUT=int(rng.integers(1, hi)))

    return _gen_grouped_common(rng, cuda, sizes)


def _gen_mlp(rng, cuda):
    def sizes(rng, aligned):
        if aligned:
            FF = 8 * int(rng.integers(1, 9))
            return dict(IN=8 * int(rng.integers(1, 13)), FFN=FF, OUT=8 * int(rng.integers(1, 13)),
                        glu=_choice(rng, [0, 0, 8, FF]))
        FF = int(rng.integers(1, 25))
        divisors = [k for k in range(1, FF + 1) if FF % k == 0]
        return dict(IN=int(rng.integers(1, 33)), FFN=FF, OUT=int(rng.integers(1, 33)),
                    glu=0 if rng.random() < 0.6 else int(_choice(rng, divisors)))

    p = _gen_grouped_common(rng, cuda, sizes)
    p["probs_zero"] = bool(rng.random() < 0.2)  # some rows with prob 0
    p["probs_grad"] = bool(rng.random() < 0.9)
    return p


def _gen_moe(rng, cuda):
    E = int(_choice(rng, [1, 2, 3, 4, 6, 8, 12, 16]))
    aligned = cuda and rng.random() < 0.5
    return dict(N=0 if rng.random() < 0.03 else int(rng.integers(1, 48)), E=E,
                top_k=int(rng.integers(1, min(E, 4) + 1)), score=_choice(rng, ["softmax", "sigmoid"]),
                normalize=bool(rng.random() < 0.5), expert_bias=bool(rng.random() < 0.3),
                hidden=8 * int(rng.integers(1, 9)) if aligned else int(rng.integers(1, 33)),
                FFN=8 * int(rng.integers(1, 5)) if aligned else int(rng.integers(1, 17)),
                dtype=_choice(rng, ["fp32", "bf16", "fp16"]), bias=bool(rng.random() < 0.4),
                glu=_choice(rng, [0, 0, 0, 1]), single=bool(rng.random() < 0.5), fuse=bool(rng.random() < 0.3),
                delay=bool(rng.random() < 0.25), recompute=bool(rng.random() < 0.7),
                data_seed=int(rng.integers(2**31)))


ATTN_MASKS = ["kind", "kind", "kind", "blocks", "flex", "flex", "flex_blocks", "cu_seqlens"]
KINDS = ["full", "causal", "causal_bottom_right", "sliding_window", "document", "document_causal", "prefix_lm"]
FLEX_MODS = ["modular", "table", "table_bh", "window"]


def _gen_attention(rng, cuda):
    B = int(rng.integers(1, 3))
    Hkv = int(rng.integers(1, 4))
    Hq = Hkv * int(_choice(rng, [1, 1, 2, 3, 4]))
    if cuda:
        dtype, D = _choice(rng, ["bf16", "fp16"]), int(_choice(rng, [64, 96, 128]))
        blocks = (128, 128) if rng.random() < 0.8 else (int(_choice(rng, [128, 256])), int(_choice(rng, [128, 256])))
        Sq = int(rng.integers(1, 400))
        Skv = Sq if rng.random() < 0.4 else int(rng.integers(1, 400))
    else:
        dtype, D = _choice(rng, ["fp32", "bf16", "fp16"]), int(_choice(rng, [1, 4, 8, 13, 16, 24, 32, 64]))
        blocks = (int(_choice(rng, [8, 16, 32, 64, 128])), int(_choice(rng, [8, 16, 32, 64, 128])))
        hi = 300 if rng.random() < 0.1 else 130  # now and then more blocks of 128
        Sq = int(rng.integers(1, hi))
        Skv = Sq if rng.random() < 0.4 else int(rng.integers(1, hi))
    source = _choice(rng, ATTN_MASKS)
    p = dict(B=B, Hq=Hq, Hkv=Hkv, Sq=Sq, Skv=Skv, D=D, dtype=dtype, block=blocks, source=source,
             deterministic=_choice(rng, [None, True, False]),
             scale=None if rng.random() < 0.6 else float(np.exp(rng.uniform(-2.5, 0.5))),
             layout=_choice(rng, ["bhsd", "bhsd", "bshd", "padded"]),
             schedule=_choice(rng, ["auto", "auto", "left_to_right", "shortest_first", "permutation"]),
             walk=_choice(rng, [None, "descending_heads_inner", "ascending_heads_outer", "ascending_heads_inner"]),
             input_scale=float(np.exp(rng.uniform(-1.0, 1.0))), data_seed=int(rng.integers(2**31)))
    if cuda:
        p["device_build"] = bool(rng.random() < 0.5)
    if source in ("kind", "blocks"):
        p["kind"] = _choice(rng, KINDS)
        p["window"] = (int(rng.integers(-1, max(Sq, Skv) + 1)), int(rng.integers(-1, max(Sq, Skv) + 1)))
        p["prefix"] = int(rng.integers(0, Skv + 1))
        p["docs_per_row"] = bool(rng.random() < 0.6)  # ids [B, S] (else [1, S], broadcast)
        p["docs_sorted"] = bool(rng.random() < 0.8)   # packed documents (else ids in any order)
        p["docs_same"] = Sq == Skv and bool(rng.random() < 0.5)  # one id tensor for both sides
        # The padded backward form (doc_padding=128): the CUDA backward runs on it; the CPU ignores it
        # but every path validates it.
        p["doc_padding"] = bool(rng.random() < 0.3)
    if source == "blocks":
        p["mask_batch"], p["mask_heads"] = bool(rng.random() < 0.5), bool(rng.random() < 0.5)
        p["block_probs"] = [float(x) for x in rng.dirichlet([1.0, 1.0, 1.0])]
    if source in ("flex", "flex_blocks"):
        p["mod"] = _choice(rng, FLEX_MODS)
        p["density"] = float(rng.uniform(0.05, 0.95))
        p["mod_args"] = [int(rng.integers(1, 7)), int(rng.integers(0, 7)), int(rng.integers(2, 9)),
                         int(rng.integers(0, 9))]
        p["full_lists"] = bool(rng.random() < 0.7)  # flex_blocks: full_kv_* given (else all partial)
        p["block_probs"] = [float(x) for x in rng.dirichlet([1.0, 1.0, 1.0])]
    if source == "cu_seqlens":
        p["causal"] = bool(rng.random() < 0.5)
        p["same_kv"] = bool(rng.random() < 0.6)
        p["doc_padding"] = bool(rng.random() < 0.3)
        if p["same_kv"]:
            p["Skv"] = p["Sq"]
        B, p["B"] = 1, 1  # one packed batch row
    if p["schedule"] == "permutation" or p["schedule"] == "auto":
        p["walk"] = None  # a walk goes with an explicit named schedule
    return p


FAMILIES = [("linear", _gen_linear, 0.32), ("mlp", _gen_mlp, 0.25), ("moe", _gen_moe, 0.1),
            ("attention", _gen_attention, 0.33)]


def make_case(device, index):
    """Case `index` of `device`'s campaign under SEED: the same case whatever the case count."""
    rng = np.random.default_rng([SEED, index, 0 if device == "cpu" else 1])
    i = int(rng.choice(len(FAMILIES), p=[f[2] for f in FAMILIES]))
    family, gen, _ = FAMILIES[i]
    return Case(device, index, family, gen(rng, device == "cuda"))


# -- shared input helpers --------------------------------------------------------------------------


def _randn(gen, *shape, scale=1.0):
    return torch.randn(*shape, generator=gen, dtype=torch.float64) * scale


def _leaf(t, device, requires_grad=True):
    return t.detach().to(device).requires_grad_(requires_grad)


def _buffer(spec, T, S, cols, dtype, device, gen):
    """A caller buffer of spec["rows"] rows: NaN in the rows the library writes (< S), random
    values in the rest (the caller's, to be left bit for bit); off a 16-byte boundary by one element
    when asked. Returns (buffer, the untouched rows' values as they must stay)."""
    rows = spec["rows"]
    keep = _randn(gen, max(rows - S, 0), cols).to(dtype)
    full = torch.cat([torch.full((min(S, rows), cols), float("nan"), dtype=dtype), keep])
    if spec["misaligned"]:
        flat = torch.empty(rows * cols + 1, dtype=dtype, device=device)
        buf = flat[1:].view(rows, cols)
    else:
        buf = torch.empty(rows, cols, dtype=dtype, device=device)
    buf.copy_(full)
    return buf, keep


def _splits_arg(p, device):
    splits = p["splits"]
    form = p["form"]
    if form == "list":
        return list(splits)
    if form in ("int64", "int32"):
        return torch.tensor(splits, dtype=torch.int64 if form == "int64" else torch.int32)
    return torch.tensor(splits, dtype=torch.int64 if form == "cuda" else torch.int32, device=device)


def _segments(splits):
    start = 0
    for g, n in enumerate(splits):
        yield g, start, start + n
        start += n


def _poison_cuda_cache(device):
    """Best effort: leave torch's caching allocator holding free 0xFF blocks (NaN in every float
    dtype), in its small (<= 1 MiB) and large pools, so that a library output it hands out again
    and the kernel does not write reads as NaN."""
    if device.type != "cuda":
        return
    blocks = [torch.full((1 << 20,), 0xFF, dtype=torch.uint8, device=device) for _ in range(8)]
    blocks.append(torch.full((48 << 20,), 0xFF, dtype=torch.uint8, device=device))
    del blocks


# -- docs/DESIGN.md section 4's weight-grad table, written here again ------------------------------


def _disposition(delay, fuse, attr):
    """(what backward gives the weight: "wgrad" / "none" / "dummy", whether the bias grad comes
    with backward (else with backward_dw))."""
    if not fuse:
        return ("none" if delay else "wgrad"), not delay
    return ("dummy" if attr else "none"), not delay


# -- GroupedLinear ---------------------------------------------------------------------------------


def _bounded_matmul(a, b, extra=0):
    """a @ b (float64) and its fp32 accumulation bound: (k + 2 + extra) u32 (sum |terms| + |value|)."""
    value = a @ b
    abs_sum = a.abs() @ b.abs()
    return value, (a.shape[-1] + 2 + extra) * U32 * (abs_sum + value.abs())


def _linear_oracle(x, W, Bv, dy, splits):
    """float64 (value, err) pairs of y, dx [S, ...], dW [G, out, in], db [G, out] per the formula."""
    S, G, OUT, IN = sum(splits), W.shape[0], W.shape[1], W.shape[2]
    y, ey = torch.zeros(S, OUT, dtype=torch.float64), torch.zeros(S, OUT, dtype=torch.float64)
    dx, edx = torch.zeros(S, IN, dtype=torch.float64), torch.zeros(S, IN, dtype=torch.float64)
    dW, edW = torch.zeros(G, OUT, IN, dtype=torch.float64), torch.zeros(G, OUT, IN, dtype=torch.float64)
    db, edb = torch.zeros(G, OUT, dtype=torch.float64), torch.zeros(G, OUT, dtype=torch.float64)
    for g, a, b in _segments(splits):
        if a == b:
            continue
        xg, dyg = x[a:b], dy[a:b]
        if Bv is None:
            y[a:b], ey[a:b] = _bounded_matmul(xg, W[g].T)
        else:  # the bias as one more term of the sum
            y[a:b], ey[a:b] = _bounded_matmul(torch.cat([xg, torch.ones(b - a, 1, dtype=torch.float64)], 1),
                                              torch.cat([W[g].T, Bv[g][None]], 0))
        dx[a:b], edx[a:b] = _bounded_matmul(dyg, W[g])
        dW[g], edW[g] = _bounded_matmul(dyg.T, xg)
        db[g], edb[g] = _bounded_matmul(dyg.T, torch.ones(b - a, dtype=torch.float64))
    return dict(y=(y, ey), dx=(dx, edx), dW=(dW, edW), db=(db, edb))


def _weight_values(layer):
    """A GroupedLinear's weights (and biases) as [G, ...] tensors, whatever their layout."""
    ws = layer.weight.detach() if layer.single_grouped_weight else torch.stack([w.detach() for w in layer.weights()])
    if not layer.use_bias:
        return ws, None
    bs = layer.bias.detach() if layer.single_grouped_weight else torch.stack([b.detach() for b in layer.biases()])
    return ws, bs


def _set_layer(layer, W, Bv, main_grad, p):
    """Parameters to the given values; main_grad and Megatron's attributes as the case says."""
    with torch.no_grad():
        ws = layer.weights()
        if layer.single_grouped_weight:
            ws[0].copy_(W)
            if Bv is not None:
                layer.biases()[0].copy_(Bv)
        else:
            for g, w in enumerate(ws):
                w.copy_(W[g])
            for g, b in enumerate(layer.biases()):
                b.copy_(Bv[g])
    for i, w in enumerate(ws):
        if p["fuse"]:
            mg = main_grad if layer.single_grouped_weight else main_grad[i]
            w.main_grad = mg.clone().to(w.device)
            if p["overwrite"]:
                w.overwrite_main_grad = True
        if p["attr"]:
            w.grad_added_to_main_grad = False


def _stacked(ts, single):
    """A layer's per-expert tensors as one [G, ...] tensor (single_grouped_weight: the one there is)."""
    assert all(t is not None for t in ts), "a gradient is missing"
    return ts[0] if single else torch.stack(list(ts))


class _Run:
    """What one backend gave for a case (CPU tensors), for the oracle and a cross-backend check."""

    def __init__(self):
        self.values = {}  # name -> (tensor, dtype of the result)

    def add(self, name, t, dtype):
        self.values[name] = (t.detach().cpu(), dtype)


def _check_layer_params(run, layer, prefix, main_grad0, splits, p, stage):
    """A GroupedLinear's weight and bias grads and main_grads after backward (stage "backward") or
    backward_dw ("backward_dw"), by the table; values go to `run` for the oracle check."""
    kind, bias_now = _disposition(p["delay"], p["fuse"], p["attr"])
    ws, bs = layer.weights(), layer.biases()
    dtype = ws[0].dtype
    if stage == "backward":
        if kind == "none":
            assert all(w.grad is None for w in ws), f"{prefix}weight grad: expected none ({kind})"
        elif kind == "dummy":
            for w in ws:
                assert w.grad is not None and w.grad.shape == w.shape, f"{prefix}weight grad: expected the dummy"
                _zero(w.grad, f"{prefix}weight grad (the dummy)")
                assert w.grad.untyped_storage().data_ptr() != w.main_grad.untyped_storage().data_ptr(), \
                    f"{prefix}the dummy aliases main_grad"
                assert w.grad_added_to_main_grad is True, f"{prefix}grad_added_to_main_grad not set"
        else:
            run.add(prefix + "dW", _stacked([w.grad for w in ws], layer.single_grouped_weight), dtype)
        if bs:
            if bias_now:
                run.add(prefix + "db", _stacked([b.grad for b in bs], layer.single_grouped_weight), dtype)
            else:
                assert all(b.grad is None for b in bs), f"{prefix}bias grad: expected none before backward_dw"
        if p["fuse"] and p["delay"]:
            for i, w in enumerate(ws):
                _same_bits(w.main_grad, main_grad0 if layer.single_grouped_weight else main_grad0[i],
                           f"{prefix}main_grad before backward_dw")
    else:
        if not p["fuse"]:
            run.add(prefix + "dW", _stacked([w.grad for w in ws], layer.single_grouped_weight), dtype)
        if bs:
            run.add(prefix + "db", _stacked([b.grad for b in bs], layer.single_grouped_weight), dtype)
    if p["fuse"] and (stage == "backward_dw" or not p["delay"]):
        mg = _stacked([w.main_grad for w in ws], layer.single_grouped_weight)
        run.add(prefix + "main_grad", mg, torch.float32)
        for g, n in enumerate(splits):
            if n == 0:  # bit for bit as it was, or zeroed (overwrite_main_grad)
                if p["overwrite"]:
                    _zero(mg[g], f"{prefix}main_grad of expert {g} (no rows, overwrite)")
                else:
                    _same_bits(mg[g], main_grad0[g], f"{prefix}main_grad of expert {g} (no rows)")


def _check_oracle_params(run, prefix, o_dW, o_db, main_grad0, p, dtype, check):
    """The oracle side of _check_layer_params: dW / db / main_grad values against their bounds."""
    vals = run.values
    if prefix + "dW" in vals:
        check(vals[prefix + "dW"][0], *o_dW, dtype, prefix + "dW")
    if prefix + "db" in vals:
        check(vals[prefix + "db"][0], *o_db, dtype, prefix + "db")
    if prefix + "main_grad" in vals:
        base = main_grad0.double()
        value = o_dW[0] if p["overwrite"] else base + o_dW[0]
        err = o_dW[1] + (0 if p["overwrite"] else U32 * (base.abs() + value.abs()))
        check(vals[prefix + "main_grad"][0], value, err, torch.float32, prefix + "main_grad")


def _x_and_buffers(p, device, gen, cols_out, dtype):
    """x (a leaf, padded rows when asked), dy of T rows, and the caller buffers."""
    T, IN, S = p["T"], p["IN"], sum(p["splits"])
    x0 = _randn(gen, T, IN).to(dtype)
    if p["x_rows_padded"]:
        storage = torch.zeros(T, IN + 3, dtype=dtype, device=device)
        storage[:, :IN] = x0.to(device)
        x = storage[:, :IN].detach().requires_grad_(p["x_grad"])
    else:
        x = _leaf(x0, device, p["x_grad"])
    dy = _randn(gen, T, cols_out).to(dtype)
    out = gin = None
    if p["out"] is not None:
        out = _buffer(p["out"], T, S, cols_out, dtype, device, gen)
    if p["grad_input"] is not None:
        gin = _buffer(p["grad_input"], T, S, IN, dtype, device, gen)
    return x0, x, dy, out, gin


def _dy_for(y, dy, T, gen):
    """The gradient autograd passes for y: dy's rows, cut to a buffer of fewer rows, or with random
    rows past T (for an `out` of more rows: the library must ignore them)."""
    rows = y.shape[0]
    if rows <= T:
        return dy[:rows].to(y.device)
    return torch.cat([dy, _randn(gen, rows - T, dy.shape[1]).to(dy.dtype)]).to(y.device)


def _check_row_outputs(run, name, got, T, S, buf, dtype):
    """A row-grouped result: rows < S go to the oracle check; a library-allocated tensor's tail is
    zero; a caller buffer's rows >= S are as the caller left them."""
    if buf is None:
        assert got.shape[0] == T, f"{name}: {got.shape[0]} rows, expected T = {T}"
        _zero(got[S:], f"{name}: the padded tail (rows >= S)")
    else:
        b, keep = buf
        assert got.data_ptr() == b.data_ptr() and got.shape == b.shape, f"{name}: not the caller's buffer"
        _same_bits(b[S:], keep, f"{name}: the caller buffer's rows >= S")
    run.add(name, got[:S], dtype)


def _check_dx(run, x, T, S, gin, dtype, name="dx"):
    """x.grad: rows < S to the oracle; rows >= S zero, or (caller grad_input) the buffer's rows as
    they are, zeros past a buffer of fewer than T rows; the buffer's own rows < S are dx's."""
    assert x.grad is not None and x.grad.shape == x.shape, f"{name}: missing or of the wrong shape"
    if gin is None:
        _zero(x.grad[S:], f"{name}: the padded tail (rows >= S)")
    else:
        b, keep = gin
        rows = b.shape[0]
        _same_bits(b[S:], keep, f"{name}: grad_input's rows >= S")
        _same_bits(x.grad[S:min(rows, T)], keep[:max(min(rows, T) - S, 0)], f"{name}: rows >= S of the buffer")
        _zero(x.grad[rows:], f"{name}: rows past a grad_input of {rows} < T rows")
        _same_bits(b[:S], x.grad[:S], f"{name}: grad_input's rows < S against x.grad")
    run.add(name, x.grad[:S], dtype)


def _linear_inputs(p):
    gen = torch.Generator().manual_seed(p["data_seed"])
    dtype = DTYPES[p["dtype"]]
    G, IN, OUT = p["G"], p["IN"], p["OUT"]
    W = (_randn(gen, G, OUT, IN, scale=p["scale"] / math.sqrt(IN))).to(dtype)
    Bv = _randn(gen, G, OUT).to(dtype) if p["bias"] else None
    mg0 = _randn(gen, G, OUT, IN).float()
    return gen, dtype, W, Bv, mg0


def _run_linear(p, device):
    gen, dtype, W, Bv, mg0 = _linear_inputs(p)
    T, S, splits = p["T"], sum(p["splits"]), p["splits"]
    m = stt.GroupedLinear(p["G"], p["IN"], p["OUT"], bias=p["bias"], params_dtype=dtype, device=device,
                          single_grouped_weight=p["single"], fuse_wgrad_accumulation=p["fuse"],
                          delay_wgrad_compute=p["delay"])
    _set_layer(m, W, Bv, mg0, p)
    x0, x, dy, out, gin = _x_and_buffers(p, device, gen, p["OUT"], dtype)
    run = _Run()
    _poison_cuda_cache(device)
    y = m(x, _splits_arg(p, device), out=None if out is None else out[0], grad_input=None if gin is None else gin[0])
    _check_row_outputs(run, "y", y, T, S, out, dtype)
    _poison_cuda_cache(device)
    y.backward(_dy_for(y, dy, T, gen))
    if p["x_grad"]:
        _check_dx(run, x, T, S, gin, dtype)
    _check_layer_params(run, m, "", mg0, splits, p, "backward")
    if p["delay"]:
        assert m.pending_wgrads == 1, f"pending_wgrads {m.pending_wgrads}, expected 1"
        m.backward_dw()
        assert m.pending_wgrads == 0
        _check_layer_params(run, m, "", mg0, splits, p, "backward_dw")
    if p["form"].startswith("cuda"):
        assert int(m.splits_status.item()) == 0, f"splits_status {int(m.splits_status.item())} for valid splits"
    return run


def _linear_oracle_values(p, device_kind="cpu"):
    gen, dtype, W, Bv, mg0 = _linear_inputs(p)
    x0, _, dy, _, _ = _x_and_buffers(p, "cpu", gen, p["OUT"], dtype)
    o = _linear_oracle(x0.double(), W.double(), None if Bv is None else Bv.double(), dy.double(), p["splits"])
    return dtype, mg0, o


def _check_linear(p, run, oracle, check):
    dtype, mg0, o = oracle
    vals = run.values
    check(vals["y"][0], *o["y"], dtype, "y")
    if "dx" in vals:
        check(vals["dx"][0], *o["dx"], dtype, "dx")
    _check_oracle_params(run, "", o["dW"], o["db"], mg0, p, dtype, check)


# -- GroupedMLP ------------------------------------------------------------------------------------


def _glu_columns(FF, k):
    """fc1's output columns of a_j and b_j (j < F): the halves, or blocks of k alternating (DESIGN 5)."""
    if k == 0:
        return torch.arange(FF), torch.arange(FF, 2 * FF)
    j = torch.arange(FF)
    a = (j // k) * 2 * k + j % k
    return a, a + k


def _mlp_oracle(x, probs, dy, W1, B1, W2, B2, splits, FF, k, dtype):
    """float64 (value, err) of y [S, out], dx [S, in], dprobs [S], dW1, dB1, dW2, dB2 [G, ...]:
    tests/support/grouped_mlp_oracle.h's analysis, with the error of fc1's stored output carried
    into backward (the library recomputes the activation from it; here it is not at hand)."""
    def rerr(v):
        return _rounding_error(dtype, v)

    f64 = dict(dtype=torch.float64)
    S, G, IN, OUT = sum(splits), W1.shape[0], W1.shape[2], W2.shape[1]
    ca, cb = _glu_columns(FF, k)
    y, ey = torch.zeros(S, OUT, **f64), torch.zeros(S, OUT, **f64)
    dx, edx = torch.zeros(S, IN, **f64), torch.zeros(S, IN, **f64)
    dp, edp = torch.zeros(S, **f64), torch.zeros(S, **f64)
    dW1, edW1 = torch.zeros_like(W1), torch.zeros_like(W1)
    dW2, edW2 = torch.zeros_like(W2), torch.zeros_like(W2)
    dB1, edB1 = torch.zeros(G, 2 * FF, **f64), torch.zeros(G, 2 * FF, **f64)
    dB2, edB2 = torch.zeros(G, OUT, **f64), torch.zeros(G, OUT, **f64)
    for g, r0, r1 in _segments(splits):
        n = r1 - r0
        if n == 0:
            continue
        xg, pg, dyg = x[r0:r1], probs[r0:r1, None], dy[r0:r1]
        z = xg @ W1[g].T
        az = xg.abs() @ W1[g].abs().T
        if B1 is not None:
            z, az = z + B1[g], az + B1[g].abs()
        ez = (IN + 2) * U32 * az + rerr(z)  # as stored in the dtype
        a, b, ea, eb = z[:, ca], z[:, cb], ez[:, ca], ez[:, cb]
        sig = torch.sigmoid(a)
        silu, dsilu = a * sig, sig * (1 + a * (1 - sig))
        h = silu * b
        # silu' is bounded by 1.1 and silu'' by 0.5: first order with the slope's drift over ea.
        eh = (dsilu.abs() + 0.5 * ea) * ea * b.abs() + (silu.abs() + 1.1 * ea) * eb + 16 * U32 * h.abs()
        hp = pg * h
        ehp = pg.abs() * eh + 2 * U32 * hp.abs() + rerr(hp)
        s = hp @ W2[g].T
        e = ehp @ W2[g].abs().T + (FF + 2) * U32 * (hp.abs() @ W2[g].abs().T)
        if B2 is not None:  # fc2's output rounded to the dtype, then probs * b2 added in fp32
            pb = pg * B2[g]
            e = e + rerr(s) + 4 * U32 * (s.abs() + pb.abs())
            s = s + pb
        y[r0:r1], ey[r0:r1] = s, e
        # Backward: dh' = dy W2 (fc2's dgrad, stored in the dtype), through SwiGLU x probs.
        dhp = dyg @ W2[g]
        edhp = (OUT + 2) * U32 * (dyg.abs() @ W2[g].abs()) + rerr(dhp)
        dpv = (h * dhp).sum(1)
        dp_abs = (h * dhp).abs().sum(1)
        dp_err = (h.abs() * edhp + eh * dhp.abs()).sum(1)
        terms = FF
        if B2 is not None:
            dpv = dpv + (dyg * B2[g]).sum(1)
            dp_abs = dp_abs + (dyg * B2[g]).abs().sum(1)
            terms += OUT
        dp[r0:r1], edp[r0:r1] = dpv, dp_err + (terms + 2) * U32 * dp_abs
        da, db_ = pg * dhp * b * dsilu, pg * dhp * silu
        eda = ((pg * b * dsilu).abs() * edhp
               + (pg * dhp).abs() * (dsilu.abs() * eb + 0.5 * b.abs() * ea + 0.5 * ea * eb)
               + 16 * U32 * da.abs() + rerr(da))
        edb_ = (pg * silu).abs() * edhp + (pg * dhp).abs() * 1.1 * ea + 16 * U32 * db_.abs() + rerr(db_)
        dz, edz = torch.zeros(n, 2 * FF, **f64), torch.zeros(n, 2 * FF, **f64)
        dz[:, ca], dz[:, cb], edz[:, ca], edz[:, cb] = da, db_, eda, edb_
        dx[r0:r1] = dz @ W1[g]
        edx[r0:r1] = edz @ W1[g].abs() + (2 * FF + 2) * U32 * (dz.abs() @ W1[g].abs())
        dW1[g] = dz.T @ xg
        edW1[g] = edz.T @ xg.abs() + (n + 2) * U32 * (dz.abs().T @ xg.abs())
        dB1[g], edB1[g] = dz.sum(0), edz.sum(0) + (n + 2) * U32 * dz.abs().sum(0)
        dW2[g] = dyg.T @ hp
        edW2[g] = dyg.abs().T @ ehp + (n + 2) * U32 * (dyg.abs().T @ hp.abs())
        dB2[g] = (pg * dyg).sum(0)
        edB2[g] = (n + 3) * U32 * (pg * dyg).abs().sum(0)
    return dict(y=(y, ey), dx=(dx, edx), dprobs=(dp, edp), dW1=(dW1, edW1), dB1=(dB1, edB1), dW2=(dW2, edW2),
                dB2=(dB2, edB2))


def _mlp_inputs(p):
    gen = torch.Generator().manual_seed(p["data_seed"])
    dtype = DTYPES[p["dtype"]]
    G, IN, FF, OUT = p["G"], p["IN"], p["FFN"], p["OUT"]
    W1 = _randn(gen, G, 2 * FF, IN, scale=p["scale"] / math.sqrt(IN)).to(dtype)
    W2 = _randn(gen, G, OUT, FF, scale=1 / math.sqrt(FF)).to(dtype)
    B1 = _randn(gen, G, 2 * FF).to(dtype) if p["bias"] else None
    B2 = _randn(gen, G, OUT).to(dtype) if p["bias"] else None
    mg1, mg2 = _randn(gen, G, 2 * FF, IN).float(), _randn(gen, G, OUT, FF).float()
    probs = torch.rand(p["T"], generator=gen, dtype=torch.float64).float()
    if p["probs_zero"]:
        probs[torch.rand(p["T"], generator=gen) < 0.3] = 0
    return gen, dtype, W1, B1, W2, B2, mg1, mg2, probs


def _run_mlp(p, device):
    gen, dtype, W1, B1, W2, B2, mg1, mg2, probs0 = _mlp_inputs(p)
    T, S, splits = p["T"], sum(p["splits"]), p["splits"]
    m = stt.GroupedMLP(p["G"], p["IN"], p["FFN"], p["OUT"], bias=p["bias"], params_dtype=dtype, device=device,
                       glu_interleave_size=p["glu"], single_grouped_weight=p["single"],
                       fuse_wgrad_accumulation=p["fuse"], delay_wgrad_compute=p["delay"])
    _set_layer(m.fc1, W1, B1, mg1, p)
    _set_layer(m.fc2, W2, B2, mg2, p)
    x0, x, dy, out, gin = _x_and_buffers(p, device, gen, p["OUT"], dtype)
    probs = _leaf(probs0, device, p["probs_grad"])
    run = _Run()
    _poison_cuda_cache(device)
    y = m(x, _splits_arg(p, device), probs, out=None if out is None else out[0],
          grad_input=None if gin is None else gin[0])
    _check_row_outputs(run, "y", y, T, S, out, dtype)
    _poison_cuda_cache(device)
    y.backward(_dy_for(y, dy, T, gen))
    if p["x_grad"]:
        _check_dx(run, x, T, S, gin, dtype)
    if p["probs_grad"]:
        assert probs.grad is not None and probs.grad.dtype == torch.float32 and probs.grad.shape == (T,), "dprobs"
        _zero(probs.grad[S:], "dprobs: the padded tail (rows >= S)")
        run.add("dprobs", probs.grad[:S], torch.float32)
    for prefix, layer, mg in (("fc1.", m.fc1, mg1), ("fc2.", m.fc2, mg2)):
        _check_layer_params(run, layer, prefix, mg, splits, p, "backward")
    if p["delay"]:
        assert m.pending_wgrads == 1, f"pending_wgrads {m.pending_wgrads}, expected 1"
        m.backward_dw()
        assert m.pending_wgrads == 0
        for prefix, layer, mg in (("fc1.", m.fc1, mg1), ("fc2.", m.fc2, mg2)):
            _check_layer_params(run, layer, prefix, mg, splits, p, "backward_dw")
    if p["form"].startswith("cuda"):
        assert int(m.splits_status.item()) == 0, f"splits_status {int(m.splits_status.item())} for valid splits"
    return run


def _mlp_oracle_values(p, device_kind="cpu"):
    gen, dtype, W1, B1, W2, B2, mg1, mg2, probs = _mlp_inputs(p)
    x0, _, dy, _, _ = _x_and_buffers(p, "cpu", gen, p["OUT"], dtype)
    d = lambda t: None if t is None else t.double()  # noqa: E731
    o = _mlp_oracle(x0.double(), probs.double(), dy.double(), W1.double(), d(B1), W2.double(), d(B2), p["splits"],
                    p["FFN"], p["glu"], dtype)
    return dtype, mg1, mg2, o


def _check_mlp(p, run, oracle, check):
    dtype, mg1, mg2, o = oracle
    vals = run.values
    check(vals["y"][0], *o["y"], dtype, "y")
    if "dx" in vals:
        check(vals["dx"][0], *o["dx"], dtype, "dx")
    if "dprobs" in vals:
        check(vals["dprobs"][0], *o["dprobs"], torch.float32, "dprobs")
    _check_oracle_params(run, "fc1.", o["dW1"], o["dB1"], mg1, p, dtype, check)
    _check_oracle_params(run, "fc2.", o["dW2"], o["dB2"], mg2, p, dtype, check)


# -- MoELayer --------------------------------------------------------------------------------------

MOE_TOL = {torch.float32: 5e-5, torch.float16: 6e-3, torch.bfloat16: 4e-2}


def _moe_inputs(p):
    """Inputs whose top-k choice is clear: the k-th and (k+1)-th choice values of every token
    differ by more than fp32 can blur (logits drawn again until so), so the oracle's float64 choice
    is the library's fp32 one."""
    gen = torch.Generator().manual_seed(p["data_seed"])
    dtype = DTYPES[p["dtype"]]
    N, E, K, H, FF = p["N"], p["E"], p["top_k"], p["hidden"], p["FFN"]
    bias = (0.3 * _randn(gen, E)).float() if p["expert_bias"] else None
    for _ in range(200):
        logits = (2 * _randn(gen, N, E)).float()
        value = _scores(logits.double(), p["score"]).float().double() + (0 if bias is None else bias.double())
        v = value.sort(1, descending=True).values
        if K == E or N == 0 or bool(((v[:, K - 1] - v[:, K]) > 1e-4).all()):
            break
    else:
        raise AssertionError("no logits with a clear top-k choice in 200 draws")
    x = _randn(gen, N, H).to(dtype)
    W1 = _randn(gen, E, 2 * FF, H, scale=1 / math.sqrt(H)).to(dtype)
    W2 = _randn(gen, E, H, FF, scale=1 / math.sqrt(FF)).to(dtype)
    B1 = (0.5 * _randn(gen, E, 2 * FF)).to(dtype) if p["bias"] else None
    B2 = (0.5 * _randn(gen, E, H)).to(dtype) if p["bias"] else None
    dout = _randn(gen, N, H).to(dtype)
    dsum = _randn(gen, E).float()
    return dtype, logits, bias, x, W1, B1, W2, B2, dout, dsum


def _scores(logits, score):
    return torch.softmax(logits, 1) if score == "softmax" else torch.sigmoid(logits)


def _moe_reference(p, logits, bias, x, W1, B1, W2, B2, dout, dsum):
    """float64 composition under autograd (the choice held): out, score_sum, the choice, and the
    gradients of sum(out * dout) + sum(score_sum * dsum) for x, logits, each expert's parameters."""
    leaf = lambda t: None if t is None else t.detach().double().requires_grad_()  # noqa: E731
    x, logits, W1, B1, W2, B2 = (leaf(t) for t in (x, logits, W1, B1, W2, B2))
    s = _scores(logits, p["score"])
    with torch.no_grad():
        value = s.float().double() + (0 if bias is None else bias.double())
        experts = torch.sort(value, dim=1, descending=True, stable=True).indices[:, :p["top_k"]]
    probs = s.gather(1, experts)
    if p["normalize"]:
        probs = probs / probs.sum(1, keepdim=True)
    ca, cb = _glu_columns(p["FFN"], p["glu"])
    out = torch.zeros(p["N"], p["hidden"], dtype=torch.float64)
    for e in range(p["E"]):
        tok, slot = (experts == e).nonzero(as_tuple=True)
        if tok.numel() == 0:
            continue
        pe = probs[tok, slot][:, None]
        z = x[tok] @ W1[e].T + (0 if B1 is None else B1[e])
        h = F.silu(z[:, ca]) * z[:, cb] * pe
        out = out.index_add(0, tok, h @ W2[e].T + (0 if B2 is None else pe * B2[e]))
    score_sum = s.sum(0)
    ((out * dout.double()).sum() + (score_sum * dsum.double()).sum()).backward()
    grads = {}
    for name, t in (("dx", x), ("dlogits", logits), ("fc1.dW", W1), ("fc1.db", B1), ("fc2.dW", W2), ("fc2.db", B2)):
        if t is not None:  # None: nothing reached it (no token; an expert no token chose): zeros
            grads[name] = torch.zeros_like(t) if t.grad is None else t.grad
    return out.detach(), score_sum.detach(), experts, grads


def _run_moe(p, device):
    dtype, logits, bias, x, W1, B1, W2, B2, dout, dsum = _moe_inputs(p)
    layer = stt.MoELayer(p["E"], p["hidden"], p["FFN"], p["top_k"], score=p["score"], normalize=p["normalize"],
                         bias=p["bias"], params_dtype=dtype, device=device, glu_interleave_size=p["glu"],
                         single_grouped_weight=p["single"], fuse_wgrad_accumulation=p["fuse"],
                         delay_wgrad_compute=p["delay"], recompute_expert_input=p["recompute"])
    pf = dict(fuse=p["fuse"], overwrite=False, attr=False)
    mg1 = torch.zeros(p["E"], 2 * p["FFN"], p["hidden"])
    mg2 = torch.zeros(p["E"], p["hidden"], p["FFN"])
    _set_layer(layer.experts.fc1, W1, B1, mg1, pf)
    _set_layer(layer.experts.fc2, W2, B2, mg2, pf)
    xl, ll = _leaf(x, device), _leaf(logits, device)
    _poison_cuda_cache(device)
    got = layer(xl, ll, None if bias is None else bias.to(device))
    _poison_cuda_cache(device)
    ((got.out.float() * dout.to(device).float()).sum() + (got.score_sum * dsum.to(device)).sum()).backward()
    if p["delay"]:
        layer.backward_dw()
    run = _Run()
    run.add("out", got.out, dtype)
    run.add("score_sum", got.score_sum, torch.float32)
    run.add("counts", got.counts, torch.int64)
    run.add("dx", xl.grad, dtype)
    run.add("dlogits", ll.grad, torch.float32)
    for prefix, lin in (("fc1.", layer.experts.fc1), ("fc2.", layer.experts.fc2)):
        ws = lin.weights()
        dW = _stacked([w.main_grad if p["fuse"] else w.grad for w in ws], p["single"])
        run.add(prefix + "dW", dW, torch.float32 if p["fuse"] else dtype)
        if p["bias"]:
            run.add(prefix + "db", _stacked([b.grad for b in lin.biases()], p["single"]), dtype)
    return run


def _moe_oracle_values(p, device_kind="cpu"):
    dtype, logits, bias, x, W1, B1, W2, B2, dout, dsum = _moe_inputs(p)
    return (dtype, *_moe_reference(p, logits, bias, x, W1, B1, W2, B2, dout, dsum))


def _check_moe(p, run, oracle, check=None):
    """The MoE layer against its float64 composition (`check` unused: no bound is carried here)."""
    dtype, out, score_sum, experts, grads = oracle
    vals = run.values
    counts = torch.bincount(experts.reshape(-1), minlength=p["E"])
    assert torch.equal(vals["counts"][0], counts), f"counts {vals['counts'][0].tolist()}, expected {counts.tolist()}"
    tol = MOE_TOL[dtype]
    _check_relative(vals["out"][0], out, tol, "out")
    _check_relative(vals["score_sum"][0], score_sum, 1e-5, "score_sum")
    _check_relative(vals["dx"][0], grads["dx"], tol, "dx")
    _check_relative(vals["dlogits"][0], grads["dlogits"], tol, "dlogits")
    for name in ("fc1.dW", "fc1.db", "fc2.dW", "fc2.db"):
        if name in grads:
            for e in range(p["E"]):  # each expert against its own scale
                _check_relative(vals[name][0][e], grads[name][e], tol, f"{name}[{e}]")


# -- block-sparse attention ------------------------------------------------------------------------


def _doc_ids(gen, B, S, sorted_ids):
    """int32 document ids [B, S]: packed documents of random lengths (1 up to S), or ids in any
    order from a small alphabet."""
    if not sorted_ids:
        return torch.randint(0, 4, (B, S), generator=gen, dtype=torch.int32)
    ids = torch.empty(B, S, dtype=torch.int32)
    for b in range(B):
        s = d = 0
        while s < S:
            n = 1 + int(torch.randint(0, max(1, S // int(torch.randint(1, 6, (1,), generator=gen))), (1,),
                                      generator=gen))
            ids[b, s:s + n] = d
            s, d = s + n, d + 1
    return ids


def _expand_blocks(blocks, bq, bkv, sq, skv):
    return blocks.repeat_interleave(bq, -2).repeat_interleave(bkv, -1)[..., :sq, :skv]


def _random_blocks(gen, lead, mq, nk, probs):
    """uint8 [*lead, mq, nk]: 0 skipped, 1 partial, 2 full, with the given probabilities."""
    r = torch.rand(*lead, mq, nk, generator=gen)
    return (r >= probs[0]).to(torch.uint8) + (r >= probs[0] + probs[1]).to(torch.uint8)


def _flex_mod(p, gen):
    """(mask_mod, dense(b, h, q, kv)): a mask_mod for flex_attention and the same predicate over
    broadcast index tensors (the oracle's mask). Heads are query heads."""
    a, c, mod, r = p["mod_args"]
    B, H, Sq, Skv = p["B"], p["Hq"], p["Sq"], p["Skv"]
    kind = p["mod"]
    if kind == "modular":
        def fn(b, h, q, kv):
            return (q * a + kv * c) % mod != r % mod
    elif kind == "window":
        def fn(b, h, q, kv):
            return (kv <= q + r) & (q - kv <= a * mod + h)
    else:
        shape = (B, H, Sq, Skv) if kind == "table_bh" else (1, 1, Sq, Skv)
        table = torch.rand(*shape, generator=gen) < p["density"]

        def fn(b, h, q, kv):
            if kind == "table_bh":
                return table[b, h, q, kv]
            return table[0, 0, q, kv]
    return fn


def _dense_mod(fn, B, H, Sq, Skv):
    b = torch.arange(B)[:, None, None, None]
    h = torch.arange(H)[None, :, None, None]
    q = torch.arange(Sq)[None, None, :, None]
    kv = torch.arange(Skv)[None, None, None, :]
    return fn(b, h, q, kv).expand(B, H, Sq, Skv)


def _flex_lists(blocks):
    """flex's (num_blocks, indices) int32 lists of the blocks equal to one ([B, H, Mq, Nk] bool)."""
    num = blocks.sum(-1).to(torch.int32)
    order = torch.argsort((~blocks).to(torch.int8), dim=-1, stable=True).to(torch.int32)
    return num, order


def _schedule_kw(p, mask_kv_blocks, gen):
    sched = p["schedule"]
    if sched == "permutation":
        sched = torch.randperm(mask_kv_blocks, generator=gen).tolist()
    kw = {"schedule": sched}
    if p["walk"] is not None:
        kw["walk"] = p["walk"]
    return kw


def _with_walk(mask, sched):
    """The builders from blocks take no walk: set it afterwards (with_schedule) where the case has one."""
    return mask.with_schedule(sched["schedule"], walk=sched["walk"]) if "walk" in sched else mask


def _attention_mask(p, gen, device):
    """(sparsetrain.BlockMask on `device`, dense allowed bool broadcastable to [B, Hq, Sq, Skv])."""
    B, Hq, Sq, Skv = p["B"], p["Hq"], p["Sq"], p["Skv"]
    bq, bkv = p["block"]
    mq, nk = -(-Sq // bq), -(-Skv // bkv)
    src = p["source"]
    on_device = device.type == "cuda" and p.get("device_build", False)
    sched = _schedule_kw(p, nk, gen)
    if src in ("kind", "blocks"):
        kind = p["kind"]
        doc_q = doc_kv = None
        if kind.startswith("document"):
            rows = B if p["docs_per_row"] else 1
            doc_q = _doc_ids(gen, rows, Sq, p["docs_sorted"])
            doc_kv = doc_q if p["docs_same"] else _doc_ids(gen, rows, Skv, p["docs_sorted"])
        allowed = dense_mask(kind, Sq, Skv, window_left=p["window"][0], window_right=p["window"][1],
                             prefix_length=p["prefix"], doc_q=doc_q, doc_kv=doc_kv)
        if src == "kind":
            kw = dict(window_left=p["window"][0], window_right=p["window"][1], prefix_length=p["prefix"],
                      block_size=(bq, bkv), framework="torch", **sched)
            if kind.startswith("document"):
                kw.update(doc_q=doc_q, doc_kv=doc_kv)
                if p["doc_padding"] and Sq == Skv and p["schedule"] != "permutation":
                    kw["doc_padding"] = 128
            if on_device:
                kw["device"] = device
            mask = st.BlockMask.build(kind, Sq, Skv, **kw)
            return mask.to(device), allowed
        lead = (B if p["mask_batch"] else 1, Hq if p["mask_heads"] else 1)
        blocks = _random_blocks(gen, lead, mq, nk, p["block_probs"])
        spec = st.MaskSpec(kind, p["window"][0], p["window"][1], p["prefix"],
                           None if doc_q is None else doc_q, None if doc_kv is None else doc_kv)
        mask = _with_walk(st.BlockMask.from_blocks(blocks, Sq, Skv, block_size=(bq, bkv), spec=spec,
                                                   framework="torch", schedule=sched["schedule"]), sched)
        dense = _expand_blocks(blocks, bq, bkv, Sq, Skv)
        return mask.to(device), (dense == 2) | ((dense == 1) & allowed)
    if src in ("flex", "flex_blocks"):
        from torch.nn.attention import flex_attention as flex  # noqa: PLC0415

        fn = _flex_mod(p, gen)
        per_bh = p["mod"] in ("table_bh", "window")  # reads b or h
        dense = _dense_mod(fn, B, Hq, Sq, Skv)
        if src == "flex":
            fm = flex.create_block_mask(fn, B if per_bh else None, Hq if per_bh else None, Sq, Skv, device="cpu",
                                        BLOCK_SIZE=(bq, bkv))
            mask = st.BlockMask.from_torch(fm, schedule=sched["schedule"], device=device)
            return _with_walk(mask, sched), dense
        lead = (B, Hq) if per_bh else (1, 1)
        blocks = _random_blocks(gen, lead, mq, nk, p["block_probs"])
        if not p["full_lists"]:
            blocks = blocks.clamp(max=1)
        kvn, kvi = _flex_lists(blocks == 1)
        full = {}
        if p["full_lists"]:
            fkvn, fkvi = _flex_lists(blocks == 2)
            full = dict(full_kv_num_blocks=fkvn, full_kv_indices=fkvi)
        fm = flex.BlockMask.from_kv_blocks(kvn, kvi, BLOCK_SIZE=(bq, bkv), mask_mod=fn, seq_lengths=(Sq, Skv), **full)
        mask = st.BlockMask.from_torch(fm, batch=B if per_bh else None, heads=Hq if per_bh else None,
                                       schedule=sched["schedule"], device=device)
        exp = _expand_blocks(blocks, bq, bkv, Sq, Skv)
        return _with_walk(mask, sched), (exp == 2) | ((exp == 1) & dense)
    # cu_seqlens: one packed row; positions past the last offset belong to no document.
    def lengths(total):
        out, s = [], 0
        while True:
            n = 1 + int(torch.randint(0, max(1, total // 3), (1,), generator=gen))
            if s + n > total:
                return out
            out.append(n)
            s += n

    lq = lengths(Sq)
    if p["same_kv"]:
        lk = lq
    else:  # as many key documents, of their own lengths (cut to fit Skv)
        lk = [1 + int(torch.randint(0, max(1, 2 * Skv // len(lq)), (1,), generator=gen)) for _ in lq]
        while len(lk) > 1 and sum(lk) > Skv:
            lk.pop()
            lq.pop()
        lk[0] = min(lk[0], Skv)
    cu_q = torch.tensor([0] + lq, dtype=torch.int32).cumsum(0).to(torch.int32)
    cu_k = torch.tensor([0] + lk, dtype=torch.int32).cumsum(0).to(torch.int32)
    ids_q = torch.full((Sq,), len(lq), dtype=torch.int64)
    ids_k = torch.full((Skv,), len(lq) + 1, dtype=torch.int64)
    for i, (a, b) in enumerate(zip(cu_q[:-1].tolist(), cu_q[1:].tolist())):
        ids_q[a:b] = i
    for i, (a, b) in enumerate(zip(cu_k[:-1].tolist(), cu_k[1:].tolist())):
        ids_k[a:b] = i
    allowed = ids_q[:, None] == ids_k[None, :]
    if p["causal"]:
        allowed = allowed & (torch.arange(Skv)[None, :] <= torch.arange(Sq)[:, None])
    kw = dict(seq_q=Sq, seq_kv=Skv, causal=p["causal"], block_size=(bq, bkv), schedule=sched["schedule"])
    if p["doc_padding"] and p["same_kv"] and p["schedule"] != "permutation":
        kw["doc_padding"] = 128
    cu_k_arg = cu_q if p["same_kv"] else cu_k
    mask = st.BlockMask.from_cu_seqlens(cu_q.to(device), cu_k_arg.to(device), **kw)
    return mask.to(device), allowed[None, None]


def _attention_oracle(q, k, v, do, allowed, scale, dtype, p_operand):
    """float64 (value, err) of o, lse, dq, dk, dv ([B, H, S, D] / [B, Hq, Sq]): dense masked softmax
    and its analytic backward with tests/support/attention_oracle.h's first-order bound; a row with
    no allowed key gives o = 0, lse = -inf and zero gradients. p_operand: the dtype P and dS are
    rounded to before the second GEMMs (the CUDA kernels' 16-bit operands), None for fp32."""
    B, Hq, Sq, D = q.shape
    Hkv, Skv = k.shape[1], k.shape[2]
    grp = Hq // Hkv
    uop = 0.0 if p_operand is None else _U[p_operand]
    # fp16's subnormals: a P or dS (before the scale) below 2^-14 rounds to a multiple of 2^-24,
    # an absolute error up to 2^-25 that no relative term covers.
    sub = 2.0 ** -25 if p_operand == torch.float16 else 0.0
    kk, vv = k.repeat_interleave(grp, 1), v.repeat_interleave(grp, 1)
    A = allowed.expand(B, Hq, Sq, Skv)
    n = A.sum(-1).double()
    empty = n == 0
    s = scale * (q @ kk.transpose(-1, -2))
    es = abs(scale) * (D + 1) * U32 * (q.abs() @ kk.abs().transpose(-1, -2))
    Es = torch.where(A, es, 0.0).amax(-1)
    lse = torch.where(A, s, -math.inf).logsumexp(-1)
    lse0 = torch.where(empty, 0.0, lse)
    pr = torch.where(A, torch.exp(s - lse0[..., None]), 0.0)
    lse_err = Es + (n + 3) * U32 + 2 * U32 * lse0.abs()
    ep_f = 2 * Es + (n + 4) * U32 + uop
    o = pr @ vv
    Af = A.double()
    o_err = (ep_f + (n + 3) * U32)[..., None] * (pr @ vv.abs()) + sub * (Af @ vv.abs())
    delta = (do * o).sum(-1)
    ddelta = (do.abs() * (o_err + _rounding_error(dtype, o))).sum(-1) + (D + 1) * U32 * (do * o).abs().sum(-1)
    dpv = do @ vv.transpose(-1, -2)
    abs_dp = do.abs() @ vv.abs().transpose(-1, -2)
    ep_b = es + lse_err[..., None] + 2 * U32
    diff = dpv - delta[..., None]
    ds = scale * pr * diff
    dds = (abs(scale) * pr * ((ep_b + 3 * U32) * diff.abs() + (D + 1) * U32 * abs_dp + ddelta[..., None])
           + uop * ds.abs() + abs(scale) * sub * Af)
    dq = ds @ kk
    dq_err = dds @ kk.abs() + ((n + 2) * U32)[..., None] * (ds.abs() @ kk.abs())

    def per_kv_head(t):
        return t.reshape(B, Hkv, grp, Skv, D).sum(2)

    dsT, prT = ds.transpose(-1, -2), pr.transpose(-1, -2)
    kv_terms = A.reshape(B, Hkv, grp, Sq, Skv).sum((2, 3)).double()[..., None]
    dk = per_kv_head(dsT @ q)
    dk_err = (per_kv_head(dds.transpose(-1, -2) @ q.abs())
              + (kv_terms + 2) * U32 * per_kv_head(ds.abs().transpose(-1, -2) @ q.abs()))
    dv = per_kv_head(prT @ do)
    dv_err = (per_kv_head(((ep_b + uop) * pr + sub * Af).transpose(-1, -2) @ do.abs())
              + (kv_terms + 2) * U32 * per_kv_head(prT @ do.abs()))
    return dict(o=(o, o_err), lse=(lse, torch.where(empty, 0.0, lse_err)), dq=(dq, dq_err), dk=(dk, dk_err),
                dv=(dv, dv_err)), empty


def _attention_inputs(p):
    gen = torch.Generator().manual_seed(p["data_seed"])
    dtype = DTYPES[p["dtype"]]
    B, Hq, Hkv, Sq, Skv, D = p["B"], p["Hq"], p["Hkv"], p["Sq"], p["Skv"], p["D"]
    s = p["input_scale"]
    q = _randn(gen, B, Hq, Sq, D, scale=s).to(dtype)
    k = _randn(gen, B, Hkv, Skv, D, scale=s).to(dtype)
    v = _randn(gen, B, Hkv, Skv, D).to(dtype)
    do = _randn(gen, B, Hq, Sq, D).to(dtype)
    return gen, dtype, q, k, v, do


def _laid_out(t, layout, device):
    """t [B, H, S, D] as a leaf on `device` in `layout`: contiguous, a transpose(1, 2) view of
    [B, S, H, D] storage, or rows padded to D + 8 columns."""
    if layout == "bshd":
        return t.transpose(1, 2).contiguous().to(device).transpose(1, 2).detach().requires_grad_()
    if layout == "padded":
        B, H, S, D = t.shape
        storage = torch.zeros(B, H, S, D + 8, dtype=t.dtype, device=device)
        storage[..., :D] = t.to(device)
        return storage[..., :D].detach().requires_grad_()
    return _leaf(t, device)


def _run_attention(p, device):
    gen, dtype, q0, k0, v0, do = _attention_inputs(p)
    mask, _ = _attention_mask(p, gen, device)
    q, k, v = (_laid_out(t, p["layout"], device) for t in (q0, k0, v0))
    _poison_cuda_cache(device)
    o, lse = stt.block_sparse_attention(q, k, v, mask, scale=p["scale"], deterministic=p["deterministic"],
                                        return_lse=True)
    assert o.shape == q.shape and o.dtype == dtype and lse.dtype == torch.float32 and lse.shape == q.shape[:3]
    _poison_cuda_cache(device)
    o.backward(do.to(device))
    run = _Run()
    for name, t, dt in (("o", o, dtype), ("lse", lse, torch.float32), ("dq", q.grad, dtype), ("dk", k.grad, dtype),
                        ("dv", v.grad, dtype)):
        assert t is not None, f"{name}: missing"
        run.add(name, t, dt)
    return run


def _attention_oracle_values(p, device_kind):
    gen, dtype, q, k, v, do = _attention_inputs(p)
    _, allowed = _attention_mask(p, gen, torch.device("cpu"))
    scale = p["scale"] if p["scale"] is not None else 1 / math.sqrt(p["D"])
    return _attention_oracle(q.double(), k.double(), v.double(), do.double(), allowed, scale, dtype,
                             dtype if device_kind == "cuda" else None)


def _check_attention(p, run, oracle, check):
    o, empty = oracle
    vals = run.values
    if bool(empty.any()):
        _zero(vals["o"][0][empty], "o: rows without an allowed key")
    for name in ("o", "lse", "dq", "dk", "dv"):
        got, dt = vals[name]
        check(got, *o[name], dt, name)


# -- the tests -------------------------------------------------------------------------------------

# family -> (run on a device, the oracle for a device kind ("cpu", "cuda"), check a run against it)
RUNNERS = {"linear": (_run_linear, _linear_oracle_values, _check_linear),
           "mlp": (_run_mlp, _mlp_oracle_values, _check_mlp),
           "moe": (_run_moe, _moe_oracle_values, _check_moe),
           "attention": (_run_attention, _attention_oracle_values, _check_attention)}


@contextlib.contextmanager
def _reporting(case):
    """Any failure (an assertion, or the library raising on a valid case) reported with the case,
    its parameters and its rerun command (conftest.py's tally reads the case from the parameters)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # small float64 oracles: intra-op threads cost 100x on a loaded 2-core CI machine
    try:
        yield
    except (pytest.skip.Exception, KeyboardInterrupt):
        raise
    except Exception as e:
        raise AssertionError(f"{case.repro()}\n  {type(e).__name__}: {e}") from e
    finally:
        torch.set_num_threads(threads)


def _cpu(case):
    run, oracle, check = RUNNERS[case.family]
    result = run(case.params, torch.device("cpu"))
    check(case.params, result, oracle(case.params, "cpu"), _check_bounded)


CPU_LIST = [make_case("cpu", i) for i in range(CPU_CASES)]


@pytest.mark.parametrize("case", CPU_LIST, ids=[c.id for c in CPU_LIST])
def test_fuzz_cpu(case):
    with _reporting(case):
        _cpu(case)


# CUDA: the same generator with the device's rules; each case on the GPU and on the CPU reference
# (the same inputs), each against the oracle and the two against each other.

_ATTN_KERNELS = {}


def _cuda_attention_kernels(dev):
    """The (dtype, D) pairs this build has CUDA attention kernels for (ALL: bf16 / fp16 x 64 / 96 /
    128; MINIMAL: bf16 D = 128); the library names the built ones in its refusal."""
    if dev not in _ATTN_KERNELS:
        found = []
        for dt in ("bf16", "fp16"):
            for D in (64, 96, 128):
                q = torch.zeros(1, 1, 128, D, dtype=DTYPES[dt], device=dev)
                try:
                    stt.block_sparse_attention(q, q, q, st.BlockMask.build("causal", 128, device=dev))
                    found.append((dt, D))
                except ValueError as e:
                    if "with a CUDA kernel in this build" not in str(e):
                        raise
        _ATTN_KERNELS[dev] = found
    return _ATTN_KERNELS[dev]


def _device_params(case, dev):
    """case.params as this device and build can run them: an attention case on a GPU that is not a
    Hopper skips (visibly), and one whose (dtype, D) has no kernel in this build takes one that has
    (chosen by the case index, so the same case on the same build), noted in the parameters."""
    p = case.params
    if dev.type != "cuda":
        return p
    if not st.built_with_cuda():
        pytest.skip("sparsetrain was built without the CUDA backend: the CUDA fuzz cases skipped")
    if case.family != "attention":
        return p
    if torch.cuda.get_device_capability(dev) != (9, 0):
        pytest.skip(f"GPU {torch.cuda.get_device_name(dev)} is not a Hopper (compute capability 9.0): the CUDA "
                    "attention fuzz cases skipped")
    kernels = _cuda_attention_kernels(dev)
    if not kernels:
        pytest.skip("no CUDA attention kernel in this build: the CUDA attention fuzz cases skipped")
    if (p["dtype"], p["D"]) not in kernels:
        dt, D = kernels[case.index % len(kernels)]
        p = dict(p, dtype=dt, D=D, remapped=f"{p['dtype']} D {p['D']}: not in this build")
    return p


def _cross(case, dev, ref_dev):
    """case on `dev` and on the CPU reference `ref_dev`: both against the oracle (the bound of
    `dev`'s kind), and `dev` against the reference."""
    p = case.params = _device_params(case, dev)
    run, oracle, check = RUNNERS[case.family]
    got = run(p, dev)
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    ref = run(p, ref_dev)
    assert got.values.keys() == ref.values.keys(), \
        f"results differ in kind: {sorted(got.values)} against the reference's {sorted(ref.values)}"
    ref_oracle = oracle(p, "cpu")
    dev_oracle = oracle(p, dev.type) if case.family == "attention" else ref_oracle  # P's rounding on CUDA
    check(p, ref, ref_oracle, _check_bounded)
    if case.family == "moe":
        check(p, got, dev_oracle)
        tol = 2 * MOE_TOL[DTYPES[p["dtype"]]]
        for name, (t, dt) in got.values.items():
            other = ref.values[name][0]
            if dt == torch.int64:
                assert torch.equal(t, other), f"{name}: {t.tolist()} against the reference's {other.tolist()}"
            else:
                _check_relative(t, other, 2e-5 if name == "score_sum" else tol, f"{name} against the CPU reference")
        return

    def pair(t, value, err, dtype, what):
        _check_pair(t, ref.values[what][0], value, err, dtype, what)

    check(p, got, dev_oracle, _check_bounded)
    check(p, got, dev_oracle, pair)


if HAVE_CUDA:
    CUDA_PARAMS = [pytest.param(c, id=c.id) for c in (make_case("cuda", i) for i in range(CUDA_CASES))]
else:
    CUDA_PARAMS = [pytest.param(None, id="no-cuda")]


@pytest.mark.skipif(not HAVE_CUDA, reason="no CUDA device (torch.cuda.is_available() is False): the CUDA fuzz cases "
                    "skipped")
@pytest.mark.parametrize("case", CUDA_PARAMS)
def test_fuzz_cuda(case):
    with _reporting(case):
        _cross(case, torch.device("cuda", torch.cuda.current_device()), torch.device("cpu"))
