"""A small Qwen3-MoE-like model from Hugging Face transformers trained on packed real text, twice
from the same weights and batches: transformers' own implementations (attention --baseline-attn,
default sdpa; experts --baseline-experts, default grouped_mm) and sparsetrain's
(attn_implementation / experts_implementation "sparsetrain", sparsetrain.integrations.transformers).
Bytes of the Python standard library's sources, each file a document; a batch is rows of
--seq bytes cut at random and packed as DataCollatorWithFlattening packs them (position_ids that
restart at each file's first byte, no attention mask), so both sides attend within documents;
bf16 weights, AdamW. The baseline trains --baseline-runs times (its kernels are not deterministic:
its own runs can end further apart than 1 %). Prints each run's loss every 50 steps, the final
losses (mean of the last 20 steps), the check (sparsetrain's within 1 % of the range of the
baseline's) and the median step times and their ratio (baseline over sparsetrain: above 1,
sparsetrain faster).

    python bench/train_hf_moe.py [--steps 300] [--json out.json] [--device cuda]
"""

import copy

import numpy as np
import torch

from train_moe_lm import byte_loss, corpus_files, record_run, report, train, training_args

import sparsetrain.integrations.transformers  # noqa: F401  (registers "sparsetrain")
from transformers import AutoModelForCausalLM, Qwen3MoeConfig


def config(d, heads, kv_heads, layers, experts, ffn, top_k):
    return Qwen3MoeConfig(vocab_size=256, hidden_size=d, intermediate_size=2 * ffn, moe_intermediate_size=ffn,
                          num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                          head_dim=d // heads, num_experts=experts, num_experts_per_tok=top_k, norm_topk_prob=True,
                          max_position_embeddings=1 << 16, use_cache=False, tie_word_embeddings=False)


def batch_of(data, file_starts, rng, batch, seq, device):
    """(input_ids, position_ids, labels): rows of seq bytes at random offsets, each position counted
    from its document's first byte in the row (a file's, or the row's): DataCollatorWithFlattening's
    packed form."""
    offsets = rng.integers(0, len(data) - seq - 1, batch)
    ids = np.stack([data[o:o + seq + 1] for o in offsets]).astype(np.int64)
    index = offsets[:, None] + np.arange(seq)[None, :]
    first = file_starts[np.searchsorted(file_starts, index, side="right") - 1]
    pos = index - np.maximum(first, offsets[:, None])
    t = torch.from_numpy
    return t(ids[:, :-1]).to(device), t(pos).to(device), t(ids[:, 1:]).to(device)


def main():
    ap = training_args(__doc__, batch=8, seq=4096)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--baseline-attn", default="sdpa")
    ap.add_argument("--baseline-experts", default="grouped_mm")
    ap.add_argument("--baseline-runs", type=int, default=2,
                    help="train the baseline this many times: its own run-to-run spread (default %(default)s)")
    ap.add_argument("--model", default="1024,8,2,4,64,512,8",
                    help="d, heads, kv heads, layers, experts, ffn, top_k (default %(default)s: head dim 128, in a "
                         "MINIMAL build; a 512-wide, 4-layer model with 16 experts is host-bound, ~30 ms a step "
                         "either way)")
    args = ap.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        print("train_hf_moe: skipped, no CUDA GPU (--device cpu runs the CPU reference, slowly)")
        return
    cfg = config(*[int(v) for v in args.model.split(",")])
    data, file_starts = corpus_files()
    torch.manual_seed(0)
    state = None
    device_name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    result = {"device": device_name, "bytes": int(len(data)), **vars(args)}
    runs = [("baseline", args.baseline_attn, args.baseline_experts)] * args.baseline_runs
    for tag, attn, experts in runs + [("sparsetrain", "sparsetrain", "sparsetrain")]:
        print(f"{tag} (attention {attn}, experts {experts}):", flush=True)
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(copy.deepcopy(cfg), attn_implementation=attn,
                                                 experts_implementation=experts, dtype=torch.bfloat16)
        model.to(args.device).train()
        if state is None:
            state = {k: v.clone() for k, v in model.state_dict().items()}
        model.load_state_dict(state)
        losses, ms = train(model, lambda rng: batch_of(data, file_starts, rng, args.batch, args.seq, args.device),
                           lambda b: byte_loss(model(input_ids=b[0], position_ids=b[1]).logits, b[2]),
                           args.steps, args.lr, args.device)
        record_run(result, tag, losses, ms)
    report(result, "baseline", "sparsetrain", args.json)


if __name__ == "__main__":
    main()
