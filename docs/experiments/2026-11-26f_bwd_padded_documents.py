"""What document-start tiles (issue 15 item 4) could gain, measured on today's kernel without
building them: the backward on the bench's documents against the same documents each padded to a
multiple of 128 tokens (there every 128-aligned tile holds one document, so only diagonal tiles are
masked, by their causal triangle, as document-start tiles would be). The time per visited block
of the two (det and nondet) prices the partial tiles' document-id masking and straddling, which the
CPU models leave out (docs/PERF.md, thirteenth session). Run on a GPU from the repository root with
a build on PYTHONPATH: python docs/experiments/2026-11-26f_bwd_padded_documents.py [CASES]"""
import sys

import numpy as np
import torch

sys.path.insert(0, "bench")
import bench_attention as ba  # noqa: E402


def padded(ids_row):
    """One batch row's document ids with every document padded to a multiple of 128 tokens."""
    out, s, n = [], 0, len(ids_row)
    while s < n:
        e = s
        while e < n and ids_row[e] == ids_row[s]:
            e += 1
        out += [int(ids_row[s])] * (-(-(e - s) // 128) * 128)
        s = e
    return out


def main():
    import sparsetrain
    import sparsetrain.torch as stt
    names = sys.argv[1].split(",") if len(sys.argv) > 1 else ["document_causal_1to3000", "document_causal"]
    for name in names:
        c, g, doc_cpu, _, _, _ = ba.case_masks(name, ba.SEQ, "cuda")
        rows = [padded(doc_cpu[b].tolist()) for b in range(g.B)]
        S2 = max(len(r) for r in rows)
        # Rows padded to one length with one more document (128-aligned: it starts on a tile).
        pad = np.array([r + [r[-1] + 1] * (S2 - len(r)) for r in rows], np.int32)
        for label, ids, S in (("today", doc_cpu, g.S), ("padded", torch.from_numpy(pad), S2)):
            gen = torch.Generator(device="cuda").manual_seed(0)
            q, k, v = (torch.randn(g.B, h, S, c.D, device="cuda", dtype=torch.bfloat16, generator=gen).requires_grad_()
                       for h in (c.Hq, c.Hkv, c.Hkv))
            do = torch.randn(g.B, c.Hq, S, c.D, device="cuda", dtype=torch.bfloat16, generator=gen)
            m = sparsetrain.BlockMask.build("document_causal", S, device="cuda", document_ids=ids.to("cuda"))
            visits = int(m.kv_num_blocks.sum() + m.full_kv_num_blocks.sum()) * (1 if m.kv_num_blocks.shape[0] == g.B
                                                                             else g.B) * c.Hq
            outs = [stt.block_sparse_attention(q, k, v, m, deterministic=det) for det in (True, False)]
            med, _ = ba.interleaved_ms([lambda o=o: torch.autograd.grad(o, (q, k, v), do, retain_graph=True)
                                        for o in outs], 3, 20)
            print(f"{name:26s} {label:7s} S {S:6d} visits {visits:7d}  det {med[0]:.3f} ms "
                  f"({1e6 * med[0] / visits:.1f} ns a visit)  nondet {med[1]:.3f} ms ({1e6 * med[1] / visits:.1f})",
                  flush=True)


if __name__ == "__main__":
    main()
