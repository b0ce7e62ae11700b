"""KDA chunked forward, stage 3 (Pallas, Triton lowering): the output.

One program per (chunk, value head, batch): o = qg h_t + A_qk v_new, the contribution of the
state before the chunk plus the chunk's own causal part (qg and A_qk carry the scale and decay).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from hybrax.ops.kda.pallas_tiles import chunk_rows_spec, chunk_state_spec, dot_settings


def _output_kernel(qg_ref, h_ref, aqk_ref, v_new_ref, o_ref, *, precision):
    inter = jnp.dot(qg_ref[...], h_ref[...], precision=precision, preferred_element_type=jnp.float32)
    intra = jnp.dot(aqk_ref[...], v_new_ref[...], precision=precision, preferred_element_type=jnp.float32)
    o_ref[...] = (inter + intra).astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("chunk", "num_warps", "interpret"))
def chunk_output(
    qg: jax.Array, h: jax.Array, aqk: jax.Array, v_new: jax.Array, *,
    chunk: int = 64, num_warps: int = 4, interpret: bool = False,
) -> jax.Array:
    """Stage 3: qg [B, T, HV, K]; h [B, NT, HV, K, V]; A_qk [B, T, HV, chunk]; v_new [B, T, HV, V] -> o."""
    batch, length, heads, dk = qg.shape
    dv = v_new.shape[3]
    _, precision = dot_settings(qg.dtype, interpret)

    return pl.pallas_call(
        functools.partial(_output_kernel, precision=precision),
        grid=(length // chunk, heads, batch),
        in_specs=[
            chunk_rows_spec(chunk, dk), chunk_state_spec(dk, dv), chunk_rows_spec(chunk, chunk),
            chunk_rows_spec(chunk, dv),
        ],
        out_specs=chunk_rows_spec(chunk, dv),
        out_shape=jax.ShapeDtypeStruct(v_new.shape, v_new.dtype),
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=2),
        interpret=interpret,
        name="kda_chunk_output",
    )(qg, h, aqk, v_new)
