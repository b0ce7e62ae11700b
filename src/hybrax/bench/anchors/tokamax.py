"""tokamax's `kimi_delta_attention`, implementation xla_chunked, on the benchmark's KDA inputs (dense shapes).

Its xla_chunked path takes only its fused bounded gate, g = lower_bound * sigmoid(exp(a_log) * raw); with
a_log = 0 and lower_bound = -5 the raw gate logit(g / -5) reproduces the benchmark's per-channel log decay g
(a check of its output against ours says so). Its layout is [H, B, T, K]: inputs are transposed before the
timing, and its output back for the check.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from hybrax.bench.anchors import require
from hybrax.bench.shapes import Shape
from hybrax.bench.workloads.base import Call, Declined, Inputs, first, jax_call, to_numpy

PACKAGES = ("tokamax",)
LOWER_BOUND = -5.0


def _raw_gate(g: jax.Array) -> jax.Array:
    """The raw gate whose bounded activation at a_log = 0 is g: logit(g / lower_bound)."""
    share = jnp.clip(g / LOWER_BOUND, 1e-7, 1.0 - 1e-7)
    return jnp.log(share) - jnp.log1p(-share)


def build(name: str, op: str, shape: Shape, inputs: Inputs, mode: str) -> Call:
    if op != "kda":
        raise Declined(f"tokamax is an anchor of kda only, not {op}")
    if inputs["cu_seqlens"] is not None:
        raise Declined("tokamax's xla_chunked KDA takes no packed sequences")
    api = require("tokamax._src.ops.kda.api", "tokamax")
    heads_first = lambda x: jnp.moveaxis(x, 2, 0)  # noqa: E731 - [B, T, H, ...] -> [H, B, T, ...]
    arrays = {**inputs, "g": _raw_gate(inputs["g"])}
    args = [heads_first(arrays[name]) for name in ("q", "k", "v", "g", "beta")]
    a_log = jnp.zeros((shape.heads,), jnp.float32)

    def forward(q, k, v, gate, beta) -> Any:
        return api.kimi_delta_attention(
            q, k, v, gate, beta, a_log=a_log, scale=shape.head_dim ** -0.5, output_final_state=True,
            use_qk_l2norm=True, use_gate_in_kernel=True, lower_bound=LOWER_BOUND, implementation="xla_chunked",
        )

    call = jax_call(forward, args, mode, heads_first(inputs["d_out"]))
    if mode != "fwd":
        return call
    jitted = jax.jit(forward)
    return Call(run=call.run, output=lambda: to_numpy(jnp.moveaxis(first(jitted(*args)), 0, 2)))
