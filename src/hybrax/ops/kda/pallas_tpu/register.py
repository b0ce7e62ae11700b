"""`kernel_delta_attention`'s "pallas_tpu:chunked" implementation: the Pallas Mosaic TPU forward (`chunk_fwd`) and
backward (`chunk_bwd`), chosen by `auto` on a TPU, runnable anywhere in the TPU interpret mode with
`platform="pallas_tpu"`.

The forward keeps, beside the output, the fp32 state entering each chunk; the backward kernel takes the problem
and those states and recomputes everything else per chunk. The backward covers every call the forward takes
(per-head and per-channel decay, GQA, any T, the L2 norm inside or not, packed sequences), so no XLA path runs in
either direction. Packed sequences (cu_seqlens) run from chunk boundaries (`layout`), each chunk's sequence
scalar-prefetched. Declined (`auto` then takes XLA): K or V above 128, dtypes other than bf16 and fp32, chunks
other than 16, 32, 64 and 128, use_chunked=False, packed layouts of more than `layout.MAX_CHUNKS` chunks.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from hybrax.core import Invocation, cotangent, register
from hybrax.ops.kda.base import OP_ID, KdaProblem, KernelDeltaAttentionConfig
from hybrax.ops.kda.pallas_tpu.chunk_bwd import kda_backward
from hybrax.ops.kda.pallas_tpu.chunk_fwd import head_dims_reason, kda_forward
from hybrax.ops.kda.pallas_tpu.layout import MAX_CHUNKS, packed_chunks

PLATFORM = "pallas_tpu"


CHUNKS = (16, 32, 64, 128)  # powers of two of whole sub-chunks, at most one MXU tile


def _supports(inv: Invocation, cfg: KernelDeltaAttentionConfig | None = None) -> str | None:
    chunk = (cfg or _heuristic(inv)).chunk_size  # without a config, the call's chunk_size, which it honours
    if chunk not in CHUNKS:
        return f"needs chunk_size in {CHUNKS}, got {chunk}"
    if not inv.static["use_chunked"]:
        return "use_chunked=False asks for the recurrent scan"
    cu_seqlens = inv.arrays["cu_seqlens"]
    if cu_seqlens is not None:
        length, sequences = inv.arrays["q"].shape[1], cu_seqlens.shape[0] - 1
        chunks = packed_chunks(length, sequences, chunk)
        if chunks > MAX_CHUNKS:
            return f"packs {sequences} sequences over {length} tokens in {chunks} chunks, more than {MAX_CHUNKS}"
    reason = head_dims_reason(inv.arrays["q"].shape, inv.arrays["v"].shape)
    if reason:
        return reason
    if inv.arrays["q"].dtype not in (jnp.bfloat16, jnp.float32):
        return f"needs bf16 or fp32 inputs, got {inv.arrays['q'].dtype}"
    return None


def _heuristic(inv: Invocation) -> KernelDeltaAttentionConfig:
    # The call's chunk_size, 64 by default. TPU v5e, (1, 8192, 16, 128) bf16, forward: chunk 128 4.31 ms, 64 5.04
    # (4 heads per step; benchmarks/results). The backward's per-token work grows with the chunk (the solve's and
    # the pairwise terms' [C, C] tiles): 64 until forward+backward is timed at both (benchmarks/kda_tpu.py, its api
    # part).
    return KernelDeltaAttentionConfig(chunk_size=inv.static["chunk_size"])


def _candidates(inv: Invocation) -> list[KernelDeltaAttentionConfig]:
    return [KernelDeltaAttentionConfig(chunk_size=c) for c in (64, 128)]


def _forward(problem: KdaProblem, cfg: KernelDeltaAttentionConfig, with_states: bool) -> tuple:
    return kda_forward(
        problem.q, problem.k, problem.v, problem.decay, problem.beta, problem.initial_state,
        scale=problem.scale, cu_seqlens=problem.cu_seqlens, l2_normalize=problem.use_qk_l2norm, chunk=cfg.chunk_size,
        with_states=with_states,
    )


def _forward_with_residuals(problem: KdaProblem, cfg: KernelDeltaAttentionConfig) -> tuple:
    o, final, entering = _forward(problem, cfg, with_states=True)
    return (o, final), (problem, entering)


def _backward(cfg: KernelDeltaAttentionConfig, residuals: tuple[KdaProblem, jax.Array], ct: tuple) -> KdaProblem:
    """The problem's cotangent from the problem, the fp32 states entering each chunk and (dO, d final state)."""
    problem, entering = residuals
    d_out, d_final = ct
    dq, dk, dv, dg, dbeta, d_initial = kda_backward(
        problem.q, problem.k, problem.v, problem.decay, problem.beta, entering, d_out, d_final,
        scale=problem.scale, cu_seqlens=problem.cu_seqlens, l2_normalize=problem.use_qk_l2norm, chunk=cfg.chunk_size,
    )
    return cotangent(problem, q=dq, k=dk, v=dv, decay=dg, beta=dbeta, initial_state=d_initial)


# In the "tpu" row (ops/kda/api.py) after XLA's single step, which serves T = 1 without padding a chunk, and
# before XLA chunked.
@register(
    OP_ID, PLATFORM, "chunked", heuristic_cfg=_heuristic,
    candidate_cfgs=_candidates, supports=_supports, fwd=_forward_with_residuals, bwd=_backward,
)
def pallas_tpu_chunked(problem: KdaProblem, cfg: KernelDeltaAttentionConfig) -> tuple[jax.Array, jax.Array]:
    return _forward(problem, cfg, with_states=False)
