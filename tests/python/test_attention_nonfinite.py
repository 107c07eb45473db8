"""NaN and inf in block_sparse_attention's inputs are never hidden, and both backends put them in
the same elements (docs/DESIGN.md section 6, "Non-finite inputs": every pair of a visited block
enters the arithmetic, a masked one with weight 0, and 0 x inf is NaN). A NaN or an inf goes into
one row or element of q, k, v or dout; the CPU backend's o, lse, dq, dk and dv must be non-finite
exactly where an independent float64 oracle of that rule says (and close to it elsewhere), for
every mask kind, GQA and Sq != Skv. On a Hopper GPU the CUDA results must be non-finite exactly
where the CPU reference's are, deterministic and not; with the padded document backward, at
least where every allowed pair puts them. Skipped visibly without torch (and the CUDA part
without a Hopper GPU)."""

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed: non-finite attention tests skipped")

import sparsetrain as st  # noqa: E402
import sparsetrain.torch as stt  # noqa: E402
from dense_masks import dense_mask  # noqa: E402

NAN, INF = float("nan"), float("inf")
# (tensor, what, value): a whole row (all of its D elements) or one element of it.
INJECTIONS = [("q", "row", NAN), ("q", "element", INF), ("k", "row", NAN), ("k", "element", -INF),
              ("k", "element", INF), ("v", "element", NAN), ("v", "row", INF), ("do", "element", NAN),
              ("do", "row", -INF)]


def _allowed(kind, Sq, Skv, doc=None, **params):
    """bool [B or 1, 1, Sq, Skv]: the kinds' definitions (dense_masks), or the mask function."""
    if kind == "mod3_causal":  # an arbitrary mask function: a bitmask in the library
        q, kv = torch.arange(Sq)[:, None], torch.arange(Skv)[None, :]
        return (((q + kv) % 3 != 0) & (kv <= q))[None, None]
    return dense_mask(kind, Sq, Skv, doc_q=doc, doc_kv=doc, **params)


def _mask(kind, Sq, Skv, block, doc, device, params, doc_padding=0):
    if kind == "mod3_causal":
        flex = pytest.importorskip("torch.nn.attention.flex_attention")
        fm = flex.create_block_mask(lambda b, h, q, kv: ((q + kv) % 3 != 0) & (kv <= q), 1, 1, Sq, Skv,
                                    device="cpu", BLOCK_SIZE=block)
        return st.BlockMask.from_torch(fm).to(device)
    if kind.startswith("document"):
        return st.BlockMask.build(kind, Sq, document_ids=doc.to(device), block_size=block, device=device,
                                  doc_padding=doc_padding)
    return st.BlockMask.build(kind, Sq, Skv, block_size=block, **params).to(device)


def _visited(mask, B, H, Sq, Skv):
    """bool [B, H, Sq, Skv]: the pairs of the blocks each q block visits (partial or full)."""
    m = mask.cpu().to_torch()
    out = torch.zeros(B, H, Sq, Skv, dtype=torch.bool)
    lists = [(m.kv_num_blocks, m.kv_indices)]
    if m.full_kv_num_blocks is not None:
        lists.append((m.full_kv_num_blocks, m.full_kv_indices))
    for counts, indices in lists:
        counts = counts.expand(B, H, -1)
        indices = indices.expand(B, H, *indices.shape[2:])
        for b in range(B):
            for h in range(H):
                for qb in range(counts.shape[-1]):
                    for n in indices[b, h, qb, :int(counts[b, h, qb])].tolist():
                        out[b, h, qb * m.block_q:(qb + 1) * m.block_q, n * m.block_kv:(n + 1) * m.block_kv] = True
    return out


def _masked_sum(coef, vec, sel, chunk=32):
    """[B, H, I, D]: sum over j of coef[i, j] * vec[j] where sel[i, j], else nothing (not 0 x vec[j]:
    a non-finite vec[j] reaches only the selected sums). In row chunks: [B, H, I, J, D] at once is
    too large at CUDA sizes."""
    parts = []
    for i in range(0, coef.shape[2], chunk):
        c, m = coef[:, :, i:i + chunk, :, None], sel[:, :, i:i + chunk, :, None]
        parts.append(torch.where(m, c * vec[:, :, None], 0.0).sum(3))
    return torch.cat(parts, 2)


