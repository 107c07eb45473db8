"""pytest hooks for tests/python: the fuzz campaign's tally. Each test of test_fuzz.py takes one
`case` (a test_fuzz.Case: device, family); at the end of the session one line per device reads
"fuzz: N cases run, F failures (cpu, seed 56: ...)", the number docs/PERF.md quotes. Skipped
cases are not counted as run. (Read from the test's parameters rather than through
record_property, which warns under --junitxml's default xunit2 family.)

Also: every CUDA graph capture collects garbage first (TORCH_CUDAGRAPH_GC=1, torch's behaviour
before it made that optional). make_graphed_callables leaves a module in a reference cycle (its
forward becomes a closure over the module) that holds the graphs; dead, such a cycle is freed only
by the garbage collector, and a collection that happens to run inside a later test's capture
destroys those graphs there, a CUDA call a capture forbids: that capture fails
(cudaErrorStreamCaptureInvalidated, seen once in the whole suite on an H200)."""

import collections
import os

import pytest

os.environ.setdefault("TORCH_CUDAGRAPH_GC", "1")  # read when torch is imported, after this

_TALLY = collections.defaultdict(lambda: {"run": 0, "failed": 0, "seconds": 0.0, "seed": None,
                                          "families": collections.Counter()})


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    callspec = getattr(item, "callspec", None)
    case = callspec.params.get("case") if callspec is not None else None
    device = getattr(case, "device", None)
    if device is not None and report.when == "call":
        t = _TALLY[device]
        t["seed"] = getattr(item.module, "SEED", None)
        t["seconds"] += report.duration
        if not report.skipped:
            t["run"] += 1
            t["families"][case.family] += 1
            t["failed"] += int(report.failed)
    return report


def pytest_terminal_summary(terminalreporter):
    for device in sorted(_TALLY):
        t = _TALLY[device]
        if t["run"] == 0:
            continue
        families = ", ".join(f"{k} {v}" for k, v in sorted(t["families"].items()))
        terminalreporter.write_line(
            f"fuzz: {t['run']} cases run, {t['failed']} failures ({device}, seed {t['seed']}: {families}; "
            f"{t['seconds']:.1f} s)")
