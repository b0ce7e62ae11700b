"""One KDA decode step per request over a serving state pool (`kda_decode_pool`), as a server runs it.

Inputs: one token per request, q, k, v N(0, 1) in the benchmark's dtype; the raw gate and beta logits in fp32,
activated inside (bounded gate lower_bound * sigmoid(exp(a_log) * (g + dt_bias)) with lower_bound = -5, beta
through a sigmoid, L2 norm of q and k, scale K^-0.5); fp32 states [H, K, V] in a pool with one row per request,
named by slots in shuffled order. Implementations are named by platform ("auto", "xla", "pallas", "cuda": one
decode kernel each).

Work: the state read and written, 2 B H K V 4 bytes per step. Beside every row: the stream floor and the copy
bandwidth (`decode.py`).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from hybrax.bench.shapes import Shape
from hybrax.bench.workloads import decode
from hybrax.bench.workloads.base import Call, Declined, Inputs, Work, Workload, check_mode, split_impl, to_numpy
from hybrax.serving import kda_decode_pool

LOWER_BOUND = -5.0
MODES = ("fwd",)


def make_inputs(shape: Shape, dtype: Any) -> Inputs:
    keys = jax.random.split(jax.random.key(0), 9)
    batch, heads, dim = shape.batch, shape.heads, shape.head_dim
    token = (batch, 1, heads, dim)
    q, k, v = (jax.random.normal(keys[i], token, dtype) for i in range(3))
    return {
        "q": q, "k": k, "v": v,
        "g": jax.random.normal(keys[3], token, jnp.float32),
        "beta": jax.random.normal(keys[4], token[:3], jnp.float32),
        "a_log": 0.5 * jax.random.normal(keys[5], (heads,), jnp.float32),
        "dt_bias": jax.random.normal(keys[6], (heads, dim), jnp.float32),
        "state": jax.random.normal(keys[7], (batch, heads, dim, dim), jnp.float32),  # request order
        "slots": jax.random.permutation(keys[8], batch).astype(jnp.int32),
    }


def step_inputs(inputs: Inputs) -> tuple:
    return tuple(inputs[name] for name in ("q", "k", "v", "g", "beta", "a_log", "dt_bias", "slots"))


def pool_of(inputs: Inputs) -> jax.Array:
    """The pool holding request b's state in row slots[b]."""
    return jnp.zeros_like(inputs["state"]).at[inputs["slots"]].set(inputs["state"])


def ours(impl: str, shape: Shape, inputs: Inputs, mode: str) -> Call:
    check_mode("kda_decode", mode, MODES)
    platform, backend = split_impl(impl)
    if backend != "auto":
        raise Declined(f"kda_decode takes a platform (auto, xla, pallas, cuda), each with one decode kernel; "
                       f"got {impl!r}")

    def step(pool, arrays):
        q, k, v, g, beta, a_log, dt_bias, slots = arrays
        return kda_decode_pool(q, k, v, g, beta, pool, slots, a_log=a_log, dt_bias=dt_bias, lower_bound=LOWER_BOUND,
                               gate="bounded", beta_is_logits=True, platform=None if platform == "auto" else platform)

    arrays = step_inputs(inputs)
    one_step = jax.jit(step)
    return decode.carried_call(step, pool_of(inputs), arrays, decode.steps_for(shape.batch * shape.heads),
                               output=lambda: to_numpy(one_step(pool_of(inputs), arrays)[0]))


def work(shape: Shape, mode: str, dtype: Any) -> Work:
    return Work(bytes=2 * shape.batch * shape.heads * shape.head_dim**2 * 4)


def extras(shape: Shape, inputs: Inputs, mode: str, measure) -> dict[str, Any]:
    """The stream floor's time per step and the copy bandwidth (where there is one)."""
    floor = decode.carried_call(decode.stream_step, pool_of(inputs), None,
                                 decode.steps_for(shape.batch * shape.heads))
    found = {"floor_ms": measure(floor).median_ms / floor.steps}
    bandwidth = decode.copy_bandwidth(measure)
    if bandwidth:
        found["copy_gbps"] = bandwidth / 1e9
    return found


WORKLOAD = Workload(
    op="kda_decode", families=("kda_decode",), impls=("auto",), anchors=("fla",), modes=MODES,
    inputs=make_inputs, ours=ours, work=work, extras=extras,
)
