"""The README's Python examples run as written (on the CPU)."""

import pathlib
import re

import pytest

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"
EXAMPLES = re.findall(r"```python\n(.*?)```", README.read_text(), re.DOTALL)


def test_readme_has_examples():
    assert len(EXAMPLES) >= 2


@pytest.mark.parametrize("index", range(len(EXAMPLES)))
def test_readme_example_runs(index):
    if "hybrax.nn" in EXAMPLES[index]:  # the layers need the `nn` extra, which the wheel smoke venvs leave out
        pytest.importorskip("flax")
    exec(compile(EXAMPLES[index], f"README.md example {index}", "exec"), {})
