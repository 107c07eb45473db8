"""sparsetrain.torch.ExpertParallelMoELayer on 2 and 4 gloo processes (one machine, CPU), and on 2
and 4 GPUs with NCCL where the machine has them (skipped, visibly, elsewhere), against the
single-process MoELayer holding all the experts (on the rank's own device), run on the ranks'
tokens concatenated in rank order: out, dx, dlogits and every expert's weight gradients (gathered
from the ranks) must be bitwise equal. Cases: fp32 and bf16, softmax and sigmoid, top_k 1 and 2, token counts per rank
that are multiples of nothing (one rank with none), empty experts, a rank whose tokens all go to
other ranks and a rank that receives no rows, single grouped weights with main_grad and delayed
wgrad. Each world size is launched once for all its cases (processes cost seconds to start);
the exchanges' receive buffers are poisoned with NaN; a failing rank fails its case with the
rank's traceback, and a launch that outlives its timeout (a deadlock) fails every case left."""

import os
import socket
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import NamedTuple, Tuple

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed: expert-parallel tests skipped")
dist = torch.distributed
if not dist.is_available() or not dist.is_gloo_available():
    pytest.skip("torch.distributed with gloo is not available: expert-parallel tests skipped", allow_module_level=True)

import torch.multiprocessing as mp  # noqa: E402

import sparsetrain.torch as stt  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
H, F = 16, 8
LAUNCH_TIMEOUT_S = 240  # 4 processes on CI's 2 cores; a deadlock ends here, not in CI's own timeout


class Case(NamedTuple):
    name: str
    world: int
    dtype: str
    score: str
    top_k: int
    num_experts: int
    tokens: Tuple[int, ...]  # per rank
    routing: str = "random"  # or "skewed": rank 0's tokens avoid its experts, _silent(world) gets none
    normalize: bool = False
    expert_bias: bool = False
    grouped_main_grad_delayed: bool = False  # single_grouped_weight, bias, main_grad, delayed wgrad
    seed: int = 0


CASES = [
    Case("fp32_softmax_k2_E4_N13_7", 2, "float32", "softmax", 2, 4, (13, 7), seed=1),
    Case("bf16_sigmoid_k1_E6_N5_11_bias", 2, "bfloat16", "sigmoid", 1, 6, (5, 11), expert_bias=True, seed=2),
    Case("bf16_softmax_k2_E4_skewed", 2, "bfloat16", "softmax", 2, 4, (9, 6), "skewed", normalize=True, seed=3),
    Case("fp32_sigmoid_k1_E4_N10_0", 2, "float32", "sigmoid", 1, 4, (10, 0), seed=4),
    Case("bf16_softmax_k2_E6_grouped_main_grad_delayed", 2, "bfloat16", "softmax", 2, 6, (11, 8),
         grouped_main_grad_delayed=True, seed=5),
    Case("bf16_softmax_k2_E8_N7_13_3_10", 4, "bfloat16", "softmax", 2, 8, (7, 13, 3, 10), normalize=True, seed=6),
    Case("fp32_sigmoid_k1_E8_skewed", 4, "float32", "sigmoid", 1, 8, (5, 9, 4, 6), "skewed", seed=7),
    Case("bf16_sigmoid_k2_E8_skewed", 4, "bfloat16", "sigmoid", 2, 8, (6, 3, 11, 2), "skewed", normalize=True,
         expert_bias=True, seed=8),
    Case("fp32_softmax_k2_E4_N3_0_8_5", 4, "float32", "softmax", 2, 4, (3, 0, 8, 5), seed=9),
    Case("bf16_sigmoid_k2_E12_grouped_main_grad_delayed", 4, "bfloat16", "sigmoid", 2, 12, (9, 4, 7, 5),
         grouped_main_grad_delayed=True, seed=10),
]


def _poisoned_buffer(like, rows):
    return like.new_full((rows, *like.shape[1:]), float("nan"))


def _silent(world):
    """The rank whose experts no token chooses in a skewed case (with 2 ranks, rank 0: it then
    both sends all its tokens away and receives none)."""
    return world - 1 if world > 2 else 0


