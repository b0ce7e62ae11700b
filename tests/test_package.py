"""The installed package: its version, its license and what `hybrax` exports, without optional extras."""

import importlib.metadata
import subprocess
import sys

import hybrax


def test_version_matches_the_distribution():
    assert hybrax.__version__ == importlib.metadata.version("hybrax")


def test_exports_resolve():
    missing = [name for name in hybrax.__all__ if not hasattr(hybrax, name)]
    assert not missing, f"hybrax.__all__ names {missing}, which hybrax does not define"


def test_import_needs_no_optional_extra():
    """`import hybrax` must work with flax and optax absent (the `nn` extra is optional)."""
    code = (
        "import sys; sys.modules['flax'] = None; sys.modules['optax'] = None\n"
        "import hybrax, hybrax.serving, hybrax.parallel\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
