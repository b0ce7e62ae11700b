"""What every benchmark op is made of: its inputs for a shape, our implementations as timed calls, and its work.

An op (`Workload`) builds, for a `Shape` and a mode ("fwd", or "fwd+bwd": the gradient of sum(out * d_out) for
every differentiable input), a `Call`: a function of no arguments that runs one unit of work (one jitted call,
or a loop of `steps` decode steps), and optionally the forward output for a cross-check against the anchors.
`work` gives the FLOPs or the bytes of one step, for TFLOP/s or GB/s.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from hybrax.bench.shapes import Shape

MODES = ("fwd", "fwd+bwd")
Inputs = dict[str, Any]


class Declined(Exception):
    """An implementation or anchor that cannot run this problem here; the message says why."""


@dataclasses.dataclass(frozen=True)
class Call:
    """run() does `steps` steps of the op and returns what to wait for; framework: "jax" or "torch";
    output(): the forward output on the benchmark's inputs as float32 NumPy in hybrax's layout (fwd only);
    memory_mb(): the memory the call holds at its peak."""

    run: Callable[[], Any]
    framework: str = "jax"
    steps: int = 1
    output: Callable[[], np.ndarray] | None = None
    memory_mb: Callable[[], float] | None = None


@dataclasses.dataclass(frozen=True)
class Work:
    """FLOPs or bytes moved by one step (None: not counted)."""

    flops: float | None = None
    bytes: float | None = None


@dataclasses.dataclass(frozen=True)
class Workload:
    """One op of the runner.

    families: the shape families it takes; impls: the implementations timed by default ("platform:backend",
    "platform" or "auto"); anchors: the anchors that have a counterpart; inputs(shape, dtype) -> Inputs;
    ours(impl, shape, inputs, mode) -> Call; work(shape, mode, dtype) -> Work; extras(shape, inputs, mode, measure)
    -> fields recorded beside every row of the shape and mode (floors, baselines; measure(Call) -> Timing), or None.
    """

    op: str
    families: tuple[str, ...]
    impls: tuple[str, ...]
    anchors: tuple[str, ...]
    modes: tuple[str, ...]
    inputs: Callable[[Shape, Any], Inputs]
    ours: Callable[[str, Shape, Inputs, str], Call]
    work: Callable[[Shape, str, Any], Work]
    extras: Callable[..., dict[str, Any]] | None = None


def split_impl(impl: str) -> tuple[str, str]:
    """'pallas:chunked' -> ('pallas', 'chunked'); 'pallas' -> ('pallas', 'auto'); 'auto' -> ('auto', 'auto')."""
    platform, _, backend = impl.partition(":")
    return platform, backend or "auto"


def config_for(config_type: type, impl: str) -> Any:
    """The config that names `impl` (None for "auto": the library's own choice); knobs take their defaults."""
    platform, backend = split_impl(impl)
    return None if platform == "auto" else config_type(platform, backend)


def first(out: Any) -> jax.Array:
    """The output of an op that may also return states or pools."""
    return out[0] if isinstance(out, (tuple, list)) else out


def to_numpy(x: Any) -> np.ndarray:
    return np.asarray(jnp.asarray(x, jnp.float32))


def compiled_memory_mb(jitted: Any, args: Sequence[Any]) -> float:
    """Arguments + outputs + temporaries of the compiled function: what it holds at its peak."""
    stats = jitted.lower(*args).compile().memory_analysis()
    if stats is None:
        raise Declined("this backend reports no memory analysis")
    return (stats.argument_size_in_bytes + stats.output_size_in_bytes + stats.temp_size_in_bytes) / 2**20


def jax_call(forward: Callable[..., Any], args: Sequence[Any], mode: str, cotangent: jax.Array) -> Call:
    """A jitted call of forward(*args) ("fwd"), or of the gradient of sum(first(out) * cotangent) with respect to
    every argument ("fwd+bwd"; the cotangent is an argument, not a constant folded into the program)."""
    args = tuple(args)
    if mode == "fwd":
        jitted = jax.jit(forward)
        return Call(run=lambda: jitted(*args), output=lambda: to_numpy(first(jitted(*args))))

    def loss(*arrays):
        *inputs, d_out = arrays
        return jnp.sum(first(forward(*inputs)).astype(jnp.float32) * d_out)

    gradient = jax.jit(jax.grad(loss, argnums=tuple(range(len(args)))))
    with_cotangent = (*args, cotangent)
    return Call(run=lambda: gradient(*with_cotangent),
                memory_mb=lambda: compiled_memory_mb(gradient, with_cotangent))


def check_mode(op: str, mode: str, modes: Sequence[str]) -> None:
    if mode not in modes:
        raise Declined(f"{op} is timed in modes {tuple(modes)}, not {mode!r}")
