"""FP8 (blockwise e4m3, docs/DESIGN.md section 12) against bf16 and torch's rowwise FP8 grouped
GEMM, in this process on this GPU; CUDA events after warm-up, medians, both timings (one call at a
time, back to back).

GEMMs (Dirichlet(2) routings, seed 0, bench_grouped_linear's): torch._scaled_grouped_mm (rowwise
e4m3, fast accumulation, its inputs quantized beforehand: the GEMM alone) against our GroupedLinear
fprop with fp8=True, whole (x's quantization included, the weights' cached: their version does not
change between calls) and its GEMM kernels alone (the kernels' own times from torch.profiler, the
quantization kernels left out); then ours in FP8 against ours in bf16, forward and forward +
backward (dgrad and wgrad, every quantization included), and the time of the weights'
quantization that each optimizer step adds (fp8_weight_quantize_kernel_ms).

MoE layers (bench_moe's SonicMoE and Qwen3 shapes): MoELayer(fp8=True), and with
fp8_saved_activations (fc1's output held in e4m3), against the same layer in bf16, forward +
backward, and what each holds between forward and backward (held_mib). --top N adds each timed step's N costliest kernels (GPU ms a step, from
torch.profiler): where the time goes, before tuning.

    python bench/bench_fp8.py [--only gemm,moe] [--reps 20] [--top N] [--json out.json]
"""

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_attention as ba  # noqa: E402
from bench_grouped_linear import routing  # noqa: E402
from bench_moe import CASES as MOE_CASES  # noqa: E402

GEMMS = {  # name: (G, T, in, out): the shapes torch._scaled_grouped_mm was measured at (issue text)
    "g8_t32768_7168x4096": (8, 32768, 7168, 4096),
    "g64_t131072_4096x4096": (64, 131072, 4096, 4096),
    "g24_t20000_7168x2048": (24, 20000, 7168, 2048),
    "g128_t65536_2048x768": (128, 65536, 2048, 768),
}
MOES = ("sonic", "qwen3")


def timings(fn, reps):
    """(one call at a time, back to back) in ms."""
    return ba.time_ms(fn, reps)[0], ba.queued_ms(fn, reps)


TOP = 0  # --top: kernels listed per profiled step


