"""Canonical problems: what a public function hands to its implementations after validation.

A problem is a frozen dataclass registered as a JAX pytree. Array fields (possibly None) are its
leaves, so a problem passes through `jax.jit`, `jax.vmap` and `jax.custom_vjp` like any pytree;
fields made with `static_field()` are hashable metadata (flags, scales, sizes) and take part in
the cache key of an invocation.
"""

from __future__ import annotations

import dataclasses
from typing import Any, TypeVar

import jax
import jax.numpy as jnp
import numpy as np

P = TypeVar("P")

_STATIC = "hybrax_static"


def static_field(default: Any = dataclasses.MISSING) -> Any:
    """A problem field that is not an array: hashable, part of the invocation's key."""
    return dataclasses.field(default=default, metadata={_STATIC: True})


def problem_dataclass(cls: type[P]) -> type[P]:
    """Make `cls` a frozen dataclass and register it as a pytree (arrays as leaves)."""
    cls = dataclasses.dataclass(frozen=True)(cls)
    fields = dataclasses.fields(cls)
    data_fields = [f.name for f in fields if not f.metadata.get(_STATIC)]
    meta_fields = [f.name for f in fields if f.metadata.get(_STATIC)]
    return jax.tree_util.register_dataclass(cls, data_fields=data_fields, meta_fields=meta_fields)


def array_fields(problem: Any) -> dict[str, Any]:
    """The problem's array fields by name (None where absent)."""
    return {
        f.name: getattr(problem, f.name)
        for f in dataclasses.fields(problem)
        if not f.metadata.get(_STATIC)
    }


def static_fields(problem: Any) -> dict[str, Any]:
    """The problem's static fields by name."""
    return {
        f.name: getattr(problem, f.name)
        for f in dataclasses.fields(problem)
        if f.metadata.get(_STATIC)
    }


def _zero_cotangent(array: Any) -> Any:
    if array is None:
        return None
    if jnp.issubdtype(array.dtype, jnp.inexact):
        return jnp.zeros(array.shape, array.dtype)
    # Integer inputs (segment ids, cu_seqlens) take float0 cotangents in custom VJPs.
    return np.zeros(array.shape, dtype=jax.dtypes.float0)


def cotangent(problem: P, **grads: Any) -> P:
    """A cotangent shaped like `problem`: the given gradients, zeros (or float0) elsewhere."""
    unknown = set(grads) - set(array_fields(problem))
    if unknown:
        raise TypeError(f"cotangent: {sorted(unknown)} are not array fields of {type(problem).__name__}")
    values = {
        name: (grads[name] if name in grads and array is not None else _zero_cotangent(array))
        for name, array in array_fields(problem).items()
    }
    return dataclasses.replace(problem, **values)
