"""Every ```python block of the docs pages runs: in order, in one namespace per page."""

from __future__ import annotations

import pathlib
import re

import pytest

DOCS = pathlib.Path(__file__).resolve().parents[2] / "docs"
PAGES = ["coming_from.md"]
BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


def python_blocks(page: str) -> list[str]:
    return BLOCK.findall((DOCS / page).read_text(encoding="utf-8"))


@pytest.mark.parametrize("page", PAGES)
def test_examples_run(page):
    blocks = python_blocks(page)
    assert len(blocks) >= 5, f"{page}: expected its examples, found {len(blocks)} python blocks"
    namespace: dict = {"__name__": f"docs.{page}"}
    for number, block in enumerate(blocks, 1):
        code = compile(block, f"{page} (python block {number})", "exec")
        exec(code, namespace)  # noqa: S102 - the docs' own examples
