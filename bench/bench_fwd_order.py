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
the order).

    python bench/bench_fwd_order.py --only causal,causal_s4096_b8 [--rounds 5] [--reps 20] [--json out.json]
"""

import argparse
import itertools
import json
import math
import os
import statistics

import torch

import bench_attention as ba

VARIANTS = [("sections", False), ("lpt", False), ("natural", False), ("sections", True), ("lpt", True),
            ("natural", True)]


def use(order, static):
    os.environ["SPARSETRAIN_ATTN_FWD_ORDER"] = order
    os.environ["SPARSETRAIN_ATTN_FWD_STATIC"] = "1" if static else "0"


def bench_case(name, rounds, reps):
    import sparsetrain
    import sparsetrain.torch as stt

    c, g, _, doc, _, pairs = ba.case_masks(name, ba.SEQ, "cuda")
    B, S, Hq, Hkv, D = g.B, g.S, c.Hq, c.Hkv, c.D
    mask = sparsetrain.BlockMask.build(c.kind, S, device="cuda", **ba.our_mask_args(c.kind, g, doc))
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    n_sets = max(1, math.ceil(2 * l2 / (2 * (B * Hq * S * D + 2 * B * Hkv * S * D))))
    gen = torch.Generator(device="cuda").manual_seed(0)
    sets = [tuple(torch.randn(B, h, S, D, device="cuda", dtype=torch.bfloat16, generator=gen) for h in (Hq, Hkv, Hkv))
            for _ in range(n_sets)]
    cycle = itertools.cycle(sets)

    def call():
        return stt.block_sparse_attention(*next(cycle), mask)

    outs = []
    for order, static in VARIANTS:
        use(order, static)
        outs.append(stt.block_sparse_attention(*sets[0], mask))
    same = [bool(torch.equal(o, outs[0])) for o in outs]
    times = [[] for _ in VARIANTS]
    for _ in range(rounds):
        for i, (order, static) in enumerate(VARIANTS):
            use(order, static)
            times[i].append(ba.queued_ms(call, reps, 2))
    use("sections", False)
    flops = 4.0 * D * Hq * sum(pairs)
    med = [statistics.median(t) for t in times]
    return {"case": name, "mask": c.kind, "B": B, "Hq": Hq, "Hkv": Hkv, "S": S, "D": D, "rounds": rounds,
            "reps": reps, "input_copies": n_sets,
            "variants": [{"order": o, "static": st, "fwd_b2b_ms": m, "tflops": flops / m * 1e-9, "rounds_ms": t,
                          "bitwise_equal_to_default": e}
                         for (o, st), m, t, e in zip(VARIANTS, med, times, same)]}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", required=True, metavar="NAMES", help="comma-separated bench_attention CASES")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--json", default=None, metavar="PATH")
    a = ap.parse_args()
    rows = []
    print(f"{'case':26s} " + " ".join(f"{o + ('/static' if s else ''):>15s}" for o, s in VARIANTS) + "   (TFLOP/s)")
    for name in a.only.split(","):
        r = bench_case(name, a.rounds, a.reps)
        rows.append(r)
        cells = " ".join(f"{v['tflops']:15.1f}" for v in r["variants"])
        equal = "" if all(v["bitwise_equal_to_default"] for v in r["variants"]) else "  OUTPUTS DIFFER"
        print(f"{name:26s} {cells}{equal}", flush=True)
        torch.cuda.empty_cache()
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"info": ba.environment(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
