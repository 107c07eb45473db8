"""Block-sparse attention benchmark (docs/DESIGN.md section 9): B=2, H=16, S=8192, D=128, bf16 with
masks causal, sliding window 2048 (causal) and document-causal (documents of random lengths
256..3072, seed 0, per batch row), plus D=64 (causal) and GQA Hq=32, Hkv=4 (causal); and the
classes of DESIGN section 9: document-causal with lengths drawn from 1..3000 on a long packed
sequence (B=2, S=16384) beside dense causal at the same shape, sliding windows 512 and 1024
(causal), causal at S=2048 and S=4096 with B*H = 128 (B=8, H=16: short rows), causal GQA 8:1 at
D=64; a 128k-token packed row of documents of 1..8192 tokens, GQA 8:2 (B=1); and masks a
FlexAttention user brings as a mask_mod (a prefix LM over the first S / 4 keys; 64 attention sinks with a causal
window of 1024; landmarks with a causal window; and, with many partial blocks, B=1 S=16384:
chunked-causal in chunks of 2048, a causal window of 640, a dilated window of 1536, stride 3),
ours taken over from flex's BlockMask by BlockMask.from_torch (bitmask partial blocks). Forward of
ours (sparsetrain.torch.block_sparse_attention) against FlexAttention
(torch.compile(flex_attention, dynamic=False) on the same mask from create_block_mask(...,
_compile=True)) and, for the dense-causal cases, cuDNN SDPA (sdpa_kernel(CUDNN_ATTENTION),
is_causal=True), and FlashAttention-4 (below); and the block-mask build: ours on the device
(BlockMask.build(device="cuda"): lists, transposes and dQ write orders) against
create_block_mask(mask_mod, B=None, H=None, S, S, device="cuda", _compile=True) (document-causal:
B=2, per-batch ids for both), target >= 10x; for the mask_mod kinds (FLEX_KINDS) ours is
BlockMask.from_torch of flex's mask (lists taken over, mask_mod evaluated into bitmasks on the
GPU), target: no slower than create_block_mask.
With --backward, per attention case also the backward alone (autograd.grad over a retained
forward graph) and forward + backward of ours deterministic and non-deterministic, FlexAttention,
cuDNN (causal cases) and FA4 deterministic ("fa4") and not ("fa4_nondet"): peer / ours ratios of
both, det / nondet (target <= 1.10), and each peer's peak memory of one forward + backward beyond its
inputs ("fwdbwd_<peer>_peak_mib").

FlashAttention-4 (flash-attn-4, CuTe DSL; optional: scripts/fa4-wheels carries it to the lent GPU;
absent, one line says so and the rest runs) is a peer of every case in its closest form
(fa4_peer; "fa4_form" in the row): dense causal as causal=True, sliding windows as
window_size=(window, 0), documents as flash_attn_varlen_func over the batch rows packed into one
sequence with cu_seqlens, the mask_mod kinds through its block-sparse path (the mask_mod as a CuTe
function, its block-sparse tensors from flex's BlockMask). Its inputs are copies in its layout
([B, S, H, D]; varlen [B * S, H, D]) made outside the timed calls. Ratios FA4 / ours:
"speedup_vs_fa4" (forward), "<what>_speedup_vs_fa4" (deterministic against deterministic),
"<what>_nondet_speedup_vs_fa4_nondet" (non-deterministic against non-deterministic); a form FA4
lacks is skipped with its reason in the row ("fa4_skipped", "<what>_fa4_skipped") and printed.

All in this process on this GPU, CUDA events after warm-up, inputs rotated over enough copies to
exceed twice the L2 cache. Two timings of every forward, backward and forward + backward, ours
and the peers (docs/DESIGN.md section 9; the backward's keys "bwd_<peer>_ms" / "bwd_<peer>_b2b_ms",
"fwdbwd_..." likewise):
one call at a time ("<peer>_ms": the median of >= 100 runs, each started on an idle GPU, so host
work inside the call counts: what an eager training step sees) and back to back
("<peer>_b2b_ms": the same number of calls queued between two events, divided by it: the GPU
work, host work hidden where the GPU is the slower side); ours also from CUDA-graph replays
("ours_graph_ms"). A document-causal case reports its TFLOP/s over those of dense causal at the
same B, H, S, D ("tflops_vs_dense_causal", one call at a time; "b2b_tflops_vs_dense_causal";
target >= 0.6), the dense case being measured too. FLOPs count allowed (q, kv) pairs exactly
(forward 4 * D * pairs, backward 10 * D * pairs, both 14 * D * pairs), the pairs counted in
closed form per batch row and checked against the mask evaluated densely. A peer that fails
(cuDNN unavailable, a compile error) is recorded in its row ("<peer>_error") and the run goes on.
Speed-ups are peer time / our time (> 1: we are faster). --self-check runs the host-side parts
(case geometry, document ids, closed-form pair counts against dense counts, our host mask
builds, the tables) on the CPU, no GPU needed.

The dQ schedule of ours (--schedule): "auto" (default) builds the mask on the host with the
scheduler model's choice for the case's batch, heads and the GPU's SM count (--sm-limit if given
is not a bench option: the kernel runs on every SM), then copies it to the GPU; the row records
the choice ("ours_schedule", "ours_walk") and every candidate's modelled critical paths
("schedule_candidates": det and nondet steps). "left_to_right" / "shortest_first" build on the
GPU with --walk ("descending_heads_inner", the default, "ascending_heads_outer" or "ascending_heads_inner").

    python bench/bench_attention.py [--only causal,build_causal|attention|build] [--quick]
                                    [--backward] [--reps 100] [--json out.json] [--self-check]
                                    [--schedule auto|left_to_right|shortest_first] [--walk W]
"""

import argparse
import itertools
import json
import math
import statistics
import subprocess
import sys
import time
import warnings

from typing import Callable, NamedTuple, Optional, Tuple

import numpy as np
import torch

BATCH = 2
SEQ = 8192                 # the reference S; --seq / --quick scale every case's S, window and lengths
WINDOW = 2048
DOC_LENGTHS = (256, 3072)


class Case(NamedTuple):
    """An attention case at the reference S = SEQ (bf16). window: sliding_window's left bound
    (causal on the right); doc_lengths: document lengths drawn uniformly from [lo, hi] per batch
    row; dense: the dense causal case of the same B, H, S, D whose TFLOP/s this one is compared
    with (measured whenever this one is)."""

    kind: str
    Hq: int
    Hkv: int
    D: int
    B: int = BATCH
    S: int = SEQ
    window: int = WINDOW
    doc_lengths: Tuple[int, int] = DOC_LENGTHS
    dense: Optional[str] = None


