"""The backward's hand-out sections, swept on today's kernel: backward alone (deterministic unless
NONDET=1), back to back, one process, settings interleaved (SPARSETRAIN_ATTN_BWD_ORDER is read at
every call). python docs/experiments/2026-11-26h_bwd_sections_sweep.py CASES (SETTINGS=auto,sections:8,... to choose)"""
import os, sys
sys.path.insert(0, "bench")
import torch
import bench_attention as ba
import sparsetrain
import sparsetrain.torch as stt

SETTINGS = os.environ.get("SETTINGS", "auto,columns,sections:2,sections:4,sections:8,sections:16,sections:32").split(",")
det = os.environ.get("NONDET") != "1"
for name in sys.argv[1].split(","):
    c, g, doc_cpu, doc, _, _ = ba.case_masks(name, ba.SEQ, "cuda")
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(g.B, h, g.S, c.D, device="cuda", dtype=torch.bfloat16, generator=gen).requires_grad_()
               for h in (c.Hq, c.Hkv, c.Hkv))
    do = torch.randn(g.B, c.Hq, g.S, c.D, device="cuda", dtype=torch.bfloat16, generator=gen)
    m = sparsetrain.BlockMask.build(c.kind, g.S, device="cuda", **ba.our_mask_args(c.kind, g, doc))
    o = stt.block_sparse_attention(q, k, v, m, deterministic=det)
    fns = [lambda: torch.autograd.grad(o, (q, k, v), do, retain_graph=True) for _ in SETTINGS]
    med, _ = ba.interleaved_ms(fns, 5, 20, before=lambda i: os.environ.__setitem__("SPARSETRAIN_ATTN_BWD_ORDER", SETTINGS[i]))
    os.environ.pop("SPARSETRAIN_ATTN_BWD_ORDER")
    best = min(range(len(SETTINGS)), key=lambda i: med[i])
    print(f"{name:26s} B{g.B} H{c.Hq}/{c.Hkv} S{g.S} D{c.D} {'det' if det else 'nondet'}: " +
          "  ".join(f"{s.replace('sections:', 's')} {t:.3f}" for s, t in zip(SETTINGS, med)) +
          f"   best {SETTINGS[best]} ({med[best] / med[0]:.3f} of auto)", flush=True)