def _data(case, rank):
    """The whole batch (the same on every rank, from the case's seed) and this rank's slice."""
    g = torch.Generator().manual_seed(1000 + case.seed)
    dtype = getattr(torch, case.dtype)
    n, E = sum(case.tokens), case.num_experts
    x = torch.randn(n, H, generator=g).to(dtype)
    logits = 2 * torch.randn(n, E, generator=g)
    if case.routing == "skewed":
        local = E // case.world
        silent = _silent(case.world)
        logits[:, silent * local:(silent + 1) * local] = -30.0  # nobody chooses its experts
        logits[:case.tokens[0], :local] = -30.0  # rank 0's tokens choose none of rank 0's experts
    dout = torch.randn(n, H, generator=g).to(dtype)
    dsum = torch.randn(E, generator=g)
    bias = 0.3 * torch.randn(E, generator=g) if case.expert_bias else None
    first = sum(case.tokens[:rank])
    return x, logits, dout, dsum, bias, slice(first, first + case.tokens[rank])


def _run(layer, x, logits, dout, dsum, bias, fused):
    x, logits = x.clone().requires_grad_(), logits.clone().requires_grad_()
    o = layer(x, logits, bias)
    (o.out.float() * dout.float()).sum().add((o.score_sum * dsum).sum()).backward()
    if fused:
        layer.backward_dw()
    return o, x.grad, logits.grad


def _weight_grads(experts, fused):
    grads = {}
    for name, p in experts.named_parameters():
        if fused:
            grads[name] = p.main_grad
        else:
            grads[name] = torch.zeros_like(p) if p.grad is None else p.grad
    return grads


def _global_name(name, source, local):
    """An EP rank's local parameter name -> the full layer's (per-expert names renumbered)."""
    stem = name.rstrip("0123456789")
    return f"{stem}{source * local + int(name[len(stem):])}" if stem != name else name


def _check_case(case, rank, world, device):
    fused = case.grouped_main_grad_delayed
    options = dict(score=case.score, normalize=case.normalize, params_dtype=getattr(torch, case.dtype),
                   bias=fused, single_grouped_weight=fused, fuse_wgrad_accumulation=fused, delay_wgrad_compute=fused,
                   device=device)
    torch.manual_seed(case.seed)
    full = stt.MoELayer(case.num_experts, H, F, case.top_k, **options)
    ep = stt.ExpertParallelMoELayer(case.num_experts, H, F, case.top_k, **options)
    ep.load_full_state_dict(full.state_dict())
    if fused:
        for p in list(full.experts.parameters()) + list(ep.experts.parameters()):
            p.main_grad = torch.zeros(p.shape, dtype=torch.float32, device=device)
    x, logits, dout, dsum, bias, mine = (t.to(device) if isinstance(t, torch.Tensor) else t
                                         for t in _data(case, rank))

    want, want_dx, want_dlogits = _run(full, x, logits, dout, dsum, bias, fused)
    got, got_dx, got_dlogits = _run(ep, x[mine], logits[mine], dout[mine], dsum, bias, fused)

    # Every collective before any assertion, so a mismatch on one rank cannot leave the others waiting.
    counts = got.counts.clone()
    dist.all_reduce(counts)
    local = case.num_experts // world
    gathered = {}
    for name, g in _weight_grads(ep.experts, fused).items():
        parts = [torch.empty_like(g) for _ in range(world)]
        dist.all_gather(parts, g.contiguous())
        if name.rstrip("0123456789") == name:  # single grouped [E / W, ...]: the ranks' slices in order
            gathered[name] = torch.cat(parts)
        else:
            for source, part in enumerate(parts):
                gathered[_global_name(name, source, local)] = part

    where = f"case {case.name}, rank {rank} of {world}"
    if case.routing == "skewed":
        silent = _silent(world)
        assert int(counts[silent * local:(silent + 1) * local].sum()) == 0, f"{where}: rank {silent} got rows"
        if rank == 0:
            assert int(got.counts[:local].sum()) == 0, f"{where}: rank 0's tokens chose its own experts"
    assert torch.equal(counts, want.counts), f"{where}: counts summed over ranks"
    for what, a, b in (("out", got.out, want.out[mine]), ("dx", got_dx, want_dx[mine]),
                       ("dlogits", got_dlogits, want_dlogits[mine])):
        assert a.dtype == b.dtype and torch.equal(a, b), f"{where}: {what} differs from MoELayer's"
    want_grads = {f"experts.{k}": v for k, v in _weight_grads(full.experts, fused).items()}
    assert sorted(gathered) == sorted(k[len("experts."):] for k in want_grads), f"{where}: parameter names"
    for name, g in gathered.items():
        assert torch.equal(g, want_grads[f"experts.{name}"]), f"{where}: gradient of experts.{name} differs"


