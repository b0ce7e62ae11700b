"""KDA chunked backward, the state pass in reverse (Pallas, Triton lowering).

The forward's chunk t, from the state h before it: v_new = u - w h, o = qg h + A_qk v_new,
h' = decay * h + kg^T v_new. One program per (value block, value head, batch) keeps its [K, BV]
slice of dh' (the cotangent of the state leaving chunk t, fp32) on chip and walks the chunks
backwards:

    dh_t     = dh'                                         stored: the chunk's dkg, d decay need it
    dv_new   = A_qk^T dO + kg dh'                          stored
    dh'      = decay * dh' + qg^T dO - w^T dv_new          the cotangent of h, i.e. of the previous h'

Packed sequences (`segments`): dh' restarts from its sequence's final-state cotangent at the
sequence's last chunk, and is the sequence's initial-state cotangent after its first.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from hybrax.ops.kda.common.layout import Segments
from hybrax.ops.kda.pallas_gpu.chunk_state import chunk_scalars, emit, restart, state_pass_call, state_tile
from hybrax.ops.pallas_shared import dot_settings, mm_tn


def _state_bwd_kernel(
    qg_ref, kg_ref, w_ref, aqk_ref, d_out_ref, decay_ref, d_final_ref, sequence_ref, first_ref, last_ref,
    dh_ref, dv_new_ref, d_initial_ref, *, chunk: int, precision,
):
    compute_dtype = w_ref.dtype
    packed = sequence_ref is not None
    shape = d_initial_ref.shape[1:] if packed else d_initial_ref.shape
    n_chunks = decay_ref.shape[0]

    segment_refs = (sequence_ref, first_ref, last_ref) if packed else ()

    def step(i, carry):
        d_state, (decay, segment) = carry
        t = n_chunks - 1 - i
        ahead = chunk_scalars(decay_ref, segment_refs, jnp.maximum(t - 1, 0))  # read a chunk ahead: see there
        if packed:
            sequence, first, last = segment
            d_state = restart(d_state, last, d_final_ref, sequence, shape)
        rows = pl.ds(t * chunk, chunk)
        dh_ref[t, :, :] = d_state.astype(dh_ref.dtype)
        d_out = d_out_ref[rows, :]
        dv_new = mm_tn(aqk_ref[rows, :], d_out, compute_dtype, precision) + jnp.dot(
            kg_ref[rows, :], d_state.astype(compute_dtype), precision=precision, preferred_element_type=jnp.float32
        )
        dv_new = dv_new.astype(compute_dtype)
        dv_new_ref[rows, :] = dv_new
        d_state = (
            decay[:, None] * d_state
            + mm_tn(qg_ref[rows, :], d_out, compute_dtype, precision)
            - mm_tn(w_ref[rows, :], dv_new, compute_dtype, precision)
        )
        if packed:
            emit(d_state, first, d_initial_ref, sequence)
        return d_state, ahead

    initial = jnp.zeros(shape, jnp.float32) if packed else state_tile(d_final_ref, ..., shape)
    last_chunk = chunk_scalars(decay_ref, segment_refs, n_chunks - 1)
    d_state, _ = lax.fori_loop(0, n_chunks, step, (initial, last_chunk))
    if not packed:
        d_initial_ref[...] = d_state


@functools.partial(jax.jit, static_argnames=("chunk", "block_v", "num_warps", "num_stages", "interpret"))
def chunk_state_bwd(
    qg: jax.Array, kg: jax.Array, w: jax.Array, aqk: jax.Array, d_out: jax.Array, decay: jax.Array,
    d_final: jax.Array | None, segments: Segments | None = None, *, chunk: int = 64, block_v: int | None = None,
    num_warps: int = 4, num_stages: int | None = None, interpret: bool = False,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """qg, kg, w [B, T, HV, K]; A_qk [B, T, HV, chunk]; dO [B, T, HV, V] (all one dtype); decay
    [B, NT, HV, K] fp32; d_final [B, HV, K, V] or None ([N, HV, K, V] with `segments`, B = 1).

    Returns dh [B, NT, HV, K, V] (the cotangent of the state leaving each chunk, input dtype),
    dv_new [B, T, HV, V] (input dtype) and d_initial [B, HV, K, V] fp32 (with `segments`:
    [N, HV, K, V], rows of sequences without chunks unwritten).
    """
    _, precision = dot_settings(w.dtype, interpret)
    return state_pass_call(
        functools.partial(_state_bwd_kernel, chunk=chunk, precision=precision), (qg, kg, w, aqk), d_out, decay,
        d_final, segments, chunk=chunk, block_v=block_v, num_warps=num_warps, num_stages=num_stages,
        interpret=interpret, name="kda_chunk_state_bwd",
    )
