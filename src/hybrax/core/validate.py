"""Argument checks shared by every op: errors name the argument, what it got and what it needs."""

from __future__ import annotations

from typing import Any, Sequence

import jax.numpy as jnp


def describe(shape: Sequence[Any]) -> str:
    return "[" + ", ".join(str(d) for d in shape) + "]"


def check_rank(name: str, array: Any, rank: int, layout: str) -> None:
    """`layout` is the expected shape in words, e.g. '[batch, seq_len, num_heads, head_dim]'."""
    shape = jnp.shape(array)
    if len(shape) != rank:
        raise ValueError(f"{name} must have shape {layout} ({rank} dims), got {describe(shape)}")


def check_shape(name: str, array: Any, expected: Sequence[int | None], layout: str) -> None:
    """`expected` holds sizes, None for any; `layout` names the axes for the message."""
    shape = tuple(jnp.shape(array))
    if len(shape) != len(expected) or any(e is not None and e != s for e, s in zip(expected, shape)):
        want = describe("*" if e is None else e for e in expected)
        raise ValueError(f"{name} must have shape {layout} = {want}, got {describe(shape)}")


def check_floating(name: str, array: Any) -> None:
    if not jnp.issubdtype(jnp.result_type(array), jnp.floating):
        raise ValueError(f"{name} must be a floating-point array, got dtype {jnp.result_type(array)}")


def check_integer(name: str, array: Any) -> None:
    if not jnp.issubdtype(jnp.result_type(array), jnp.integer):
        raise ValueError(f"{name} must be an integer array, got dtype {jnp.result_type(array)}")


def check_divides(small_name: str, small: int, big_name: str, big: int) -> None:
    if small <= 0 or big % small:
        raise ValueError(f"{small_name} ({small}) must divide {big_name} ({big})")
