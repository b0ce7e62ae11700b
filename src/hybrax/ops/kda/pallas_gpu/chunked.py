"""`kernel_delta_attention`'s "pallas:chunked" implementation: the Pallas forward
(`chunk_fwd`) and backward (`chunk_bwd`) joined by a custom VJP.

The backward keeps the forward's inputs, T = (I + A_kk)^-1 and A_qk (2 x [B, T, HV, 64] in the
input dtype: the most expensive stage to recompute, the cheapest to keep) and recomputes the other
chunk-local terms and the chunk states, as flash-linear-attention does. Packed sequences (cu_seqlens)
are laid out as XLA chunked lays them out (`xla.chunked.packed_layout`: each sequence from a chunk
boundary), and the state kernels restart per sequence. The forward's first kernels (the gate cumsum,
stage 1), and the backward's, read each chunk's rows of the packed inputs in place; the output and the
inputs' gradients are gathered back to the tokens. Not supported
(`auto` then picks XLA): K or V above 256.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from hybrax.core import Invocation, register, vary_like
from hybrax.ops.kda.base import CHUNK_SIZES, OP_ID, KdaProblem, KernelDeltaAttentionConfig
from hybrax.ops.kda.pallas_gpu.chunk_bwd import kda_chunk_bwd
from hybrax.ops.kda.pallas_gpu.chunk_fwd import MAX_HEAD_DIM, Packing, kda_chunk_fwd, kda_chunk_fwd_solved
from hybrax.ops.kda.pallas_gpu.chunk_state import Segments
from hybrax.ops.kda.pallas_gpu.tiles import PackedChunks
from hybrax.ops.kda.xla.chunked import Layout, from_packed_rows, packed_layout
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


def _supports(inv: Invocation, cfg: KernelDeltaAttentionConfig | None = None) -> str | None:
    if not inv.static["use_chunked"]:
        return "use_chunked=False asks for the recurrent scan"
    dk, dv = inv.arrays["q"].shape[3], inv.arrays["v"].shape[3]
    if max(dk, dv) > MAX_HEAD_DIM:
        return f"needs K and V <= {MAX_HEAD_DIM}, got K={dk}, V={dv}"
    if inv.arrays["q"].dtype not in (jnp.bfloat16, jnp.float32):
        return f"needs bf16 or fp32 inputs, got {inv.arrays['q'].dtype}"
    return None if cfg is None else chunk_reason(cfg.chunk_size)


def _heuristic(inv: Invocation) -> KernelDeltaAttentionConfig:
    # 64-token chunks (as fla): four 16-row sub-chunks per chunk, 64 serial steps per 4k tokens.
    return KernelDeltaAttentionConfig(chunk_size=64)


def _candidates(inv: Invocation) -> list[KernelDeltaAttentionConfig]:
    return [KernelDeltaAttentionConfig(chunk_size=c) for c in (32, 64)]


@register(
    OP_ID, "pallas", "chunked", priority=25, devices=("gpu",), heuristic_cfg=_heuristic,
    candidate_cfgs=_candidates, supports=_supports,
)
def _pallas_chunked(problem: KdaProblem, cfg: KernelDeltaAttentionConfig) -> tuple[jax.Array, jax.Array]:
    decay = jnp.broadcast_to(problem.decay, (*problem.beta.shape, problem.q.shape[3]))
    return run_chunked(
        problem.q, problem.k, problem.v, decay, problem.beta, problem.initial_state, problem.cu_seqlens,
        problem.state_shape, scale=problem.scale, l2_normalize=problem.use_qk_l2norm, chunk=cfg.chunk_size,
    )


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
