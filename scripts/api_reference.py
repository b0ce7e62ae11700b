"""Write docs/api.md, the API reference, from the public objects' signatures and docstrings.

    python scripts/api_reference.py           # rewrite docs/api.md
    python scripts/api_reference.py --check   # exit 1 if docs/api.md differs from what the docstrings give

The pages list every name in the `__all__` of hybrax, hybrax.serving, hybrax.parallel and hybrax.nn, in that
order, each with its signature and its docstring verbatim (Args / Returns / shapes as the code states them), so
the reference cannot drift from the code: tests/api/test_api_reference.py runs `--check`.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import pathlib
import re
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "api.md"
MODULES = [
    ("hybrax", "Operations, configs and tools"),
    ("hybrax.serving", "Serving: slot-indexed pools for decode and prefill"),
    ("hybrax.parallel", "Context parallelism"),
    ("hybrax.nn", "Layers (Flax NNX; the `nn` extra)"),
]
HEADER = """# API reference

Generated from the docstrings by `python scripts/api_reference.py`; do not edit by hand.
Arrays are laid out [batch, seq_len, heads, head_dim] ([B, T, H, D]) unless a signature says otherwise;
`coming_from.md` maps the names of flash-linear-attention, jax.nn and ejkernel onto these.
"""


def _signature(name: str, obj: object) -> str:
    try:
        text = f"{name}{inspect.signature(obj)}"
    except (TypeError, ValueError):
        return name
    # Addresses and typing's module prefixes are noise in a reference (and would differ between runs).
    text = re.sub(r" at 0x[0-9a-f]+", "", text)
    text = re.sub(r"\b(?:jaxtyping|jax\.?_?src[\w.]*|typing|hybrax[\w.]*)\.(\w)", r"\1", text)
    return text


def _kind(obj: object) -> str:
    if inspect.isclass(obj):
        return "class"
    return "function" if callable(obj) else "value"


def _entry(module: str, name: str, obj: object) -> list[str]:
    doc = inspect.getdoc(obj) or "(no docstring)"
    lines = [f"### `{module}.{name}`", "", f"*{_kind(obj)}*", ""]
    if callable(obj):
        lines += ["```python", _signature(name, obj), "```", ""]
    return lines + ["```text", doc, "```", ""]


def render() -> str:
    """The whole page, from the modules as imported now."""
    out = [HEADER]
    for module_name, title in MODULES:
        module = importlib.import_module(module_name)
        out += [f"## {title}", "", f"`import {module_name}`", ""]
        names = list(getattr(module, "__all__", []))
        out += [", ".join(f"[`{name}`](#{module_name.replace('.', '')}{name.lower()})" for name in names), ""]
        for name in names:
            out += _entry(module_name, name, getattr(module, name))
    return "\n".join(out).rstrip() + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="compare instead of writing")
    args = parser.parse_args()
    page = render()
    if args.check:
        if PAGE.read_text(encoding="utf-8") != page:
            print(f"{PAGE} is out of date: run python scripts/api_reference.py", file=sys.stderr)
            return 1
        return 0
    PAGE.write_text(page, encoding="utf-8")
    print(f"wrote {PAGE} ({page.count(chr(10))} lines)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
