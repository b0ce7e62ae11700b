"""Value checks: what shapes and dtypes cannot tell (a log decay above 0, a beta outside [0, 1], a NaN).

An eager call knows its values, so the public entry points check them before running (one reduction per
checked array) and raise ValueError naming the argument, the first offending value and its index. Under a
trace (jit, grad, vmap) the values exist only at run time: the checks are skipped, unless the computation
runs through `checked(fn)`, which compiles them into the program with jax.experimental.checkify and raises
the same ValueError after the call.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, TypeVar

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import checkify

from hybrax.core.validate import is_concrete

F = TypeVar("F", bound=Callable[..., Any])

# Part of jax.jit's cache key: a function traced with the checks is never reused for one traced without.
_CHECKING = jax.make_user_context(default_value=False)


def checked(fn: F) -> F:
    """fn with hybrax's value checks compiled into its traces; a failed check raises ValueError (checkify's
    JaxRuntimeError) once fn has run. Works with jitted fn, and fn that jits, grads or vmaps inside.

        step = hybrax.checked(jax.jit(train_step))
        step(params, batch)  # ValueError: g must be <= 0 (a log decay) ...
    """
    checkified = checkify.checkify(fn, errors=checkify.user_checks)

    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        with _CHECKING(True):
            error, out = checkified(*args, **kwargs)
        error.throw()
        return out

    return run  # type: ignore[return-value]


def check_values(name: str, x: Any, ok: Callable[[jax.Array], jax.Array], need: str, hint: str = "") -> None:
    """Every element of x satisfies `ok` (elementwise; make it False for NaN where NaN is wrong). `need` says
    what in words ('<= 0'), `hint` adds what the mistake usually is. x None, empty, or traced outside `checked`:
    nothing to check."""
    if x is None or np.size(x) == 0 or not (is_concrete(x) or _CHECKING.value):
        return
    hint = f"; {hint}" if hint else ""
    if is_concrete(x):
        with jax.ensure_compile_time_eval():  # computed now, even while an enclosing function is traced
            count, value, index = _first_failure(x, ok)
        if int(count):
            raise ValueError(f"{name} must be {need}, got {value.item()} at index {[int(i) for i in index]} "
                             f"({int(count)} of {np.size(x)} values){hint}")
        return
    count, value, index = _first_failure(x, ok)
    at = "[" + ", ".join(["{}"] * len(index)) + "]"
    checkify.check(count == 0, f"{name} must be {need}, got {{}} at index {at} ({{}} of {np.size(x)} values){hint}",
                   value, *index, count)


def _first_failure(x: Any, ok: Callable[[jax.Array], jax.Array]) -> tuple[jax.Array, jax.Array, tuple[jax.Array, ...]]:
    """(how many elements fail `ok`, the first failing value, its index: one coordinate per axis)."""
    values = jnp.asarray(x)
    bad = jnp.logical_not(ok(values)).reshape(-1)
    first = jnp.argmax(bad)
    return jnp.sum(bad, dtype=jnp.int32), values.reshape(-1)[first], jnp.unravel_index(first, values.shape)


def check_finite(name: str, x: Any) -> None:
    check_values(name, x, jnp.isfinite, "finite (no NaN or inf)")


def check_not_nan(name: str, x: Any) -> None:
    check_values(name, x, lambda values: jnp.logical_not(jnp.isnan(values)), "free of NaN")


def check_log_decay(name: str, x: Any, hint: str = "") -> None:
    """x <= 0 everywhere: a log decay, exp(x) in [0, 1]; -inf (a full reset) passes, NaN does not."""
    check_values(name, x, lambda values: values <= 0, f"<= 0 (a log decay: exp({name}) in [0, 1])", hint)


def check_unit_interval(name: str, x: Any, hint: str = "") -> None:
    check_values(name, x, lambda values: (values >= 0) & (values <= 1), "in [0, 1]", hint)
