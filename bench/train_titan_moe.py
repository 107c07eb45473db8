"""A small Qwen3-MoE model from torchtitan (its Qwen3Model, MoE on) trained on real text from the
same weights and batches: torchtitan's own implementations (--baseline-runs times: they are not
deterministic) (attention --attn, default sdpa:
causal, cuDNN / flash; experts torch._grouped_mm) and the same model converted by sparsetrain's
model converter (sparsetrain.integrations.torchtitan.convert). Bytes of the Python standard
library's sources, each file a document ending in an eos token (id 256); with --attn flex or
varlen the model's attn_mask_type is block_causal (attention within documents), with sdpa causal.
bf16 weights, AdamW; the check and the report are bench/train_hf_moe.py's (train_moe_lm.report).

    python bench/train_titan_moe.py [--steps 300] [--attn sdpa|flex|varlen] [--json out.json]
"""

import types

import numpy as np
import torch

from train_moe_lm import corpus_files, record_run, report, train, training_args

import sparsetrain.integrations.torchtitan as stt
from torchtitan.models.moe import MoEArgs
from torchtitan.models.qwen3.model.args import Qwen3ModelArgs
from torchtitan.models.qwen3.model.model import Qwen3Model

EOS = 256


def model_args(d, heads, kv_heads, layers, experts, ffn, top_k, attn, seq):
    moe = MoEArgs(num_experts=experts, num_shared_experts=0, score_func="softmax", route_norm=True, top_k=top_k,
                  load_balance_coeff=None)
    return Qwen3ModelArgs(dim=d, n_layers=layers, n_heads=heads, n_kv_heads=kv_heads, head_dim=d // heads,
                          hidden_dim=2 * ffn, vocab_size=EOS + 1, max_seq_len=seq, attn_type=attn,
                          attn_mask_type="causal" if attn == "sdpa" else "block_causal", eos_id=EOS,
                          moe_enabled=True, moe_inter_dim=ffn, moe_args=moe)


def main():
    ap = training_args(__doc__, batch=8, seq=4096)
    ap.add_argument("--attn", default="sdpa", choices=["sdpa", "flex", "varlen"])
    ap.add_argument("--baseline-runs", type=int, default=2,
                    help="train torchtitan's model this many times: its own run-to-run spread (default %(default)s)")
    ap.add_argument("--model", default="1024,8,2,4,64,512,8",
                    help="d, heads, kv heads, layers, experts, ffn, top_k (default %(default)s, as train_hf_moe.py)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("train_titan_moe: skipped, no CUDA GPU (torchtitan's MoE runs on CUDA)")
        return
    data, starts = corpus_files()
    tokens = data.astype(np.int64)
    tokens[starts[1:] - 1] = EOS  # the newline joining two files ends the first
    margs = model_args(*[int(v) for v in args.model.split(",")], args.attn, args.seq)
    tokenizer = types.SimpleNamespace(eos_id=EOS)

    def next_batch(rng):
        offsets = rng.integers(0, len(tokens) - args.seq - 1, args.batch)
        rows = torch.from_numpy(np.stack([tokens[o:o + args.seq + 1] for o in offsets])).cuda()
        return rows[:, :-1], rows[:, 1:]

    result = {"device": torch.cuda.get_device_name(), "bytes": int(len(data)), **vars(args)}
    state = None
    for tag in ["torchtitan"] * args.baseline_runs + ["sparsetrain"]:
        print(f"{tag} (attention {args.attn}):", flush=True)
        torch.manual_seed(0)
        model = Qwen3Model(margs)
        with torch.no_grad():
            model.init_weights(buffer_device=torch.device("cpu"))
        if state is None:
            state = {k: v.clone() for k, v in model.state_dict().items()}
        model.load_state_dict(state)
        if tag == "sparsetrain":
            stt.convert(model)
        model.to("cuda", torch.bfloat16).train()

        def loss_of(b, model=model):
            masks = None if args.attn == "sdpa" else model.get_attention_masks(b[0], tokenizer)
            logits = model(b[0], attention_masks=masks)
            return torch.nn.functional.cross_entropy(logits.float().reshape(-1, EOS + 1), b[1].reshape(-1))

        losses, ms = train(model, next_batch, loss_of, args.steps, args.lr, "cuda")
        record_run(result, tag, losses, ms)
    report(result, "torchtitan", "sparsetrain", args.json)


if __name__ == "__main__":
    main()
