"""`kernel_delta_attention`'s "pallas:chunked" implementation: the Pallas forward
(`pallas_chunk_fwd`) and backward (`pallas_chunk_bwd`) joined by a custom VJP.

The backward keeps nothing from the forward but its inputs: it recomputes the chunk-local terms and
the chunk states, as flash-linear-attention does. Not supported yet (`auto` then picks XLA):
cu_seqlens, K or V above 256.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from hybrax.core import Invocation, register, runtime_device
from hybrax.ops.kda.api import OP_ID, KdaProblem, KernelDeltaAttentionConfig
from hybrax.ops.kda.pallas_chunk_bwd import kda_chunk_bwd
from hybrax.ops.kda.pallas_chunk_fwd import MAX_HEAD_DIM, kda_chunk_fwd

STATIC = ("scale", "l2_normalize", "chunk", "interpret")


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8, 9))
def kda_chunk(q, k, v, g, beta, initial_state, scale: float, l2_normalize: bool, chunk: int, interpret: bool):
    """(o, final state) of KDA on [B, T, H | HV, K | V] inputs; see `kda_chunk_fwd`."""
    return kda_chunk_fwd(
        q, k, v, g, beta, initial_state, scale=scale, l2_normalize=l2_normalize, chunk=chunk, interpret=interpret
    )


def _kda_chunk_fwd(q, k, v, g, beta, initial_state, *static):
    return kda_chunk(q, k, v, g, beta, initial_state, *static), (q, k, v, g, beta, initial_state)


def _kda_chunk_bwd(*args):
    static, inputs, (d_out, d_final) = args[:4], args[4], args[5]
    return kda_chunk_bwd(*inputs, d_out, d_final, **dict(zip(STATIC, static)))


kda_chunk.defvjp(_kda_chunk_fwd, _kda_chunk_bwd)


def _supports(inv: Invocation) -> str | None:
    if not inv.static["use_chunked"]:
        return "use_chunked=False asks for the recurrent scan"
    if inv.arrays["cu_seqlens"] is not None:
        return "cu_seqlens (packed sequences) is not supported yet"
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
    o, final = kda_chunk(
        problem.q, problem.k, problem.v, decay, problem.beta, problem.initial_state,
        problem.scale, problem.use_qk_l2norm, cfg.chunk_size, runtime_device() != "gpu",
    )
    return o.astype(problem.q.dtype), final
