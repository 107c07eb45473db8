"""Host time per call of the torch front: a CPU timer over `calls` calls of tiny cases,
where the GPU (or CPU) work is small, so what is left is what an eager step pays on the host.
Cases: GroupedLinear forward at G = 4 and G = 64 (per-expert weights, the O(G) Python path) against
a Python loop of F.linear plus cat over the same groups; GroupedMLP forward at G = 4; attention
forward (causal; CUDA: bf16 B1 H2 S256 D64, CPU: fp32 B1 H1 S128 D16), also with q, k and v
requiring grad (what grad mode records), and attention's operator alone through its C++ entry and
through torch.ops. Each grouped case also times its forward operator called alone through its C++
entry (`*_op_cpp_entry`: no module, no Python front; the floor, with on the CPU the reference
backend's compute in it). Medians of 5 repeats, after warm-up, forward under torch.no_grad() and with autograd recording (grad mode).

On CUDA also the eager forward of many-expert GroupedLinear shapes against torch._grouped_mm
(`eager_vs_grouped_mm`): per-expert weights (the module's default) and device splits, as a MoE
router hands them over, against torch._grouped_mm over the same x and a packed copy of the
weights with int32 offsets; wall time per call of an eager loop (host and GPU work overlapping as
in a training step), ours and the peer in alternating rounds (medians of 7), no_grad and grad
mode (weights requiring grad, x not).

    python bench/bench_host.py [--device cpu|cuda] [--calls 1000] [--json out.json]
"""

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F


