"""`kernel_delta_attention`'s "pallas_tpu:chunked" implementation: the Pallas Mosaic TPU forward (`chunk_fwd`),
chosen by `auto` on a TPU, runnable anywhere in the TPU interpret mode with `platform="pallas_tpu"`.

Its gradient is the XLA chunked implementation's (`gradient_of`: the backward recomputes XLA's forward and
runs XLA's custom backward) until a TPU backward kernel exists. Declined (`auto` then takes XLA): packed
sequences (cu_seqlens), K or V above 128, dtypes other than bf16 and fp32, use_chunked=False.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from hybrax.core import Invocation, lookup, register
from hybrax.ops.kda.api import OP_ID, KdaProblem, KernelDeltaAttentionConfig
from hybrax.ops.kda.pallas_tpu.chunk_fwd import MAX_HEAD_DIM, kda_forward

PLATFORM = "pallas_tpu"


def _supports(inv: Invocation) -> str | None:
    if not inv.static["use_chunked"]:
        return "use_chunked=False asks for the recurrent scan"
    if inv.arrays["cu_seqlens"] is not None:
        return "packed sequences (cu_seqlens) are not covered yet"
    dk, dv = inv.arrays["q"].shape[3], inv.arrays["v"].shape[3]
    if max(dk, dv) > MAX_HEAD_DIM:
        return f"needs K and V <= {MAX_HEAD_DIM}, got K={dk}, V={dv}"
    if inv.arrays["q"].dtype not in (jnp.bfloat16, jnp.float32):
        return f"needs bf16 or fp32 inputs, got {inv.arrays['q'].dtype}"
    return None


def _heuristic(inv: Invocation) -> KernelDeltaAttentionConfig:
    return KernelDeltaAttentionConfig(chunk_size=64)


def _candidates(inv: Invocation) -> list[KernelDeltaAttentionConfig]:
    return [KernelDeltaAttentionConfig(chunk_size=c) for c in (64, 128)]


def _xla_chunked(problem: KdaProblem, cfg: KernelDeltaAttentionConfig) -> tuple[jax.Array, jax.Array]:
    """The XLA chunked implementation at the same chunk size: what the gradient differentiates."""
    return lookup(OP_ID, "xla", "chunked")(problem, cfg)


# Below XLA's single step (30), which serves T = 1 without padding a chunk; above XLA chunked (20).
@register(
    OP_ID, PLATFORM, "chunked", priority=27, devices=("tpu",), heuristic_cfg=_heuristic,
    candidate_cfgs=_candidates, supports=_supports, gradient_of=_xla_chunked,
)
def pallas_tpu_chunked(problem: KdaProblem, cfg: KernelDeltaAttentionConfig) -> tuple[jax.Array, jax.Array]:
    return kda_forward(
        problem.q, problem.k, problem.v, problem.decay, problem.beta, problem.initial_state,
        scale=problem.scale, l2_normalize=problem.use_qk_l2norm, chunk=cfg.chunk_size,
    )
