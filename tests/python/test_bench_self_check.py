"""The attention benchmark's host-side parts (case geometry, document ids, closed-form pair counts
against the dense mask, our host mask builds, auto's schedule rule, the tables) run on the CPU at
the --quick size, so that the benchmark does not drift from the library between GPU runs."""

import os
import subprocess
import sys

import pytest

pytest.importorskip("torch", reason="torch is not installed: the benchmark self-check skipped")

BENCH = os.path.join(os.path.dirname(__file__), "..", "..", "bench", "bench_attention.py")


def test_bench_attention_self_check_passes():
    r = subprocess.run([sys.executable, BENCH, "--self-check", "--quick"], capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0 and "self-check passed" in r.stdout, r.stdout[-2000:] + r.stderr[-2000:]


def test_bench_attention_self_check_with_padded_documents():
    """--doc-padding: the document cases' masks built with their padded backward form."""
    r = subprocess.run([sys.executable, BENCH, "--self-check", "--quick", "--doc-padding", "1024", "--only",
                        "document_causal,document_causal_1to3000"], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and "self-check passed" in r.stdout, r.stdout[-2000:] + r.stderr[-2000:]


def test_bench_moe_runs_on_the_cpu(tmp_path):
    """The MoE benchmark end to end at --quick on the CPU: both sides run, agree, and the JSON is
    written (its timings are not the point here)."""
    import json

    out = tmp_path / "moe.json"
    bench = os.path.join(os.path.dirname(BENCH), "bench_moe.py")
    for extra in ([], ["--keep-expert-input"]):
        r = subprocess.run([sys.executable, bench, "--quick", "--device", "cpu", "--reps", "1", "--only",
                            "mixtral,qwen3", "--json", str(out), *extra], capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
        rows = json.loads(out.read_text())["rows"]
        assert [row["case"] for row in rows] == ["mixtral", "qwen3"]
        for row in rows:
            assert row["recompute_expert_input"] == (not extra)
            assert row["max_abs_diff_vs_torch"] < 0.05, row  # bf16 experts, the same weights on both sides


def test_bench_moe_ep_runs_on_the_cpu(tmp_path):
    """The expert-parallel benchmark end to end at --quick with 2 gloo processes: both sides run
    and the JSON holds a row per case and exchange, the two-micro-batch rows of --overlap included
    (symmetric memory is CUDA-only: not a default here); its timings are not the point here."""
    import json

    out = tmp_path / "moe_ep.json"
    bench = os.path.join(os.path.dirname(BENCH), "bench_moe_ep.py")
    r = subprocess.run([sys.executable, bench, "--quick", "--device", "cpu", "--world", "2", "--reps", "1",
                        "--rounds", "1", "--only", "mixtral", "--overlap", "--json", str(out)], capture_output=True,
                       text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    rows = json.loads(out.read_text())["rows"]
    assert [(row["case"], row["exchange"]) for row in rows] == [("mixtral", "nccl"), ("mixtral", "nccl_halves"),
                                                                ("mixtral", "nccl_overlap")]
    for row in rows:
        assert row["world"] == 2 and row["ep_ms"] > 0 and row["single_ms"] > 0, row


def test_bench_bwd_ab_imports_and_shows_its_usage():
    """The backward A / B (bench_bwd_ab.py) needs a GPU to run; without arguments it imports its
    helpers from the other benchmarks and prints how to run it, so a renamed helper shows here."""
    bench = os.path.join(os.path.dirname(BENCH), "bench_bwd_ab.py")
    r = subprocess.run([sys.executable, bench], capture_output=True, text=True, timeout=300)
    assert r.returncode == 1 and "A / B of the attention backward" in r.stderr, r.stdout[-2000:] + r.stderr[-2000:]
