"""The attention forward's work order (how its persistent CTAs are handed the (batch, head, q tile)
items), A/B in one process on one GPU: what the default is checked against.

Orders (SPARSETRAIN_ATTN_FWD_ORDER, read by the library at every call): "sections" (the default:
L2 sections of heads, longest first inside each), "lpt" (longest first over the whole problem),
"natural" (numbered order: the q tiles of one head together); each handed out by the atomic
counter (dynamic, the default) or statically (SPARSETRAIN_ATTN_FWD_STATIC=1: CTA c takes c,
c + grid, ...). Per case of bench_attention.py's CASES (bf16, its B, H, S, D, mask): one mask,
inputs rotated over enough copies to exceed twice the L2 cache, and each round times every
variant back to back (`reps` calls queued between two CUDA events, after warm-up), the variants
alternating within a round so drift hits all alike; medians over the rounds. The outputs of every
variant are checked bitwise equal to the default's (each item is computed by one CTA whatever
the order). --graph times CUDA-graph replays of `reps` calls instead (each variant captured with
its switch set): the GPU work alone, where back-to-back calls shorter than ~0.4 ms are host-bound.

    python bench/bench_fwd_order.py --only causal,causal_s4096_b8 [--graph] [--rounds 5] [--reps 20]
                                    [--json out.json]
"""

import itertools
import os

import torch

import bench_attention as ba

# (label, the switches' values); the first is the default.
VARIANTS = [(f"{o}{'/static' if st else ''}", {"SPARSETRAIN_ATTN_FWD_ORDER": o, "SPARSETRAIN_ATTN_FWD_STATIC": "1" if st else "0"})
            for st in (False, True) for o in ("sections", "lpt", "natural")]


def use(i):
    os.environ.update(VARIANTS[i][1])


def bench_case(name, rounds, reps):
    import sparsetrain
    import sparsetrain.torch as stt

    c, g, _, doc, _, pairs = ba.case_masks(name, ba.SEQ, "cuda")
    B, S, Hq, Hkv, D = g.B, g.S, c.Hq, c.Hkv, c.D
    mask = sparsetrain.BlockMask.build(c.kind, S, device="cuda", **ba.our_mask_args(c.kind, g, doc))
    sets = ba.input_sets(B, Hq, Hkv, S, D)
    cycle = itertools.cycle(sets)

    def call():
        return stt.block_sparse_attention(*next(cycle), mask)

    outs = []
    for i in range(len(VARIANTS)):
        use(i)
        outs.append(stt.block_sparse_attention(*sets[0], mask))
    same = [bool(torch.equal(o, outs[0])) for o in outs]
    if GRAPH:
        fns = []
        for i in range(len(VARIANTS)):
            use(i)
            fns.append(ba.captured(call, reps))
        med, times = ba.interleaved_ms(fns, rounds, 1)
        med, times = [m / reps for m in med], [[t / reps for t in ts] for ts in times]
    else:
        med, times = ba.interleaved_ms([call] * len(VARIANTS), rounds, reps, before=use)
    use(0)
    flops = 4.0 * D * Hq * sum(pairs)
    return {"case": name, "mask": c.kind, "B": B, "Hq": Hq, "Hkv": Hkv, "S": S, "D": D, "rounds": rounds,
            "reps": reps, "input_copies": len(sets), "timing": "graph" if GRAPH else "b2b",
            "variants": [{"variant": label, "switches": env, "fwd_ms": m, "tflops": flops / m * 1e-9,
                          "rounds_ms": t, "bitwise_equal_to_default": e}
                         for (label, env), m, t, e in zip(VARIANTS, med, times, same)]}


def show(name, row):
    if not _shown:  # the header, with the first row
        print(f"{'case':26s} " + " ".join(f"{label:>15s}" for label, _ in VARIANTS) +
              f"   (TFLOP/s, {'graph' if GRAPH else 'back to back'})")
        _shown.append(name)
    cells = " ".join(f"{v['tflops']:15.1f}" for v in row["variants"])
    equal = "" if all(v["bitwise_equal_to_default"] for v in row["variants"]) else "  OUTPUTS DIFFER"
    print(f"{name:26s} {cells}{equal}", flush=True)


_shown = []
GRAPH = False

if __name__ == "__main__":
    import sys

    # This script's own options, taken off before the shared A/B command line reads the rest.
    args = sys.argv[1:]
    if "--graph" in args:
        GRAPH = True
        args.remove("--graph")
    sys.argv[1:] = args
    ba.ab_main(__doc__, bench_case, show)
