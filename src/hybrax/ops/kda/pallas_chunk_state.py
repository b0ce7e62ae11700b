"""KDA chunked forward, stage 2 (Pallas, Triton lowering): the inter-chunk state pass.

One program per (value block, value head, batch) keeps its [K, BV] slice of the fp32 state on
chip and walks the chunks in order. At chunk t, with h the state before it:

    h_t   = h                                  stored for the output stage
    v_new = u_t - w_t h                        the chunk's delta-rule corrections
    h     = decay_t * h + kg_t^T v_new         decayed to the chunk's end, then updated

Packed sequences (`segments`, a batch of one): each sequence owns whole chunks; h restarts from its
sequence's initial state at the sequence's first chunk and is its final state after its last.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from hybrax.ops.kda.pallas_tiles import dot_settings


class Segments(NamedTuple):
    """Per chunk [NT] int32: its sequence, and 1 at the sequence's first / last chunk (0 elsewhere)."""

    sequence: jax.Array
    first: jax.Array
    last: jax.Array


def state_block_spec(packed: bool, states: int, dk: int, block_v: int) -> pl.BlockSpec:
    """The [K, BV] state slice of program (value block j, head h, batch b): its own row, or all N rows
    of packed sequences (the program picks the row per chunk)."""
    if packed:
        return pl.BlockSpec((states, None, dk, block_v), lambda j, h, b: (0, h, 0, j))
    return pl.BlockSpec((None, None, dk, block_v), lambda j, h, b: (b, h, 0, j))


def segment_specs(segments: Segments | None, n_chunks: int) -> list[pl.BlockSpec | None]:
    spec = None if segments is None else pl.BlockSpec((n_chunks,), lambda j, h, b: (0,))
    return [spec] * 3


def initial_tile(h0_ref, index, shape) -> jax.Array:
    """Row `index` of the initial states (zeros without them), fp32."""
    return jnp.zeros(shape, jnp.float32) if h0_ref is None else h0_ref[index].astype(jnp.float32)


def _state_kernel(
    w_ref, u_ref, kg_ref, decay_ref, h0_ref, sequence_ref, first_ref, last_ref, h_ref, v_new_ref, final_ref,
    *, chunk: int, precision,
):
    n_chunks = decay_ref.shape[0]
    compute_dtype = w_ref.dtype
    packed = sequence_ref is not None
    tile_shape = final_ref.shape[1:] if packed else final_ref.shape

    def step(t, state):
        if packed:
            sequence = sequence_ref[t]
            state = jnp.where(first_ref[t] != 0, initial_tile(h0_ref, sequence, tile_shape), state)
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
        state = decay_ref[t, :][:, None] * state + update
        if packed:

            @pl.when(last_ref[t] != 0)
            def _():
                final_ref[sequence] = state

        return state

    if packed:
        lax.fori_loop(0, n_chunks, step, jnp.zeros(tile_shape, jnp.float32))
    else:
        final_ref[...] = lax.fori_loop(0, n_chunks, step, initial_tile(h0_ref, ..., tile_shape))


@functools.partial(jax.jit, static_argnames=("chunk", "block_v", "num_warps", "num_stages", "interpret"))
def chunk_state(
    w: jax.Array, u: jax.Array, kg: jax.Array, decay: jax.Array, initial_state: jax.Array | None,
    segments: Segments | None = None, *, chunk: int = 64, block_v: int = 32, num_warps: int = 4,
    num_stages: int = 2, interpret: bool = False,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Stage 2: w, kg [B, T, HV, K]; u [B, T, HV, V]; decay [B, NT, HV, K]; initial_state [B, HV, K, V] or None
    ([N, HV, K, V] with `segments`, B = 1).

    Returns the chunk-start states h [B, NT, HV, K, V] (input dtype), v_new [B, T, HV, V] and the
    final state [B, HV, K, V] fp32 (with `segments`: [N, HV, K, V], rows of sequences without chunks
    unwritten).
    """
    batch, length, heads, dk = w.shape
    dv = u.shape[3]
    n_chunks = length // chunk
    block_v = min(block_v, dv)
    _, precision = dot_settings(w.dtype, interpret)

    # Whole-sequence blocks: the program walks the chunks itself.
    keys_spec = pl.BlockSpec((None, length, None, dk), lambda j, h, b: (b, 0, h, 0))
    values_spec = pl.BlockSpec((None, length, None, block_v), lambda j, h, b: (b, 0, h, j))

    if segments is not None and initial_state is None:
        raise ValueError("chunk_state: packed sequences need their initial states (zeros for none)")
    states = batch if segments is None else initial_state.shape[0]
    state_spec = state_block_spec(segments is not None, states, dk, block_v)
    in_specs = [
        keys_spec, values_spec, keys_spec,
        pl.BlockSpec((None, n_chunks, None, dk), lambda j, h, b: (b, 0, h, 0)),
        None if initial_state is None else state_spec,
        *segment_specs(segments, n_chunks),
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
            jax.ShapeDtypeStruct((states, heads, dk, dv), jnp.float32),
        ],
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="kda_chunk_state",
    )(w, u, kg, decay, initial_state, *(segments or (None,) * 3))
