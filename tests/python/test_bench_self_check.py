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
