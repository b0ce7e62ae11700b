"""examples/kimi_linear_tiny.py, shortened: the tiny 3:1 model trains (its loss falls) and generates through the
cache."""

from __future__ import annotations

import importlib.util
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "kimi_linear_tiny.py"


def test_tiny_kimi_trains_and_generates():
    spec = importlib.util.spec_from_file_location("kimi_linear_tiny", EXAMPLE)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    result = example.main(steps=40, verbose=False)
    assert result["last_loss"] < 0.3 * result["first_loss"], result
    assert result["accuracy"] > 0.5, result
