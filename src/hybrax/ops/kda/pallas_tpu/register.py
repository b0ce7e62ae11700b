"""`kernel_delta_attention`'s "pallas_tpu:chunked" implementation: the Pallas Mosaic TPU forward (`chunk_fwd`),
chosen by `auto` on a TPU, runnable anywhere in the TPU interpret mode with `platform="pallas_tpu"`.

Its backward, until a TPU backward kernel exists, is the XLA chunked implementation's
(`xla_chunked.chunked_backward`), fed with what it keeps from its own forward: the problem and the fp32 state
entering each chunk, which the kernel writes beside the output (so no XLA forward runs). Declined (`auto` then
takes XLA): packed sequences (cu_seqlens), K or V above 128, dtypes other than bf16 and fp32, chunks other than
16, 32, 64 and 128, use_chunked=False.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from hybrax.core import Invocation, register
from hybrax.ops.kda.base import OP_ID, KdaProblem, KernelDeltaAttentionConfig
from hybrax.ops.kda.pallas_tpu.chunk_fwd import MAX_HEAD_DIM, kda_forward
from hybrax.ops.kda.xla_chunked import chunked_backward

PLATFORM = "pallas_tpu"


CHUNKS = (16, 32, 64, 128)  # powers of two of whole sub-chunks, at most one MXU tile


def _supports(inv: Invocation, cfg: KernelDeltaAttentionConfig | None = None) -> str | None:
    if cfg is not None and cfg.chunk_size not in CHUNKS:
        return f"needs chunk_size in {CHUNKS}, got {cfg.chunk_size}"
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
    # TPU v5e, (1, 8192, 16, 128) bf16, forward: chunk 128 4.31 ms, 64 5.04 (4 heads per step; benchmarks/results).
    # But the backward runs XLA chunked at the same chunk, timed at 64 only (41.9 of its 62.7 ms fwd+bwd), and
    # its per-token work grows with the chunk: 64 until forward+backward is timed at 128.
    return KernelDeltaAttentionConfig(chunk_size=64)


def _candidates(inv: Invocation) -> list[KernelDeltaAttentionConfig]:
    return [KernelDeltaAttentionConfig(chunk_size=c) for c in (64, 128)]


def _forward(problem: KdaProblem, cfg: KernelDeltaAttentionConfig, with_states: bool) -> tuple:
    return kda_forward(
        problem.q, problem.k, problem.v, problem.decay, problem.beta, problem.initial_state,
        scale=problem.scale, l2_normalize=problem.use_qk_l2norm, chunk=cfg.chunk_size, with_states=with_states,
    )


def _forward_with_residuals(problem: KdaProblem, cfg: KernelDeltaAttentionConfig) -> tuple:
    o, final, entering = _forward(problem, cfg, with_states=True)
    return (o, final), (problem, entering)


# Below XLA's single step (30), which serves T = 1 without padding a chunk; above XLA chunked (20).
@register(
    OP_ID, PLATFORM, "chunked", priority=27, devices=("tpu",), heuristic_cfg=_heuristic,
    candidate_cfgs=_candidates, supports=_supports, fwd=_forward_with_residuals, bwd=chunked_backward,
)
def pallas_tpu_chunked(problem: KdaProblem, cfg: KernelDeltaAttentionConfig) -> tuple[jax.Array, jax.Array]:
    return _forward(problem, cfg, with_states=False)