CASES = {
    "causal": Case("causal", 16, 16, 128),
    "sliding_window": Case("sliding_window", 16, 16, 128),
    "document_causal": Case("document_causal", 16, 16, 128, dense="causal"),
    "causal_d64": Case("causal", 16, 16, 64),
    "gqa_causal": Case("causal", 32, 4, 128),
    # DESIGN section 9's classes: many short documents on a long packed sequence, narrow windows,
    # short rows with many (batch, head) pairs, GQA 8:1 at D = 64.
    "causal_s16384": Case("causal", 16, 16, 128, S=16384),
    "document_causal_1to3000": Case("document_causal", 16, 16, 128, S=16384, doc_lengths=(1, 3000),
                                    dense="causal_s16384"),
    "sliding_window_512": Case("sliding_window", 16, 16, 128, window=512),
    "sliding_window_1024": Case("sliding_window", 16, 16, 128, window=1024),
    "causal_s2048_b8": Case("causal", 16, 16, 128, B=8, S=2048),
    "causal_s4096_b8": Case("causal", 16, 16, 128, B=8, S=4096),
    "gqa8_causal_d64": Case("causal", 32, 4, 64),
    # D = 64 beside the dense cases: documents, a window not a multiple of 128, and a mask_mod
    # window (bitmask partial blocks).
    "document_causal_1to3000_d64": Case("document_causal", 16, 16, 64, S=16384, doc_lengths=(1, 3000)),
    "sliding_window_640_d64": Case("sliding_window", 16, 16, 64, window=640),
    "flexmod_window_640_d64": Case("flex_window", 16, 16, 64, B=1, S=16384, window=640),
    # A long packed sequence: 128k tokens of documents up to 8k, GQA 4:1.
    "document_causal_128k_gqa4": Case("document_causal", 8, 2, 128, B=1, S=131072, doc_lengths=(1, 8192)),
    # Masks a FlexAttention user brings as a mask_mod: ours from flex's BlockMask through
    # BlockMask.from_torch, every partial block a bitmask (FLEX_KINDS).
    "flexmod_prefix_lm": Case("flex_prefix_lm", 16, 16, 128),
    "flexmod_sinks_window_1024": Case("flex_sinks_window", 16, 16, 128, window=1024),
    "flexmod_sinks_window_1024_gqa8": Case("flex_sinks_window", 32, 4, 128, window=1024),
    "flexmod_landmarks_window_1024": Case("flex_landmarks_window", 16, 16, 128, window=1024),
    # Masks with many partial blocks (issue 58's deliverable 4), B1 H16 S16384: chunked-causal
    # attention (chunks of `window` keys), a causal window of 640 (not a multiple of 128) and a
    # dilated window (every DILATION-th key within 1536), each as a mask_mod.
    "flexmod_chunked_causal_2048": Case("flex_chunked_causal", 16, 16, 128, B=1, S=16384, window=2048),
    "flexmod_window_640": Case("flex_window", 16, 16, 128, B=1, S=16384, window=640),
    # Its interval twin (the same allowed pairs, partial blocks masked by intervals, not bits).
    "sliding_window_640": Case("sliding_window", 16, 16, 128, B=1, S=16384, window=640),
    "flexmod_dilated_window_1536": Case("flex_dilated_window", 16, 16, 128, B=1, S=16384, window=1536),
}
# The mask_mod kinds: a prefix LM (causal, plus the first S / PREFIX_DIV keys for every query) and
# attention sinks with a causal window (the first SINKS keys, plus keys at most `window` back),
# and landmarks with a causal window (the first LANDMARKS keys of every LANDMARK_PERIOD, plus the
# window: a long kv column every 8 blocks, as in strided or global-token attention); chunked-causal
# (causal within chunks of `window` keys), a causal window, and a dilated causal window (keys at
# most `window` back and a multiple of DILATION away).
FLEX_KINDS = ("flex_prefix_lm", "flex_sinks_window", "flex_landmarks_window", "flex_chunked_causal", "flex_window",
              "flex_dilated_window")
PREFIX_DIV, SINKS = 4, 64
LANDMARK_PERIOD, LANDMARKS = 1024, 64
DILATION = 3
# The build rows: ours built from the kind on the device (BlockMask.build), and for the first three
# mask_mod kinds ours taken over from flex's mask (BlockMask.from_torch), against create_block_mask
# (each of its compiles takes ~100 s of the lent GPU's host).
BUILDS = {f"build_{k}": k for k in ("causal", "sliding_window", "document_causal", *FLEX_KINDS[:3])}


class Geometry(NamedTuple):
    B: int
    S: int
    window: int
    doc_lengths: Tuple[int, int]


