"""Every Python code block of README.md runs as written (each in a fresh namespace, in order), so
the README cannot rot; the C++ example is compiled and run by the package consumer test
(tests/consumer). Skipped visibly where torch is not installed (the examples use it)."""

import pathlib
import re

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed: README examples skipped")

README = pathlib.Path(__file__).resolve().parents[2] / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)


def test_readme_has_python_examples():
    assert len(BLOCKS) >= 3


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_readme_python_block_runs(index, capsys):
    exec(compile(BLOCKS[index], f"README.md python block {index}", "exec"), {"__name__": "__readme__"})
