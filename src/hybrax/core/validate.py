"""Argument checks shared by every op: errors name the argument, what it got and what it needs."""

from __future__ import annotations

import math
import numbers
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np


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


def is_concrete(x: Any) -> bool:
    """False for a traced value (under jit): its value is known only at run time, so value checks skip it."""
    return not isinstance(x, jax.core.Tracer)


def check_bool(name: str, array: Any) -> None:
    if jnp.result_type(array) != jnp.bool_:
        raise ValueError(f"{name} must be a bool array, got dtype {jnp.result_type(array)}")


def check_dtype(name: str, array: Any, dtype: Any, why: str) -> None:
    """`why` says what the array holds that needs `dtype`, e.g. 'the recurrent state'."""
    if jnp.result_type(array) != dtype:
        raise ValueError(f"{name} must be {jnp.dtype(dtype).name} ({why}), got {jnp.result_type(array)}")


def _real_number(value: Any) -> float | None:
    """value as a float if it is a concrete real scalar (a Python or numpy number, or a 0-d array), else None."""
    if isinstance(value, (bool, np.bool_)) or not is_concrete(value):
        return None
    if isinstance(value, numbers.Real):
        return float(value)
    if isinstance(value, (np.ndarray, jax.Array)) and value.ndim == 0 and (
            jnp.issubdtype(value.dtype, jnp.floating) or jnp.issubdtype(value.dtype, jnp.integer)):
        return float(value)
    return None


def check_number(name: str, value: Any, need: str, accept: Callable[[float], bool]) -> float:
    """A finite real scalar (Python or numpy, not traced: ops hold it as a static) for which accept(value) holds,
    as a float; `need` says what in words for the message, e.g. 'a number <= 0'."""
    number = _real_number(value)
    if number is None or not math.isfinite(number) or not accept(number):
        raise ValueError(f"{name} must be {need} (a finite Python or numpy number, not traced), got {value!r}")
    return number


def check_positive_number(name: str, value: Any) -> float:
    return check_number(name, value, "a number > 0", lambda number: number > 0)


def check_at_least_one(name: str, array: Any, axes: dict[int, str]) -> None:
    """Each named axis of `array` ({position: name}, e.g. {3: "head_dim"}) has size >= 1."""
    shape = jnp.shape(array)
    empty = [axis_name for axis, axis_name in axes.items() if shape[axis] < 1]
    if empty:
        raise ValueError(f"{name} must have {' and '.join(empty)} of at least 1, got shape {describe(shape)}")


def check_cu_seqlens(cu_seqlens: Any, batch: int, length: int, batch_of: str) -> None:
    """The packed-sequence rule of every op that takes `cu_seqlens`: an integer array [num_sequences + 1] with
    num_sequences >= 1, packing sequences into a batch of one of `length` tokens (`batch_of` names the array
    whose batch that is); cu_seqlens[0] == 0, never decreasing (empty sequences allowed), cu_seqlens[-1] <=
    length. Sequence n is tokens cu_seqlens[n]:cu_seqlens[n + 1]; tokens from cu_seqlens[-1] on belong to no
    sequence: their outputs are zeros and they change no state. Values are checked unless traced (under jit)."""
    check_integer("cu_seqlens", cu_seqlens)
    check_rank("cu_seqlens", cu_seqlens, 1, "[num_sequences + 1]")
    if jnp.shape(cu_seqlens)[0] < 2:
        raise ValueError(f"cu_seqlens must have shape [num_sequences + 1] with at least 2 entries, "
                         f"got {describe(jnp.shape(cu_seqlens))}")
    if batch != 1:
        raise ValueError(f"cu_seqlens needs a batch of one (packed sequences), got {batch_of} batch {batch}")
    if is_concrete(cu_seqlens):
        bounds = np.asarray(cu_seqlens)
        if bounds[0] != 0 or np.any(np.diff(bounds) < 0) or bounds[-1] > length:
            raise ValueError(
                f"cu_seqlens must start at 0, never decrease and end at most at seq_len {length}, got {bounds.tolist()}"
            )


def check_rows(name: str, rows: Any, num_rows: int, count_name: str = "num_slots") -> None:
    """Indices of pool rows, -1 for none: when concrete, each in [-1, num_rows) (the gathers would clamp and the
    scatters drop anything else) and the rows named at most once (two writes to one row race)."""
    if not is_concrete(rows):
        return
    values = np.asarray(rows).reshape(-1)
    outside = values[(values < -1) | (values >= num_rows)]
    if outside.size:
        raise ValueError(f"{name} must be -1 (none) or a row in [0, {count_name} = {num_rows}), "
                         f"got {np.unique(outside).tolist()}")
    named, counts = np.unique(values[values >= 0], return_counts=True)
    if np.any(counts > 1):
        raise ValueError(f"{name} must name each row at most once (two writes to one row would race), "
                         f"got {named[counts > 1].tolist()} more than once")
