"""The summary scripts/test ends with: one line per test program (each C++ test binary under ctest,
the command-line cases, each pytest module) with its passed / failed / skipped counts and the
reasons given for the skips, the output of every failed C++ test, and a total line.

    python scripts/test_summary.py CTEST_JUNIT CTEST_TESTS_JSON PYTEST_JUNIT

CTEST_JUNIT: `ctest --output-junit`; CTEST_TESTS_JSON: `ctest --show-only=json-v1` (which binary
runs each test); PYTEST_JUNIT: `pytest --junitxml`. A missing file is reported, not fatal. Exit
status 0 (the callers' own statuses decide).
"""

import collections
import json
import os
import sys
import xml.etree.ElementTree as ET


class Suite:
    def __init__(self):
        self.counts = collections.Counter()
        self.reasons = collections.Counter()


def gtest_skip_reason(output):
    """GoogleTest prints "file:line: Skipped" and the message on the next line."""
    lines = (output or "").splitlines()
    for i, line in enumerate(lines[:-1]):
        if line.endswith(": Skipped"):
            return lines[i + 1].strip()
    return "no reason given"


def read_ctest(junit, tests_json, suites, failures):
    with open(tests_json) as f:
        program = {t["name"]: os.path.basename(t["command"][0]) for t in json.load(f)["tests"] if t.get("command")}
    for case in ET.parse(junit).getroot().iter("testcase"):
        name = case.get("name")
        suite = program.get(name, "?")
        if suite in ("cmake", "cmake.exe"):  # tests driven by a cmake -P script
            prefix = name.split(".")[0]
            suite = {"Cli": "the sparsetrain command", "Package": "the installed C++ package"}.get(prefix, prefix)
        out = case.findtext("system-out") or ""
        status = case.get("status")
        s = suites[suite]
        if status == "run":
            s.counts["passed"] += 1
        elif status == "notrun" and case.find("skipped") is not None:
            s.counts["skipped"] += 1
            s.reasons[gtest_skip_reason(out)] += 1
        else:
            s.counts["failed"] += 1
            failures.append((name, out))


def read_pytest(junit, suites):
    for case in ET.parse(junit).getroot().iter("testcase"):
        where = case.get("classname") or case.get("name") or "?"
        module = next((p for p in where.split(".") if p.startswith("test_")), where)
        s = suites["pytest " + module + ".py"]
        skipped = case.find("skipped")
        if case.find("failure") is not None or case.find("error") is not None:
            s.counts["failed"] += 1
        elif skipped is not None:
            s.counts["skipped"] += 1
            # A module-level skip says "collection skipped" and puts ('file', line, 'Skipped: reason')
            # in the text.
            reason = skipped.get("message") or "no reason given"
            if reason == "collection skipped" and skipped.text and "Skipped: " in skipped.text:
                reason = skipped.text.split("Skipped: ", 1)[1].rstrip("')\" ")
            s.reasons[reason.removeprefix("Skipped: ")] += 1
        else:
            s.counts["passed"] += 1


def main(argv):
    ctest_junit, ctest_json, pytest_junit = argv[1:4]
    suites = collections.defaultdict(Suite)
    failures = []
    missing = []
    for path, read in ((ctest_junit, lambda: read_ctest(ctest_junit, ctest_json, suites, failures)),
                       (pytest_junit, lambda: read_pytest(pytest_junit, suites))):
        try:
            read()
        except (OSError, ET.ParseError, ValueError, KeyError) as e:
            missing.append(f"{path}: {e}")
    for name, out in failures:
        print(f"\n---- FAILED {name} (last lines) ----")
        print("\n".join(out.splitlines()[-30:]))
    print("\n==== test summary ====")
    width = max((len(n) for n in suites), default=0)
    total = collections.Counter()
    for name in sorted(suites):
        s = suites[name]
        total.update(s.counts)
        line = f"{name:<{width}}  {s.counts['passed']:4d} passed  {s.counts['failed']:3d} failed  {s.counts['skipped']:3d} skipped"
        if s.reasons:
            line += "  (" + "; ".join(f"{r} x{n}" if n > 1 else r for r, n in s.reasons.most_common()) + ")"
        print(line)
    for m in missing:
        print(f"results not read: {m}")
    print(f"total: {total['passed']} passed, {total['failed']} failed, {total['skipped']} skipped")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
