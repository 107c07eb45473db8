"""A / B of the attention forward and backward across two builds: run it once per build, in
alternating processes, each with its build's package first on PYTHONPATH; every process prints one
JSON line per case with its tag. Per case of bench_attention.py's CASES (bf16, its B, H, S, D,
mask, the "auto" schedule built on the host, or AB_SCHEDULE / AB_WALK): the forward alone (under
no_grad) and the backward alone (torch.autograd.grad over a retained forward graph),
deterministic and not, back to back, the three alternating in each of 5 rounds of 20 calls
(bench_attention.interleaved_ms), medians; whether two deterministic backwards are bitwise the
same; and digests of o, lse and the deterministic dq, dk, dv, so that the table shows whether the
two builds compute the same bits (a refactor that should change no result).

    # base = a checkout of the commit to compare with, built beside this one (scripts/setup)
    for r in 1 2; do
      PYTHONPATH=base/python python3 bench/bench_attn_ab.py base causal_d64,causal_s2048_b8
      PYTHONPATH=python python3 bench/bench_attn_ab.py new causal_d64,causal_s2048_b8
    done
"""
import hashlib
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch

import bench_attention as ba
from bench_dq_schedule import backward_inputs


# The schedule under test: "auto" (the default, built on the host for the real problem) or a fixed
# one through AB_SCHEDULE / AB_WALK (built on the GPU; a mask_mod kind from flex's BlockMask).
SCHEDULE = os.environ.get("AB_SCHEDULE", "auto")
WALK = os.environ.get("AB_WALK") or None


def digest(*tensors):
    """A short digest of the tensors' bytes (equal digests: bitwise equal results)."""
    h = hashlib.sha1()
    for t in tensors:
        h.update(t.detach().contiguous().view(torch.uint8).cpu().numpy().tobytes())
    return h.hexdigest()[:12]


def case_row(tag, name):
    """One case's JSON row (its tensors freed on return)."""
    import sparsetrain.torch as stt

    c, g, doc_cpu, doc, q, k, v, do = backward_inputs(name)
    mask = ba.build_our_mask(c.kind, g.S, g, doc, doc_cpu, g.B, c.Hq, c.Hkv, SCHEDULE, WALK, {})
    outs = [stt.block_sparse_attention(q, k, v, mask, deterministic=d) for d in (True, False)]

    def forward():
        with torch.no_grad():
            return stt.block_sparse_attention(q, k, v, mask)

    def backward(o):
        return torch.autograd.grad(o, (q, k, v), do, retain_graph=True)

    med, _ = ba.interleaved_ms([forward] + [lambda o=o: backward(o) for o in outs], 5, 20)
    g1, g2 = (backward(outs[0]) for _ in range(2))
    with torch.no_grad():
        o, lse = stt.block_sparse_attention(q, k, v, mask, return_lse=True)
    return {"tag": tag, "case": name, "device": torch.cuda.get_device_name(), "schedule": mask.schedule,
            "walk": mask.walk, "fwd_ms": med[0], "det_ms": med[1], "nondet_ms": med[2],
            "bitwise": all(torch.equal(x, y) for x, y in zip(g1, g2)), "fwd_digest": digest(o, lse),
            "bwd_digest": digest(*g1)}


def main(tag, names):
    for name in names:
        print(json.dumps(case_row(tag, name)), flush=True)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    main(sys.argv[1], sys.argv[2].split(","))
