"""Anchors: other libraries' implementations of the same problem, timed beside ours on the same inputs.

Each anchor module has `build(op, shape, inputs, mode) -> Call` (raising `Declined` with the reason when it has
no counterpart of the op or shape, or its library is not installed) and `versions() -> {package: version}`.
None is a dependency of hybrax: an anchor that cannot be imported declines and the run goes on.

    fla       flash-linear-attention (PyTorch + Triton; CUDA GPUs): chunk_kda, chunk_gla, chunk_simple_gla,
              fused_recurrent_kda
    tokamax   tokamax's kimi_delta_attention (its xla_chunked implementation)
    jla       jax-linear-attention's linear_attention (its Mosaic GPU kernels on a GPU)
    cudnn     jax.nn.dot_product_attention(implementation="cudnn")
    jax_nn    jax.nn.dot_product_attention(implementation="xla")
"""

from __future__ import annotations

import importlib
import importlib.metadata

from hybrax.bench.shapes import Shape
from hybrax.bench.workloads.base import Call, Declined, Inputs

ANCHORS = {
    "fla": "hybrax.bench.anchors.fla",
    "tokamax": "hybrax.bench.anchors.tokamax",
    "jla": "hybrax.bench.anchors.jla",
    "cudnn": "hybrax.bench.anchors.jax_nn",
    "jax_nn": "hybrax.bench.anchors.jax_nn",
}


def build(name: str, op: str, shape: Shape, inputs: Inputs, mode: str) -> Call:
    """The anchor's Call for this problem; Declined says why there is none."""
    if name not in ANCHORS:
        raise ValueError(f"anchor must be one of {sorted(ANCHORS)}, got {name!r}")
    return importlib.import_module(ANCHORS[name]).build(name, op, shape, inputs, mode)


def installed_version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def versions(name: str) -> dict[str, str]:
    """The versions of the packages the anchor runs on (those installed)."""
    packages = importlib.import_module(ANCHORS[name]).PACKAGES
    return {package: version for package in packages if (version := installed_version(package))}


def require(module: str, package: str) -> object:
    """Import `module` (of the pip package `package`), or decline saying it is not installed."""
    try:
        return importlib.import_module(module)
    except ImportError as error:
        raise Declined(f"{package} is not installed ({error}); pip install {package}") from error


__all__ = ["ANCHORS", "Declined", "build", "installed_version", "require", "versions"]
