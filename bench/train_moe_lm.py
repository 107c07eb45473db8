"""A small MoE language model trained on real text, twice from the same weights and batches: the
experts in bf16 and in FP8 (blockwise e4m3, docs/DESIGN.md section 12). Bytes of the Python
standard library's sources; each block pre-norm causal attention (sparsetrain's
block_sparse_attention, causal BlockMask) and an MoE layer (sparsetrain.torch.MoELayer, softmax
top-k router); bf16 weights, AdamW. Prints each run's loss every 50 steps, the final losses (mean of
the last 20 steps), their relative difference (the FP8 recipe's check: within 1 %) and the median
step time of each.

    python bench/train_moe_lm.py [--steps 300] [--json out.json]
"""

import argparse
import glob
import json
import os
import statistics
import sysconfig
import time

import numpy as np
import torch
from torch import nn

import sparsetrain.torch as stt


def corpus_files(max_bytes=32 << 20):
    """The standard library's .py files as one byte array, joined by a newline (sorted paths: the
    same text everywhere), and the offset of each file's first byte."""
    root = sysconfig.get_paths()["stdlib"]
    parts, size = [], 0
    for path in sorted(glob.glob(os.path.join(root, "**", "*.py"), recursive=True)):
        with open(path, "rb") as fh:
            parts.append(fh.read())
        size += len(parts[-1])
        if size >= max_bytes:
            break
    starts = np.cumsum([0] + [len(p) + 1 for p in parts[:-1]])
    return np.frombuffer(b"\n".join(parts), dtype=np.uint8), starts


def corpus(max_bytes=32 << 20):
    return corpus_files(max_bytes)[0]


