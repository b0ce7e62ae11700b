"""KDA chunked forward, stage 2 (Pallas, Triton lowering): the inter-chunk state pass.

One program per (value block, value head, batch) keeps its [K, BV] slice of the fp32 state on
chip and walks the chunks in order. At chunk t, with h the state before it:

    h_t   = h                                  stored for the output stage
    v_new = u_t - w_t h                        the chunk's delta-rule corrections
    h     = decay_t * h + kg_t^T v_new         decayed to the chunk's end, then updated
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from hybrax.ops.kda.pallas_tiles import dot_settings


def _state_kernel(w_ref, u_ref, kg_ref, decay_ref, h0_ref, h_ref, v_new_ref, final_ref, *, chunk: int, precision):
    n_chunks = decay_ref.shape[0]
    compute_dtype = w_ref.dtype

    def step(t, state):
        rows = pl.ds(t * chunk, chunk)
        h_ref[t, :, :] = state.astype(h_ref.dtype)
        w = w_ref[rows, :]
        v_new = u_ref[rows, :].astype(jnp.float32) - jnp.dot(
            w, state.astype(compute_dtype), precision=precision, preferred_element_type=jnp.float32
        )
        v_new = v_new.astype(compute_dtype)
        v_new_ref[rows, :] = v_new
        update = lax.dot_general(
            kg_ref[rows, :], v_new, (((0,), (0,)), ((), ())),
            precision=precision, preferred_element_type=jnp.float32,
        )
        return decay_ref[t, :][:, None] * state + update

    state = h0_ref[...].astype(jnp.float32) if h0_ref is not None else jnp.zeros(final_ref.shape, jnp.float32)
    final_ref[...] = lax.fori_loop(0, n_chunks, step, state)


@functools.partial(jax.jit, static_argnames=("chunk", "block_v", "num_warps", "num_stages", "interpret"))
def chunk_state(
    w: jax.Array, u: jax.Array, kg: jax.Array, decay: jax.Array, initial_state: jax.Array | None, *,
    chunk: int = 64, block_v: int = 32, num_warps: int = 4, num_stages: int = 2, interpret: bool = False,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Stage 2: w, kg [B, T, HV, K]; u [B, T, HV, V]; decay [B, NT, HV, K]; initial_state [B, HV, K, V] or None.

    Returns the chunk-start states h [B, NT, HV, K, V] (input dtype), v_new [B, T, HV, V] and the
    final state [B, HV, K, V] fp32.
    """
    batch, length, heads, dk = w.shape
    dv = u.shape[3]
    n_chunks = length // chunk
    block_v = min(block_v, dv)
    _, precision = dot_settings(w.dtype, interpret)

    # Whole-sequence blocks: the program walks the chunks itself.
    keys_spec = pl.BlockSpec((None, length, None, dk), lambda j, h, b: (b, 0, h, 0))
    values_spec = pl.BlockSpec((None, length, None, block_v), lambda j, h, b: (b, 0, h, j))

    state_spec = pl.BlockSpec((None, None, dk, block_v), lambda j, h, b: (b, h, 0, j))
    in_specs = [
        keys_spec, values_spec, keys_spec,
        pl.BlockSpec((None, n_chunks, None, dk), lambda j, h, b: (b, 0, h, 0)),
        None if initial_state is None else state_spec,
    ]
    kernel = functools.partial(_state_kernel, chunk=chunk, precision=precision)
    return pl.pallas_call(
        kernel,
        grid=(dv // block_v, heads, batch),
        in_specs=in_specs,
        out_specs=[
            pl.BlockSpec((None, n_chunks, None, dk, block_v), lambda j, h, b: (b, 0, h, 0, j)),
            values_spec,
            state_spec,
        ],
        out_shape=[
            jax.ShapeDtypeStruct((batch, n_chunks, heads, dk, dv), w.dtype),
            jax.ShapeDtypeStruct(u.shape, w.dtype),
            jax.ShapeDtypeStruct((batch, heads, dk, dv), jnp.float32),
        ],
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="kda_chunk_state",
    )(w, u, kg, decay, initial_state)
