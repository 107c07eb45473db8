"""Block-sparse attention benchmark (DESIGN.md section 9): B=2, H=16, S=8192, D=128, bf16 with
masks causal, sliding window 2048 (causal) and document-causal (documents of random lengths
256..3072, seed 0, per batch row), plus D=64 (causal) and GQA Hq=32, Hkv=4 (causal). Forward of
ours (sparsetrain.torch.block_sparse_attention) against FlexAttention
(torch.compile(flex_attention, dynamic=False) on the same mask from create_block_mask(...,
_compile=True)) and, for the dense-causal cases, cuDNN SDPA (sdpa_kernel(CUDNN_ATTENTION),
is_causal=True); and the block-mask build: ours on the device (BlockMask.build(device="cuda"):
lists, transposes and dQ write orders) against create_block_mask(mask_mod, B=None, H=None, S, S,
device="cuda", _compile=True) (document-causal: B=2, per-batch ids for both), target >= 10x.
With --backward, per attention case also the backward alone (autograd.grad over a retained
forward graph) and forward + backward of ours deterministic and non-deterministic, FlexAttention
and cuDNN (causal cases): peer / ours ratios of both, and det / nondet (target <= 1.10).

All in this process on this GPU: CUDA events after warm-up, the median of >= 100 runs (each run
starts on an idle GPU, so host work inside the call counts), inputs rotated over enough copies to
exceed twice the L2 cache. FLOPs count allowed (q, kv) pairs exactly (forward 4 * D * pairs,
backward 10 * D * pairs, both 14 * D * pairs), the pairs counted in closed form per batch row and
checked against the mask evaluated densely. A peer that fails (cuDNN unavailable, a compile error)
is recorded in its row ("<peer>_error") and the run goes on. Speed-ups are peer time / our time
(> 1: we are faster).

    python bench/bench_attention.py [--only causal,build_causal|attention|build] [--quick]
                                    [--backward] [--reps 100] [--json out.json]
"""

import argparse
import itertools
import json
import math
import statistics
import subprocess
import sys
import time
import warnings

import numpy as np
import torch

# name: (mask kind, Hq, Hkv, D). B = 2, S = 8192 (--quick: 2048), bf16.
CASES = {
    "causal": ("causal", 16, 16, 128),
    "sliding_window": ("sliding_window", 16, 16, 128),
    "document_causal": ("document_causal", 16, 16, 128),
    "causal_d64": ("causal", 16, 16, 64),
    "gqa_causal": ("causal", 32, 4, 128),
}
BUILDS = {f"build_{k}": k for k in ("causal", "sliding_window", "document_causal")}
BATCH = 2
SEQ = 8192
WINDOW = 2048            # at S = 8192; scaled with S (--quick)
DOC_LENGTHS = (256, 3072)  # at S = 8192; scaled with S


# -- masks: our kinds, flex's mask_mods, exact pair counts ------------------------------------------


