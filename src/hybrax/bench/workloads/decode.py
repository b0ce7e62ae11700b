"""What the decode benchmarks share: many steps in one jitted loop, and the floors a step is measured against.

A server runs a decode step per layer inside one program, with no host round trip between steps. So the
benchmarks run `steps` steps inside one jitted `lax.fori_loop` (unrolled: an XLA while loop costs some
microseconds per iteration on a GPU, which a server's program never pays), the state or cache donated and
carried in place, and report the time per step.

Floors: `stream_floor` is the same loop moving the same state in place with nothing else (S = 0.999 S, one XLA
fusion per step): no step that reads and writes the state can beat it. `copy_bandwidth` is a 1 GiB
device-to-device copy's bytes read plus written per second (accelerators only).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from hybrax.bench.workloads.base import Call

UNROLL = 10


def steps_for(rows: int) -> tuple[int, int]:
    """(steps per call, unroll) for a step over `rows` request x head rows: ~1000 steps for one request of 32
    heads, fewer as a step grows (a call stays well above its dispatch); few on the CPU, which has no queue to
    fill."""
    if jax.default_backend() == "cpu":
        return 10, 1
    steps = min(1000, max(UNROLL, round(1000 / math.sqrt(rows / 32) / UNROLL) * UNROLL))
    return steps, UNROLL


def decode_loop(step: Callable[[Any, Any], tuple[Any, Any]], steps: int, unroll: int) -> Callable:
    """loop(carry, inputs) -> (carry, output of the first step): `steps` steps of step(carry, inputs) ->
    (output, carry) in one jitted program, the carry donated (updated in place)."""

    @functools.partial(jax.jit, donate_argnums=(0,))
    def loop(carry, inputs):
        out, carry = step(carry, inputs)
        carry = lax.fori_loop(1, steps, lambda _, c: step(c, inputs)[1], carry, unroll=unroll)
        return carry, out

    return loop


def carried_call(step: Callable, carry: Any, inputs: Any, steps: tuple[int, int],
                 output: Callable | None = None) -> Call:
    """A Call running the decode loop of `step` for (steps, unroll), the carry (state or cache) threaded from call
    to call."""
    steps, unroll = steps
    loop = decode_loop(step, steps, unroll)
    held = {"carry": carry}

    def run():
        held["carry"], out = loop(held["carry"], inputs)
        return out

    return Call(run=run, steps=steps, output=output)


def stream_step(carry: jax.Array, inputs: Any) -> tuple[jax.Array, jax.Array]:
    """The floor's step: the state read and written once (the barrier keeps XLA from folding the steps)."""
    del inputs
    carry = lax.optimization_barrier(carry * 0.999)
    return carry.reshape(-1)[:1], carry


@functools.cache
def copy_bandwidth(measure: Callable[[Call], Any], size_bytes: int = 2**30) -> float | None:
    """Bytes read plus written per second by a device-to-device copy of `size_bytes` (None on the CPU)."""
    if jax.default_backend() == "cpu":
        return None
    source = jnp.ones((size_bytes // 4,), jnp.float32)
    copy = jax.jit(jnp.copy)
    timing = measure(Call(run=lambda: copy(source)))
    return 2 * size_bytes / (timing.median_ms * 1e-3)
