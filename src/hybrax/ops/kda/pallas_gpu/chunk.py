"""KDA chunked on the GPU as one differentiable function: the Pallas forward (`chunk_fwd`) and backward
(`chunk_bwd`) joined by a custom VJP, shared by `kernel_delta_attention` ("pallas:chunked", `chunked.py`) and
gated linear attention (`recurrent_attention`'s Pallas path, the delta rule off).

The backward keeps the forward's inputs, T = (I + A_kk)^-1 and A_qk (2 x [B, T, HV, 64] in the
input dtype: the most expensive stage to recompute, the cheapest to keep) and recomputes the other
chunk-local terms and the chunk states, as flash-linear-attention does. Packed sequences (cu_seqlens)
are laid out as XLA chunked lays them out (`common.layout.packed_layout`: each sequence from a chunk
boundary), and the state kernels restart per sequence. The forward's first kernels (the gate cumsum,
stage 1), and the backward's, read each chunk's rows of the packed inputs in place; the output and the
inputs' gradients are gathered back to the tokens.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from hybrax.core import vary_like
from hybrax.ops.kda.base import CHUNK_SIZES
from hybrax.ops.kda.common.layout import Layout, Segments, from_packed_rows, packed_layout
from hybrax.ops.kda.pallas_gpu.chunk_bwd import kda_chunk_bwd
from hybrax.ops.kda.pallas_gpu.chunk_fwd import Packing, kda_chunk_fwd, kda_chunk_fwd_solved
from hybrax.ops.kda.pallas_gpu.tiles import PackedChunks
from hybrax.ops.pallas_shared import interpret_here

STATIC = ("scale", "l2_normalize", "chunk", "interpret", "delta_rule")


def packing(layout: Layout, length: int, chunk: int) -> Packing:
    """`Packing` of a packed layout of `length` tokens."""
    rows = layout.source.reshape(layout.num_chunks, chunk)
    start = jnp.minimum(rows[:, 0], length)
    return Packing(layout.source, layout.destination, PackedChunks(start, jnp.sum(rows < length, axis=1)))


@functools.partial(jax.custom_vjp, nondiff_argnums=(8, 9, 10, 11, 12))
def kda_chunk(
    q, k, v, g, beta, initial_state, segments: Segments | None, packed: Packing | None, scale: float,
    l2_normalize: bool, chunk: int, interpret: bool, delta_rule: bool = True,
):
    """(o, final state) of KDA on [B, T, H | HV, K | V] inputs; see `kda_chunk_fwd`. With `packed`, the
    inputs are packed rows [1, T, ...] and o comes back in the padded layout. Without `delta_rule`, gated
    linear attention (beta unused)."""
    return kda_chunk_fwd(
        q, k, v, g, beta, initial_state, segments, None if packed is None else packed.chunks, scale=scale,
        l2_normalize=l2_normalize, chunk=chunk, delta_rule=delta_rule, interpret=interpret,
    )


def _kda_chunk_fwd(q, k, v, g, beta, initial_state, segments, packed, *static):
    inputs = (q, k, v, g, beta, initial_state, segments)
    chunks = None if packed is None else packed.chunks
    o, final, solved = kda_chunk_fwd_solved(*inputs, chunks, **dict(zip(STATIC, static)))
    return (o, final), (inputs, packed, solved)


def _kda_chunk_bwd(*args):
    static, ((*inputs, segments), packed, solved), (d_out, d_final) = args[:len(STATIC)], *args[len(STATIC):]
    grads = kda_chunk_bwd(*inputs, d_out, d_final, segments, solved, packed, **dict(zip(STATIC, static)))
    return (*grads, None, None)  # segments, packing: integer metadata, no cotangent


kda_chunk.defvjp(_kda_chunk_fwd, _kda_chunk_bwd)


def chunk_reason(chunk: int) -> str | None:
    """Why the kernels cannot take chunks of `chunk` tokens (16-row sub-chunks, at most 128 rows), or None."""
    return None if chunk in CHUNK_SIZES else f"needs chunk_size in {CHUNK_SIZES}, got {chunk}"


def run_chunked(
    q: jax.Array, k: jax.Array, v: jax.Array, decay: jax.Array, beta: jax.Array, initial_state: jax.Array | None,
    cu_seqlens: jax.Array | None, state_shape: tuple[int, ...], *, scale: float, l2_normalize: bool, chunk: int,
    delta_rule: bool = True,
) -> tuple[jax.Array, jax.Array]:
    """(o in q's dtype, final states) through the Pallas stages, with gradients; cu_seqlens packs sequences
    (batch 1; initial states [N, ...] of `state_shape`, zeros when None). Without `delta_rule`, gated linear
    attention (`recurrent_attention`'s Pallas path)."""
    segments, layout, packed = None, None, None
    if cu_seqlens is not None:
        layout = packed_layout(cu_seqlens, q.shape[1], chunk)
        segments = Segments(*(x.astype(jnp.int32) for x in layout.segments))
        packed = packing(layout, q.shape[1], chunk)
        if initial_state is None:
            initial_state = vary_like(jnp.zeros(state_shape, jnp.float32), q, k, v, decay, beta)
    o, final = kda_chunk(q, k, v, decay, beta, initial_state, segments, packed, scale, l2_normalize, chunk,
                         interpret_here(), delta_rule)
    if layout is not None:  # tokens of no sequence read zeros
        o = from_packed_rows(o, layout)
    return o.astype(q.dtype), final
