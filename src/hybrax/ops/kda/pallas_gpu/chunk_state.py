"""KDA chunked, stage 2 (Pallas, Triton lowering): the inter-chunk state pass, and the output.

One program per (value block, value head, batch) keeps its [K, BV] slice of the fp32 state on
chip and walks the chunks in order. At chunk t, with h the state before it:

    v_new = u_t - w_t h                        the chunk's delta-rule corrections
    o_t   = qg_t h + A_qk,t v_new              the forward (`chunk_state_output`): the chunk's output
    h_t   = h, v_new                           stored for the backward, by its recompute (`chunk_state`)
    h     = decay_t * h + kg_t^T v_new         decayed to the chunk's end, then updated

The forward's output off the recurrence's critical path costs the pass little: at (1, 8192, 32, 128)
bf16 on the H200, 0.228 ms against 0.237 for the pass storing h and v_new plus 0.115 for a separate
output kernel reading them back (H200 measurements).

Packed sequences (`segments`, a batch of one): each sequence owns whole chunks; h restarts from its
sequence's initial state at the sequence's first chunk and is its final state after its last.
`state_pass_call` launches this kernel and its mirror in `chunk_state_bwd`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from hybrax.ops.kda.common.layout import Segments
from hybrax.ops.kda.pallas_gpu.tiles import pipeline_stages
from hybrax.ops.pallas_shared import dot_settings, mm_tn, pallas_call


def state_tile(states_ref, index, shape) -> jax.Array:
    """Row `index` (or `...`: the whole block) of a ref of states, fp32; zeros without the ref."""
    return jnp.zeros(shape, jnp.float32) if states_ref is None else states_ref[index].astype(jnp.float32)


def restart(state, flag, states_ref, sequence, shape) -> jax.Array:
    """The carried state, or at a chunk where a pass enters a sequence (`flag` != 0: its first chunk, in
    reverse its last) the sequence's row of `states_ref` (read only there)."""
    return lax.cond(flag != 0, lambda: state_tile(states_ref, sequence, shape), lambda: state)


def emit(state, flag, out_ref, sequence) -> None:
    """Store the state as the sequence's row of `out_ref` at a chunk where a pass leaves it (`flag` != 0)."""

    @pl.when(flag != 0)
    def _():
        out_ref[sequence] = state


def chunk_scalars(decay_ref, segment_refs, t) -> tuple[jax.Array, tuple]:
    """Chunk t's decay row and, for packed sequences, its (sequence, first, last).

    The state passes read these a chunk ahead (carried through the loop): Triton copies ahead only the dots'
    operands, and ptxas moves no plain load across the dots' barriers, so read where they are used each
    would wait out a memory round trip inside every chunk's serial chain.
    """
    return decay_ref[t, :], tuple(ref[t] for ref in segment_refs)


def _state_kernel(w_ref, kg_ref, *refs, chunk: int, precision, with_output: bool):
    """The state pass. With `with_output` the refs after w, kg begin with qg, A_qk, and each chunk's
    output o = qg h + A_qk v_new is written (outputs: o, the final state); without, each chunk's h and
    v_new are (for the backward; outputs: h, v_new, the final state)."""
    qg_ref, aqk_ref, *refs = refs if with_output else (None, None, *refs)
    u_ref, decay_ref, h0_ref, sequence_ref, first_ref, last_ref, *outs = refs
    h_ref, v_new_ref, o_ref, final_ref = (None, None, *outs) if with_output else (*outs[:2], None, outs[2])
    compute_dtype = w_ref.dtype
    packed = sequence_ref is not None
    shape = final_ref.shape[1:] if packed else final_ref.shape
    dot = functools.partial(jnp.dot, precision=precision, preferred_element_type=jnp.float32)

    n_chunks = decay_ref.shape[0]
    segment_refs = (sequence_ref, first_ref, last_ref) if packed else ()

    def step(t, carry):
        state, (decay, segment) = carry
        ahead = chunk_scalars(decay_ref, segment_refs, jnp.minimum(t + 1, n_chunks - 1))
        if packed:
            sequence, first, last = segment
            state = restart(state, first, h0_ref, sequence, shape)
        rows = pl.ds(t * chunk, chunk)
        state_in = state.astype(compute_dtype)
        v_new = (u_ref[rows, :].astype(jnp.float32) - dot(w_ref[rows, :], state_in)).astype(compute_dtype)
        if with_output:
            o_ref[rows, :] = (dot(qg_ref[rows, :], state_in) + dot(aqk_ref[rows, :], v_new)).astype(o_ref.dtype)
        else:
            h_ref[t, :, :] = state_in.astype(h_ref.dtype)
            v_new_ref[rows, :] = v_new
        state = decay[:, None] * state + mm_tn(kg_ref[rows, :], v_new, compute_dtype, precision)
        if packed:
            emit(state, last, final_ref, sequence)
        return state, ahead

    initial = jnp.zeros(shape, jnp.float32) if packed else state_tile(h0_ref, ..., shape)
    state, _ = lax.fori_loop(0, n_chunks, step, (initial, chunk_scalars(decay_ref, segment_refs, 0)))
    if not packed:
        final_ref[...] = state


