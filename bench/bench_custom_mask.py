"""Masks that are none of our built-in kinds: a FlexAttention mask_mod taken over with
BlockMask.from_torch, so every partial block's mask is a per-block bitmask (the path a user who
brings their own mask_mod takes). B=2, H=16, S=8192, D=128, bf16; masks: a prefix LM (causal, the
first S / 4 keys seen by every query) and attention sinks with a window (the first 64 keys, plus
keys at most 1024 back). Per mask, in this process: the forward (back to back and one call at a
time) and bench_attention.bench_backward (backward alone and forward + backward, ours
deterministic and not, FlexAttention on the same mask), the outputs compared with flex.

    python bench/bench_custom_mask.py [--reps 30] [--json out.json]
"""
import argparse
import itertools
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_attention as ba  # noqa: E402

B, H, S, D = 2, 16, 8192, 128
MASKS = {
    "prefix_lm": lambda b, h, q, kv: (q >= kv) | (kv < S // 4),
    "sinks_window_1024": lambda b, h, q, kv: (q >= kv) & ((q - kv <= 1024) | (kv < 64)),
}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--json")
    args = ap.parse_args()
    import sparsetrain
    import sparsetrain.torch as stt
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    # The backward alone runs over retained graphs (retain_graph=True), which flex's compiled
    # backwards with donated buffers refuse: donation off (it only saves memory), as bench_attention.
    torch._functorch.config.donated_buffer = False
    flex_compiled = torch.compile(flex_attention, dynamic=False)
    rows = []
    for name, mask_mod in MASKS.items():
        fmask = create_block_mask(mask_mod, None, None, S, S, device="cuda", _compile=True)
        mask = sparsetrain.BlockMask.from_torch(fmask)
        pairs = ba.dense_pairs(mask_mod, 1, S)[0]
        row = {"case": name, "mask": "bitmask (BlockMask.from_torch)", "B": B, "Hq": H, "Hkv": H, "S": S, "D": D,
               "dtype": "bf16", "density": pairs / (S * S), "fwd_flops": 4.0 * D * H * B * pairs, "reps": args.reps,
               "partial_blocks": int(mask.kv_num_blocks.sum()), "full_blocks": int(mask.full_kv_num_blocks.sum()),
               "ours_schedule": mask.schedule, "ours_walk": mask.walk}
        sets = ba.input_sets(B, H, H, S, D)
        row["input_copies"] = len(sets)
        for peer, fn in (("ours", lambda q, k, v: stt.block_sparse_attention(q, k, v, mask)),
                         ("flex", lambda q, k, v: flex_compiled(q, k, v, block_mask=fmask))):
            it = itertools.cycle(sets)
            ba.run_peer(row, peer, lambda fn=fn, it=it: fn(*next(it)), args.reps, row["fwd_flops"], b2b=True)
        q, k, v = sets[0]
        row["max_abs_diff_vs_flex"] = float((stt.block_sparse_attention(q, k, v, mask).float() -
                                            flex_compiled(q, k, v, block_mask=fmask).float()).abs().max())
        row["b2b_speedup_vs_flex"] = row["flex_b2b_ms"] / row["ours_b2b_ms"]
        ba.bench_backward(row, mask, fmask, sets, args.reps, flex_compiled, 1, "custom")
        print(json.dumps({k: v for k, v in row.items() if "speedup" in k or "det_over" in k or "diff" in k
                          or k in ("case", "partial_blocks", "full_blocks")}), flush=True)
        rows.append(row)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"info": {"device": torch.cuda.get_device_name(0), "torch": torch.__version__}, "rows": rows}, f,
                      indent=1)


if __name__ == "__main__":
    main()
