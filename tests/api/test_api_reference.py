"""docs/api.md is what scripts/api_reference.py makes of the public docstrings now: a changed signature or
docstring without the page regenerated fails here, naming the command that fixes it."""

from __future__ import annotations

import importlib.util
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _generator():
    spec = importlib.util.spec_from_file_location("api_reference", ROOT / "scripts" / "api_reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_api_page_is_current():
    generator = _generator()
    page = (ROOT / "docs" / "api.md").read_text(encoding="utf-8")
    assert page == generator.render(), "docs/api.md is out of date: run python scripts/api_reference.py"


def test_every_public_name_has_a_docstring_of_its_own():
    """A class that only inherits its base's docstring (or none) says nothing about itself in the reference."""
    import inspect

    generator = _generator()
    missing = []
    for module_name, _ in generator.MODULES:
        module = importlib.import_module(module_name)
        for name in module.__all__:
            obj = getattr(module, name)
            own = obj.__dict__.get("__doc__") if inspect.isclass(obj) else getattr(obj, "__doc__", None)
            if callable(obj) and not (own or "").strip():
                missing.append(f"{module_name}.{name}")
    assert not missing, f"public names without a docstring of their own: {missing}"