# A state pass is serial over chunks with one program per (value block, value head, sequence), so at
# fewer than a wave of programs of 32 value columns, 16 columns put twice as many SMs to work. H200,
# bf16, ms with 32 / 16 columns: (1, 32768, 16, 128), 64 programs of 32: state with output 0.864 / 0.785,
# state 0.834 / 0.745, reverse state 0.972 / 0.862; (2, 16384, 16, 128), 128 programs of 32: 0.454 / 0.791,
# 0.456 / 0.448, 0.519 / 0.851 (H200 measurements).
FULL_WAVE = 128


def default_block_v(rows: int, dv: int) -> int:
    """The value columns per program of a state pass over `rows` = batch x value heads."""
    return 32 if rows * (dv // 32) >= FULL_WAVE else 16


def output_block_v(rows: int, dv: int) -> int:
    """The same for the forward's pass with the output, which takes 64 columns from two waves of 64-column
    programs up: at (8, 2048, 16, 128) bf16 on the H200 (256 programs of 64), 0.160 ms against 0.183 with 32
    columns (at (1, 8192, 32, 128), 64 programs of 64, 32 columns stay)."""
    return 64 if dv >= 64 and rows * (dv // 64) >= 2 * FULL_WAVE else default_block_v(rows, dv)


def state_pass_call(
    kernel: Callable, rows: Sequence[jax.Array], values: jax.Array, decay: jax.Array, states: jax.Array | None,
    segments: Segments | None, *, chunk: int, block_v: int | None, num_warps: int, num_stages: int | None,
    interpret: bool, name: str, chunk_states: bool = True,
) -> tuple[jax.Array, ...]:
    """Launch a state pass: one program per (value block, value head, batch) over whole sequences.

    kernel(*row refs, values, decay, states, sequence, first, last, per-chunk states out, values out,
    states out); rows [B, T, HV, width] (any widths), values [B, T, HV, V], decay [B, NT, HV, K],
    states [B | N, HV, K, V] or None (required with `segments`). Returns ([B, NT, HV, K, V] and
    [B, T, HV, V] in the rows' dtype, [B | N, HV, K, V] fp32); without `chunk_states` the kernel has
    no per-chunk states out. `num_stages` None: `pipeline_stages`' choice for the rows' dtype and K (2
    where three were not measured); `block_v` None: `default_block_v`'s.
    """
    batch, length, heads, dk = decay.shape[0], values.shape[1], values.shape[2], decay.shape[3]
    dv = values.shape[3]
    n_chunks = length // chunk
    block_v = min(block_v or default_block_v(batch * heads, dv), dv)
    if segments is not None and states is None:
        raise ValueError(f"{name}: packed sequences need their states (zeros for none)")
    count = batch if segments is None else states.shape[0]
    if segments is None:
        state_spec = pl.BlockSpec((None, None, dk, block_v), lambda j, h, b: (b, h, 0, j))
        segment_spec = None
    else:  # all N rows: the program picks a sequence's row per chunk
        state_spec = pl.BlockSpec((count, None, dk, block_v), lambda j, h, b: (0, h, 0, j))
        segment_spec = pl.BlockSpec((n_chunks,), lambda j, h, b: (0,))

    # Whole-sequence blocks: the program walks the chunks itself.
    row_specs = [pl.BlockSpec((None, length, None, x.shape[3]), lambda j, h, b: (b, 0, h, 0)) for x in rows]
    values_spec = pl.BlockSpec((None, length, None, block_v), lambda j, h, b: (b, 0, h, j))
    dtype = rows[0].dtype
    return pallas_call(
        kernel,
        grid=(dv // block_v, heads, batch),
        in_specs=[
            *row_specs, values_spec, pl.BlockSpec((None, n_chunks, None, dk), lambda j, h, b: (b, 0, h, 0)),
            None if states is None else state_spec, *[segment_spec] * 3,
        ],
        out_specs=[
            *[pl.BlockSpec((None, n_chunks, None, dk, block_v), lambda j, h, b: (b, 0, h, 0, j))] * chunk_states,
            values_spec,
            state_spec,
        ],
        out_shape=[
            *[jax.ShapeDtypeStruct((batch, n_chunks, heads, dk, dv), dtype)] * chunk_states,
            jax.ShapeDtypeStruct(values.shape, dtype),
            jax.ShapeDtypeStruct((count, heads, dk, dv), jnp.float32),
        ],
        compiler_params=pltriton.CompilerParams(
            num_warps=num_warps, num_stages=num_stages or pipeline_stages(dtype, dk, before=2)
        ),
        interpret=interpret,
        name=name,
    )(*rows, values, decay, states, *(segments or (None,) * 3))


def _forward_pass(
    rows: Sequence[jax.Array], u: jax.Array, decay: jax.Array, initial_state: jax.Array | None,
    segments: Segments | None, *, with_output: bool, interpret: bool, **launch,
) -> tuple[jax.Array, ...]:
    """`_state_kernel` launched on rows (w, kg[, qg, A_qk]) with the outs its flag asks for."""
    _, precision = dot_settings(rows[0].dtype, interpret)
    kernel = functools.partial(_state_kernel, chunk=launch["chunk"], precision=precision, with_output=with_output)
    return state_pass_call(
        kernel, rows, u, decay, initial_state, segments, interpret=interpret, chunk_states=not with_output,
        **launch,
    )


@functools.partial(jax.jit, static_argnames=("chunk", "block_v", "num_warps", "num_stages", "interpret"))
def chunk_state(
    w: jax.Array, u: jax.Array, kg: jax.Array, decay: jax.Array, initial_state: jax.Array | None,
    segments: Segments | None = None, *, chunk: int = 64, block_v: int | None = None, num_warps: int = 4,
    num_stages: int | None = None, interpret: bool = False,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Stage 2: w, kg [B, T, HV, K]; u [B, T, HV, V]; decay [B, NT, HV, K]; initial_state [B, HV, K, V] or None
    ([N, HV, K, V] with `segments`, B = 1).

    Returns the chunk-start states h [B, NT, HV, K, V] (input dtype), v_new [B, T, HV, V] and the
    final state [B, HV, K, V] fp32 (with `segments`: [N, HV, K, V], rows of sequences without chunks
    unwritten).
    """
    return _forward_pass(
        (w, kg), u, decay, initial_state, segments, with_output=False, interpret=interpret,
        chunk=chunk, block_v=block_v, num_warps=num_warps, num_stages=num_stages, name="kda_chunk_state",
    )


@functools.partial(
    jax.jit, static_argnames=("chunk", "block_v", "num_warps", "num_stages", "interpret")
)
def chunk_state_output(
    w: jax.Array, u: jax.Array, kg: jax.Array, decay: jax.Array, qg: jax.Array, aqk: jax.Array,
    initial_state: jax.Array | None, segments: Segments | None = None, *, chunk: int = 64,
    block_v: int | None = None, num_warps: int = 4, num_stages: int | None = None, interpret: bool = False,
) -> tuple[jax.Array, ...]:
    """Stages 2 and 3 in one pass (the forward's): `chunk_state`'s arguments and qg [B, T, HV, K],
    A_qk [B, T, HV, chunk]. Returns o [B, T, HV, V] (input dtype) and the final state as `chunk_state`;
    the chunk states never leave the chip. `block_v` None: `output_block_v`'s."""
    block_v = block_v or output_block_v(decay.shape[0] * decay.shape[2], u.shape[3])
    return _forward_pass(
        (w, kg, qg, aqk), u, decay, initial_state, segments, with_output=True,
        interpret=interpret, chunk=chunk, block_v=block_v, num_warps=num_warps, num_stages=num_stages,
        name="kda_chunk_state_output",
    )
