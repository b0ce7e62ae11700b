"""`kernel_delta_attention`'s "pallas:chunked" implementation: the Pallas forward
(`pallas_chunk_fwd`) and backward (`pallas_chunk_bwd`) joined by a custom VJP.

The backward keeps the forward's inputs, T = (I + A_kk)^-1 and A_qk (2 x [B, T, HV, 64] in the
input dtype: the most expensive stage to recompute, the cheapest to keep) and recomputes the other
chunk-local terms and the chunk states, as flash-linear-attention does. Packed sequences (cu_seqlens)
are laid out as XLA chunked lays them out (`xla_chunked.packed_layout`: each sequence from a chunk
boundary, tokens gathered there and back), and the state kernels restart per sequence. Not supported
(`auto` then picks XLA): K or V above 256.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from hybrax.core import Invocation, register, runtime_device
from hybrax.ops.kda.api import OP_ID, KdaProblem, KernelDeltaAttentionConfig
from hybrax.ops.kda.pallas_chunk_bwd import kda_chunk_bwd
from hybrax.ops.kda.pallas_chunk_fwd import MAX_HEAD_DIM, kda_chunk_fwd, kda_chunk_fwd_solved
from hybrax.ops.kda.pallas_chunk_state import Segments
from hybrax.ops.kda.xla_chunked import from_packed_rows, packed_layout, to_packed_rows

STATIC = ("scale", "l2_normalize", "chunk", "interpret")


@functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8, 9, 10))
def kda_chunk(
    q, k, v, g, beta, initial_state, segments: Segments | None, scale: float, l2_normalize: bool, chunk: int,
    interpret: bool,
):
    """(o, final state) of KDA on [B, T, H | HV, K | V] inputs; see `kda_chunk_fwd`."""
    return kda_chunk_fwd(
        q, k, v, g, beta, initial_state, segments, scale=scale, l2_normalize=l2_normalize, chunk=chunk,
        interpret=interpret,
    )


def _kda_chunk_fwd(q, k, v, g, beta, initial_state, segments, *static):
    inputs = (q, k, v, g, beta, initial_state, segments)
    o, final, solved = kda_chunk_fwd_solved(*inputs, **dict(zip(STATIC, static)))
    return (o, final), (inputs, solved)


def _kda_chunk_bwd(*args):
    static, ((*inputs, segments), solved), (d_out, d_final) = args[:4], args[4], args[5]
    grads = kda_chunk_bwd(*inputs, d_out, d_final, segments, solved, **dict(zip(STATIC, static)))
    return (*grads, None)  # segments: integer metadata, no cotangent


kda_chunk.defvjp(_kda_chunk_fwd, _kda_chunk_bwd)


def _supports(inv: Invocation) -> str | None:
    if not inv.static["use_chunked"]:
        return "use_chunked=False asks for the recurrent scan"
    dk, dv = inv.arrays["q"].shape[3], inv.arrays["v"].shape[3]
    if max(dk, dv) > MAX_HEAD_DIM:
        return f"needs K and V <= {MAX_HEAD_DIM}, got K={dk}, V={dv}"
    if inv.arrays["q"].dtype not in (jnp.bfloat16, jnp.float32):
        return f"needs bf16 or fp32 inputs, got {inv.arrays['q'].dtype}"
    return None


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
    inputs = (problem.q, problem.k, problem.v, decay, problem.beta)
    initial_state, segments, layout = problem.initial_state, None, None
    if problem.cu_seqlens is not None:
        layout = packed_layout(problem.cu_seqlens, problem.q.shape[1], cfg.chunk_size)
        segments = Segments(*(x.astype(jnp.int32) for x in layout.segments))
        inputs = tuple(to_packed_rows(x, layout) for x in inputs)
        if initial_state is None:
            initial_state = jnp.zeros(problem.state_shape, jnp.float32)
    o, final = kda_chunk(
        *inputs, initial_state, segments, problem.scale, problem.use_qk_l2norm, cfg.chunk_size,
        runtime_device() != "gpu",
    )
    if layout is not None:  # tokens of no sequence read zeros
        o = from_packed_rows(o, layout)
    return o.astype(problem.q.dtype), final
