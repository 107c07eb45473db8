"""The deterministic backward under each column schedule x walk (block_mask.h: ColumnSchedule,
WalkOrder), A/B in one process on one GPU: what "auto" (choose_schedule) is checked against.

Per case of bench_attention.py's CASES (bf16, its B, H, S, D, mask), one input set and four
retained forward graphs: deterministic with left to right + descending heads inner, left to right
+ ascending heads outer and shortest first + ascending heads outer, and non-deterministic (atomic
dQ) as the floor. Each round times every graph's backward alone (torch.autograd.grad with
retain_graph) back to back (`reps` calls queued between two CUDA events, after warm-up); the
graphs alternate within a round so drift hits all alike, and the row keeps every round and the
medians. The row also carries auto's choice for the case (the host build with the real batch,
heads and 132 workers) and the model's critical paths of every candidate.

    python bench/bench_dq_schedule.py --only causal,gqa_causal [--rounds 5] [--reps 20] [--json out.json]
"""


import torch

import bench_attention as ba

CANDIDATES = [("left_to_right", "descending_heads_inner", True), ("left_to_right", "ascending_heads_outer", True),
              ("shortest_first", "ascending_heads_outer", True), ("left_to_right", "descending_heads_inner", False)]


def backward_inputs(name):
    """A bench_attention case's masks and bf16 q, k, v (requiring grad) and dout on the GPU, seed 0."""
    c, g, doc_cpu, doc, _, _ = ba.case_masks(name, ba.SEQ, "cuda")
    B, S, Hq, Hkv, D = g.B, g.S, c.Hq, c.Hkv, c.D
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(B, h, S, D, device="cuda", dtype=torch.bfloat16, generator=gen).requires_grad_()
               for h in (Hq, Hkv, Hkv))
    do = torch.randn(B, Hq, S, D, device="cuda", dtype=torch.bfloat16, generator=gen)
    return c, g, doc_cpu, doc, q, k, v, do


def bench_case(name, rounds, reps):
    import sparsetrain
    import sparsetrain.torch as stt
    from sparsetrain import _C

    c, g, doc_cpu, doc, q, k, v, do = backward_inputs(name)
    B, S, Hq, Hkv, D = g.B, g.S, c.Hq, c.Hkv, c.D
    args = ba.our_mask_args(c.kind, g, doc)
    outs = [stt.block_sparse_attention(q, k, v, sparsetrain.BlockMask.build(c.kind, S, device="cuda", schedule=s,
                                                                              walk=w, **args), deterministic=det)
            for s, w, det in CANDIDATES]
    host = sparsetrain.BlockMask.build(c.kind, S, framework="torch", schedule="auto", auto_problem=(B, Hq, Hkv, 132),
                                       **ba.our_mask_args(c.kind, g, doc_cpu))
    med, times = ba.interleaved_ms([lambda o=o: torch.autograd.grad(o, (q, k, v), do, retain_graph=True)
                                    for o in outs], rounds, reps)
    return {"case": name, "mask": c.kind, "B": B, "Hq": Hq, "Hkv": Hkv, "S": S, "D": D, "rounds": rounds,
            "reps": reps, "auto": {"schedule": host.schedule, "walk": host.walk},
            "model": _C.schedule_candidates(host._core_mask(), [B, Hq, Hkv, 132]),
            "candidates": [{"schedule": s, "walk": w, "deterministic": det, "bwd_b2b_ms": m, "rounds_ms": t}
                           for (s, w, det), m, t in zip(CANDIDATES, med, times)]}


def show(name, r):
    ms = [x["bwd_b2b_ms"] for x in r["candidates"]]
    print(f"{name:26s} det ms: LTR desc {ms[0]:.3f}  LTR asc {ms[1]:.3f} ({ms[1] / ms[0]:.3f}x)  SPT asc "
          f"{ms[2]:.3f} ({ms[2] / ms[0]:.3f}x)  nondet {ms[3]:.3f}  auto {r['auto']['schedule']} "
          f"{r['auto']['walk']}  model {[m['critical_path'] for m in r['model']]}", flush=True)


if __name__ == "__main__":
    ba.ab_main(__doc__, bench_case, show)
