"""BlockMask.build's and BlockMask.from_torch's two routes give the same masks: torch tensors come
from the C++ torch library (python/src/torch_block_mask.cpp, one call with the padded backward form,
or with a flex mask's move to the GPU), numpy arrays (and torch tensors where that library is
missing) through `_C`. Every kind, schedule and walk, "auto" with a problem, document masks with
their padded form, on the CPU and (where there is one) a CUDA device; bad arguments are
ValueErrors naming them, from either route."""

import numpy as np
import pytest

import sparsetrain as st
from sparsetrain import _block_mask
from sparsetrain._block_mask import TENSOR_NAMES

torch = pytest.importorskip("torch")
pytest.importorskip("sparsetrain.torch", reason="the C++ torch library is not built")

CUDA = torch.cuda.is_available()


def _ids(seq, seed):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, 300, size=seq)
    ids = np.repeat(np.arange(seq), lengths)[:seq]
    ids[seq - rng.integers(0, 40):] = ids.max() + 1  # a tail document
    return ids.astype(np.int32)[None]


def _as_numpy(x):
    if x is None:
        return None
    return x.cpu().numpy() if isinstance(x, torch.Tensor) else np.asarray(x)


def _same(a, b, where):
    """a and b: the same mask, tensors, schedule, walk and padded form."""
    for name in TENSOR_NAMES:
        x, y = _as_numpy(getattr(a, name)), _as_numpy(getattr(b, name))
        assert (x is None) == (y is None), f"{where}: {name} present in one mask only"
        if x is not None:
            assert (x.dtype, x.shape) == (y.dtype, y.shape), f"{where}: {name} {x.dtype}{x.shape}, {y.dtype}{y.shape}"
            assert np.array_equal(x, y), f"{where}: {name} differs"
    assert (a.schedule, a.walk) == (b.schedule, b.walk), where
    assert np.array_equal(_as_numpy(a.schedule_permutation), _as_numpy(b.schedule_permutation)) or (
        a.schedule_permutation is None and b.schedule_permutation is None), where
    assert (a.backward_padded is None) == (b.backward_padded is None), f"{where}: padded form in one mask only"
    if a.backward_padded is not None:
        _same(a.backward_padded, b.backward_padded, where + " (padded)")
        for name in ("real_rows",):
            assert np.array_equal(_as_numpy(getattr(a.backward_padded, name)),
                                  _as_numpy(getattr(b.backward_padded, name))), f"{where}: padded {name}"
        for side in ("doc_q", "doc_kv"):
            assert np.array_equal(_as_numpy(getattr(a.backward_padded.spec, side)),
                                  _as_numpy(getattr(b.backward_padded.spec, side))), f"{where}: padded {side}"


CASES = [
    ("causal", 1000, 1000, {}),
    ("causal_bottom_right", 700, 1300, {}),
    ("full", 300, 520, {}),
    ("sliding_window", 1100, 1100, dict(window_left=200, window_right=37)),
    ("prefix_lm", 900, 900, dict(prefix_length=301)),
    ("document", 1024, 1024, dict(doc_padding=128)),
    ("document_causal", 1333, 1333, dict(doc_padding=256)),
    ("document_causal", 777, 777, {}),
]
SCHEDULES = [
    dict(),
    dict(schedule="left_to_right", walk="ascending_heads_outer"),
    dict(schedule="shortest_first"),
    dict(schedule="auto", auto_problem=(2, 16, 4, 132)),
]


@pytest.mark.parametrize("kind,sq,skv,extra", CASES)
@pytest.mark.parametrize("sched", SCHEDULES, ids=["auto", "l2r_ascending", "shortest", "auto_problem"])
@pytest.mark.parametrize("block", [128, (128, 256)])
def test_torch_route_equals_the_numpy_route(kind, sq, skv, extra, sched, block, monkeypatch):
    kw = dict(extra, **sched, block_size=block)
    if kind.startswith("document"):
        kw["document_ids"] = _ids(sq, sq)
    ref = st.BlockMask.build(kind, sq, skv, framework="numpy", **kw)
    got = st.BlockMask.build(kind, sq, skv, framework="torch", **kw)
    assert isinstance(got.kv_indices, torch.Tensor)
    _same(got, ref, f"{kind} {sched} {block}")
    if CUDA:
        # On a device the padded form's length is a bound known on the host (no sync), not the
        # host build's exact length: the device routes are compared with each other.
        dev = st.BlockMask.build(kind, sq, skv, framework="torch", device="cuda", **kw)
        assert dev.kv_indices.is_cuda
        monkeypatch.setattr(_block_mask, "_TORCH_LIBRARY", [None])
        dev_c = st.BlockMask.build(kind, sq, skv, framework="torch", device="cuda", **kw)
        _same(dev, dev_c, f"{kind} {sched} {block} on cuda, the two routes")
        dev.backward_padded = ref.backward_padded = None  # the lists themselves equal the host's
        _same(dev, ref, f"{kind} {sched} {block} on cuda")