def _oracle(q, k, v, do, allowed, computed, scale):
    """float64 o, lse, dq, dk, dv of the rule: the arithmetic over the `computed` pairs (allowed
    ones, plus masked ones with weight 0). Scores and dP are dot products (a matmul's element (i,
    j) reads row i and column j alone); the sums over pairs are _masked_sum's."""
    q, k, v, do = (t.double() for t in (q, k, v, do))
    G = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(G, 1), v.repeat_interleave(G, 1)
    allowed = allowed.expand(q.shape[0], q.shape[1], -1, -1)
    computed = computed | allowed
    s = torch.where(allowed, scale * (q @ k.transpose(-1, -2)), -INF)
    mx = torch.where(s.isnan(), -INF, s).amax(-1)  # NaN skipped, as fmaxf
    e = torch.where(s != -INF, torch.exp(s - torch.where(mx == -INF, 0.0, mx)[..., None]), 0.0)
    total = e.sum(-1)
    empty = total == 0
    o = torch.where(empty[..., None], 0.0, _masked_sum(e, v, computed) / total[..., None])
    lse = torch.where(empty, -INF, mx + torch.log(total))
    lse_b = torch.where(lse == -INF, INF, lse)  # P = exp(S - inf) = 0 on a row without keys
    p = torch.where(s != -INF, torch.exp(s - lse_b[..., None]), 0.0)
    ds = p * (do @ v.transpose(-1, -2) - (do * o).sum(-1)[..., None]) * scale
    dq = _masked_sum(ds, k, computed)
    dk = _masked_sum(ds.transpose(-1, -2), q, computed.transpose(-1, -2))
    dv = _masked_sum(p.transpose(-1, -2), do, computed.transpose(-1, -2))
    B, Hkv = k.shape[0], k.shape[1] // G
    dk, dv = (t.view(B, Hkv, G, *t.shape[2:]).sum(2) for t in (dk, dv))
    return {"o": o, "lse": lse, "dq": dq, "dk": dk, "dv": dv}


def _inputs(B, Hq, Hkv, Sq, Skv, D, dtype, device, injection, seed):
    g = torch.Generator().manual_seed(seed)
    t = {"q": torch.randn(B, Hq, Sq, D, generator=g), "k": torch.randn(B, Hkv, Skv, D, generator=g),
         "v": torch.randn(B, Hkv, Skv, D, generator=g), "do": torch.randn(B, Hq, Sq, D, generator=g)}
    name, what, value = injection
    x = t[name]
    b, h, r = (int(torch.randint(0, n, (1,), generator=g)) for n in x.shape[:3])
    if what == "row":
        x[b, h, r] = value
    else:
        x[b, h, r, int(torch.randint(0, D, (1,), generator=g))] = value
    return {n: x.to(dtype).to(device) for n, x in t.items()}


def _run(inputs, mask, deterministic=True):
    q, k, v = (inputs[n].detach().clone().requires_grad_() for n in ("q", "k", "v"))
    o, lse = stt.block_sparse_attention(q, k, v, mask, deterministic=deterministic, return_lse=True)
    o.backward(inputs["do"])
    return {"o": o.detach(), "lse": lse.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}


def _check_pattern(got, want, case, exact=True):
    """Non-finite exactly where `want` is (exact=False: at least there); NaN vs inf not told apart
    (a P that underflows in the kernel's bf16 but not in fp32 turns inf into NaN)."""
    for name in ("o", "lse", "dq", "dk", "dv"):
        g, w = ~torch.isfinite(got[name].cpu()), ~torch.isfinite(want[name].cpu())
        missing, extra = int((w & ~g).sum()), int((g & ~w).sum())
        assert missing == 0, f"{case}: {name}: {missing} element(s) finite that must be non-finite (hidden)"
        if exact:
            assert extra == 0, f"{case}: {name}: {extra} element(s) non-finite that the rule keeps finite"


def _check_values(got, want, case, tol):
    for name in ("o", "lse", "dq", "dk", "dv"):
        g, w = got[name].cpu().double(), want[name].cpu().double()
        both = torch.isfinite(g) & torch.isfinite(w)
        err = (g[both] - w[both]).abs() - tol * (1 + w[both].abs())
        assert bool((err <= 0).all()), f"{case}: {name}: finite elements differ (max {err.max().item():.3e} over tol)"


# (kind, Sq, Skv, params) in blocks: 16 on the CPU, 128 on CUDA. Sizes off the block, partial,
# full and skipped blocks in each.
CASES = {
    "causal": ("causal", 3.3, 3.3, {}),
    "causal_bottom_right": ("causal_bottom_right", 2.1, 3.6, {}),
    "sliding_window": ("sliding_window", 3.4, 3.4, {"window_left": 1.3, "window_right": 0.4}),
    "prefix_lm": ("prefix_lm", 2.6, 2.6, {"prefix_length": 1.2}),
    "full": ("full", 1.3, 2.7, {}),
    "document": ("document", 3.1, 3.1, {}),
    "document_causal": ("document_causal", 3.1, 3.1, {}),
    "mod3_causal": ("mod3_causal", 2.4, 2.4, {}),
}


