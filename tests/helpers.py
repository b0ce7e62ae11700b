"""Shared test helpers: relative error against float64 references, random inputs, lowering for a GPU."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from hybrax.core import relative_error

# Tolerances on ||out - ref|| / ||ref|| by input dtype.
TOLERANCE = {jnp.float32: 1e-5, jnp.bfloat16: 1e-2, jnp.float16: 5e-3}


def assert_close(out: Any, ref: Any, tol: float, what: str = "output") -> float:
    """Assert relative error <= tol for every leaf (NaN/inf in `out` always fails)."""
    for index, (o, r) in enumerate(zip(jax.tree.leaves(out), jax.tree.leaves(ref), strict=True)):
        o = np.asarray(jnp.asarray(o, jnp.float32) if jnp.asarray(o).dtype == jnp.bfloat16 else o)
        assert o.shape == np.shape(r), f"{what}[{index}]: shape {o.shape} != reference {np.shape(r)}"
        error = relative_error(o, r)
        assert error <= tol, f"{what}[{index}]: relative error {error:.3e} > {tol:.1e}"
    return error


def normal(seed: int, shape: tuple[int, ...], dtype: Any = jnp.float32, scale: float = 1.0) -> jax.Array:
    return (scale * jax.random.normal(jax.random.key(seed), shape, jnp.float32)).astype(dtype)


def to64(x: Any) -> np.ndarray | None:
    return None if x is None else np.asarray(jnp.asarray(x, jnp.float32), np.float64)


def on_h200(invocation: Any) -> Any:
    """The same invocation as an H200 call would build it (which implementations `auto` may take there)."""
    return dataclasses.replace(invocation, device="gpu", device_kind="NVIDIA H200")


def lower_for_h200(fn, *args) -> str:
    """The StableHLO text of fn(*args) (ShapeDtypeStructs) lowered for an H200, without one."""
    h200 = jax.sharding.AbstractDevice(device_kind="NVIDIA H200", num_cores=132, platform="cuda")
    with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((1,), ("x",), abstract_device=h200)):
        return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def pretend_h200_cudnn_limits(monkeypatch) -> None:
    """An H200's cuDNN limits wherever the tests run: its compute capability (jax.nn asks the CUDA plugin; the
    CPU has none) and the head dims cuDNN takes there."""
    from jax._src.cudnn import fused_attention_stablehlo

    from hybrax.ops.attention import cudnn

    monkeypatch.setattr(fused_attention_stablehlo, "check_compute_capability", lambda capability: True)
    monkeypatch.setattr(cudnn, "max_head_dim", lambda: 256)


def pretend_h200_with_cudnn(monkeypatch) -> None:
    """What an H200 would answer, wherever the tests run: its cuDNN limits, the runtime device (read when the
    executor resolves a traced call) and cuDNN's version (jax.nn asks before lowering)."""
    from jax._src.cudnn import fused_attention_stablehlo

    from hybrax.core import kernel

    pretend_h200_cudnn_limits(monkeypatch)
    monkeypatch.setattr(kernel, "runtime_device", lambda: "gpu")
    monkeypatch.setattr(fused_attention_stablehlo, "check_cudnn_version", lambda: 91000)