class Block(nn.Module):
    def __init__(self, d, heads, experts, ffn, top_k, fp8, device):
        super().__init__()
        self.heads = heads
        kw = dict(device=device, dtype=torch.bfloat16)
        self.norm1, self.norm2 = nn.RMSNorm(d, **kw), nn.RMSNorm(d, **kw)
        self.qkv, self.proj = nn.Linear(d, 3 * d, bias=False, **kw), nn.Linear(d, d, bias=False, **kw)
        self.router = nn.Linear(d, experts, bias=False, device=device)  # fp32: the MoE layer's logits
        self.moe = stt.MoELayer(experts, d, ffn, top_k, normalize=True, params_dtype=torch.bfloat16, device=device,
                                fp8=fp8)

    def forward(self, x, mask):
        B, S, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(B, S, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        a = stt.block_sparse_attention(q, k, v, mask)
        x = x + self.proj(a.transpose(1, 2).reshape(B, S, d))
        h = self.norm2(x).reshape(B * S, d)
        return x + self.moe(h, self.router(h.float())).out.view(B, S, d)


class MoELM(nn.Module):
    def __init__(self, d, heads, layers, experts, ffn, top_k, fp8, device):
        super().__init__()
        kw = dict(device=device, dtype=torch.bfloat16)
        self.embed = nn.Embedding(256, d, **kw)
        self.blocks = nn.ModuleList(Block(d, heads, experts, ffn, top_k, fp8, device) for _ in range(layers))
        self.norm, self.head = nn.RMSNorm(d, **kw), nn.Linear(d, 256, bias=False, **kw)

    def forward(self, tokens, mask):
        x = self.embed(tokens)
        for b in self.blocks:
            x = b(x, mask)
        return self.head(self.norm(x))


def sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


def train(model, next_batch, loss_of, steps, lr, device, seed=0):
    """Losses of each step and the median step time (ms): next_batch(rng) draws a batch (the same
    ones each run, from `seed`; not timed), loss_of(batch) is the model's loss on it; AdamW with a
    30-step warm-up."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 30))
    rng = np.random.default_rng(seed)
    losses, times = [], []
    for step in range(steps):
        batch = next_batch(rng)
        sync(device)
        t0 = time.perf_counter()
        loss = loss_of(batch)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        losses.append(loss.item())  # syncs
        times.append((time.perf_counter() - t0) * 1e3)
        if step % 50 == 0 or step == steps - 1:
            print(f"  step {step:4d} loss {losses[-1]:.4f}", flush=True)
    return losses, statistics.median(times[min(5, steps - 1):])


def record_run(result, tag, losses, ms):
    """One training run of `tag` into result["runs"][tag]: its final loss (the mean of the last 20
    steps), median step time (ms) and losses."""
    result.setdefault("runs", {}).setdefault(tag, []).append(
        {"final_loss": statistics.mean(losses[-20:]), "step_ms": ms, "losses": losses})


def report(result, base, ours, json_path=None):
    """The loss check and the step time ratio of `ours` (one run: deterministic) against `base` (one
    run or more: a stack's own implementations are not deterministic, and two of its runs can end
    further apart than the 1 % the check allows). Passes when ours lies within 1 % of the range of
    the baseline's final losses; prints and stores the numbers, and writes `result` to json_path."""
    runs = result["runs"]
    finals = [r["final_loss"] for r in runs[base]]
    mine = runs[ours][0]["final_loss"]
    lo, hi = min(finals), max(finals)
    result["baseline_spread"] = (hi - lo) / statistics.mean(finals)
    result["final_loss_rel_diff"] = abs(mine - statistics.mean(finals)) / statistics.mean(finals)
    result["loss_check"] = lo * 0.99 <= mine <= hi * 1.01
    base_ms = statistics.median(r["step_ms"] for r in runs[base])
    ours_ms = runs[ours][0]["step_ms"]
    result["step_time_ratio"] = base_ms / ours_ms
    print(f"final loss (mean of the last 20 steps): {base} {', '.join(f'{f:.4f}' for f in finals)} (its runs "
          f"{100 * result['baseline_spread']:.2f} % apart), {ours} {mine:.4f} "
          f"({'within' if result['loss_check'] else 'OUTSIDE'} 1 % of the {base}'s range); step {base_ms:.1f} ms "
          f"{base}, {ours_ms:.1f} ms {ours} ({result['step_time_ratio']:.2f}x)")
    if json_path:
        with open(json_path, "w") as fh:
            json.dump(result, fh, indent=1)


def training_args(doc, batch, seq):
    """The training benches' command line: steps, batch rows of seq tokens, the learning rate, the
    JSON path (each bench adds its own)."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--batch", type=int, default=batch)
    ap.add_argument("--seq", type=int, default=seq)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--json", default=None)
    return ap


def byte_loss(logits, targets):
    return nn.functional.cross_entropy(logits.float().reshape(-1, 256), targets.reshape(-1))


def main():
    ap = training_args(__doc__, batch=16, seq=1024)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--model", default="512,8,4,16,1024,2",
                    help="d, heads, layers, experts, ffn, top_k (default %(default)s)")
    args = ap.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        print("train_moe_lm: skipped, no CUDA GPU (the FP8 recipe's kernels are Hopper's; --device cpu runs the "
              "CPU reference, slowly)")
        return
    dims = [int(v) for v in args.model.split(",")]
    data = corpus()
    torch.manual_seed(0)
    state = {k: v.clone() for k, v in MoELM(*dims, False, args.device).state_dict().items()}
    device_name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    result = {"device": device_name, "bytes": int(len(data)), **vars(args)}
    for tag, fp8 in (("bf16", False), ("fp8", True)):
        print(f"{tag}:", flush=True)
        model = MoELM(*dims, fp8, args.device)
        model.load_state_dict(state)
        mask = stt.BlockMask.build("causal", args.seq, device=args.device)

        def next_batch(rng):
            starts = rng.integers(0, len(data) - args.seq - 1, args.batch)
            return torch.from_numpy(np.stack([data[s:s + args.seq + 1] for s in starts]).astype(np.int64)).to(
                args.device)

        losses, ms = train(model, next_batch, lambda chunk: byte_loss(model(chunk[:, :-1], mask), chunk[:, 1:]),
                           args.steps, args.lr, args.device)
        result[f"{tag}_final_loss"] = statistics.mean(losses[-20:])
        result[f"{tag}_step_ms"] = ms
        result[f"{tag}_losses"] = losses
    rel = abs(result["fp8_final_loss"] - result["bf16_final_loss"]) / result["bf16_final_loss"]
    result["final_loss_rel_diff"] = rel
    print(f"final loss (mean of the last 20 steps): bf16 {result['bf16_final_loss']:.4f}, "
          f"fp8 {result['fp8_final_loss']:.4f}, relative difference {100 * rel:.2f} % "
          f"({'within' if rel <= 0.01 else 'OUTSIDE'} 1 %); step {result['bf16_step_ms']:.1f} ms bf16, "
          f"{result['fp8_step_ms']:.1f} ms fp8")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(result, fh, indent=1)


if __name__ == "__main__":
    main()
