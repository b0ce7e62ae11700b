"""KDA chunked forward, stage 3 (Pallas, Triton lowering): the output.

One program per (chunk, value block, value head, batch): o = qg h_t + A_qk v_new, the contribution
of the state before the chunk plus the chunk's own causal part (qg and A_qk carry the scale and decay).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from hybrax.ops.kda.pallas_tiles import dot_settings


def _output_kernel(qg_ref, h_ref, aqk_ref, v_new_ref, o_ref, *, precision):
    inter = jnp.dot(qg_ref[...], h_ref[...], precision=precision, preferred_element_type=jnp.float32)
    intra = jnp.dot(aqk_ref[...], v_new_ref[...], precision=precision, preferred_element_type=jnp.float32)
    o_ref[...] = (inter + intra).astype(o_ref.dtype)


# The largest [K, BV] slice of h one program reads (its dot stages the slice in shared memory): the whole
# state up to K = V = 128 in either dtype; at K = V = 256 two (bf16) or four (fp32) value blocks, since a
# whole fp32 state asks for more than the H200's 227 KiB of shared memory.
MAX_STATE_SLICE_BYTES = 64 * 1024


def value_block(dk: int, dv: int, dtype) -> int:
    """Value columns per program: all of V while the [K, V] slice of h fits MAX_STATE_SLICE_BYTES."""
    return min(dv, MAX_STATE_SLICE_BYTES // (dk * jnp.dtype(dtype).itemsize))


@functools.partial(jax.jit, static_argnames=("chunk", "block_v", "num_warps", "interpret"))
def chunk_output(
    qg: jax.Array, h: jax.Array, aqk: jax.Array, v_new: jax.Array, *,
    chunk: int = 64, block_v: int | None = None, num_warps: int = 4, interpret: bool = False,
) -> jax.Array:
    """Stage 3: qg [B, T, HV, K]; h [B, NT, HV, K, V]; A_qk [B, T, HV, chunk]; v_new [B, T, HV, V] -> o
    (`block_v` value columns per program; `value_block`'s when None)."""
    batch, length, heads, dk = qg.shape
    dv = v_new.shape[3]
    _, precision = dot_settings(qg.dtype, interpret)
    block_v = block_v or value_block(dk, dv, h.dtype)
    rows = lambda width: pl.BlockSpec((None, chunk, None, width), lambda t, j, h, b: (b, t, h, 0))  # noqa: E731
    values = pl.BlockSpec((None, chunk, None, block_v), lambda t, j, h, b: (b, t, h, j))

    return pl.pallas_call(
        functools.partial(_output_kernel, precision=precision),
        grid=(length // chunk, dv // block_v, heads, batch),
        in_specs=[
            rows(dk), pl.BlockSpec((None, None, None, dk, block_v), lambda t, j, h, b: (b, t, h, 0, j)), rows(chunk),
            values,
        ],
        out_specs=values,
        out_shape=jax.ShapeDtypeStruct(v_new.shape, v_new.dtype),
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=2),
        interpret=interpret,
        name="kda_chunk_output",
    )(qg, h, aqk, v_new)