def _worker(rank, world, init_file, done_dir, cases, backend):
    torch.set_num_threads(1)  # the processes share the machine's cores
    device = "cpu"
    if backend == "nccl":
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast stays off on the lent machines
        device = f"cuda:{rank}"
        torch.cuda.set_device(device)
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=LAUNCH_TIMEOUT_S))
    try:
        import sparsetrain._torch_ep as ep  # noqa: PLC0415

        ep._receive_buffer = _poisoned_buffer  # every received row must be written by the exchange
        if world > 1:
            with pytest.raises(ValueError, match=f"num_experts: expected a multiple of the group's size {world}"):
                stt.ExpertParallelMoELayer(world + 1, H, F, 1)
        for case in cases:
            _check_case(case, rank, world, device)
            with open(os.path.join(done_dir, f"{case.name}.{rank}"), "w"):
                pass
    finally:
        dist.destroy_process_group()


_LAUNCHES = {}


def _launch(world, backend="gloo"):
    """Runs every case of this world size in one group of `world` processes (gloo on the CPU, or
    NCCL with one GPU each), once; returns the names of the cases every rank finished and the
    launch's error (None if it ended well)."""
    if (world, backend) not in _LAUNCHES:
        cases = [c for c in CASES if c.world == world]
        with tempfile.TemporaryDirectory() as tmp:
            error = None
            ctx = mp.start_processes(_worker, args=(world, os.path.join(tmp, "store"), tmp, cases, backend), nprocs=world,
                                     join=False, start_method="spawn")
            deadline = time.monotonic() + LAUNCH_TIMEOUT_S
            try:
                while not ctx.join(timeout=max(0.1, deadline - time.monotonic())):
                    if time.monotonic() >= deadline:
                        error = f"{world} processes still running after {LAUNCH_TIMEOUT_S} s (a deadlock?)"
                        break
            except Exception as e:  # noqa: BLE001  (ProcessRaisedException carries the child's traceback)
                error = f"{type(e).__name__}: {e}"
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
                    p.join()
            done = {c.name for c in cases if all(os.path.exists(os.path.join(tmp, f"{c.name}.{r}"))
                                                 for r in range(world))}
        _LAUNCHES[(world, backend)] = (done, error)
    return _LAUNCHES[(world, backend)]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"W{c.world}_{c.name}")
def test_expert_parallel_layer_equals_the_single_process_layer_bitwise(case):
    done, error = _launch(case.world)
    assert case.name in done, f"{case.name} did not pass on every rank:\n{error}"


def _nccl_gpus():
    """GPUs NCCL may use here (0 without CUDA or NCCL)."""
    if not (torch.cuda.is_available() and dist.is_nccl_available()):
        return 0
    return torch.cuda.device_count()


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"nccl_W{c.world}_{c.name}")
def test_expert_parallel_layer_on_gpus_equals_the_single_gpu_layer_bitwise(case):
    """The same cases with NCCL, one GPU per rank: the exchange moves device tensors, the experts
    run the CUDA GroupedMLP, the reference runs on each rank's GPU. Every expert GEMM runs one
    kernel shape without split-K (cuda/grouped_linear/sm90_tuning.h), so a row's result does not
    depend on how many experts or rows share the launch: bitwise, as on the CPU."""
    gpus = _nccl_gpus()
    if gpus < case.world:
        pytest.skip(f"NCCL with {case.world} GPUs: this machine has {gpus} usable by NCCL")
    done, error = _launch(case.world, "nccl")
    assert case.name in done, f"{case.name} did not pass on every rank (NCCL):\n{error}"


def test_layer_needs_an_initialised_process_group():
    if dist.is_initialized():
        pytest.skip("a process group is initialised in this process")
    with pytest.raises(RuntimeError, match="torch.distributed is not initialised"):
        stt.ExpertParallelMoELayer(4, H, F, 1)


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_torchrun_example_runs():
    """examples/moe_expert_parallel.py under torchrun (2 processes, gloo), as the README shows it."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2",
           "--master-addr", "127.0.0.1", "--master-port", str(_free_port()),
           str(REPO / "examples" / "moe_expert_parallel.py")]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=LAUNCH_TIMEOUT_S, cwd=REPO,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, f"torchrun exited {r.returncode}:\n{r.stdout}\n{r.stderr}"
    for rank in range(2):
        assert f"rank {rank} of 2" in r.stdout and "equals the single-process layer" in r.stdout, r.stdout