def _case(name, block, lengths=None):
    """(kind, Sq, Skv, params, document ids [1, S] or None); lengths: the documents' (S their sum)."""
    kind, sq, skv, params = CASES[name]
    Sq, Skv = int(sq * block), int(skv * block)
    params = {k: int(v * block) for k, v in params.items()}
    doc = None
    if kind.startswith("document"):
        if lengths is None:
            g = torch.Generator().manual_seed(5)
            cuts = torch.randint(1, Sq, (4,), generator=g).sort().values
        else:
            Sq = Skv = sum(lengths)
            cuts = torch.tensor(lengths).cumsum(0)[:-1]
        doc = (torch.arange(Sq)[None, :, None] >= cuts).sum(-1).int()
    return kind, Sq, Skv, params, doc


@pytest.mark.parametrize("injection", INJECTIONS, ids=[f"{n}_{w}_{v}" for n, w, v in INJECTIONS])
@pytest.mark.parametrize("name", list(CASES))
def test_cpu_results_are_non_finite_where_the_rule_says(name, injection):
    kind, Sq, Skv, params, doc = _case(name, 16)
    B, Hq, Hkv, D = 1, 4, 2, 24
    mask = _mask(kind, Sq, Skv, 16, doc, "cpu", params)
    x = _inputs(B, Hq, Hkv, Sq, Skv, D, torch.float32, "cpu", injection, seed=len(name))
    got = _run(x, mask)
    allowed = _allowed(kind, Sq, Skv, doc, **params)
    want = _oracle(x["q"], x["k"], x["v"], x["do"], allowed, _visited(mask, B, Hq, Sq, Skv), 1 / D ** 0.5)
    case = f"cpu {name} {injection}"
    _check_pattern(got, want, case)
    _check_values(got, want, case, 1e-4)
    assert any(not bool(torch.isfinite(got[n]).all()) for n in got), f"{case}: nothing non-finite at all"


def _hopper():
    return torch.cuda.is_available() and st.built_with_cuda() and torch.cuda.get_device_capability(0) == (9, 0)


hopper = pytest.mark.skipif(not _hopper(), reason="no Hopper GPU (or a CPU-only build): CUDA non-finite tests skipped")
CUDA_D = 128  # bf16 at D = 128 is in every build, a MINIMAL one too; the rule is the same at every head dim


@hopper
@pytest.mark.parametrize("injection", INJECTIONS, ids=[f"{n}_{w}_{v}" for n, w, v in INJECTIONS])
@pytest.mark.parametrize("name", list(CASES))
def test_cuda_results_are_non_finite_where_the_cpu_reference_says(name, injection):
    kind, Sq, Skv, params, doc = _case(name, 128)
    B, Hq, Hkv, D = 1, 2, 1, CUDA_D
    x = _inputs(B, Hq, Hkv, Sq, Skv, D, torch.bfloat16, "cuda", injection, seed=len(name))
    want = _run({n: t.cpu() for n, t in x.items()}, _mask(kind, Sq, Skv, 128, doc, "cpu", params))
    mask = _mask(kind, Sq, Skv, 128, doc, "cuda", params)
    for deterministic in (True, False):
        got = _run(x, mask, deterministic)
        case = f"cuda {name} {injection} det={deterministic}"
        _check_pattern(got, want, case)
        _check_values(got, want, case, 5e-2)


@hopper
@pytest.mark.parametrize("injection", INJECTIONS, ids=[f"{n}_{w}_{v}" for n, w, v in INJECTIONS])
def test_cuda_padded_document_backward_hides_nothing(injection):
    """The padded backward's tiles are not the mask's blocks: at least every allowed pair's
    elements are non-finite (the oracle over the allowed pairs alone); the forward is exact."""
    kind, Sq, Skv, params, doc = _case("document_causal", 128, lengths=[150, 37, 209, 130])
    B, Hq, Hkv, D = 1, 2, 1, CUDA_D
    x = _inputs(B, Hq, Hkv, Sq, Skv, D, torch.bfloat16, "cuda", injection, seed=3)
    mask = _mask(kind, Sq, Skv, 128, doc, "cuda", params, doc_padding=128)
    assert mask.backward_padded is not None
    got = _run(x, mask)
    allowed = _allowed(kind, Sq, Skv, doc)
    xc = {n: t.cpu().float() for n, t in x.items()}
    must = _oracle(xc["q"], xc["k"], xc["v"], xc["do"], allowed, allowed, 1 / D ** 0.5)
    _check_pattern(got, must, f"cuda padded {injection}", exact=False)
    want = _run({n: t.cpu() for n, t in x.items()}, _mask(kind, Sq, Skv, 128, doc, "cpu", params))
    for name in ("o", "lse"):
        assert torch.equal(torch.isfinite(got[name].cpu()), torch.isfinite(want[name])), name
