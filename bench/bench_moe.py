"""The whole MoE layer: sparsetrain.torch.MoELayer against the torch composition over the
same experts (torch.softmax + torch.topk + argsort + index_select + our GroupedMLP + index_add),
forward and forward + backward, bf16, in this process on this GPU: CUDA events after warm-up,
medians, back to back (the GPU work) and one call at a time (host work included); each one's peak
memory beyond its inputs and the memory its autograd graph holds between forward and backward
(what adds up over a model's layers); TFLOP/s of the expert GEMMs (forward 6 * rows * hidden * ffn, backward
twice that; rows = tokens * top_k). Shapes: SonicMoE's headline (T 32768, hidden 4096, ffn 2048,
64 experts, top-4), Mixtral-like (8 experts top-2, hidden 4096, ffn 14336), DeepSeek-V3-like (32
experts top-8 at hidden 7168, ffn 2048: the routing of 256 experts top-8 as one GPU of an
expert-parallel group of 8 sees it, without the communication) and Qwen3-like (128 experts top-8,
hidden 4096, ffn 1536). Router logits random normal (scale 1), seed 0. Both sides' outputs are
compared (max abs difference recorded). On CUDA: CUDA events (bench_attention's time_ms and
queued_ms); on the CPU wall times.

--quick: small shapes; --device cpu with --quick runs the whole script on the CPU (a smoke test of
the script, no timings worth reading). --keep-expert-input: our layer with recompute_expert_input=False
(x's gathered rows held for backward, as the composition does, instead of gathered again: the default).
Each timed fwd + bwd is one step after zero_grad(set_to_none=True): the gradients are set to None before
its backward (--accumulate-grads: added into the last step's, both sides then also timing that add).

    python bench/bench_moe.py [--only sonic,mixtral] [--quick] [--device cuda|cpu] [--reps 20] [--json out.json]
                              [--keep-expert-input] [--accumulate-grads]
"""

import argparse
import json
import statistics
import sys
import time

import torch

CASES = {  # name: (tokens, hidden, ffn, experts, top_k)
    "sonic": (32768, 4096, 2048, 64, 4),
    "mixtral": (16384, 4096, 14336, 8, 2),
    "deepseek_v3_local": (16384, 7168, 2048, 32, 8),
    "qwen3": (16384, 4096, 1536, 128, 8),
}
QUICK = {"sonic": (512, 256, 128, 16, 4), "mixtral": (256, 256, 512, 8, 2),
         "deepseek_v3_local": (256, 256, 128, 32, 8), "qwen3": (256, 256, 96, 128, 8)}


def torch_composition(layer, x, logits, top_k, normalize):
    """The peer: routing, permutation and combine in torch around the same GroupedMLP."""
    E = logits.shape[1]
    probs, experts = torch.topk(torch.softmax(logits, dim=-1), top_k, dim=-1)
    if normalize:
        probs = probs / probs.sum(-1, keepdim=True)
    flat = experts.reshape(-1)
    order = torch.argsort(flat, stable=True)
    token = order // top_k
    counts = torch.bincount(flat, minlength=E)
    y = layer.experts(x.index_select(0, token), counts, probs.reshape(-1)[order])
    return torch.zeros_like(x).index_add_(0, token, y)


def sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


def timed(fn, reps, device):
    """(one call at a time, back to back) in ms: medians of CUDA-event timings on CUDA, of wall
    times on the CPU."""
    if device == "cuda":
        import bench_attention as ba

        return ba.time_ms(fn, reps)[0], ba.queued_ms(fn, reps)
    for _ in range(2):
        fn()
    sync(device)
    one, b2b = [], []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        sync(device)
        one.append((time.perf_counter() - t0) * 1e3)
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    sync(device)
    b2b.append((time.perf_counter() - t0) * 1e3 / reps)
    return statistics.median(one), b2b[0]


def peak_mib(fn, device):
    """Peak memory beyond the inputs (bench_grouped_mlp's measure); None on the CPU."""
    if device != "cuda":
        return None
    from bench_grouped_mlp import peak_extra_mb

    return peak_extra_mb(fn)


def held_mib(fn, dy, device):
    """MiB allocated after fn's forward and freed by its backward: what the autograd graph holds
    between the passes (its output included), the memory that adds up over a model's layers."""
    if device != "cuda":
        return None
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    y = fn()
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated() - before
    torch.autograd.backward(y, dy)
    return held / 2**20