def document_ids(B, S, seed=0):
    """int32 [B, S]: per batch row, consecutive documents of lengths drawn uniformly from
    DOC_LENGTHS (scaled by S / 8192; seed 0), the last one cut at S."""
    rng = np.random.default_rng(seed)
    lo, hi = (max(1, n * S // SEQ) for n in DOC_LENGTHS)
    ids = np.empty((B, S), np.int32)
    for b in range(B):
        s = d = 0
        while s < S:
            n = int(rng.integers(lo, hi + 1))
            ids[b, s:s + n] = d
            s, d = s + n, d + 1
    return torch.from_numpy(ids)


def window_for(S):
    return WINDOW * S // SEQ


def mask_mod_for(kind, S, doc):
    """flex_attention's mask_mod for our kind (doc: the device document ids)."""
    if kind == "causal":
        return lambda b, h, q, kv: q >= kv
    if kind == "sliding_window":
        w = window_for(S)
        return lambda b, h, q, kv: (q >= kv) & (q - kv <= w)
    if kind == "document_causal":
        return lambda b, h, q, kv: (doc[b, q] == doc[b, kv]) & (q >= kv)
    raise ValueError(kind)


def our_mask_args(kind, S, doc):
    if kind == "sliding_window":
        return {"window_left": window_for(S), "window_right": 0}
    if kind == "document_causal":
        return {"document_ids": doc}
    return {}


def pairs_per_batch(kind, B, S, doc_cpu):
    """Allowed (q, kv) pairs of one head, per batch row, in closed form (Python ints)."""
    if kind == "causal":
        return [S * (S + 1) // 2] * B
    if kind == "sliding_window":
        w = min(window_for(S), S - 1)  # rows q < w see q + 1 keys, the others w + 1
        return [w * (w + 1) // 2 + (S - w) * (w + 1)] * B
    if kind == "document_causal":
        out = []
        for b in range(B):
            _, lengths = torch.unique_consecutive(doc_cpu[b], return_counts=True)
            out.append(sum(int(n) * (int(n) + 1) // 2 for n in lengths))
        return out
    raise ValueError(kind)


def dense_pairs(mask_mod, B, S, rows=1024):
    """The same count from mask_mod evaluated densely on the GPU (the check of the closed form)."""
    kv = torch.arange(S, device="cuda")[None, :]
    out = []
    for b in range(B):
        bt = torch.tensor(b, device="cuda")
        n = 0
        for r in range(0, S, rows):
            q = torch.arange(r, min(S, r + rows), device="cuda")[:, None]
            n += int(mask_mod(bt, 0, q, kv).sum())
        out.append(n)
    return out


# -- timing ----------------------------------------------------------------------------------------


def time_ms(fn, reps, warmup=3):
    """Median of `reps` CUDA-event timings of fn() after warm-up; each run starts on an idle GPU
    (synchronised), so host work inside fn counts. Also the median wall time of the same runs."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times, walls = [], []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0 = time.perf_counter()
        a.record()
        fn()
        b.record()
        b.synchronize()
        walls.append((time.perf_counter() - t0) * 1e3)
        times.append(a.elapsed_time(b))
    return statistics.median(times), statistics.median(walls)


def graph_ms(fn, reps):
    """Median time of fn captured in a CUDA graph and replayed: the GPU work without the host's."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return time_ms(graph.replay, reps)[0]


def first_line(e):
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[0] if lines else ''}"[:400]


def run_peer(row, name, fn, reps, flops=None, wall=False):
    """Times fn into row[name + '_ms'] (and TFLOP/s); a failure is recorded, never fatal."""
    try:
        t, w = time_ms(fn, reps)
    except Exception as e:  # noqa: BLE001 - any peer failure is data
        row[f"{name}_error"] = first_line(e)
        row[f"{name}_ms"] = float("nan")
        torch.cuda.synchronize()
        return float("nan")
    row[f"{name}_ms"] = t
    if wall:
        row[f"{name}_wall_ms"] = w
    if flops is not None:
        row[f"{name}_tflops"] = flops / t * 1e-9
    return t


# -- the attention cases ---------------------------------------------------------------------------


def bench_case(name, S, reps, backward, flex_compiled):
    import sparsetrain
    import sparsetrain.torch as stt
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.flex_attention import create_block_mask

    kind, Hq, Hkv, D = CASES[name]
    B, dt, dev = BATCH, torch.bfloat16, "cuda"
    G = Hq // Hkv
    doc_cpu = document_ids(B, S) if kind == "document_causal" else None
    doc = None if doc_cpu is None else doc_cpu.to(dev)
    mask_mod = mask_mod_for(kind, S, doc)
    pairs = pairs_per_batch(kind, B, S, doc_cpu)
    dense = dense_pairs(mask_mod, B, S)
    if dense != pairs:
        raise AssertionError(f"{name}: closed-form pair counts {pairs} != dense counts {dense}")
    total_pairs = Hq * sum(pairs)
    flops = 4.0 * D * total_pairs
    row = {"case": name, "mask": kind, "B": B, "Hq": Hq, "Hkv": Hkv, "S": S, "D": D, "dtype": "bf16",
           "pairs_per_head_per_batch": pairs, "density": sum(pairs) / (B * S * S), "fwd_flops": flops,
           "reps": reps}
    if kind == "sliding_window":
        row["window_left"] = window_for(S)
    if kind == "document_causal":
        row["documents_per_batch"] = [int(torch.unique(doc_cpu[b]).numel()) for b in range(B)]

    # Inputs: enough copies to exceed twice the L2 cache, used in turn by every peer.
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    set_bytes = 2 * (B * Hq * S * D + 2 * B * Hkv * S * D)  # bf16 q, k, v
    n_sets = max(1, math.ceil(2 * l2 / set_bytes))
    gen = torch.Generator(device=dev).manual_seed(0)
    sets = [tuple(torch.randn(B, h, S, D, device=dev, dtype=dt, generator=gen) for h in (Hq, Hkv, Hkv))
            for _ in range(n_sets)]
    row["input_copies"] = n_sets

    def rotating(fn):
        it = itertools.cycle(sets)
        return lambda: fn(*next(it))

    def cudnn(q, k, v):
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=G > 1)

    # The masks: ours built on the device (explicit left-to-right schedule, the device default),
    # flex's by create_block_mask(_compile=True) from the same definition.
    mask = fmask = None
    try:
        mask = sparsetrain.BlockMask.build(kind, S, device=dev, **our_mask_args(kind, S, doc))
        row["blocks_computed"] = int(mask.kv_num_blocks.sum() + mask.full_kv_num_blocks.sum()) * \
            (1 if mask.kv_num_blocks.shape[0] == B else B)
        row["blocks_total"] = B * mask.num_q_blocks * mask.num_kv_blocks
    except Exception as e:  # noqa: BLE001
        row["ours_error"] = "mask: " + first_line(e)
    try:
        fmask = create_block_mask(mask_mod, B if kind == "document_causal" else None, None, S, S, device=dev,
                                  _compile=True)
    except Exception as e:  # noqa: BLE001
        row["flex_error"] = "mask: " + first_line(e)

    def ours_call(q, k, v):
        return stt.block_sparse_attention(q, k, v, mask)

    def flex_call(q, k, v):
        return flex_compiled(q, k, v, block_mask=fmask, enable_gqa=G > 1)

    nan = float("nan")
    with torch.no_grad():
        t = run_peer(row, "ours", rotating(ours_call), reps, flops) if mask is not None else nan
        if mask is not None:
            try:
                row["ours_graph_ms"] = graph_ms(rotating(ours_call), reps)
            except Exception as e:  # noqa: BLE001
                row["ours_graph_error"] = first_line(e)
                torch.cuda.synchronize()
        pt = run_peer(row, "flex", rotating(flex_call), reps, flops) if fmask is not None else nan
        row["speedup_vs_flex"] = pt / t
        if kind == "causal":
            pt = run_peer(row, "cudnn", rotating(cudnn), reps, flops)
            row["speedup_vs_cudnn"] = pt / t
            if G > 1:  # cuDNN on k and v expanded to Hq heads (in case enable_gqa is not supported there)
                expanded = [(q, k.repeat_interleave(G, 1), v.repeat_interleave(G, 1)) for q, k, v in sets]
                it = itertools.cycle(expanded)

                def cudnn_expanded():
                    q, k, v = next(it)
                    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)

                pt = run_peer(row, "cudnn_expanded_kv", cudnn_expanded, reps, flops)
                row["speedup_vs_cudnn_expanded_kv"] = pt / t
                del expanded, it
        # One call each on the same inputs: ours against the peers (the same mask: close results).
        if mask is not None:
            q, k, v = sets[0]
            peers = [("flex", flex_call)] if fmask is not None else []
            peers += [("cudnn", cudnn)] if kind == "causal" else []
            try:
                o = ours_call(q, k, v).float()
                for peer, fn in peers:
                    try:
                        row[f"max_abs_diff_vs_{peer}"] = float((o - fn(q, k, v).float()).abs().max())
                    except Exception:  # noqa: BLE001 - its failure is in the row already
                        pass
            except Exception as e:  # noqa: BLE001
                row.setdefault("ours_error", first_line(e))
    if backward and mask is not None:
        bench_backward(row, mask, fmask, sets, reps, flex_compiled, G, kind)
    print(json.dumps(row), flush=True)
    return row


def bench_backward(row, mask, fmask, sets, reps, flex_compiled, G, kind):
    """Per peer, on the forward's rotated inputs: the backward alone (torch.autograd.grad over a
    forward graph retained per input copy; 10 * D * pairs FLOPs) and forward + backward (the
    forward, then torch.autograd.grad; 14 * D * pairs FLOPs). Peers: ours deterministic ("ours")
    and not ("ours_nondet"), FlexAttention on the same mask, cuDNN SDPA on the causal cases (with
    GQA also on k and v expanded to Hq heads). Ratios: peer / ours (deterministic), and the
    deterministic mode's cost det / nondet (target <= 1.10)."""
    import sparsetrain.torch as stt
    from torch.nn.attention import SDPBackend, sdpa_kernel

    row["bwd_flops"] = 2.5 * row["fwd_flops"]
    row["fwdbwd_flops"] = 3.5 * row["fwd_flops"]
    dev = sets[0][0].device
    gen = torch.Generator(device=dev).manual_seed(1)
    inputs = [(*(t.detach().requires_grad_() for t in qkv), torch.randn(qkv[0].shape, device=dev,
                                                                         dtype=qkv[0].dtype, generator=gen))
              for qkv in sets]

    def cudnn(q, k, v):
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=G > 1)

    peers = {"ours": lambda q, k, v: stt.block_sparse_attention(q, k, v, mask, deterministic=True),
             "ours_nondet": lambda q, k, v: stt.block_sparse_attention(q, k, v, mask, deterministic=False)}
    if fmask is not None:
        peers["flex"] = lambda q, k, v: flex_compiled(q, k, v, block_mask=fmask, enable_gqa=G > 1)
    if kind == "causal":
        peers["cudnn"] = cudnn
    peer_inputs = {peer: inputs for peer in peers}
    if kind == "causal" and G > 1:  # k and v expanded to Hq heads, leaves themselves (no reduction)
        peers["cudnn_expanded_kv"] = cudnn
        peer_inputs["cudnn_expanded_kv"] = [
            (q, *(t.detach().repeat_interleave(G, 1).requires_grad_() for t in (k, v)), do) for q, k, v, do in inputs]

    grads = {}
    for peer, fwd in peers.items():
        args = peer_inputs[peer]
        it = itertools.cycle(args)

        def fwd_bwd():
            q, k, v, do = next(it)
            return torch.autograd.grad(fwd(q, k, v), (q, k, v), do)

        run_peer(row, f"fwdbwd_{peer}", fwd_bwd, reps, row["fwdbwd_flops"])
        try:
            retained = [(fwd(q, k, v), q, k, v, do) for q, k, v, do in args]
        except Exception as e:  # noqa: BLE001
            row[f"bwd_{peer}_error"] = first_line(e)
            row[f"bwd_{peer}_ms"] = float("nan")
            torch.cuda.synchronize()
            continue
        it_bwd = itertools.cycle(retained)

        def bwd():
            o, q, k, v, do = next(it_bwd)
            return torch.autograd.grad(o, (q, k, v), do, retain_graph=True)

        run_peer(row, f"bwd_{peer}", bwd, reps, row["bwd_flops"])
        if peer in ("ours", "ours_nondet", "flex"):  # gradients of the first input copy, compared below
            first = retained[0]
            try:
                grads[peer] = torch.autograd.grad(first[0], first[1:4], first[4], retain_graph=True)
            except Exception:  # noqa: BLE001 - its failure is in the row already
                pass
            del first
        del retained, it_bwd
        torch.cuda.synchronize()

    nan = float("nan")
    for what in ("bwd", "fwdbwd"):
        ours = row.get(f"{what}_ours_ms", nan)
        for peer in ("flex", "cudnn", "cudnn_expanded_kv"):
            if f"{what}_{peer}_ms" in row:
                row[f"{what}_speedup_vs_{peer}"] = row[f"{what}_{peer}_ms"] / ours
        row[f"{what}_det_over_nondet"] = ours / row.get(f"{what}_ours_nondet_ms", nan)
    # The same gradients: ours against flex, and the two modes of ours (max abs, bf16).
    for peer, ref in (("flex", "ours"), ("flex", "ours_nondet"), ("ours", "ours_nondet")):
        if peer in grads and ref in grads:
            for name, a, b in zip(("dq", "dk", "dv"), grads[ref], grads[peer]):
                row[f"max_abs_diff_{name}_{ref}_vs_{peer}"] = float((a.float() - b.float()).abs().max())
    if "ours" in grads:  # a second deterministic backward: bitwise the same?
        try:
            o = peers["ours"](*inputs[0][:3])
            again = torch.autograd.grad(o, inputs[0][:3], inputs[0][3])
            row["ours_bwd_bitwise_repeatable"] = all(torch.equal(a, b) for a, b in zip(again, grads["ours"]))
        except Exception as e:  # noqa: BLE001
            row.setdefault("bwd_ours_error", first_line(e))


# -- block-mask build ------------------------------------------------------------------------------


def bench_build(name, S, reps):
    import sparsetrain
    from torch.nn.attention.flex_attention import create_block_mask

    kind = BUILDS[name]
    B = BATCH if kind == "document_causal" else None
    doc_cpu = document_ids(BATCH, S) if kind == "document_causal" else None
    doc = None if doc_cpu is None else doc_cpu.to("cuda")
    mask_mod = mask_mod_for(kind, S, doc)
    row = {"case": name, "mask": kind, "B": B or 1, "S": S, "block": 128, "reps": reps}
    if kind == "sliding_window":
        row["window_left"] = window_for(S)

    def ours():
        return sparsetrain.BlockMask.build(kind, S, device="cuda", schedule="left_to_right",
                                           **our_mask_args(kind, S, doc))

    def flex():
        return create_block_mask(mask_mod, B, None, S, S, device="cuda", _compile=True)

    def ours_host():  # informational: the host builder ("auto" schedule) and the copy to the GPU
        return sparsetrain.BlockMask.build(kind, S, framework="torch", **our_mask_args(kind, S, doc_cpu)).to("cuda")

    t = run_peer(row, "ours", ours, reps, wall=True)
    try:
        m = ours()
        row["ours_schedule"] = m.schedule
        row["ours_blocks"] = int(m.kv_num_blocks.sum() + m.full_kv_num_blocks.sum())
        fm = flex()
        row["flex_blocks"] = int(fm.kv_num_blocks.sum() + fm.full_kv_num_blocks.sum())
    except Exception as e:  # noqa: BLE001
        row.setdefault("check_error", first_line(e))
    pt = run_peer(row, "flex", flex, reps, wall=True)
    row["speedup_vs_flex"] = pt / t
    run_peer(row, "ours_host", ours_host, max(10, reps // 10), wall=True)
    print(json.dumps(row), flush=True)
    return row


# -- main ------------------------------------------------------------------------------------------


def environment():
    # "device" first: scripts/gpu-check copies the output from the line that starts {"device.
    info = {"device": None, "date": time.strftime("%Y-%m-%d %H:%M:%S"), "torch": torch.__version__,
            "cuda": torch.version.cuda, "python": sys.version.split()[0]}
    try:
        import sparsetrain
        info["sparsetrain"] = sparsetrain.version()
    except Exception as e:  # noqa: BLE001
        info["sparsetrain"] = first_line(e)
    try:
        p = torch.cuda.get_device_properties(0)
        info.update(device=torch.cuda.get_device_name(0), sm_count=p.multi_processor_count,
                    l2_bytes=p.L2_cache_size, capability=f"{p.major}.{p.minor}")
    except Exception as e:  # noqa: BLE001
        info["device"] = first_line(e)
    try:
        info["cudnn"] = torch.backends.cudnn.version()
    except Exception as e:  # noqa: BLE001
        info["cudnn"] = first_line(e)
    try:
        info["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                        capture_output=True, text=True, timeout=30).stdout.strip().splitlines()[0]
    except Exception:  # noqa: BLE001
        info["driver"] = "unknown"
    try:
        import triton
        info["triton"] = triton.__version__
    except Exception:  # noqa: BLE001
        info["triton"] = None
    return info


def selected(only):
    names = list(CASES) + list(BUILDS)
    if not only:
        return names
    out = []
    for n in only.split(","):
        n = n.strip()
        if n == "attention":
            out += list(CASES)
        elif n == "build":
            out += list(BUILDS)
        elif n in names:
            out.append(n)
        else:
            raise SystemExit(f"--only: unknown name {n!r}; expected some of {', '.join(names)}, attention, build")
    return list(dict.fromkeys(out))


def print_tables(rows):
    """The forward, backward and mask-build tables (the --json rows hold every number)."""

    def f(r, key, fmt="{:.3f}"):
        v = r.get(key)
        return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else fmt.format(v)

    att = [r for r in rows if r["case"] in CASES]
    if att:
        print(f"\n{'case':16} {'ours ms':>9} {'TFLOP/s':>8} {'graph ms':>9} {'flex ms':>9} {'TFLOP/s':>8} "
              f"{'flex/ours':>9} {'cudnn ms':>9} {'TFLOP/s':>8} {'cudnn/ours':>10}  errors")
        for r in att:
            errs = "; ".join(f"{k[:-6]}: {v}" for k, v in r.items()
                             if (k.endswith("_error") and not k.startswith(("bwd_", "fwdbwd_"))) or k == "error")
            print(f"{r['case']:16} {f(r, 'ours_ms'):>9} {f(r, 'ours_tflops', '{:.1f}'):>8} "
                  f"{f(r, 'ours_graph_ms'):>9} {f(r, 'flex_ms'):>9} {f(r, 'flex_tflops', '{:.1f}'):>8} "
                  f"{f(r, 'speedup_vs_flex', '{:.2f}x'):>9} {f(r, 'cudnn_ms'):>9} "
                  f"{f(r, 'cudnn_tflops', '{:.1f}'):>8} {f(r, 'speedup_vs_cudnn', '{:.2f}x'):>10}  {errs}")
    bwd = [r for r in att if "bwd_flops" in r]
    if bwd:
        # Ours is the deterministic backward unless "nondet"; x-columns are peer / ours (> 1: we are
        # faster), det/nondet the deterministic mode's cost (target <= 1.10).
        for what, title in (("bwd", "backward alone"), ("fwdbwd", "forward + backward")):
            print(f"\n{title + ' (ms)':20} {'ours':>8} {'TFLOP/s':>8} {'nondet':>8} {'det/nondet':>10} "
                  f"{'flex':>8} {'flex/ours':>9} {'cudnn':>8} {'cudnn/ours':>10}  errors")
            for r in bwd:
                errs = "; ".join(f"{k[:-6]}: {v}" for k, v in r.items()
                                 if k.startswith(what + "_") and k.endswith("_error"))
                print(f"{r['case']:20} {f(r, what + '_ours_ms'):>8} {f(r, what + '_ours_tflops', '{:.1f}'):>8} "
                      f"{f(r, what + '_ours_nondet_ms'):>8} {f(r, what + '_det_over_nondet', '{:.3f}'):>10} "
                      f"{f(r, what + '_flex_ms'):>8} {f(r, what + '_speedup_vs_flex', '{:.2f}x'):>9} "
                      f"{f(r, what + '_cudnn_ms'):>8} {f(r, what + '_speedup_vs_cudnn', '{:.2f}x'):>10}  {errs}")
    builds = [r for r in rows if r["case"] in BUILDS]
    if builds:
        print(f"\n{'mask build':24} {'ours ms':>9} {'flex ms':>9} {'flex/ours':>10} (target >= 10x) "
              f"{'ours host+copy ms':>17}  errors")
        for r in builds:
            errs = "; ".join(f"{k[:-6]}: {v}" for k, v in r.items() if k.endswith("_error") or k == "error")
            print(f"{r['case']:24} {f(r, 'ours_ms'):>9} {f(r, 'flex_ms'):>9} {f(r, 'speedup_vs_flex', '{:.1f}x'):>10} "
                  f"{'':15} {f(r, 'ours_host_ms'):>17}  {errs}")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", default="", metavar="NAMES",
                    help=f"comma-separated cases: {', '.join(list(CASES) + list(BUILDS))}, or 'attention' / "
                         "'build' for each group (default: all)")
    ap.add_argument("--quick", action="store_true",
                    help="a smoke run: S = 2048 (the window and document lengths scaled with S), 10 runs")
    ap.add_argument("--seq", type=int, default=None, help="S (default 8192; --quick: 2048)")
    ap.add_argument("--reps", type=int, default=None, help="timed runs per measurement (default 100; --quick: 10)")
    ap.add_argument("--backward", action="store_true",
                    help="also time the backward alone (10 * D * pairs FLOPs) and forward + backward (14 * D * "
                         "pairs) of ours (deterministic and not), FlexAttention and cuDNN (causal)")
    ap.add_argument("--json", default=None, metavar="PATH", help="write the environment and every row as JSON")
    args = ap.parse_args()
    names = selected(args.only)
    S = args.seq or (2048 if args.quick else SEQ)
    reps = args.reps or (10 if args.quick else 100)
    if not torch.cuda.is_available():
        raise SystemExit("bench_attention: no CUDA device (torch.cuda.is_available() is False)")
    for opt in ("cache_size_limit", "recompile_limit"):  # flex recompiles per mask_mod and shape
        if hasattr(torch._dynamo.config, opt):
            setattr(torch._dynamo.config, opt, 64)
    from torch.nn.attention.flex_attention import flex_attention
    # The backward alone is timed over a retained graph (autograd.grad(retain_graph=True)), which
    # compiled backwards with donated buffers refuse: donation off (it only saves memory).
    torch._functorch.config.donated_buffer = False
    flex_compiled = torch.compile(flex_attention, dynamic=False)
    # create_block_mask(_compile=True) is what DESIGN.md section 9 names; torch 2.11 deprecates it
    # in favour of torch.compile(create_block_mask) with a warning on every call.
    warnings.filterwarnings("ignore", message="_compile flag on create_block_mask")

    info = environment()
    info.update(args=vars(args), S=S, reps=reps)
    rows = []
    for name in names:
        try:
            if name in CASES:
                rows.append(bench_case(name, S, reps, args.backward, flex_compiled))
            else:
                rows.append(bench_build(name, S, reps))
        except Exception as e:  # noqa: BLE001 - a case that cannot run is recorded, the rest still run
            row = {"case": name, "error": first_line(e)}
            print(json.dumps(row), flush=True)
            rows.append(row)
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"info": info, "rows": rows}, f, indent=1)
    print(f"\n{json.dumps(info)}")

    print_tables(rows)


if __name__ == "__main__":
    main()