def kernels_ms(fn, reps=10):
    """{kernel name: GPU ms per call} of fn's kernels, from torch.profiler."""
    fn()
    torch.cuda.synchronize()
    acts = [torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    out = {}
    for e in prof.key_averages():
        us = getattr(e, "device_time_total", None)
        if us is None:
            us = e.cuda_time_total
        if us:
            out[e.key] = out.get(e.key, 0.0) + us / reps / 1e3
    return out


def top_kernels(ms):
    """The TOP costliest of kernels_ms' {name: ms}, as [name (200 characters at most), ms]."""
    return [[k[:200], round(v, 4)] for k, v in sorted(ms.items(), key=lambda kv: -kv[1])[:TOP]]


def kernel_ms(fn, reps=10, top_key=None, row=None):
    """The GPU time per call of fn's kernels by class: {"gemm", "quantize", "other"} in ms (a
    kernel's class from its name: ours are quantize_*; CUTLASS's and torch's GEMMs are
    device_kernel / gemm / sm90 ones). With --top, row[top_key] lists the costliest."""
    ms = kernels_ms(fn, reps)
    out = {"gemm": 0.0, "quantize": 0.0, "other": 0.0}
    for key, v in ms.items():
        name = key.lower()
        cls = ("quantize" if "quantize" in name else
               "gemm" if any(s in name for s in ("device_kernel", "gemm", "sm90_", "cutlass")) else "other")
        out[cls] += v
    if TOP and row is not None:
        row[top_key] = top_kernels(ms)
    return out


def bench_gemm(name, shape, reps):
    import sparsetrain.torch as stt

    G, T, K, N = shape
    splits = routing(G, T)
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(T, K, device="cuda", dtype=torch.bfloat16, generator=gen)
    dy = torch.randn(T, N, device="cuda", dtype=torch.bfloat16, generator=gen)
    dev_splits = torch.tensor(splits, device="cuda")
    row = {"case": name, "G": G, "T": T, "in": K, "out": N}
    flops = 2.0 * T * K * N

    # torch's rowwise FP8 grouped GEMM, its operands quantized beforehand (unit scales: the scales'
    # values do not change its time).
    xq = x.to(torch.float8_e4m3fn)
    wq = (torch.randn(G, N, K, device="cuda", generator=gen) * 0.02).to(torch.float8_e4m3fn)
    sa = torch.ones(T, device="cuda")
    sb = torch.ones(G, N, device="cuda")
    offs = torch.cumsum(torch.tensor(splits, device="cuda"), 0).to(torch.int32)

    def peer():
        return torch._scaled_grouped_mm(xq, wq.transpose(-2, -1), sa, sb, offs=offs, out_dtype=torch.bfloat16,
                                        use_fast_accum=True)

    try:
        row["torch_rowwise_ms"], row["torch_rowwise_b2b_ms"] = timings(peer, reps)
        row["torch_rowwise_tflops"] = flops / row["torch_rowwise_b2b_ms"] * 1e-9
    except (RuntimeError, AttributeError) as e:  # an older torch: no rowwise grouped GEMM
        print(f"{name}: torch._scaled_grouped_mm skipped: {e}".splitlines()[0])

    layers = {fp8: stt.GroupedLinear(G, K, N, bias=False, params_dtype=torch.bfloat16, device="cuda", fp8=fp8)
              for fp8 in (True, False)}
    layers[False].load_state_dict(layers[True].state_dict())
    xg = x.clone().requires_grad_()
    for fp8, layer in layers.items():
        tag = "fp8" if fp8 else "bf16"

        def fwd(layer=layer):
            with torch.no_grad():
                return layer(x, dev_splits)

        def fwd_bwd(layer=layer):
            for p in (xg, *layer.parameters()):
                p.grad = None
            layer(xg, dev_splits).backward(dy)

        row[f"{tag}_fwd_ms"], row[f"{tag}_fwd_b2b_ms"] = timings(fwd, reps)
        row[f"{tag}_fwdbwd_ms"], row[f"{tag}_fwdbwd_b2b_ms"] = timings(fwd_bwd, reps)
        row[f"{tag}_fwd_tflops"] = flops / row[f"{tag}_fwd_b2b_ms"] * 1e-9
        row[f"{tag}_fwdbwd_tflops"] = 3 * flops / row[f"{tag}_fwdbwd_b2b_ms"] * 1e-9
        if fp8:
            k = kernel_ms(fwd, top_key="fp8_fwd_top_kernels", row=row)
            row["fp8_fwd_gemm_kernel_ms"], row["fp8_fwd_quantize_kernel_ms"] = k["gemm"], k["quantize"]
            row["fp8_fwd_other_kernel_ms"] = k["other"]

            def fwd_new_weights(layer=layer):
                with torch.no_grad():  # a new version (as an optimizer step makes): quantized anew
                    for w in layer.weights():
                        w.add_(0)
                fwd()

            # What an optimizer step adds: the weights' quantization (both copies), once a step.
            row["fp8_weight_quantize_kernel_ms"] = kernel_ms(fwd_new_weights)["quantize"] - k["quantize"]
            row["fp8_fwd_gemm_tflops"] = flops / k["gemm"] * 1e-9 if k["gemm"] else None
            kb = kernel_ms(fwd_bwd, top_key="fp8_fwdbwd_top_kernels", row=row)
            row["fp8_fwdbwd_quantize_kernel_ms"] = kb["quantize"]
            row["fp8_fwdbwd_gemm_kernel_ms"], row["fp8_fwdbwd_other_kernel_ms"] = kb["gemm"], kb["other"]
    with torch.no_grad():
        ref = layers[False](x, dev_splits).float()
        got = layers[True](x, dev_splits).float()
        row["fp8_rel_err_vs_bf16"] = float((got - ref).norm() / ref.norm())
    if "torch_rowwise_b2b_ms" in row and row.get("fp8_fwd_gemm_kernel_ms"):
        row["gemm_vs_torch_rowwise"] = row["torch_rowwise_b2b_ms"] / row["fp8_fwd_gemm_kernel_ms"]
        row["fwd_vs_torch_rowwise"] = row["torch_rowwise_b2b_ms"] / row["fp8_fwd_b2b_ms"]
    row["fp8_vs_bf16_fwd"] = row["bf16_fwd_b2b_ms"] / row["fp8_fwd_b2b_ms"]
    row["fp8_vs_bf16_fwdbwd"] = row["bf16_fwdbwd_b2b_ms"] / row["fp8_fwdbwd_b2b_ms"]
    return row


def bench_moe(name, reps):
    import sparsetrain.torch as stt

    T, H, F, E, K = MOE_CASES[name]
    gen = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(T, H, generator=gen).to(device="cuda", dtype=torch.bfloat16).requires_grad_()
    logits = torch.randn(T, E, generator=gen).cuda().requires_grad_()
    dy = torch.randn(T, H, generator=gen).to(device="cuda", dtype=torch.bfloat16)
    # fp8_saved: the FP8 layer holding fc1's output as e4m3 codes for backward (fp8_saved_activations).
    options = {"fp8": dict(fp8=True), "bf16": dict(fp8=False), "fp8_saved": dict(fp8=True, fp8_saved_activations=True)}
    layers = {tag: stt.MoELayer(E, H, F, K, normalize=True, params_dtype=torch.bfloat16, device="cuda", **kw)
              for tag, kw in options.items()}
    for tag in ("bf16", "fp8_saved"):
        layers[tag].load_state_dict(layers["fp8"].state_dict())
    row = {"case": name, "tokens": T, "hidden": H, "ffn": F, "experts": E, "top_k": K}
    flops_fwd = 6.0 * T * K * H * F
    for tag, layer in layers.items():

        def fwd_bwd(layer=layer):
            for p in (x, logits, *layer.parameters()):
                p.grad = None
            torch.autograd.backward(layer(x, logits).out, dy)

        row[f"{tag}_fwdbwd_ms"], row[f"{tag}_fwdbwd_b2b_ms"] = timings(fwd_bwd, reps)
        row[f"{tag}_tflops"] = 3 * flops_fwd / row[f"{tag}_fwdbwd_b2b_ms"] * 1e-9
        if TOP:
            ms = kernels_ms(fwd_bwd, reps=5)
            row[f"{tag}_fwdbwd_kernels_ms"] = sum(ms.values())
            row[f"{tag}_fwdbwd_top_kernels"] = top_kernels(ms)
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        y = layer(x, logits).out
        torch.cuda.synchronize()
        row[f"{tag}_held_mib"] = (torch.cuda.memory_allocated() - before) / 2**20
        del y
    with torch.no_grad():
        ref = layers["bf16"](x, logits).out.float()
        got = layers["fp8"](x, logits).out.float()
        row["fp8_rel_err_vs_bf16"] = float((got - ref).norm() / ref.norm())
    row["fp8_vs_bf16_fwdbwd"] = row["bf16_fwdbwd_b2b_ms"] / row["fp8_fwdbwd_b2b_ms"]
    row["fp8_saved_vs_bf16_fwdbwd"] = row["bf16_fwdbwd_b2b_ms"] / row["fp8_saved_fwdbwd_b2b_ms"]
    row["fp8_saved_held_vs_fp8"] = row["fp8_saved_held_mib"] / row["fp8_held_mib"]
    return row


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", default="gemm,moe")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--json", default=None)
    ap.add_argument("--top", type=int, default=0, help="list each profiled step's N costliest kernels")
    args = ap.parse_args()
    global TOP
    TOP = args.top
    if not torch.cuda.is_available():
        print("bench_fp8: skipped, no CUDA GPU (the FP8 kernels are Hopper's)")
        return
    parts = args.only.split(",")
    rows = []
    if "gemm" in parts:
        for name, shape in GEMMS.items():
            rows.append(bench_gemm(name, shape, args.reps))
            print(json.dumps(rows[-1]), flush=True)
            torch.cuda.empty_cache()
    if "moe" in parts:
        for name in MOES:
            rows.append(bench_moe(name, args.reps))
            print(json.dumps(rows[-1]), flush=True)
            torch.cuda.empty_cache()
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}
    print(f"{'case':24s} {'gemm/torch':>10s} {'fwd/torch':>9s} {'fwd x bf16':>10s} {'f+b x bf16':>10s} {'rel err':>8s}")
    for r in rows:
        def f(key):
            v = r.get(key)
            return f"{v:.3f}" if isinstance(v, float) else "-"
        print(f"{r['case']:24s} {f('gemm_vs_torch_rowwise'):>10s} {f('fwd_vs_torch_rowwise'):>9s} "
              f"{f('fp8_vs_bf16_fwd'):>10s} {f('fp8_vs_bf16_fwdbwd'):>10s} {f('fp8_rel_err_vs_bf16'):>8s}")
    for r in rows:
        for key in (k for k in r if k.endswith("_top_kernels")):
            print(f"{r['case']} {key}:")
            for name, ms in r[key]:
                print(f"  {ms:8.3f} ms  {name[:150]}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(result, fh, indent=1)


if __name__ == "__main__":
    main()
