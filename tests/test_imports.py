"""Every library module imports alone in a fresh interpreter, with `hybrax/__init__.py` bypassed: no module relies
on another having been imported first (an import cycle between an op's api and its backends, say). The
applications built on the public package (the benchmark runner, the demo) import alone through it."""

import pkgutil
import subprocess
import sys

import pytest

import hybrax

PACKAGE_PATH = hybrax.__path__[0]
MODULES = sorted(m.name for m in pkgutil.walk_packages(hybrax.__path__, "hybrax.") if not m.name.endswith("__main__"))
# A bare package object stands in for hybrax, so that only the module asked for (and what it imports) runs.
IMPORT_ALONE = (
    "import importlib, sys, types\n"
    "package = types.ModuleType('hybrax'); package.__path__ = [{path!r}]; sys.modules['hybrax'] = package\n"
    "importlib.import_module({name!r})\n"
)
OPTIONAL = ("hybrax.nn",)  # needs the `nn` extra
APPLICATIONS = ("hybrax.bench", "hybrax.demo")  # users of the public `hybrax` package
IMPORT_THROUGH_PACKAGE = "import importlib; importlib.import_module({name!r})\n"


def test_every_module_is_listed():
    assert "hybrax.ops.kda.base" in MODULES and "hybrax.ops.attention.api" in MODULES


def test_every_module_imports_alone():
    failures = []
    for name in MODULES:
        if name.startswith(OPTIONAL) and not _has("flax"):
            continue
        code = IMPORT_THROUGH_PACKAGE if name.startswith(APPLICATIONS) else IMPORT_ALONE
        done = subprocess.run([sys.executable, "-c", code.format(path=PACKAGE_PATH, name=name)],
                              capture_output=True, text=True, env={"JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin"})
        if done.returncode:
            failures.append(f"{name}: {done.stderr.strip().splitlines()[-1]}")
    assert not failures, "modules that do not import alone:\n" + "\n".join(failures)


def _has(module: str) -> bool:
    try:
        __import__(module)
    except ImportError:
        return False
    return True
