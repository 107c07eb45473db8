"""Why a many-expert wgrad sometimes takes twice its time in bench_grouped_linear.py: the same
timing loop, per batch: the median GPU time between the events, the host time of the call, and
the caching allocator's device mallocs / frees during the batch. With "keep": the device's
default memory pool (the library's default allocator, cudaMallocAsync) told to keep what it frees
(release threshold UINT64_MAX) instead of returning it at each synchronize."""
import ctypes, glob, statistics, sys, time
import torch
sys.path.insert(0, "bench")
from bench_grouped_linear import MODELS, routing
import sparsetrain

if "keep" in sys.argv:
    torch.cuda.init()
    lib = ctypes.CDLL((glob.glob(torch.__file__.rsplit("/", 2)[0] + "/nvidia/cu13/lib/libcudart.so*")
                       + glob.glob("/usr/local/cuda/lib64/libcudart.so*"))[0])
    pool, thr = ctypes.c_void_p(), ctypes.c_uint64(2**64 - 1)
    assert lib.cudaDeviceGetDefaultMemPool(ctypes.byref(pool), 0) == 0
    assert lib.cudaMemPoolSetAttribute(pool, 4, ctypes.byref(thr)) == 0  # cudaMemPoolAttrReleaseThreshold
    print("default pool keeps its memory")
G, T, gemms = MODELS["qwen"]
_, k_in, n_out = gemms[1]
splits = routing(G, T)
dev, dt = "cuda", torch.bfloat16
torch.manual_seed(0)
x = torch.randn(T, k_in, device=dev, dtype=dt)
dy = torch.randn(T, n_out, device=dev, dtype=dt)
w = torch.randn(G, n_out, k_in, device=dev, dtype=dt) / k_in ** 0.5
layer = sparsetrain.GroupedLinear(w, delay_wgrad_compute=True)
ds = sparsetrain.DeviceSplits(torch.tensor(splits, device=dev))
for batch in range(10):
    s0 = torch.cuda.memory_stats()
    times, host = [], []
    for _ in range(60):
        layer.backward(x, dy, ds)
        if batch % 2: torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(); h0 = time.perf_counter()
        out = layer.backward_dw()
        host.append((time.perf_counter() - h0) * 1e3)
        b.record(); b.synchronize()
        times.append(a.elapsed_time(b))
        del out
    s1 = torch.cuda.memory_stats()
    d = {k: s1.get(k, 0) - s0.get(k, 0) for k in ("num_device_alloc", "num_device_free", "num_alloc_retries")}
    print(f"batch {batch} {'synced' if batch % 2 else 'queued'}: gpu median {statistics.median(times):.3f} ms "
          f"(min {min(times):.3f} max {max(times):.3f}), host median {statistics.median(host):.3f} ms, {d}", flush=True)
if "profile" in sys.argv:  # where the call's host time goes
    import cProfile, pstats
    layer.backward(x, dy, ds); layer.backward_dw(); torch.cuda.synchronize()
    pr = cProfile.Profile()
    for _ in range(30):
        layer.backward(x, dy, ds)
        torch.cuda.synchronize()
        pr.enable(); out = layer.backward_dw(); pr.disable()
        torch.cuda.synchronize(); del out
    pstats.Stats(pr).sort_stats("tottime").print_stats(12)
