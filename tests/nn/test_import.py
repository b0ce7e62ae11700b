"""hybrax imports without Flax; hybrax.nn, without it, says which extra to install."""

from __future__ import annotations

import os
import subprocess
import sys

WITHOUT_FLAX = """
import sys
sys.modules["flax"] = None  # `import flax` now raises ImportError, as if it were not installed
import hybrax, hybrax.serving
try:
    import hybrax.nn
except ImportError as error:
    print(error)
"""


def test_hybrax_needs_no_flax_and_hybrax_nn_names_the_extra():
    result = subprocess.run([sys.executable, "-c", WITHOUT_FLAX], capture_output=True, text=True, timeout=120,
                            env=dict(os.environ, JAX_PLATFORMS="cpu"))
    assert result.returncode == 0, result.stderr
    assert "hybrax.nn needs Flax" in result.stdout and "pip install 'hybrax[nn]'" in result.stdout, result.stdout
