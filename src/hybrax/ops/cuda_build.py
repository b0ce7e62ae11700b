"""What every op's CUDA C++ kernels share: building a `.cu` file with nvcc at first use, loading it and registering
its XLA FFI handlers.

A kernel ships as source beside its Python wrapper. On the first call on a GPU it is compiled for that GPU's
compute capability (`-gencode=arch=compute_XY,code=sm_XY`, so Hopper's own instructions are used) against the
XLA FFI headers jaxlib carries, into a cache folder (`$HYBRAX_CACHE_DIR`, default `~/.cache/hybrax/cuda`), named
by a hash of everything that changes the binary; later processes load the cached library. nvcc is found on
`$HYBRAX_NVCC`, the PATH, `$CUDA_HOME/bin` or `/usr/local/cuda/bin`. Without a GPU or nvcc the implementations
that need it decline with the reason (`unavailable_reason`), and `auto` takes the next one.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import jax

NVCC_FLAGS = ("-O3", "-std=c++17", "-shared", "-Xcompiler", "-fPIC")


@functools.cache
def nvcc_path() -> str | None:
    """The nvcc to build with, or None."""
    candidates = [os.environ.get("HYBRAX_NVCC"), shutil.which("nvcc")]
    candidates += [os.path.join(root, "bin", "nvcc") for root in (os.environ.get("CUDA_HOME"), "/usr/local/cuda")
                   if root]
    return next((path for path in candidates if path and os.access(path, os.X_OK)), None)


def unavailable_reason(device: str) -> str | None:
    """Why a CUDA kernel cannot run on `device` (the invocation's runtime device), or None."""
    if device != "gpu":
        return f"needs an NVIDIA GPU (runtime device: {device})"
    if nvcc_path() is None:
        return "needs nvcc (the CUDA toolkit) to build its kernel: set HYBRAX_NVCC or CUDA_HOME, or put nvcc on PATH"
    return None


def _cache_dir() -> Path:
    return Path(os.environ.get("HYBRAX_CACHE_DIR", Path.home() / ".cache" / "hybrax")) / "cuda"


def _compute_capability() -> str:
    """"90" for an H100/H200: the first GPU's compute capability, digits only."""
    return jax.devices("gpu")[0].compute_capability.replace(".", "")


@functools.cache
def load_library(source: Path, targets: tuple[tuple[str, str], ...]) -> ctypes.CDLL:
    """Build `source` (once per binary-changing input), load it, and register each (target name, C symbol) as a
    CUDA FFI target. Raises RuntimeError with nvcc's message when the build fails."""
    nvcc, arch = nvcc_path(), _compute_capability()
    if nvcc is None:
        raise RuntimeError(unavailable_reason("gpu"))
    version = subprocess.run([nvcc, "--version"], capture_output=True, text=True, check=True).stdout
    flags = [*NVCC_FLAGS, f"-gencode=arch=compute_{arch},code=sm_{arch}", "-isystem", jax.ffi.include_dir()]
    key = hashlib.sha256("\0".join([source.read_text(), version, jax.__version__, *flags]).encode()).hexdigest()
    library = _cache_dir() / f"{source.stem}-sm{arch}-{key[:16]}.so"
    if not library.exists():
        library.parent.mkdir(parents=True, exist_ok=True)
        # Build beside the target and rename: concurrent processes never load a half-written library.
        with tempfile.TemporaryDirectory(dir=library.parent) as scratch:
            built = Path(scratch) / library.name
            result = subprocess.run([nvcc, *flags, str(source), "-o", str(built)], capture_output=True, text=True)
            if result.returncode:
                raise RuntimeError(f"nvcc failed to build {source.name}:\n{result.stderr[-4000:]}")
            os.replace(built, library)
    loaded = ctypes.cdll.LoadLibrary(str(library))
    for name, symbol in targets:
        jax.ffi.register_ffi_target(name, jax.ffi.pycapsule(getattr(loaded, symbol)), platform="CUDA")
    return loaded
