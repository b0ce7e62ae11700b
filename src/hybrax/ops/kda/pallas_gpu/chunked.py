"""`kernel_delta_attention`'s "pallas:chunked" implementation: the Pallas chunked kernels (`chunk.run_chunked`:
forward and backward joined by a custom VJP) on the problem, packed sequences included. Not supported
(`auto` then picks XLA): K or V above 256, dtypes other than bf16 and fp32, use_chunked=False.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from hybrax.core import Invocation, register
from hybrax.ops.kda.base import OP_ID, KdaProblem, KernelDeltaAttentionConfig
from hybrax.ops.kda.pallas_gpu.chunk import chunk_reason, run_chunked
from hybrax.ops.kda.pallas_gpu.chunk_fwd import MAX_HEAD_DIM


def _supports(inv: Invocation, cfg: KernelDeltaAttentionConfig | None = None) -> str | None:
    if not inv.static["use_chunked"]:
        return "use_chunked=False asks for the recurrent scan"
    dk, dv = inv.arrays["q"].shape[3], inv.arrays["v"].shape[3]
    if max(dk, dv) > MAX_HEAD_DIM:
        return f"needs K and V <= {MAX_HEAD_DIM}, got K={dk}, V={dv}"
    if inv.arrays["q"].dtype not in (jnp.bfloat16, jnp.float32):
        return f"needs bf16 or fp32 inputs, got {inv.arrays['q'].dtype}"
    return chunk_reason((cfg or _heuristic(inv)).chunk_size)  # without a config, the call's chunk_size


def _heuristic(inv: Invocation) -> KernelDeltaAttentionConfig:
    # The call's chunk_size: 64 by default (as fla: four 16-row sub-chunks per chunk, 64 serial steps per 4k tokens).
    return KernelDeltaAttentionConfig(chunk_size=inv.static["chunk_size"])


def _candidates(inv: Invocation) -> list[KernelDeltaAttentionConfig]:
    return [KernelDeltaAttentionConfig(chunk_size=c) for c in (32, 64)]


@register(
    OP_ID, "pallas", "chunked", heuristic_cfg=_heuristic,
    candidate_cfgs=_candidates, supports=_supports,
)
def _pallas_chunked(problem: KdaProblem, cfg: KernelDeltaAttentionConfig) -> tuple[jax.Array, jax.Array]:
    decay = jnp.broadcast_to(problem.decay, (*problem.beta.shape, problem.q.shape[3]))
    return run_chunked(
        problem.q, problem.k, problem.v, decay, problem.beta, problem.initial_state, problem.cu_seqlens,
        problem.state_shape, scale=problem.scale, l2_normalize=problem.use_qk_l2norm, chunk=cfg.chunk_size,
    )
