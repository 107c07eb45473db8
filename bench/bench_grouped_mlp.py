"""GroupedMLP benchmark (docs/DESIGN.md sections 5 and 9): forward and forward + backward of the three MoE
models' expert MLPs (bf16, no bias, fp32 main_grad for both weights), ours (sparsetrain.torch.GroupedMLP
with device splits) against the torch composition — torch._grouped_mm, silu(a) * b * probs,
torch._grouped_mm under autograd, then main_grad += weight.grad as Megatron does without fusion —
in this process on this GPU, CUDA events after warm-up, median over repetitions. Also the peak
memory each step allocates beyond its inputs (ours also without the main_grad fusion, bf16 weight
grads as the composition's), and the share of our step spent in the elementwise kernels (what
folding them into the GEMM epilogues could save at most).

    python bench/bench_grouped_mlp.py [--models mixtral,deepseek,qwen,gpt_oss] [--json out.json]
"""

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F

import sparsetrain.torch as stt

from bench_grouped_linear import routing

MODELS = {  # name: (G, T, hidden, ffn)
    "mixtral": (8, 16384, 4096, 14336),
    "deepseek": (8, 32768, 7168, 2048),
    "qwen": (128, 65536, 2048, 768),
    "gpt_oss": (32, 24000, 2880, 2880),
}


def time_ms(fn, reps=30, warmup=3):
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def peak_extra_mb(fn):
    """Peak bytes allocated while fn runs, beyond what was allocated before it (MB)."""
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def elementwise_share(fn):
    """Share of the GPU time of fn spent in our elementwise kernels (SwiGLU forward / backward)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    total = elem = 0.0
    for e in prof.key_averages():
        t = e.device_time_total
        total += t
        if "swiglu" in e.key:
            elem += t
    return elem / total if total else float("nan")


def bench_model(name, G, T, hidden, ffn):
    dev, dt = "cuda", torch.bfloat16
    torch.manual_seed(0)
    splits = routing(G, T)
    splits_dev = torch.tensor(splits, device=dev)
    offs = torch.cumsum(splits_dev, 0).to(torch.int32)
    S = sum(splits)
    x = torch.randn(T, hidden, device=dev, dtype=dt, requires_grad=True)
    probs = torch.rand(T, device=dev, requires_grad=True)
    dy = torch.randn(T, hidden, device=dev, dtype=dt)

    ours = stt.GroupedMLP(G, hidden, ffn, bias=False, params_dtype=dt, device=dev, single_grouped_weight=True,
                          fuse_wgrad_accumulation=True)
    for layer in (ours.fc1, ours.fc2):
        layer.weight.main_grad = torch.zeros(layer.weight.shape, device=dev, dtype=torch.float32)

    # The torch composition over the same weights (own leaves, own main_grads).
    w1 = ours.fc1.weight.detach().clone().requires_grad_()
    w2 = ours.fc2.weight.detach().clone().requires_grad_()
    mg1, mg2 = torch.zeros_like(w1, dtype=torch.float32), torch.zeros_like(w2, dtype=torch.float32)

    def torch_forward():
        z = torch._grouped_mm(x, w1.transpose(-2, -1), offs=offs)
        a, b = z.chunk(2, dim=-1)
        h = F.silu(a) * b * probs.to(dt).unsqueeze(-1)
        return torch._grouped_mm(h, w2.transpose(-2, -1), offs=offs)

    def torch_step():
        torch_forward().backward(dy)
        for w, mg in ((w1, mg1), (w2, mg2)):
            mg.add_(w.grad)
            w.grad = None
        x.grad = probs.grad = None

    def ours_step():
        ours(x, splits_dev, probs).backward(dy)
        x.grad = probs.grad = None

    # Ours without the fusion, like for like with the composition's memory: bf16 weight grads.
    unfused = stt.GroupedMLP(G, hidden, ffn, bias=False, params_dtype=dt, device=dev, single_grouped_weight=True)

    def ours_unfused_step():
        unfused(x, splits_dev, probs).backward(dy)
        x.grad = probs.grad = unfused.fc1.weight.grad = unfused.fc2.weight.grad = None

    with torch.no_grad():
        ref, got = torch_forward(), ours(x, splits_dev, probs)
        err = ((got[:S].float() - ref[:S].float()).norm() / ref[:S].float().norm()).item()

    flops_fwd = 2.0 * S * hidden * 2 * ffn + 2.0 * S * ffn * hidden
    row = {"model": name, "G": G, "T": T, "hidden": hidden, "ffn": ffn, "rel_err_vs_torch": err}
    with torch.no_grad():
        row["ours_fwd_ms"] = time_ms(lambda: ours(x, splits_dev, probs))
        row["torch_fwd_ms"] = time_ms(torch_forward)
    row["ours_step_ms"] = time_ms(ours_step)
    row["torch_step_ms"] = time_ms(torch_step)
    row["speedup_fwd"] = row["torch_fwd_ms"] / row["ours_fwd_ms"]
    row["speedup_step"] = row["torch_step_ms"] / row["ours_step_ms"]
    row["ours_step_tflops"] = 3 * flops_fwd / row["ours_step_ms"] * 1e-9
    row["ours_peak_extra_mb"] = peak_extra_mb(ours_step)
    row["ours_unfused_peak_extra_mb"] = peak_extra_mb(ours_unfused_step)
    row["torch_peak_extra_mb"] = peak_extra_mb(torch_step)
    row["ours_elementwise_share"] = elementwise_share(ours_step)
    print(json.dumps(row), flush=True)
    del ours, unfused, w1, w2, mg1, mg2
    torch.cuda.empty_cache()
    return row


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="mixtral,deepseek,qwen")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    info = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "cuda": torch.version.cuda,
            "date": time.strftime("%Y-%m-%d")}
    rows = [bench_model(m, *MODELS[m]) for m in args.models.split(",")]
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"info": info, "rows": rows}, f, indent=1)
    print(f"\n{info}")
    print(f"{'model':9} {'fwd ours/torch ms':>18} {'x':>6} {'fwd+bwd ours/torch ms':>22} {'x':>6} {'TFLOP/s':>8} "
          f"{'peak extra MB ours/unfused/torch':>33} {'elementwise':>11} {'rel err':>8}")
    for r in rows:
        print(f"{r['model']:9} {r['ours_fwd_ms']:8.3f}/{r['torch_fwd_ms']:<9.3f} {r['speedup_fwd']:6.3f} "
              f"{r['ours_step_ms']:10.3f}/{r['torch_step_ms']:<11.3f} {r['speedup_step']:6.3f} "
              f"{r['ours_step_tflops']:8.1f} {r['ours_peak_extra_mb']:12.0f}/{r['ours_unfused_peak_extra_mb']:.0f}/"
              f"{r['torch_peak_extra_mb']:<12.0f} "
              f"{100 * r['ours_elementwise_share']:10.1f}% {r['rel_err_vs_torch']:8.1e}")


if __name__ == "__main__":
    main()