def host_us(fn, calls, device):
    for _ in range(max(10, calls // 10)):
        fn()
    if device == "cuda":
        torch.cuda.synchronize()
    reps = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        if device == "cuda":
            torch.cuda.synchronize()
        reps.append((time.perf_counter() - t0) / calls * 1e6)
    return statistics.median(reps)


def paired_us(ours, peer, calls, reps=7):
    """host_us of two CUDA callables measured in alternating rounds (ours, peer, ours, ...), so a
    drift of the GPU's clock between them cancels: (ours, peer) medians."""
    for fn in (ours, peer):
        for _ in range(max(10, calls // 10)):
            fn()
    times = ([], [])
    for _ in range(reps):
        for fn, out in zip((ours, peer), times):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            torch.cuda.synchronize()
            out.append((time.perf_counter() - t0) / calls * 1e6)
    return statistics.median(times[0]), statistics.median(times[1])


def op_entry(name, m, op, inputs):
    """The module's forward operator called alone through the C++ torch library's entry, with the
    module's `inputs` (x, splits[, probs]) and its parameters as they are now."""
    import sparsetrain.torch.native as stn

    fwd = getattr(stn.TORCH_OPS, op)
    params, main_grads, flags = m._op_args()
    return [(f"{name}_op_cpp_entry", lambda: fwd(m._id, *inputs, params, main_grads, flags, None, None))]


def cases(device):
    import sparsetrain
    import sparsetrain.torch as stt

    dt = torch.bfloat16 if device == "cuda" else torch.float32
    out = []
    for G in (4, 64):
        K = N = 64
        m = stt.GroupedLinear(G, K, N, bias=True, params_dtype=dt, device=device)
        x = torch.randn(4 * G, K, device=device, dtype=dt)
        splits = [4] * G
        ws, bs = m.weights(), m.biases()
        out.append((f"grouped_linear_fwd_G{G}", lambda m=m, x=x, s=splits: m(x, s)))
        out += op_entry(f"grouped_linear_fwd_G{G}", m, "grouped_linear_forward", (x, torch.tensor(splits)))
        out.append((f"loop_of_F.linear_G{G}", lambda x=x, ws=ws, bs=bs, G=G:
                    torch.cat([F.linear(xi, w, b) for xi, w, b in zip(x.split(4), ws, bs)])))
    mlp = stt.GroupedMLP(4, 64, 32, bias=True, params_dtype=dt, device=device)
    xm, pm = torch.randn(16, 64, device=device, dtype=dt), torch.rand(16, device=device)
    out.append(("grouped_mlp_fwd_G4", lambda: mlp(xm, [4] * 4, pm)))
    out += op_entry("grouped_mlp_fwd_G4", mlp, "grouped_mlp_forward", (xm, torch.tensor([4] * 4), pm))
    # The CPU reference's work grows with S * S * D: keep it small there.
    S, H, D = (256, 2, 64) if device == "cuda" else (128, 1, 16)
    q, k, v = (torch.randn(1, H, S, D, device=device, dtype=dt) for _ in range(3))
    mask = sparsetrain.BlockMask.build("causal", S, device=device)
    out.append(("attention_fwd", lambda: stt.block_sparse_attention(q, k, v, mask)))
    # q, k and v requiring grad: in grad mode autograd records the call (its graph freed unused).
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
    out.append(("attention_fwd_inputs_require_grad", lambda: stt.block_sparse_attention(qg, kg, vg, mask)))
    # The operator alone (no Python front: checks, mask cache) through each of its two entries:
    # the C++ one that eager calls take, and torch.ops (what torch.compile and modes see).
    w = sparsetrain._block_mask.wire(mask.to_torch())
    a = (q, k, v, w[0], w[1], w[2], D ** -0.5, True, 0)
    out.append(("attention_op_cpp_entry", lambda: stt.native.TORCH_OPS.attention(*a)))
    out.append(("attention_op_torch_ops", lambda: torch.ops.sparsetrain.block_sparse_attention.default(*a)))
    return out


# (G, T, in, out): a 64-expert layer at two token counts, Qwen3-like 128 experts (fc1) at two.
EAGER_SHAPES = ((64, 8192, 2048, 1024), (64, 32768, 4096, 2048), (128, 16384, 2048, 1536), (128, 65536, 2048, 1536))


def eager_vs_grouped_mm(calls):
    """[(name, ours, peer)]: the many-expert eager cases (see the module's doc)."""
    import sparsetrain.torch as stt

    out = []
    gen = torch.Generator(device="cuda").manual_seed(0)
    for G, T, K, N in EAGER_SHAPES:
        m = stt.GroupedLinear(G, K, N, bias=False, params_dtype=torch.bfloat16, device="cuda")
        x = torch.randn(T, K, device="cuda", dtype=torch.bfloat16, generator=gen)
        loads = torch.rand(G, device="cuda", generator=gen) + 0.5
        splits = (loads / loads.sum() * T).floor().to(torch.int64)
        splits[0] += T - splits.sum()
        offs = torch.cumsum(splits, 0).to(torch.int32)
        packed = torch.stack([w.detach() for w in m.weights()]).requires_grad_()  # [G, out, in], as ours
        out.append((f"eager_G{G}_T{T}_{K}x{N}", lambda m=m, x=x, s=splits: m(x, s),
                    lambda x=x, w=packed, o=offs: torch._grouped_mm(x, w.transpose(-2, -1), offs=o)))
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--calls", type=int, default=1000)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    rows = []
    for name, fn in cases(a.device):
        with torch.no_grad():
            no_grad = host_us(fn, a.calls, a.device)
        grad = host_us(fn, a.calls, a.device)
        rows.append({"case": name, "no_grad_us": no_grad, "grad_mode_us": grad})
        print(f"{name:34s} no_grad {no_grad:8.1f} us   grad mode {grad:8.1f} us", flush=True)
    if a.device == "cuda":
        calls = max(20, a.calls // 10)
        for name, ours, peer in eager_vs_grouped_mm(calls):
            r = {"case": name, "calls": calls}
            for mode, grad in (("no_grad", False), ("grad_mode", True)):
                with torch.set_grad_enabled(grad):
                    r[f"{mode}_us"], r[f"grouped_mm_{mode}_us"] = paired_us(ours, peer, calls)
                r[f"{mode}_speedup_vs_grouped_mm"] = r[f"grouped_mm_{mode}_us"] / r[f"{mode}_us"]
            rows.append(r)
            print(f"{name:34s} no_grad {r['no_grad_us']:8.1f} us ({r['no_grad_speedup_vs_grouped_mm']:.2f}x "
                  f"torch._grouped_mm)   grad mode {r['grad_mode_us']:8.1f} us "
                  f"({r['grad_mode_speedup_vs_grouped_mm']:.2f}x)", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"device": a.device, "torch": torch.__version__, "calls": a.calls, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
