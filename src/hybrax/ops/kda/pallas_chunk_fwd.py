"""KDA chunked forward on the GPU with Pallas (Triton lowering): the stages end to end.

    stage 0  pallas_chunk_cumsum    the chunk-local gate cumsum G; (XLA) q, k L2-normalized, q scaled
    stage 1a pallas_chunk_solve     A_kk, A_qk from 16x16 block matmuls, T = (I + A_kk)^-1 (per chunk)
    stage 1b pallas_chunk_wy        w, u (the WY form), kg, qg, the chunk's decay (per chunk)
    stage 2  pallas_chunk_state     the state pass, state on chip, serial over chunks
    stage 3  pallas_chunk_output    o = qg h + A_qk v_new (per chunk)

This file pads the inputs to the kernels' tile sizes (T to the chunk, K and V to powers of two
>= 16; zero keys, values, gates and betas leave the state untouched), crops the results, and
registers the pipeline as `kernel_delta_attention`'s "pallas:chunked" implementation. Under
differentiation it is, for now, the XLA chunked implementation (forward with residuals and backward).
Not supported yet (`auto` then picks XLA): cu_seqlens, K or V above 256.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

from hybrax.core import Invocation, register, runtime_device
from hybrax.ops.kda.api import OP_ID, KdaProblem, KernelDeltaAttentionConfig
from hybrax.ops.kda.pallas_chunk_cumsum import chunk_local_cumsum
from hybrax.ops.kda.pallas_chunk_output import chunk_output
from hybrax.ops.kda.pallas_chunk_solve import chunk_solve
from hybrax.ops.kda.pallas_chunk_state import chunk_state
from hybrax.ops.kda.pallas_chunk_wy import chunk_wy
from hybrax.ops.kda.xla_chunked import chunked_backward, chunked_forward_with_residuals
from hybrax.ops.kda.xla_scan import l2_normalize

MIN_TILE = 16
MAX_HEAD_DIM = 256


def _tile(size: int) -> int:
    """The smallest power of two >= max(size, 16): Triton tiles are powers of two, dots >= 16."""
    return max(MIN_TILE, 1 << (size - 1).bit_length())


def _pad_to(x: jax.Array | None, sizes: dict[int, int]) -> jax.Array | None:
    if x is None:
        return None
    widths = [(0, sizes.get(axis, n) - n) for axis, n in enumerate(x.shape)]
    return jnp.pad(x, widths) if any(w for _, w in widths) else x


def prepare_qk(q: jax.Array, k: jax.Array, scale: float, normalize: bool) -> tuple[jax.Array, jax.Array]:
    """Unit-norm keys and queries (fp32 math, stored in the input dtype), queries scaled."""
    dtype = q.dtype
    q, k = q.astype(jnp.float32), k.astype(jnp.float32)
    if normalize:
        q, k = l2_normalize(q), l2_normalize(k)
    return (q * scale).astype(dtype), k.astype(dtype)


@functools.partial(
    jax.jit,
    static_argnames=("scale", "l2_normalize", "chunk", "block_v", "state_warps", "interpret"),
)
def kda_chunk_fwd(
    q: Float[Array, "B T H K"],
    k: Float[Array, "B T H K"],
    v: Float[Array, "B T HV V"],
    g: Float[Array, "B T HV K"],
    beta: Float[Array, "B T HV"],
    initial_state: Float[Array, "B HV K V"] | None = None,
    *,
    scale: float,
    l2_normalize: bool = True,
    chunk: int = 64,
    block_v: int = 32,
    state_warps: int = 4,
    interpret: bool = False,
) -> tuple[Float[Array, "B T HV V"], Float[Array, "B HV K V"]]:
    """KDA forward: o [B, T, HV, V] (v's dtype) and the final state [B, HV, K, V] (fp32).

    g is the per-channel log decay (<= 0), beta the update strength (already through its
    sigmoid); q, k, v share one dtype (bf16 or fp32); HV is a multiple of H.
    """
    length, dk, dv = q.shape[1], q.shape[3], v.shape[3]
    padded_length = -(-length // chunk) * chunk
    kp, vp = _tile(dk), _tile(dv)
    dtype = v.dtype
    q, k = (_pad_to(x.astype(dtype), {1: padded_length, 3: kp}) for x in (q, k))
    v = _pad_to(v, {1: padded_length, 3: vp})
    q, k = prepare_qk(q, k, scale, l2_normalize)
    g = chunk_local_cumsum(_pad_to(g, {1: padded_length, 3: kp}), chunk=chunk, interpret=interpret)
    beta = _pad_to(beta.astype(jnp.float32), {1: padded_length})
    initial_state = _pad_to(initial_state, {2: kp, 3: vp})

    inverse, aqk = chunk_solve(q, k, g, beta, chunk=chunk, interpret=interpret)
    w, u, kg, qg, decay = chunk_wy(q, k, v, g, beta, inverse, chunk=chunk, interpret=interpret)
    h, v_new, final_state = chunk_state(
        w, u, kg, decay, initial_state, chunk=chunk, block_v=block_v, num_warps=state_warps, interpret=interpret
    )
    o = chunk_output(qg, h, aqk, v_new, chunk=chunk, interpret=interpret)
    return o[:, :length, :, :dv], final_state[:, :, :dk, :dv]


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


def _pallas_chunked(problem: KdaProblem, cfg: KernelDeltaAttentionConfig) -> tuple[jax.Array, jax.Array]:
    decay = jnp.broadcast_to(problem.decay, (*problem.beta.shape, problem.q.shape[3]))
    o, final = kda_chunk_fwd(
        problem.q, problem.k, problem.v, decay, problem.beta, problem.initial_state,
        scale=problem.scale, l2_normalize=problem.use_qk_l2norm, chunk=cfg.chunk_size,
        interpret=runtime_device() != "gpu",
    )
    return o.astype(problem.q.dtype), final


# Under differentiation this is XLA chunked's forward and backward until a Pallas backward lands: the
# Pallas forward feeding the XLA backward measured 25.0 ms forward+backward against XLA's own 23.6 ms at
# (1, 8192, 32, 128) bf16 on the H200 (XLA shares the chunk-local terms between its forward and
# backward; a backward after the Pallas forward must rebuild them). The forward alone took 4.5 ms
# against XLA's 9.0 ms there with the one-kernel stage 1 (BENCHMARKS.md); the three-kernel stage 1
# is not measured yet, so this stays below xla:chunked (20) for `auto`: ask with platform="pallas".
register(
    OP_ID, "pallas", "chunked", priority=15, devices=("gpu",), heuristic_cfg=_heuristic,
    candidate_cfgs=_candidates, supports=_supports, fwd=chunked_forward_with_residuals, bwd=chunked_backward,
)(_pallas_chunked)