def test_a_permutation_schedule_and_the_fallback_route(monkeypatch):
    nk = 9
    perm = list(np.random.default_rng(3).permutation(nk))
    for fw in ("numpy", "torch"):
        m = st.BlockMask.build("causal", 128 * nk, framework=fw, schedule=perm)
        assert m.schedule == "permutation" and list(_as_numpy(m.schedule_permutation)) == perm
    ref = st.BlockMask.build("document_causal", 1500, document_ids=_ids(1500, 7), framework="numpy", doc_padding=128)
    via_torch = st.BlockMask.build("document_causal", 1500, document_ids=_ids(1500, 7), framework="torch",
                                   doc_padding=128)
    monkeypatch.setattr(_block_mask, "_TORCH_LIBRARY", [None])  # torch tensors through `_C`
    via_c = st.BlockMask.build("document_causal", 1500, document_ids=_ids(1500, 7), framework="torch",
                               doc_padding=128)
    assert isinstance(via_c.kv_indices, torch.Tensor)
    _same(via_torch, ref, "torch library")
    _same(via_c, ref, "_C with torch tensors")


@pytest.mark.parametrize("route", ["torch_library", "c"])
def test_bad_arguments_name_themselves(route, monkeypatch):
    if route == "c":
        monkeypatch.setattr(_block_mask, "_TORCH_LIBRARY", [None])
    build = st.BlockMask.build
    cases = [
        (lambda: build("causal", 512, framework="torch", schedule="bogus"), "schedule"),
        (lambda: build("causal", 512, framework="torch", schedule="left_to_right", walk="sideways"), "walk"),
        (lambda: build("causal", 512, framework="torch", schedule=[0, 1]), "schedule"),
        (lambda: build("causal", 512, framework="torch", auto_problem=(1, 2, 3)), "auto_problem"),
        (lambda: build("causal", 512, framework="torch", block_size=(128, 0)), "block"),
        (lambda: build("causal", 512, framework="torch", schedule=[0, 1, 2, 3], doc_padding=128), "doc_padding"),
        (lambda: build("document", 512, framework="torch", document_ids=np.zeros((1, 511), np.int32)), "doc"),
        (lambda: build("document", 512, framework="torch", document_ids=np.zeros((1, 512), np.int32),
                       schedule=[0, 1, 2, 3], doc_padding=128), "doc_padding"),
    ]
    for f, needle in cases:
        with pytest.raises(ValueError, match=needle):
            f()


def _flex_masks():
    """flex BlockMasks (host) of a mask_mod varying with b, h, q and kv: leading dims [2, 3] and
    broadcast ones, ragged lengths, square and non-square blocks."""
    flex = pytest.importorskip("torch.nn.attention.flex_attention")

    def mod(b, h, q, kv):
        return ((q >= kv) | (kv < 100)) & ((h + b) % 3 != (q // 200) % 3) & (kv % 7 != 3)

    return [flex.create_block_mask(mod, 2, 3, 1000, 900, device="cpu", BLOCK_SIZE=(128, 64)),
            flex.create_block_mask(lambda b, h, q, kv: (q - kv < 300) & (kv <= q), None, None, 700, 700,
                                   device="cpu", BLOCK_SIZE=128)]


@pytest.mark.parametrize("schedule,problem", [("auto", None), ("auto", (2, 6, 3, 8)), ("shortest_first", None),
                                              ([4, 0, 3, 1, 2, 5, 6, 7, 8, 9, 10, 11, 12, 13], None)])
def test_from_torch_routes_agree(schedule, problem, monkeypatch):
    """BlockMask.from_torch through the torch library (built and moved in one call) and through
    `_C`: the same mask, bitmasks included, on the host and (where there is one) a CUDA device."""
    for fm in _flex_masks():
        perm = isinstance(schedule, list)
        if perm and len(schedule) != -(-fm.seq_lengths[1] // fm.BLOCK_SIZE[1]):
            continue
        devices = ["cpu"] + (["cuda"] if CUDA else [])
        via_lib = [st.BlockMask.from_torch(fm, schedule=schedule, auto_problem=problem, device=d) for d in devices]
        with monkeypatch.context() as mp:
            mp.setattr(_block_mask, "_TORCH_LIBRARY", [None])
            via_c = [st.BlockMask.from_torch(fm, schedule=schedule, auto_problem=problem, device=d) for d in devices]
        for d, a, b in zip(devices, via_lib, via_c):
            assert a.kv_indices.device.type == d and b.kv_indices.device.type == d
            assert a.partial_bitmasks.device.type == d
            _same(a, b, f"from_torch {schedule} {problem} on {d}")


@pytest.mark.parametrize("route", ["torch_library", "c"])
def test_from_torch_bad_schedule_names_itself(route, monkeypatch):
    if route == "c":
        monkeypatch.setattr(_block_mask, "_TORCH_LIBRARY", [None])
    fm = _flex_masks()[1]
    for kw, needle in ((dict(schedule="bogus"), "schedule"), (dict(schedule=[0, 1]), "schedule"),
                       (dict(auto_problem=(1, 2, 3)), "auto_problem")):
        with pytest.raises(ValueError, match=needle):
            st.BlockMask.from_torch(fm, **kw)
