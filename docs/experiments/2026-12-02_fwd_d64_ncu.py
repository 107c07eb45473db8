"""Experiment: one attention forward at D = 64 (causal, B2 H16 S8192, bf16; the bench's
"causal, D 64" case) for ncu: three warm-up calls, then the profiled one.
    ncu --set full --import-source no -k regex:fwd_kernel -s 3 -c 1 -o OUT python3 THIS.py [D]"""
import sys

import torch

import sparsetrain as st
import sparsetrain.torch as stt

D = int(sys.argv[1]) if len(sys.argv) > 1 else 64
B, H, S = 2, 16, 8192
q, k, v = (torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
mask = st.BlockMask.build("causal", S, framework="torch", device="cuda")
for _ in range(4):
    o = stt.block_sparse_attention(q, k, v, mask)
torch.cuda.synchronize()
print("done", o.shape)