def geometry(case, seq):
    """A case's B, S, window and document lengths for a run at --seq `seq` (S, window and lengths
    scaled by seq / SEQ; lengths at least 1)."""
    return Geometry(case.B, max(1, case.S * seq // SEQ), case.window * seq // SEQ,
                    tuple(max(1, n * seq // SEQ) for n in case.doc_lengths))


# -- masks: our kinds, flex's mask_mods, exact pair counts ------------------------------------------


def document_ids(B, S, lengths, seed=0):
    """int32 [B, S]: per batch row, consecutive documents of lengths drawn uniformly from
    lengths = (lo, hi) (seed 0), the last one cut at S."""
    rng = np.random.default_rng(seed)
    lo, hi = lengths
    ids = np.empty((B, S), np.int32)
    for b in range(B):
        s = d = 0
        while s < S:
            n = int(rng.integers(lo, hi + 1))
            ids[b, s:s + n] = d
            s, d = s + n, d + 1
    return torch.from_numpy(ids)


def mask_mod_for(kind, g, doc):
    """flex_attention's mask_mod for our kind (g: the Geometry; doc: the document ids)."""
    if kind == "causal":
        return lambda b, h, q, kv: q >= kv
    if kind == "sliding_window":
        w = g.window
        return lambda b, h, q, kv: (q >= kv) & (q - kv <= w)
    if kind == "document_causal":
        return lambda b, h, q, kv: (doc[b, q] == doc[b, kv]) & (q >= kv)
    if kind in FLEX_KINDS:
        return lambda b, h, q, kv: flex_kind_allowed(kind, g, q, kv)
    raise ValueError(kind)


def flex_kind_allowed(kind, g, q, kv, const=lambda x: x):
    """A mask_mod kind's (FLEX_KINDS) predicate on query and key indices, written once for flex's
    mask_mod (torch tensors) and FA4's CuTe mask_mod (fa4_mask_mod: TensorSSA values, `const` making
    an Int32 one of each constant)."""
    causal = q >= kv
    if kind == "flex_prefix_lm":
        return causal | (kv < const(g.S // PREFIX_DIV))
    if kind == "flex_sinks_window":
        return causal & ((q - kv <= const(g.window)) | (kv < const(SINKS)))
    if kind == "flex_landmarks_window":
        return causal & ((q - kv <= const(g.window)) | (kv % const(LANDMARK_PERIOD) < const(LANDMARKS)))
    if kind == "flex_chunked_causal":
        return causal & (q // const(g.window) == kv // const(g.window))
    if kind == "flex_window":
        return causal & (q - kv <= const(g.window))
    if kind == "flex_dilated_window":  # (q - kv) % d only where q >= kv: CuTe's remainder and torch's agree there
        return causal & (q - kv <= const(g.window)) & ((q - kv) % const(DILATION) == const(0))
    raise ValueError(kind)


# --doc-padding: document masks also carry their padded backward form (BlockMask.build's
# doc_padding), 0: none; None (the default): what a mask built on the GPU carries
# by default (the library's rule), also for the masks this bench builds on the host.
DOC_PADDING = None


def doc_padding_for(S):
    if DOC_PADDING is not None:
        return DOC_PADDING
    from sparsetrain._block_mask import _AUTO_DOC_PADDING

    return _AUTO_DOC_PADDING if S >= _AUTO_DOC_PADDING else 0


def our_mask_args(kind, g, doc):
    if kind == "sliding_window":
        return {"window_left": g.window, "window_right": 0}
    if kind == "document_causal":
        pad = doc_padding_for(g.S)
        return {"document_ids": doc, **({"doc_padding": pad} if pad else {})}
    return {}


def pairs_per_batch(kind, g, doc_cpu):
    """Allowed (q, kv) pairs of one head, per batch row, in closed form (Python ints)."""
    B, S = g.B, g.S
    if kind == "causal":
        return [S * (S + 1) // 2] * B
    if kind in ("sliding_window", "flex_window"):
        w = min(g.window, S - 1)  # rows q < w see q + 1 keys, the others w + 1
        return [w * (w + 1) // 2 + (S - w) * (w + 1)] * B
    if kind == "document_causal":
        out = []
        for b in range(B):
            _, lengths = torch.unique_consecutive(doc_cpu[b], return_counts=True)
            out.append(sum(int(n) * (int(n) + 1) // 2 for n in lengths))
        return out
    if kind == "flex_prefix_lm":  # rows q < P see the P prefix keys, the others q + 1
        p = S // PREFIX_DIV
        return [p * p + (S * (S + 1) - p * (p + 1)) // 2] * B
    if kind == "flex_sinks_window":  # the window's min(q, w) + 1 keys, and the sinks below it
        w = g.window
        return [sum(min(q, w) + 1 + max(0, min(SINKS, q - w)) for q in range(S))] * B
    if kind == "flex_landmarks_window":  # the window's keys, and the landmarks among keys [0, q - w)

        def landmarks_below(x):
            return (x // LANDMARK_PERIOD) * LANDMARKS + min(x % LANDMARK_PERIOD, LANDMARKS)
        w = g.window
        return [sum(min(q, w) + 1 + landmarks_below(max(0, q - w)) for q in range(S))] * B
    if kind == "flex_chunked_causal":  # causal within each chunk (the last one possibly shorter)
        c = g.window
        return [(S // c) * (c * (c + 1) // 2) + (S % c) * (S % c + 1) // 2] * B
    if kind == "flex_dilated_window":  # keys q, q - d, q - 2d, ... down to q - min(q, w)
        return [sum(min(q, g.window) // DILATION + 1 for q in range(S))] * B
    raise ValueError(kind)


def dense_pairs(mask_mod, B, S, rows=1024, device="cuda"):
    """The same count from mask_mod evaluated densely (the check of the closed form) on `device`
    (the GPU in a run; the CPU in --self-check; the document ids must be there)."""
    kv = torch.arange(S, device=device)[None, :]
    out = []
    for b in range(B):
        bt = torch.tensor(b, device=device)
        n = 0
        for r in range(0, S, rows):
            q = torch.arange(r, min(S, r + rows), device=device)[:, None]
            n += int(mask_mod(bt, 0, q, kv).sum())
        out.append(n)
    return out


# -- timing ----------------------------------------------------------------------------------------


def time_ms(fn, reps, warmup=3):
    """Median of `reps` CUDA-event timings of fn() after warm-up; each run starts on an idle GPU
    (synchronised), so host work inside fn counts. Also the median wall time of the same runs."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times, walls = [], []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0 = time.perf_counter()
        a.record()
        fn()
        b.record()
        b.synchronize()
        walls.append((time.perf_counter() - t0) * 1e3)
        times.append(a.elapsed_time(b))
    return statistics.median(times), statistics.median(walls)


def input_sets(B, Hq, Hkv, S, D, device="cuda", dtype=torch.bfloat16):
    """(q, k, v) inputs [B, H, S, D]: enough copies to exceed twice the L2 cache, to be used in turn
    (a timed call never finds its inputs in L2 from the call before)."""
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    set_bytes = 2 * (B * Hq * S * D + 2 * B * Hkv * S * D)  # bf16 q, k, v
    gen = torch.Generator(device=device).manual_seed(0)
    return [tuple(torch.randn(B, h, S, D, device=device, dtype=dtype, generator=gen) for h in (Hq, Hkv, Hkv))
            for _ in range(max(1, math.ceil(2 * l2 / set_bytes)))]


B2B_ROUNDS = 5  # bench_backward's back-to-back timings: rounds of the peers in turn


def interleaved_ms(fns, rounds, reps, before=None):
    """A / B timing in one process: each round times every fn back to back (queued_ms), the fns
    alternating so that drift (clocks, temperature) hits all alike; before(i), if given, runs
    ahead of fn i's timing. Returns (medians over the rounds, each fn's per-round times)."""
    times = [[] for _ in fns]
    for _ in range(rounds):
        for i, fn in enumerate(fns):
            if before is not None:
                before(i)
            times[i].append(queued_ms(fn, reps, 2))
    return [statistics.median(t) for t in times], times


def ab_main(doc, bench_case, show):
    """The A / B scripts' command line: --only cases of CASES, --rounds, --reps, --json; runs
    bench_case(name, rounds, reps) per case, show(name, row) prints it."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", required=True, metavar="NAMES", help="comma-separated bench_attention CASES")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--json", default=None, metavar="PATH")
    a = ap.parse_args()
    rows = []
    for name in a.only.split(","):
        rows.append(bench_case(name, a.rounds, a.reps))
        show(name, rows[-1])
        torch.cuda.empty_cache()
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"info": environment(), "rows": rows}, f, indent=1)


def queued_ms(fn, reps, warmup=3):
    """Back to back: `reps` calls of fn() queued between two CUDA events, the time per call (the
    GPU work, host work hidden while the GPU is the slower side; the host's when it is not)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(reps):
        fn()
    b.record()
    b.synchronize()
    return a.elapsed_time(b) / reps


def captured(fn, calls=1):
    """`calls` calls of fn captured in a CUDA graph (after warm-up on a side stream); returns the
    graph's replay."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    return graph.replay


def graph_ms(fn, reps):
    """Median time of fn captured in a CUDA graph and replayed: the GPU work without the host's."""
    return time_ms(captured(fn), reps)[0]


def first_line(e):
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[0] if lines else ''}"[:400]


def run_peer(row, name, fn, reps, flops=None, wall=False, b2b=False):
    """Times fn into row[name + '_ms'] (one call at a time, and TFLOP/s) and, with b2b, into
    row[name + '_b2b_ms'] (back to back, and TFLOP/s); a failure is recorded, never fatal."""
    try:
        t, w = time_ms(fn, reps)
        if b2b:
            tb = queued_ms(fn, reps)
    except Exception as e:  # noqa: BLE001 - any peer failure is data
        row[f"{name}_error"] = first_line(e)
        row[f"{name}_ms"] = float("nan")
        if b2b:
            row[f"{name}_b2b_ms"] = float("nan")
        torch.cuda.synchronize()
        return float("nan")
    row[f"{name}_ms"] = t
    if wall:
        row[f"{name}_wall_ms"] = w
    if flops is not None:
        row[f"{name}_tflops"] = flops / t * 1e-9
    if b2b:
        row[f"{name}_b2b_ms"] = tb
        if flops is not None:
            row[f"{name}_b2b_tflops"] = flops / tb * 1e-9
    return t


# -- FlashAttention-4, an optional peer --------------------------------------------------------------


def import_fa4():
    """(flash_attn.cute.interface, its version) of flash-attn-4 (scripts/fa4-wheels installs it on the
    lent GPU), or (None, why it cannot be imported)."""
    try:
        import importlib.metadata

        from flash_attn.cute import interface
    except Exception as e:  # noqa: BLE001 - absent or broken: the bench goes on without it
        return None, first_line(e)
    try:
        return interface, importlib.metadata.version("flash-attn-4")
    except Exception:  # noqa: BLE001
        return interface, "unknown version"


class Fa4Peer(NamedTuple):
    """FA4's form of a case: call(q, k, v, deterministic) -> out on inputs in its layout; to_fa4 takes
    one of ours ([B, H, S, D]) to it (a contiguous copy: [B, S, H, D], varlen [B * S, H, D]), from_fa4
    one of its back ([B, H, S, D], a view); no_det: why its deterministic backward is not timed
    (None: it is)."""

    form: str
    call: Callable
    to_fa4: Callable
    from_fa4: Callable
    no_det: Optional[str]


def fa4_cu_seqlens(doc_cpu, device):
    """Document ids [B, S] as FlashAttention's varlen arguments over the B rows packed into one
    sequence: int32 cu_seqlens (each row's documents in turn, offsets from b * S) and the longest
    document's length."""
    lengths = [torch.unique_consecutive(row, return_counts=True)[1] for row in doc_cpu]
    lengths = torch.cat(lengths)
    cu = torch.zeros(lengths.numel() + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(lengths, 0)
    return cu.to(device), int(lengths.max())


def fa4_mask_mod(kind, g):
    """A mask_mod kind as FA4's CuTe mask_mod: (batch, head, q_idx, kv_idx, seqlen_info, aux_tensors)
    -> bool, the indices Int32 TensorSSA values (FA4's flash_attn/cute/mask.py call_mask_mod; constants
    made with flash_attn.cute.utils.scalar_to_ssa as its tests/cute/mask_mod_definitions.py does)."""
    import cutlass
    from cutlass import cute
    from flash_attn.cute.utils import scalar_to_ssa

    def const(x):
        return scalar_to_ssa(x, cutlass.Int32)

    @cute.jit
    def mask_mod(batch, head, q_idx, kv_idx, seqlen_info, aux_tensors):
        return flex_kind_allowed(kind, g, q_idx, kv_idx, const)

    return mask_mod


FA4_NO_DET_BLOCK_SPARSE = ("FA4 has no deterministic block-sparse backward on SM90 (flash_bwd_sm90.py: "
                           "'Deterministic not implemented for block-sparse backward')")


def fa4_peer(fa4, kind, g, doc_cpu, fmask, device):
    """FA4's closest form of our mask `kind` (fa4: flash_attn.cute.interface): dense causal as
    causal=True; a sliding window as window_size=(window, 0) (keys q - window .. q); documents as
    flash_attn_varlen_func(causal=True) with cu_seqlens over the rows packed into one sequence; a
    mask_mod kind (FLEX_KINDS) through FA4's block-sparse path: the mask_mod as a CuTe function
    and flex's BlockMask of the same definition as its tensors (kv lists forward, q lists backward,
    as FA4's tests/cute/test_mask_mod.py passes them). Returns (Fa4Peer, None) or (None, why not)."""
    B, S = g.B, g.S

    def to_fa4(t):
        return t.transpose(1, 2).contiguous()

    def from_fa4(t):
        return t.view(B, S, *t.shape[-2:]).transpose(1, 2)

    if kind == "causal":
        return Fa4Peer("flash_attn_func(causal=True)",
                       lambda q, k, v, det: fa4.flash_attn_func(q, k, v, causal=True, deterministic=det)[0],
                       to_fa4, from_fa4, None), None
    if kind == "sliding_window":
        w = g.window
        return Fa4Peer(f"flash_attn_func(window_size=({w}, 0))",
                       lambda q, k, v, det: fa4.flash_attn_func(q, k, v, window_size=(w, 0), deterministic=det)[0],
                       to_fa4, from_fa4, None), None
    if kind == "document_causal":
        cu, longest = fa4_cu_seqlens(doc_cpu, device)

        def varlen(q, k, v, det):
            return fa4.flash_attn_varlen_func(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=longest,
                                              max_seqlen_k=longest, causal=True, deterministic=det)[0]
        return Fa4Peer("flash_attn_varlen_func(cu_seqlens, causal=True)", varlen,
                       lambda t: to_fa4(t).flatten(0, 1), from_fa4, None), None
    if kind in FLEX_KINDS:
        if fmask is None:
            return None, "no flex BlockMask to take its block-sparse tensors from"
        from flash_attn.cute.block_sparsity import BlockSparseTensorsTorch

        block = tuple(fmask.BLOCK_SIZE)
        fwd = BlockSparseTensorsTorch(mask_block_cnt=fmask.kv_num_blocks, mask_block_idx=fmask.kv_indices,
                                      full_block_cnt=fmask.full_kv_num_blocks, full_block_idx=fmask.full_kv_indices,
                                      block_size=block)
        bwd = BlockSparseTensorsTorch(mask_block_cnt=fmask.q_num_blocks, mask_block_idx=fmask.q_indices,
                                      full_block_cnt=fmask.full_q_num_blocks, full_block_idx=fmask.full_q_indices,
                                      block_size=block)
        mod = fa4_mask_mod(kind, g)

        def block_sparse(q, k, v, det):
            return fa4.flash_attn_func(q, k, v, mask_mod=mod, block_sparse_tensors=fwd, block_sparse_tensors_bwd=bwd,
                                       deterministic=det)[0]
        return Fa4Peer(f"flash_attn_func(mask_mod=CuTe {kind}, block_sparse_tensors from flex's BlockMask {block})",
                       block_sparse, to_fa4, from_fa4, FA4_NO_DET_BLOCK_SPARSE), None
    return None, f"no FA4 form for the mask kind {kind!r}"


# -- the attention cases ---------------------------------------------------------------------------


def case_masks(name, seq, device):
    """A case's geometry, document ids (on the host and on `device`), flex mask_mod and closed-form
    pair counts; the counts checked against the mask_mod evaluated densely on `device`."""
    c = CASES[name]
    g = geometry(c, seq)
    doc_cpu = document_ids(g.B, g.S, g.doc_lengths) if c.kind == "document_causal" else None
    doc = None if doc_cpu is None else doc_cpu.to(device)
    mask_mod = mask_mod_for(c.kind, g, doc)
    pairs = pairs_per_batch(c.kind, g, doc_cpu)
    dense = dense_pairs(mask_mod, g.B, g.S, device=device)
    if dense != pairs:
        raise AssertionError(f"{name}: closed-form pair counts {pairs} != dense counts {dense}")
    return c, g, doc_cpu, doc, mask_mod, pairs


def cuda_workers():
    """The backward's persistent CTAs: the GPU's SM count (132, an H100 / H200, without a GPU)."""
    return torch.cuda.get_device_properties(0).multi_processor_count if torch.cuda.is_available() else 132


def build_our_mask(kind, S, g, doc, doc_cpu, B, Hq, Hkv, schedule, walk, row):
    """Ours for the case: "auto" on the host for the real problem (copied to the GPU), or an
    explicit schedule and walk built on the GPU; a mask_mod kind (FLEX_KINDS) from flex's own
    BlockMask through BlockMask.from_torch, as a FlexAttention user takes it over (on the host,
    then copied). The choice and, for "auto", the model's candidates in `row`."""
    import sparsetrain
    from sparsetrain import _C

    cuda = torch.cuda.is_available()
    if kind in FLEX_KINDS:
        from torch.nn.attention.flex_attention import create_block_mask

        fm = create_block_mask(mask_mod_for(kind, g, None), None, None, S, S, device="cuda" if cuda else "cpu")
        host = sparsetrain.BlockMask.from_torch(fm, device="cpu", auto_problem=(B, Hq, Hkv, cuda_workers()))
        if schedule != "auto":
            host = host.with_schedule(schedule, walk=walk)
    elif schedule == "auto":
        host = sparsetrain.BlockMask.build(kind, S, framework="torch", schedule="auto",
                                           auto_problem=(B, Hq, Hkv, cuda_workers()), **our_mask_args(kind, g, doc_cpu))
    else:
        host = None
        mask = sparsetrain.BlockMask.build(kind, S, device="cuda", schedule=schedule, walk=walk,
                                           **our_mask_args(kind, g, doc))
    if schedule == "auto":
        row["schedule_candidates"] = _C.schedule_candidates(host._core_mask(), [B, Hq, Hkv, cuda_workers()])
        row["schedule_model_workers"] = cuda_workers()
    if host is not None:
        mask = host.to("cuda") if cuda else host
    row["ours_schedule"] = mask.schedule
    row["ours_walk"] = mask.walk
    row["ours_doc_padded"] = mask.backward_padded is not None
    return mask


def bench_case(name, seq, reps, backward, flex_compiled, schedule="auto", walk=None, fa4=None):
    import sparsetrain
    import sparsetrain.torch as stt
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.flex_attention import create_block_mask

    dt, dev = torch.bfloat16, "cuda"
    c, g, doc_cpu, doc, mask_mod, pairs = case_masks(name, seq, dev)
    kind, Hq, Hkv, D, B, S = c.kind, c.Hq, c.Hkv, c.D, g.B, g.S
    G = Hq // Hkv
    total_pairs = Hq * sum(pairs)
    flops = 4.0 * D * total_pairs
    row = {"case": name, "mask": kind, "B": B, "Hq": Hq, "Hkv": Hkv, "S": S, "D": D, "dtype": "bf16",
           "pairs_per_head_per_batch": pairs, "density": sum(pairs) / (B * S * S), "fwd_flops": flops,
           "reps": reps}
    if kind == "sliding_window":
        row["window_left"] = g.window
    if kind == "document_causal":
        row["documents_per_batch"] = [int(torch.unique(doc_cpu[b]).numel()) for b in range(B)]
        row["document_lengths"] = list(g.doc_lengths)
    if c.dense is not None:
        row["dense_causal_case"] = c.dense

    # Inputs: enough copies to exceed twice the L2 cache, used in turn by every peer.
    sets = input_sets(B, Hq, Hkv, S, D, dev, dt)
    row["input_copies"] = len(sets)

    def rotating(fn, over=sets):
        it = itertools.cycle(over)
        return lambda: fn(*next(it))

    def cudnn(q, k, v):
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=G > 1)

    # The masks: ours (build_our_mask: "auto" for the real problem by default), flex's by
    # create_block_mask(_compile=True) from the same definition.
    mask = fmask = None
    try:
        mask = build_our_mask(kind, S, g, doc, doc_cpu, B, Hq, Hkv, schedule, walk, row)
        row["blocks_computed"] = int(mask.kv_num_blocks.sum() + mask.full_kv_num_blocks.sum()) * \
            (1 if mask.kv_num_blocks.shape[0] == B else B)
        row["blocks_total"] = B * mask.num_q_blocks * mask.num_kv_blocks
    except Exception as e:  # noqa: BLE001
        row["ours_error"] = "mask: " + first_line(e)
    try:
        fmask = create_block_mask(mask_mod, B if kind == "document_causal" else None, None, S, S, device=dev,
                                  _compile=True)
    except Exception as e:  # noqa: BLE001
        row["flex_error"] = "mask: " + first_line(e)
    fa4c = None  # FA4's form of the case (fa4_peer), when FA4 is there
    if fa4 is not None:
        try:
            fa4c, why = fa4_peer(fa4, kind, g, doc_cpu, fmask, dev)
            if fa4c is None:
                row["fa4_skipped"] = why
                print(f"{name}: FA4 skipped: {why}", flush=True)
            else:
                row["fa4_form"] = fa4c.form
        except Exception as e:  # noqa: BLE001
            row["fa4_error"] = "setup: " + first_line(e)

    def ours_call(q, k, v):
        return stt.block_sparse_attention(q, k, v, mask)

    def flex_call(q, k, v):
        return flex_compiled(q, k, v, block_mask=fmask, enable_gqa=G > 1)

    nan = float("nan")
    with torch.no_grad():
        t = run_peer(row, "ours", rotating(ours_call), reps, flops, b2b=True) if mask is not None else nan
        if mask is not None:
            try:
                row["ours_graph_ms"] = graph_ms(rotating(ours_call), reps)
                row["ours_graph_tflops"] = flops / row["ours_graph_ms"] * 1e-9
            except Exception as e:  # noqa: BLE001
                row["ours_graph_error"] = first_line(e)
                torch.cuda.synchronize()
        pt = run_peer(row, "flex", rotating(flex_call), reps, flops, b2b=True) if fmask is not None else nan
        row["speedup_vs_flex"] = pt / t
        row["b2b_speedup_vs_flex"] = row.get("flex_b2b_ms", nan) / row.get("ours_b2b_ms", nan)
        if kind == "causal":
            pt = run_peer(row, "cudnn", rotating(cudnn), reps, flops, b2b=True)
            row["speedup_vs_cudnn"] = pt / t
            row["b2b_speedup_vs_cudnn"] = row.get("cudnn_b2b_ms", nan) / row.get("ours_b2b_ms", nan)
            if G > 1:  # cuDNN on k and v expanded to Hq heads (in case enable_gqa is not supported there)
                expanded = [(q, k.repeat_interleave(G, 1), v.repeat_interleave(G, 1)) for q, k, v in sets]
                it = itertools.cycle(expanded)

                def cudnn_expanded():
                    q, k, v = next(it)
                    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)

                pt = run_peer(row, "cudnn_expanded_kv", cudnn_expanded, reps, flops, b2b=True)
                row["speedup_vs_cudnn_expanded_kv"] = pt / t
                row["b2b_speedup_vs_cudnn_expanded_kv"] = (row.get("cudnn_expanded_kv_b2b_ms", nan)
                                                           / row.get("ours_b2b_ms", nan))
                del expanded, it
        if fa4c is not None:  # on copies in FA4's layout, made here, outside the timed calls
            fa4_sets = [tuple(fa4c.to_fa4(t) for t in qkv) for qkv in sets]
            pt = run_peer(row, "fa4", rotating(lambda q, k, v: fa4c.call(q, k, v, False), fa4_sets), reps, flops,
                          b2b=True)
            row["speedup_vs_fa4"] = pt / t
            row["b2b_speedup_vs_fa4"] = row.get("fa4_b2b_ms", nan) / row.get("ours_b2b_ms", nan)
            del fa4_sets
        # One call each on the same inputs: ours against the peers (the same mask: close results).
        if mask is not None:
            q, k, v = sets[0]
            peers = [("flex", flex_call)] if fmask is not None else []
            peers += [("cudnn", cudnn)] if kind == "causal" else []
            if fa4c is not None:
                peers.append(("fa4", lambda q, k, v: fa4c.from_fa4(fa4c.call(*(fa4c.to_fa4(x) for x in (q, k, v)),
                                                                              False))))
            try:
                o = ours_call(q, k, v).float()
                for peer, fn in peers:
                    try:
                        row[f"max_abs_diff_vs_{peer}"] = float((o - fn(q, k, v).float()).abs().max())
                    except Exception:  # noqa: BLE001 - its failure is in the row already
                        pass
            except Exception as e:  # noqa: BLE001
                row.setdefault("ours_error", first_line(e))
    if backward and mask is not None:
        bench_backward(row, mask, fmask, sets, reps, flex_compiled, G, kind, fa4c)
    print(json.dumps(row), flush=True)
    return row


def bench_backward(row, mask, fmask, sets, reps, flex_compiled, G, kind, fa4=None):
    """Per peer, on the forward's rotated inputs: the backward alone (torch.autograd.grad over a
    forward graph retained per input copy; 10 * D * pairs FLOPs) and forward + backward (the
    forward, then torch.autograd.grad; 14 * D * pairs FLOPs). Peers: ours deterministic ("ours")
    and not ("ours_nondet"), FlexAttention on the same mask, cuDNN SDPA on the causal cases (with
    GQA also on k and v expanded to Hq heads), FA4 in its form of the case (fa4: an Fa4Peer; on
    leaves of its own layout) deterministic ("fa4") and not ("fa4_nondet"). Each timed one call at
    a time ("<what>_<peer>_ms": host work counts) and back to back ("<what>_<peer>_b2b_ms": the GPU work; the peers in
    alternating rounds, the median, so the board's drift hits all alike). Ratios, both ways
    ("<what>_speedup_vs_<peer>", "<what>_b2b_speedup_vs_<peer>"): peer / ours (deterministic; FA4's
    non-deterministic also against ours non-deterministic), and the deterministic mode's cost
    det / nondet (target <= 1.10); peak memory of one forward + backward."""
    import sparsetrain.torch as stt
    from torch.nn.attention import SDPBackend, sdpa_kernel

    row["bwd_flops"] = 2.5 * row["fwd_flops"]
    row["fwdbwd_flops"] = 3.5 * row["fwd_flops"]
    dev = sets[0][0].device
    gen = torch.Generator(device=dev).manual_seed(1)
    inputs = [(*(t.detach().requires_grad_() for t in qkv), torch.randn(qkv[0].shape, device=dev,
                                                                         dtype=qkv[0].dtype, generator=gen))
              for qkv in sets]

    def cudnn(q, k, v):
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=G > 1)

    peers = {"ours": lambda q, k, v: stt.block_sparse_attention(q, k, v, mask, deterministic=True),
             "ours_nondet": lambda q, k, v: stt.block_sparse_attention(q, k, v, mask, deterministic=False)}
    if fmask is not None:
        peers["flex"] = lambda q, k, v: flex_compiled(q, k, v, block_mask=fmask, enable_gqa=G > 1)
    if kind == "causal":
        peers["cudnn"] = cudnn
    peer_inputs = {peer: inputs for peer in peers}
    if fa4 is not None:
        fa4_inputs = [(*(fa4.to_fa4(t.detach()).detach().requires_grad_() for t in (q, k, v)), fa4.to_fa4(do))
                      for q, k, v, do in inputs]
        fa4_modes = (("fa4", True), ("fa4_nondet", False)) if fa4.no_det is None else (("fa4_nondet", False),)
        for peer, det in fa4_modes:
            peers[peer] = lambda q, k, v, det=det: fa4.call(q, k, v, det)
            peer_inputs[peer] = fa4_inputs
        if fa4.no_det is not None:
            row["bwd_fa4_skipped"] = row["fwdbwd_fa4_skipped"] = fa4.no_det
            print(f"{row.get('case', '')}: FA4 deterministic backward skipped: {fa4.no_det}", flush=True)
    if kind == "causal" and G > 1:  # k and v expanded to Hq heads, leaves themselves (no reduction)
        peers["cudnn_expanded_kv"] = cudnn
        peer_inputs["cudnn_expanded_kv"] = [
            (q, *(t.detach().repeat_interleave(G, 1).requires_grad_() for t in (k, v)), do) for q, k, v, do in inputs]

    def fwd_bwd_of(fwd, args):
        it = itertools.cycle(args)

        def fwd_bwd():
            q, k, v, do = next(it)
            return torch.autograd.grad(fwd(q, k, v), (q, k, v), do)
        return fwd_bwd

    def bwd_of(retained):
        it = itertools.cycle(retained)

        def bwd():
            o, q, k, v, do = next(it)
            return torch.autograd.grad(o, (q, k, v), do, retain_graph=True)
        return bwd

    grads, fwd_bwds, bwds = {}, {}, {}
    for peer, fwd in peers.items():
        args = peer_inputs[peer]
        fwd_bwd = fwd_bwd_of(fwd, args)
        if not math.isnan(run_peer(row, f"fwdbwd_{peer}", fwd_bwd, reps, row["fwdbwd_flops"])):
            fwd_bwds[peer] = fwd_bwd
        # Peak memory of one forward + backward beyond what was allocated before it (the inputs):
        # o, lse or the peer's saved tensors, workspaces, the gradients.
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        try:
            fwd_bwd()
            torch.cuda.synchronize()
            row[f"fwdbwd_{peer}_peak_mib"] = (torch.cuda.max_memory_allocated() - base) / 2**20
        except Exception as e:  # noqa: BLE001 - the timing above recorded it already
            row.setdefault(f"fwdbwd_{peer}_error", first_line(e))
        try:
            retained = [(fwd(q, k, v), q, k, v, do) for q, k, v, do in args]
        except Exception as e:  # noqa: BLE001
            row[f"bwd_{peer}_error"] = first_line(e)
            row[f"bwd_{peer}_ms"] = row[f"bwd_{peer}_b2b_ms"] = float("nan")
            torch.cuda.synchronize()
            continue
        bwd = bwd_of(retained)  # the retained graphs live until the back-to-back rounds below
        if not math.isnan(run_peer(row, f"bwd_{peer}", bwd, reps, row["bwd_flops"])):
            bwds[peer] = bwd
        if peer in ("ours", "ours_nondet", "flex", "fa4", "fa4_nondet"):  # of the first input copy, compared below
            first = retained[0]
            try:
                grads[peer] = torch.autograd.grad(first[0], first[1:4], first[4], retain_graph=True)
                if peer.startswith("fa4"):
                    grads[peer] = tuple(fa4.from_fa4(x) for x in grads[peer])
            except Exception:  # noqa: BLE001 - its failure is in the row already
                pass
            del first
        del retained
        torch.cuda.synchronize()
    # Back to back, the peers in alternating rounds: timed one peer after the other, the one timed
    # when the board had heated under its power cap read up to 7 % slower.
    for what, fns in (("fwdbwd", fwd_bwds), ("bwd", bwds)):
        med, _ = interleaved_ms(list(fns.values()), B2B_ROUNDS, max(1, reps // B2B_ROUNDS))
        for peer, t in zip(fns, med):
            row[f"{what}_{peer}_b2b_ms"] = t
            row[f"{what}_{peer}_b2b_tflops"] = row[f"{what}_flops"] / t * 1e-9
        for peer in set(peers) - set(fns):
            row[f"{what}_{peer}_b2b_ms"] = float("nan")
    del bwds
    torch.cuda.synchronize()

    backward_ratios(row)
    # The same gradients: ours against flex, and the two modes of ours (max abs, bf16).
    for peer, ref in (("flex", "ours"), ("flex", "ours_nondet"), ("ours", "ours_nondet"), ("fa4", "ours"),
                      ("fa4_nondet", "ours_nondet")):
        if peer in grads and ref in grads:
            for name, a, b in zip(("dq", "dk", "dv"), grads[ref], grads[peer]):
                row[f"max_abs_diff_{name}_{ref}_vs_{peer}"] = float((a.float() - b.float()).abs().max())
    if "ours" in grads:  # a second deterministic backward: bitwise the same?
        try:
            o = peers["ours"](*inputs[0][:3])
            again = torch.autograd.grad(o, inputs[0][:3], inputs[0][3])
            row["ours_bwd_bitwise_repeatable"] = all(torch.equal(a, b) for a, b in zip(again, grads["ours"]))
        except Exception as e:  # noqa: BLE001
            row.setdefault("bwd_ours_error", first_line(e))


def backward_ratios(row):
    """bench_backward's ratios from its timings, one call at a time and back to back."""
    nan = float("nan")
    for what in ("bwd", "fwdbwd"):
        for sfx in ("", "b2b_"):
            ours = row.get(f"{what}_ours_{sfx}ms", nan)
            for peer in ("flex", "cudnn", "cudnn_expanded_kv", "fa4"):
                if f"{what}_{peer}_{sfx}ms" in row:
                    row[f"{what}_{sfx}speedup_vs_{peer}"] = row[f"{what}_{peer}_{sfx}ms"] / ours
            if f"{what}_fa4_nondet_{sfx}ms" in row:  # FA4's non-deterministic against ours
                row[f"{what}_{sfx}nondet_speedup_vs_fa4_nondet"] = (row[f"{what}_fa4_nondet_{sfx}ms"]
                                                                     / row.get(f"{what}_ours_nondet_{sfx}ms", nan))
            row[f"{what}_{sfx}det_over_nondet"] = ours / row.get(f"{what}_ours_nondet_{sfx}ms", nan)


# -- block-mask build ------------------------------------------------------------------------------


def bench_build(name, seq, reps):
    import sparsetrain
    from torch.nn.attention.flex_attention import create_block_mask

    kind = BUILDS[name]
    g = geometry(next(c for c in CASES.values() if c.kind == kind), seq)
    S = g.S
    B = g.B if kind == "document_causal" else None
    doc_cpu = document_ids(g.B, S, g.doc_lengths) if kind == "document_causal" else None
    doc = None if doc_cpu is None else doc_cpu.to("cuda")
    mask_mod = mask_mod_for(kind, g, doc)
    row = {"case": name, "mask": kind, "B": B or 1, "S": S, "block": 128, "reps": reps}
    if kind == "sliding_window":
        row["window_left"] = g.window

    def flex():
        return create_block_mask(mask_mod, B, None, S, S, device="cuda", _compile=True)

    if kind in FLEX_KINDS:  # ours from flex's mask as a FlexAttention user has it
        fm = flex()

        def ours():
            return sparsetrain.BlockMask.from_torch(fm, schedule="left_to_right")
        ours_host = None
    else:
        def ours():
            return sparsetrain.BlockMask.build(kind, S, device="cuda", schedule="left_to_right",
                                               **our_mask_args(kind, g, doc))

        def ours_host():  # informational: the host builder ("auto" schedule) and the copy to the GPU
            return sparsetrain.BlockMask.build(kind, S, framework="torch",
                                               **our_mask_args(kind, g, doc_cpu)).to("cuda")

    t = run_peer(row, "ours", ours, reps, wall=True)
    try:
        m = ours()
        row["ours_schedule"] = m.schedule
        row["ours_blocks"] = int(m.kv_num_blocks.sum() + m.full_kv_num_blocks.sum())
        fm = flex()
        row["flex_blocks"] = int(fm.kv_num_blocks.sum() + fm.full_kv_num_blocks.sum())
    except Exception as e:  # noqa: BLE001
        row.setdefault("check_error", first_line(e))
    pt = run_peer(row, "flex", flex, reps, wall=True)
    row["speedup_vs_flex"] = pt / t
    if ours_host is not None:
        run_peer(row, "ours_host", ours_host, max(10, reps // 10), wall=True)
    print(json.dumps(row), flush=True)
    return row


# -- main ------------------------------------------------------------------------------------------


def environment():
    # "device" first: scripts/gpu-check copies the output from the line that starts {"device.
    info = {"device": None, "date": time.strftime("%Y-%m-%d %H:%M:%S"), "torch": torch.__version__,
            "cuda": torch.version.cuda, "python": sys.version.split()[0]}
    try:
        import sparsetrain
        info["sparsetrain"] = sparsetrain.version()
    except Exception as e:  # noqa: BLE001
        info["sparsetrain"] = first_line(e)
    try:
        p = torch.cuda.get_device_properties(0)
        info.update(device=torch.cuda.get_device_name(0), sm_count=p.multi_processor_count,
                    l2_bytes=p.L2_cache_size, capability=f"{p.major}.{p.minor}")
    except Exception as e:  # noqa: BLE001
        info["device"] = first_line(e)
    try:
        info["cudnn"] = torch.backends.cudnn.version()
    except Exception as e:  # noqa: BLE001
        info["cudnn"] = first_line(e)
    try:
        info["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                        capture_output=True, text=True, timeout=30).stdout.strip().splitlines()[0]
    except Exception:  # noqa: BLE001
        info["driver"] = "unknown"
    try:
        import triton
        info["triton"] = triton.__version__
    except Exception:  # noqa: BLE001
        info["triton"] = None
    return info


def selected(only):
    names = list(CASES) + list(BUILDS)
    if not only:
        return names
    out = []
    for n in only.split(","):
        n = n.strip()
        if n == "attention":
            out += list(CASES)
        elif n == "build":
            out += list(BUILDS)
        elif n in names:
            out.append(n)
        else:
            raise SystemExit(f"--only: unknown name {n!r}; expected some of {', '.join(names)}, attention, build")
    # A document case's dense causal reference is measured with it (its ratio needs both).
    out += [CASES[n].dense for n in out if n in CASES and CASES[n].dense is not None]
    return list(dict.fromkeys(out))


def add_dense_ratios(rows):
    """On each row with a dense causal reference: its TFLOP/s over the reference's, one call at a
    time ("tflops_vs_dense_causal") and back to back ("b2b_tflops_vs_dense_causal")."""
    by_case = {r["case"]: r for r in rows}
    nan = float("nan")
    for r in rows:
        ref = by_case.get(r.get("dense_causal_case"))
        if ref is None:
            continue
        for key, out in (("ours_tflops", "tflops_vs_dense_causal"), ("ours_b2b_tflops", "b2b_tflops_vs_dense_causal"),
                         ("ours_graph_tflops", "graph_tflops_vs_dense_causal")):
            r[out] = r.get(key, nan) / ref.get(key, nan)


def print_tables(rows):
    """The forward, backward and mask-build tables (the --json rows hold every number)."""

    def f(r, key, fmt="{:.3f}"):
        v = r.get(key)
        return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else fmt.format(v)

    def note(k, v):  # an "<x>_error" or "<x>_skipped" entry of a row
        return f"{k[:-8]} skipped: {v}" if k.endswith("_skipped") else f"{k[:-6]}: {v}"

    att = [r for r in rows if r["case"] in CASES]
    if att:
        # The forward twice: one call at a time (host work counts) and back to back (the GPU work;
        # ours also from CUDA-graph replays). "vs dense": a document case's TFLOP/s over dense
        # causal's at the same shape (target >= 0.6).
        for title, sfx, extra in (("forward, one call at a time", "", ""),
                                  ("forward, back to back", "b2b_", "graph ms")):
            ms = (lambda peer: f"{peer}_{sfx}ms") if sfx else (lambda peer: f"{peer}_ms")
            tf = (lambda peer: f"{peer}_{sfx}tflops") if sfx else (lambda peer: f"{peer}_tflops")
            print(f"\n{title}\n{'case':24} {'B':>2} {'S':>6} {'ours ms':>9} {'TFLOP/s':>8} {extra:>9} {'flex ms':>9} "
                  f"{'TFLOP/s':>8} {'flex/ours':>9} {'cudnn ms':>9} {'TFLOP/s':>8} {'cudnn/ours':>10} "
                  f"{'fa4 ms':>9} {'TFLOP/s':>8} {'fa4/ours':>8} {'vs dense':>8}  errors")
            for r in att:
                errs = "; ".join(note(k, v) for k, v in r.items()
                                 if (k.endswith(("_error", "_skipped")) and not k.startswith(("bwd_", "fwdbwd_")))
                                 or k == "error")
                graph = f(r, "ours_graph_ms") if sfx else ""
                print(f"{r['case']:24} {r.get('B', '-'):>2} {r.get('S', '-'):>6} {f(r, ms('ours')):>9} "
                      f"{f(r, tf('ours'), '{:.1f}'):>8} {graph:>9} {f(r, ms('flex')):>9} "
                      f"{f(r, tf('flex'), '{:.1f}'):>8} {f(r, sfx + 'speedup_vs_flex', '{:.2f}x'):>9} "
                      f"{f(r, ms('cudnn')):>9} {f(r, tf('cudnn'), '{:.1f}'):>8} "
                      f"{f(r, sfx + 'speedup_vs_cudnn', '{:.2f}x'):>10} "
                      f"{f(r, ms('fa4')):>9} {f(r, tf('fa4'), '{:.1f}'):>8} "
                      f"{f(r, sfx + 'speedup_vs_fa4', '{:.2f}x'):>8} "
                      f"{f(r, sfx + 'tflops_vs_dense_causal', '{:.2f}'):>8}  {errs if not sfx else ''}")
    bwd = [r for r in att if "bwd_flops" in r]
    if bwd:
        # Ours is the deterministic backward unless "nondet"; x-columns are peer / ours (> 1: we are
        # faster; fa4nd/ond: FA4's non-deterministic over ours), det/nondet the deterministic mode's
        # cost (target <= 1.10). Each one call at a time (host work counts) and back to back (the GPU
        # work).
        for what, title in (("bwd", "backward alone"), ("fwdbwd", "forward + backward")):
            for sfx, how in (("", "one call at a time"), ("b2b_", "back to back")):
                def ms(peer):
                    return f"{what}_{peer}_{sfx}ms"

                print(f"\n{title + ', ' + how + ' (ms)':44} {'ours':>8} {'TFLOP/s':>8} {'nondet':>8} "
                      f"{'det/nondet':>10} {'flex':>8} {'flex/ours':>9} {'cudnn':>8} {'cudnn/ours':>10} "
                      f"{'fa4':>8} {'fa4/ours':>8} {'fa4 nd':>8} {'fa4nd/ond':>9}  errors")
                for r in bwd:
                    errs = "; ".join(note(k, v) for k, v in r.items() if not sfx and k.startswith(what + "_")
                                     and k.endswith(("_error", "_skipped")))
                    print(f"{r['case']:44} {f(r, ms('ours')):>8} {f(r, f'{what}_ours_{sfx}tflops', '{:.1f}'):>8} "
                          f"{f(r, ms('ours_nondet')):>8} {f(r, f'{what}_{sfx}det_over_nondet', '{:.3f}'):>10} "
                          f"{f(r, ms('flex')):>8} {f(r, f'{what}_{sfx}speedup_vs_flex', '{:.2f}x'):>9} "
                          f"{f(r, ms('cudnn')):>8} {f(r, f'{what}_{sfx}speedup_vs_cudnn', '{:.2f}x'):>10} "
                          f"{f(r, ms('fa4')):>8} {f(r, f'{what}_{sfx}speedup_vs_fa4', '{:.2f}x'):>8} "
                          f"{f(r, ms('fa4_nondet')):>8} "
                          f"{f(r, f'{what}_{sfx}nondet_speedup_vs_fa4_nondet', '{:.2f}x'):>9}  {errs}")
    builds = [r for r in rows if r["case"] in BUILDS]
    if builds:
        print(f"\n{'mask build':24} {'ours ms':>9} {'flex ms':>9} {'flex/ours':>10} (target >= 10x; "
              "from_torch: >= 1x) "
              f"{'ours host+copy ms':>17}  errors")
        for r in builds:
            errs = "; ".join(f"{k[:-6]}: {v}" for k, v in r.items() if k.endswith("_error") or k == "error")
            print(f"{r['case']:24} {f(r, 'ours_ms'):>9} {f(r, 'flex_ms'):>9} {f(r, 'speedup_vs_flex', '{:.1f}x'):>10} "
                  f"{'':15} {f(r, 'ours_host_ms'):>17}  {errs}")


def self_check(names, seq):
    """The host-side parts on the CPU: for each selected attention case at --seq, its geometry,
    document ids and closed-form pair counts against the mask_mod evaluated densely, and our
    BlockMask built on the host from the same arguments covering every allowed pair; then the
    tables over rows with made-up timings (the printing and ratio code)."""
    import sparsetrain

    rows = []
    for name in names:
        if name not in CASES:
            continue
        c, g, doc_cpu, _, mask_mod, pairs = case_masks(name, seq, "cpu")
        choice = {}
        mask = build_our_mask(c.kind, g.S, g, None, doc_cpu, g.B, c.Hq, c.Hkv, "auto", None, choice)
        if doc_padding_for(g.S) and c.kind == "document_causal":  # --doc-padding: the padded form, every token placed
            placed = mask.backward_padded.real_rows
            assert int((placed >= 0).sum()) == g.B * g.S and mask.backward_padded.walk == mask.walk, name
        chosen = [x for x in choice["schedule_candidates"]
                  if (x["schedule"], x["walk"]) == (choice["ours_schedule"], choice["ours_walk"])]
        # auto's rule (block_mask.h choose_schedule): left to right, the descending walk (measured),
        # or, only on a mask given by blocks (a mask_mod kind), the ascending walk with the heads
        # innermost where the model puts it at <= 0.9x the descending one's deterministic path.
        paths = {x["walk"]: x["critical_path"] for x in choice["schedule_candidates"] if x["schedule"] == "left_to_right"}
        ascending = choice["ours_walk"] == "ascending_heads_inner"
        assert chosen and choice["ours_schedule"] == "left_to_right", (name, choice)
        assert choice["ours_walk"] == "descending_heads_inner" or (
            ascending and c.kind in FLEX_KINDS
            and paths["ascending_heads_inner"] <= 0.9 * paths["descending_heads_inner"]), (name, choice)
        print(f"self-check {name:24} auto: {choice['ours_schedule']} {choice['ours_walk']} (model steps: " +
              ", ".join(f"{x['schedule']}/{x['walk']} {x['critical_path']} det {x['nondeterministic_critical_path']} "
                        "nondet" for x in choice["schedule_candidates"]) + ")", flush=True)
        # Every allowed pair lies in a listed block: the blocks' element count bounds the pairs.
        blocks = mask.kv_num_blocks.sum() + mask.full_kv_num_blocks.sum()
        listed = int(blocks) * (1 if mask.kv_num_blocks.shape[0] == g.B else g.B)
        full = int(mask.full_kv_num_blocks.sum()) * (1 if mask.kv_num_blocks.shape[0] == g.B else g.B)
        assert full * mask.block_q * mask.block_kv <= sum(pairs) <= listed * mask.block_q * mask.block_kv, name
        if c.kind == "document_causal":  # FA4's varlen form of the documents allows the same pairs
            cu, longest = fa4_cu_seqlens(doc_cpu, "cpu")
            n = (cu[1:] - cu[:-1]).long()
            assert int(cu[-1]) == g.B * g.S and int(n.max()) == longest, name
            assert int((n * (n + 1) // 2).sum()) == sum(pairs), name
        print(f"self-check {name:24} B={g.B} S={g.S} window={g.window if c.kind == 'sliding_window' else '-'} "
              f"docs={[int(torch.unique(doc_cpu[b]).numel()) for b in range(g.B)] if doc_cpu is not None else '-'} "
              f"pairs/head={pairs} (dense count agrees) blocks={listed}", flush=True)
        fake = 1.0 + len(rows)
        flops = 4.0 * c.D * c.Hq * sum(pairs)
        row = {"case": name, "mask": c.kind, "B": g.B, "S": g.S, "fwd_flops": flops}
        if c.dense is not None:
            row["dense_causal_case"] = c.dense
        for peer in ("ours", "flex", "fa4") + (("cudnn",) if c.kind == "causal" else ()):
            for sfx in ("", "b2b_"):
                row[f"{peer}_{sfx}ms"] = fake
                row[f"{peer}_{sfx}tflops"] = flops / fake * 1e-9
        row["ours_graph_ms"] = fake
        row["ours_graph_tflops"] = flops / fake * 1e-9
        for peer in ("flex", "cudnn", "fa4"):
            if f"{peer}_ms" in row:
                row[f"speedup_vs_{peer}"] = row[f"b2b_speedup_vs_{peer}"] = 1.0
        row["bwd_flops"], row["fwdbwd_flops"] = 2.5 * flops, 3.5 * flops
        bwd_peers = ("ours", "ours_nondet", "flex", "fa4_nondet") + (("cudnn",) if c.kind == "causal" else ())
        if c.kind in FLEX_KINDS:  # as bench_backward leaves it: FA4's deterministic block-sparse backward
            row["bwd_fa4_skipped"] = row["fwdbwd_fa4_skipped"] = FA4_NO_DET_BLOCK_SPARSE
        else:
            bwd_peers += ("fa4",)
        for what in ("bwd", "fwdbwd"):
            for peer in bwd_peers:
                for k, sfx in enumerate(("", "b2b_")):
                    row[f"{what}_{peer}_{sfx}ms"] = fake * (2 + k)
                    row[f"{what}_{peer}_{sfx}tflops"] = row[f"{what}_flops"] / (fake * (2 + k)) * 1e-9
        backward_ratios(row)
        for what in ("bwd", "fwdbwd"):  # the ratios' keys and values, checked on the made-up rows
            for sfx in ("", "b2b_"):
                assert row[f"{what}_{sfx}speedup_vs_flex"] == 1.0 and row[f"{what}_{sfx}det_over_nondet"] == 1.0
                assert row[f"{what}_{sfx}nondet_speedup_vs_fa4_nondet"] == 1.0
                assert row.get(f"{what}_{sfx}speedup_vs_fa4", 1.0) == 1.0
        rows.append(row)
    add_dense_ratios(rows)
    print_tables(rows)
    print("\nself-check passed (timings above are made up)")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", default="", metavar="NAMES",
                    help=f"comma-separated cases: {', '.join(list(CASES) + list(BUILDS))}, or 'attention' / "
                         "'build' for each group (default: all)")
    ap.add_argument("--quick", action="store_true",
                    help="a smoke run: S = 2048 (the window and document lengths scaled with S), 10 runs")
    ap.add_argument("--seq", type=int, default=None, help="S (default 8192; --quick: 2048)")
    ap.add_argument("--reps", type=int, default=None, help="timed runs per measurement (default 100; --quick: 10)")
    ap.add_argument("--backward", action="store_true",
                    help="also time the backward alone (10 * D * pairs FLOPs) and forward + backward (14 * D * "
                         "pairs) of ours (deterministic and not), FlexAttention and cuDNN (causal)")
    ap.add_argument("--json", default=None, metavar="PATH", help="write the environment and every row as JSON")
    ap.add_argument("--schedule", default="auto", choices=("auto", "left_to_right", "shortest_first"),
                    help="ours' dQ schedule (default auto: the scheduler model's choice for the case, recorded)")
    ap.add_argument("--walk", default=None, choices=("descending_heads_inner", "ascending_heads_outer",
                                                     "ascending_heads_inner"),
                    help="with an explicit --schedule: the backward's walk (default descending_heads_inner)")
    ap.add_argument("--doc-padding", type=int, default=None, metavar="N",
                    help="document masks with their padded backward form: documents of >= N tokens (>= 128) on "
                         "128-token boundaries in the backward; 0: none (default: the library's default for "
                         "masks built on the GPU, 1024 at S >= 1024, also for this bench's host builds)")
    ap.add_argument("--self-check", action="store_true",
                    help="run the host-side parts on the CPU (no GPU): geometry, document ids, closed-form pair "
                         "counts against dense counts, our host mask builds, the tables; then exit")
    args = ap.parse_args()
    global DOC_PADDING
    DOC_PADDING = args.doc_padding
    names = selected(args.only)
    S = args.seq or (2048 if args.quick else SEQ)
    reps = args.reps or (10 if args.quick else 100)
    if args.self_check:
        return self_check(names, S)
    if not torch.cuda.is_available():
        raise SystemExit("bench_attention: no CUDA device (torch.cuda.is_available() is False)")
    for opt in ("cache_size_limit", "recompile_limit"):  # flex recompiles per mask_mod and shape
        if hasattr(torch._dynamo.config, opt):
            setattr(torch._dynamo.config, opt, 64)
    from torch.nn.attention.flex_attention import flex_attention
    # The backward alone is timed over a retained graph (autograd.grad(retain_graph=True)), which
    # compiled backwards with donated buffers refuse: donation off (it only saves memory).
    torch._functorch.config.donated_buffer = False
    flex_compiled = torch.compile(flex_attention, dynamic=False)
    # create_block_mask(_compile=True) is what docs/DESIGN.md section 9 names; torch 2.11 deprecates it
    # in favour of torch.compile(create_block_mask) with a warning on every call.
    warnings.filterwarnings("ignore", message="_compile flag on create_block_mask")

    info = environment()
    info.update(args=vars(args), S=S, reps=reps)
    fa4, fa4_version = import_fa4()
    if fa4 is None:
        print(f"FA4 skipped: flash_attn.cute does not import ({fa4_version}); scripts/fa4-wheels installs it",
              flush=True)
        info["fa4"] = "skipped: " + fa4_version
    else:
        info["fa4"] = fa4_version
    rows = []
    for name in names:
        try:
            if name in CASES:
                rows.append(bench_case(name, S, reps, args.backward, flex_compiled, args.schedule, args.walk, fa4))
            else:
                rows.append(bench_build(name, S, reps))
        except Exception as e:  # noqa: BLE001 - a case that cannot run is recorded, the rest still run
            row = {"case": name, "error": first_line(e)}
            print(json.dumps(row), flush=True)
            rows.append(row)
        torch.cuda.empty_cache()
    add_dense_ratios(rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"info": info, "rows": rows}, f, indent=1)
    print(f"\n{json.dumps(info)}")

    print_tables(rows)


if __name__ == "__main__":
    main()