def bench_case(name, shape, reps, device, recompute=True, accumulate=False):
    import sparsetrain.torch as stt

    T, H, F, E, K = shape
    gen = torch.Generator(device="cpu").manual_seed(0)
    layer = stt.MoELayer(E, H, F, K, normalize=True, params_dtype=torch.bfloat16, device=device,
                         recompute_expert_input=recompute)
    x = torch.randn(T, H, generator=gen).to(device=device, dtype=torch.bfloat16).requires_grad_()
    logits = torch.randn(T, E, generator=gen).to(device).requires_grad_()
    dy = torch.randn(T, H, generator=gen).to(device=device, dtype=torch.bfloat16)

    def ours():
        return layer(x, logits).out

    def peer():
        return torch_composition(layer, x, logits, K, True)

    rows = T * K
    flops_fwd = 6.0 * rows * H * F
    row = {"case": name, "tokens": T, "hidden": H, "ffn": F, "experts": E, "top_k": K, "device": device,
           "recompute_expert_input": recompute, "accumulate_grads": accumulate}
    with torch.no_grad():
        row["max_abs_diff_vs_torch"] = float((ours().float() - peer().float()).abs().max())
    leaves = [x, logits, *layer.parameters()]

    def no_grads():
        for t in leaves:
            t.grad = None

    for label, fn in (("ours", ours), ("torch", peer)):
        def fwd_bwd(f=fn):
            y = f()
            if not accumulate:
                no_grads()  # a step after zero_grad(set_to_none=True): no add of each weight's gradient
            torch.autograd.backward(y, dy)

        one, b2b = timed(fn, reps, device)
        one_fb, b2b_fb = timed(fwd_bwd, reps, device)
        row.update({f"{label}_fwd_ms": one, f"{label}_fwd_b2b_ms": b2b, f"{label}_fwdbwd_ms": one_fb,
                    f"{label}_fwdbwd_b2b_ms": b2b_fb, f"{label}_fwd_tflops": flops_fwd / b2b * 1e-9,
                    f"{label}_bwd_tflops": 2 * flops_fwd / max(b2b_fb - b2b, 1e-9) * 1e-9,
                    f"{label}_fwdbwd_peak_mib": peak_mib(fwd_bwd, device),
                    f"{label}_held_mib": held_mib(fn, dy, device)})
        no_grads()
    row["fwdbwd_speedup_b2b"] = row["torch_fwdbwd_b2b_ms"] / row["ours_fwdbwd_b2b_ms"]
    return row


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", default=",".join(CASES))
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--json", default=None)
    ap.add_argument("--keep-expert-input", action="store_true",
                    help="our layer keeps x's gathered rows for backward (recompute_expert_input=False) instead of "
                         "gathering them again (the default)")
    ap.add_argument("--accumulate-grads", action="store_true",
                    help="backward adds into the gradients of the steps before (a loop without zero_grad: both "
                         "sides then also time an add over every weight's gradient, 2.6-3.9 ms at sonic / qwen3 "
                         "on an H200) instead of a step after zero_grad(set_to_none=True) (the default)")
    a = ap.parse_args()
    shapes = QUICK if a.quick else CASES
    rows = []
    print(f"{'case':20s} {'ours fwd+bwd ms':>16s} {'torch fwd+bwd ms':>17s} {'speedup':>8s} "
          f"{'ours fwd/bwd TFLOP/s':>21s} {'peak MiB ours/torch':>20s} {'held MiB ours/torch':>20s}")
    for name in a.only.split(","):
        r = bench_case(name, shapes[name], a.reps, a.device, not a.keep_expert_input, a.accumulate_grads)
        rows.append(r)
        peak = (f"{r['ours_fwdbwd_peak_mib']:.0f}/{r['torch_fwdbwd_peak_mib']:.0f}"
                if r["ours_fwdbwd_peak_mib"] is not None else "-")
        held = f"{r['ours_held_mib']:.0f}/{r['torch_held_mib']:.0f}" if r["ours_held_mib"] is not None else "-"
        print(f"{name:20s} {r['ours_fwdbwd_b2b_ms']:16.3f} {r['torch_fwdbwd_b2b_ms']:17.3f} "
              f"{r['fwdbwd_speedup_b2b']:7.2f}x {r['ours_fwd_tflops']:10.1f}/{r['ours_bwd_tflops']:<10.1f} "
              f"{peak:>20s} {held:>20s}", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"python": sys.version.split()[0], "torch": torch.__version__, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
