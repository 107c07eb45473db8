"""Per-item timing of the backward (a build with docs/experiments/2026-11-26d_bwd_item_clocks.patch applied;
run from the repository root with that build on PYTHONPATH): one det call after a
warm-up and one nondet, per case; the dQ conversion kernel prints the PROF line. SCHEDULE and WALK
(environment) pick another schedule than "auto" (e.g. shortest_first, ascending_heads_outer)."""
import os
import sys
sys.path.insert(0, "bench")
import torch
import bench_attention as ba
import bench_dq_schedule as bds


def main():
    import sparsetrain
    import sparsetrain.torch as stt
    for name in sys.argv[1].split(","):
        c, g, _, doc, q, k, v, do = bds.backward_inputs(name)
        sched = {"schedule": os.environ["SCHEDULE"], "walk": os.environ.get("WALK")} if "SCHEDULE" in os.environ else {}
        m = sparsetrain.BlockMask.build(c.kind, g.S, device="cuda", **sched, **ba.our_mask_args(c.kind, g, doc))
        for det in (True, True, False):
            o = stt.block_sparse_attention(q, k, v, m, deterministic=det)
            torch.cuda.synchronize()
            print(f"== {name} det={det}", flush=True)
            torch.autograd.grad(o, (q, k, v), do)
            torch.cuda.synchronize()


if __name__ == "__main__":
    main()
