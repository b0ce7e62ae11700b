"""KDA chunked forward, stage 1c (Pallas, Triton lowering): the WY form and the decayed keys and queries.

One program per (chunk, value head, batch), whole-chunk tiles and two [C, C] x [C, K | V] matmuls:

    w  = T (beta k exp(G)),  u = T (beta v)         T = (I + A_kk)^-1 from stage 1b
    kg = k exp(G_last - G)                          keys decayed to the chunk's end (state update)
    qg = q exp(G)                                   queries decayed from the chunk's start (output)
    decay = exp(G_last)                             the chunk's total per-channel decay
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from hybrax.ops.kda.pallas_tiles import chunk_column_spec, chunk_rows_spec, dot_settings, mm


def _wy_kernel(
    q_ref, k_ref, v_ref, g_ref, beta_ref, inverse_ref, w_ref, u_ref, kg_ref, qg_ref, decay_ref,
    *, compute_dtype, precision,
):
    chunk = q_ref.shape[0]
    gates = g_ref[...]
    last = g_ref[chunk - 1, :]
    decay_ref[...] = jnp.exp(last)
    betas = beta_ref[...].astype(jnp.float32)[:, None]
    inverse = inverse_ref[...]
    keys = k_ref[...].astype(jnp.float32)
    w_ref[...] = mm(inverse, keys * betas * jnp.exp(gates), compute_dtype, precision).astype(w_ref.dtype)
    u_ref[...] = mm(inverse, v_ref[...].astype(jnp.float32) * betas, compute_dtype, precision).astype(u_ref.dtype)
    kg_ref[...] = (keys * jnp.exp(last[None, :] - gates)).astype(kg_ref.dtype)
    qg_ref[...] = (q_ref[...].astype(jnp.float32) * jnp.exp(gates)).astype(qg_ref.dtype)


@functools.partial(jax.jit, static_argnames=("chunk", "num_warps", "interpret"))
def chunk_wy(
    q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array, beta: jax.Array, inverse: jax.Array, *,
    chunk: int = 64, num_warps: int = 4, interpret: bool = False,
) -> tuple[jax.Array, ...]:
    """q, k [B, T, H, K]; v [B, T, HV, V]; g [B, T, HV, K] (fp32); beta [B, T, HV]; T [B, T, HV, chunk].

    Returns w, kg, qg [B, T, HV, K]; u [B, T, HV, V] (the inputs' dtype); decay [B, T/chunk, HV, K] fp32.
    """
    batch, length, heads, dk = q.shape
    dv, value_heads = v.shape[3], v.shape[2]
    group = value_heads // heads
    compute_dtype, precision = dot_settings(q.dtype, interpret)

    def rows_spec(width, group=1):
        return chunk_rows_spec(chunk, width, group)

    token_shape = (batch, length, value_heads)
    return pl.pallas_call(
        functools.partial(_wy_kernel, compute_dtype=compute_dtype, precision=precision),
        grid=(length // chunk, value_heads, batch),
        in_specs=[
            rows_spec(dk, group), rows_spec(dk, group), rows_spec(dv), rows_spec(dk), chunk_column_spec(chunk),
            rows_spec(chunk),
        ],
        out_specs=[
            rows_spec(dk), rows_spec(dv), rows_spec(dk), rows_spec(dk),
            pl.BlockSpec((None, None, None, dk), lambda t, h, b: (b, t, h, 0)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((*token_shape, dk), q.dtype),  # w
            jax.ShapeDtypeStruct((*token_shape, dv), q.dtype),  # u
            jax.ShapeDtypeStruct((*token_shape, dk), q.dtype),  # kg
            jax.ShapeDtypeStruct((*token_shape, dk), q.dtype),  # qg
            jax.ShapeDtypeStruct((batch, length // chunk, value_heads, dk), jnp.float32),  # decay
        ],
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret,
        name="kda_chunk_wy",
    )(q, k, v, g, beta, inverse)
