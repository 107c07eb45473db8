"""Backward cost of 128-aligned vs document-start tiles (issue 15 item 4) over the bench's documents
(bench_attention's generator, seed 0): visits, partial (masked) visits and columns, and a time
estimate from a short column's per-visit and per-item clocks. docs/PERF.md (thirteenth session).
Run: python docs/experiments/2026-11-26f_bwd_document_tiles_model.py"""
import os, sys

import numpy as np
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "bench"))
import bench_attention as ba  # noqa: E402  (its document generator, so the lengths are the bench's)


def ids(B, S, lo, hi):
    """Per batch row, the document lengths of bench_attention.document_ids (seed 0)."""
    doc = ba.document_ids(B, S, (lo, hi)).numpy()
    return [list(np.bincount(row)) for row in doc]


def aligned(L, S, blk=128):
    # doc id per token; per (q tile, kv tile) pair: visited if any allowed pair; partial unless all pairs allowed
    doc = np.repeat(np.arange(len(L)), L); pos = np.arange(S)
    nt = (S + blk - 1) // blk
    start = np.concatenate([[0], np.cumsum(L)[:-1]]); dstart = start[doc]
    visits = partial = 0; cols = set()
    for qt in range(nt):
        q = pos[qt*blk:(qt+1)*blk]; 
        lo_k = dstart[q].min(); hi_k = q.max()
        for kt in range(lo_k // blk, hi_k // blk + 1):
            k = pos[kt*blk:(kt+1)*blk]
            allowed = (doc[q][:, None] == doc[k][None, :]) & (q[:, None] >= k[None, :])
            if allowed.any():
                visits += 1; cols.add(kt)
                if not allowed.all(): partial += 1
    return visits, partial, len(cols)
def docstart(L, blk=128):
    visits = partial = items = 0
    for n in L:
        t = (n + blk - 1) // blk
        visits += t * (t + 1) // 2; items += t
        partial += t + (1 if n % blk else 0) * 0  # diagonal tiles (interval masks); the last tile's rows are short
    return visits, partial, items
for name, B, S, lo, hi in (("documents 1..3000 (B2 S16384)", 2, 16384, 1, 3000), ("documents default", 2, 8192, None, None),
                           ("128k documents 1..8192", 1, 131072, 1, 8192)):
    if lo is None:
        lo, hi = ba.DOC_LENGTHS
        name += f" {lo}..{hi}"
    docs = ids(B, S, lo, hi)
    a = np.sum([aligned(L, S) for L in docs], axis=0); d = np.sum([docstart(L) for L in docs], axis=0)
    print(f"{name}: 128-aligned visits {a[0]} (partial {a[1]}, {100*a[1]/a[0]:.0f} %), columns {a[2]}; "
          f"doc-start visits {d[0]} (diagonal {d[1]}), columns {d[2]}")
    V, I = 5.2, 8.0  # K cycles: a short column's visit, an item's fixed cost (eleventh session's clocks)
    for m in (0.0, 0.1, 0.2):
        ta = a[0]*V + a[1]*V*m + a[2]*I; td = d[0]*V + d[1]*V*m*0.5 + d[2]*I
        print(f"   partial-visit surcharge {m:.0%}: doc-start / aligned time {td/ta:.3f}")

def variant_k(L, S, blk=128):
    # kv columns aligned to document starts, q tiles on the fixed grid
    visits = partial = items = 0; s = 0
    for n in L:
        e = s + n
        for t in range((n + blk - 1) // blk):
            a = s + t * blk; b = min(e, a + blk); items += 1
            for qt in range(a // blk, (e - 1) // blk + 1):
                q0, q1 = qt * blk, min(S, qt * blk + blk)
                visits += 1
                partial += 0 if (q0 >= b and q1 <= e) else 1
        s = e
    return visits, partial, items
print("variant K (kv columns at document starts, q tiles on the grid):")
for name, B, S, lo, hi in (("documents 1..3000", 2, 16384, 1, 3000), ("128k documents 1..8192", 1, 131072, 1, 8192)):
    docs = ids(B, S, lo, hi)
    a = np.sum([aligned(L, S) for L in docs], axis=0); k = np.sum([variant_k(L, S) for L in docs], axis=0)
    print(f"  {name}: aligned visits {a[0]} partial {a[1]} columns {a[2]} | K visits {k[0]} partial {k[1]} columns {k[2]}")
    for m in (0.0, 0.1, 0.2):
        V, I = 5.2, 8.0
        ta = a[0]*V + a[1]*V*m + a[2]*I; tk = k[0]*V + k[1]*V*m + k[2]*I
        print(f"     surcharge {m:.0%}: K / aligned {tk/ta:.3f}")
