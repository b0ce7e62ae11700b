"""KDA's inter-chunk step for the TPU kernels, on values in VMEM: the state S [K, V] (fp32, carried in a VMEM
scratch across the sequential chunk axis of the grid) through one chunk, in the WY / UT form:

    v_new = u - w S                          the chunk's delta-rule corrections
    o     = qg S + A_qk v_new                the chunk's output
    S'    = Diag(exp(G_C)) S + kg^T v_new    decayed to the chunk's end, then updated

with w = T (beta k exp(G)), u = T (beta v), qg = scale q exp(G), kg = k exp(G_C - G) (`chunk_fwd`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from hybrax.ops.kda.pallas_tpu.dots import Dot


def row_to_column(row: jax.Array) -> jax.Array:
    """[1, n] -> [n, 1], through a diagonal select and a lane sum (no narrow transpose)."""
    n = row.shape[1]
    eye = lax.broadcasted_iota(jnp.int32, (n, n), 0) == lax.broadcasted_iota(jnp.int32, (n, n), 1)
    return jnp.sum(jnp.where(eye, jnp.broadcast_to(row, (n, n)), 0.0), axis=1, keepdims=True)


def state_step(
    state: jax.Array, w: jax.Array | None, u: jax.Array, qg: jax.Array, aqk: jax.Array, kg: jax.Array,
    decay: jax.Array, dot: Dot,
) -> tuple[jax.Array, jax.Array]:
    """(o [C, V], S' [K, V]) fp32 from the state S entering the chunk and the chunk's terms: w, qg, kg [C, K],
    u [C, V], A_qk [C, C] (masked), decay [1, K] = exp(G_C). w None: no delta rule (gated linear attention,
    v_new = u = v). For bf16 inputs `dot` takes bf16 operands (the state too, as flash-linear-attention's
    kernels), accumulating in fp32."""
    entering = dot.operand(state)
    v_new = u if w is None else u - dot(w, entering)
    corrections = dot.operand(v_new)
    o = dot(qg, entering) + dot(aqk, corrections)
    return o, row_to_column(decay) * state + dot(kg, corrections, "tn")
