# Issue 14, 64-row q tiles, modelled (docs/PERF.md, 2026-11-26 ninth session): over the bench's
# documents (seed 0), the share of empty 64-row halves of visited 128 x 128 tiles and the pairs
# computed with 128- vs 64-row q tiles. Run from the repository root: python docs/experiments/2026-11-26b_q_tile_64_model.py
import sys, numpy as np
sys.path.insert(0, "bench")
from bench_attention import document_ids
def run(name, S, B, allowed_fn):
    T = 128; nq = S // T
    vis = half = empty_half = 0; pairs_alloc = 0; pairs_vis = 0
    for b in range(B):
        for qt in range(nq):
            q = np.arange(qt*T, qt*T+T)
            for kt in range(qt+1):
                k = np.arange(kt*T, kt*T+T)
                A = allowed_fn(b, q[:, None], k[None, :])
                if not A.any(): continue
                vis += 1; pairs_alloc += A.sum(); pairs_vis += T*T
                for h in (A[:64], A[64:]):
                    half += 1; empty_half += not h.any()
    print(f"{name}: tile visits {vis}, allowed pairs in visits {pairs_alloc/pairs_vis:.3f}, empty 64-row halves {empty_half/half:.3f}")
S = 16384
docs = document_ids(2, S, (1, 3000))
run("documents 1..3000 S16384", S, 2, lambda b, q, k: (docs[b][q] == docs[b][k]) & (k <= q))
docs2 = document_ids(2, 8192, (1, 512))
run("documents 1..512 S8192", 8192, 2, lambda b, q, k: (docs2[b][q] == docs2[b][k]) & (k <= q))
for w in (512, 1024):
    run(f"window {w} S8192", 8192, 1, lambda b, q, k, w=w: (k <= q) & (q - k < w))
run("causal S8192", 8192, 1, lambda b, q, k: k <= q)
def pairs(name, S, B, TQ, allowed_fn, TK=128):
    vis = al = 0
    for b in range(B):
        for qt in range(S // TQ):
            q = np.arange(qt*TQ, qt*TQ+TQ)
            for kt in range((qt*TQ + TQ - 1)//TK + 1):
                k = np.arange(kt*TK, kt*TK+TK)
                A = allowed_fn(b, q[:, None], k[None, :])
                if A.any(): vis += TQ*TK; al += A.sum()
    return al / vis, vis
for TQ in (128, 64):
    f, v = pairs("docs", S, 2, TQ, lambda b, q, k: (docs[b][q] == docs[b][k]) & (k <= q))
    f2, v2 = pairs("docs", 8192, 2, TQ, lambda b, q, k: (docs2[b][q] == docs2[b][k]) & (k <= q))
    print(f"q tile {TQ}: documents 1..3000 allowed/computed {f:.3f} (computed pairs {v/1e6:.1f}M); 1..512 {f2:.3f} ({v2/1e6:.1f}M)")
