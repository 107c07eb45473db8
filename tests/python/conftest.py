"""pytest hooks for tests/python: the fuzz campaign's tally (test_fuzz.py tags each case with
record_property: fuzz_device, fuzz_family, fuzz_seed), printed at the end of the session as one
line per device, "fuzz: N cases run, F failures (cpu, seed 56: ...)", the number
docs/PERF.md's reliability line quotes. Skipped cases are not counted as run."""

import collections

_TALLY = collections.defaultdict(lambda: {"run": 0, "failed": 0, "seconds": 0.0, "seed": None,
                                          "families": collections.Counter()})


def pytest_runtest_logreport(report):
    props = dict(report.user_properties)
    device = props.get("fuzz_device")
    if device is None or report.when != "call":
        return
    t = _TALLY[device]
    t["seed"] = props.get("fuzz_seed")
    t["seconds"] += report.duration
    if report.skipped:
        return
    t["run"] += 1
    t["families"][props.get("fuzz_family")] += 1
    if report.failed:
        t["failed"] += 1


def pytest_terminal_summary(terminalreporter):
    for device in sorted(_TALLY):
        t = _TALLY[device]
        if t["run"] == 0:
            continue
        families = ", ".join(f"{k} {v}" for k, v in sorted(t["families"].items()))
        terminalreporter.write_line(
            f"fuzz: {t['run']} cases run, {t['failed']} failures ({device}, seed {t['seed']}: {families}; "
            f"{t['seconds']:.1f} s)")
