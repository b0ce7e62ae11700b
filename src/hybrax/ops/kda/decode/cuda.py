"""KDA decode on NVIDIA GPUs in CUDA C++ (`cuda_decode.cu`, built with nvcc at first use): the fused step of
`pallas_gpu.py` beside it, one token per request, the state in place.

Registered under platform "cuda" for `kernel_delta_attention`'s T = 1 path and for `kda_decode_pool`, above the
Pallas kernel: on the H200 it streams the state faster (H200 measurements). It takes one token per request, the
K-first state and K in {64, 128} with V a multiple of 32; speculative decoding (T > 1, token_slots) and the
V-first pool stay with the Pallas kernel. Without a GPU or nvcc it declines (`cuda_build.unavailable_reason`).
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from hybrax.core import Invocation, register
from hybrax.ops import cuda_build
from hybrax.ops.kda.base import OP_ID, KdaProblem, KernelDeltaAttentionConfig
from hybrax.ops.kda.common.delta import single_step
from hybrax.ops.kda.decode.operands import GATES, step_scalars

SOURCE = Path(__file__).with_name("cuda_decode.cu")
TARGET = "hybrax_kda_decode"
KEY_DIMS = (64, 128)
# (block_v, num_warps) the .cu file instantiates: value columns and warps (32 threads each) per block.
LAUNCHES = ((32, 2), (32, 4), (64, 4), (64, 8), (128, 8))


def shape_reason(tokens: int, dk: int, dv: int) -> str | None:
    """Why the kernel cannot take this step's shapes, or None."""
    if tokens != 1:
        return f"takes one token per request (decode), got {tokens}"
    if dk not in KEY_DIMS or dv % 32:
        return f"needs K in {KEY_DIMS} and V a multiple of 32, got K={dk}, V={dv}"
    return None


# `auto` takes the CUDA step from this many request x value-head rows up and leaves fewer to the Pallas step, faster
# there on the H200 (H = 32, K = V = 128, µs per step CUDA / Pallas: B = 1 3.32 / 2.47, B = 8 9.26 /
# 8.33, B = 64 74.11 / 77.95, B = 256 274.9 / 291.9; B = 1024 at H = 16 547.2 / 585.3).
AUTO_MIN_ROWS = 2048


def auto_declines(platform: str, rows: int) -> str | None:
    """Why `auto` leaves a step of `rows` = requests x value heads to the Pallas kernel, or None."""
    if platform == "auto" and rows < AUTO_MIN_ROWS:
        return f"auto takes it from {AUTO_MIN_ROWS} request x value-head rows (the Pallas step is faster below), " \
               f"got {rows}"
    return None


def decline_reason(q_shape: tuple[int, ...], v_shape: tuple[int, ...], platform: str, device: str) -> str | None:
    """Why the CUDA step does not take a step of q [B, T, H, K] and v [B, T, HV, V] asked for on `platform` and
    running on `device`, or None: its shapes, `auto`'s rows, or no GPU / nvcc."""
    batch, tokens, _, dk = q_shape
    value_heads, dv = v_shape[2:]
    reason = shape_reason(tokens, dk, dv) or auto_declines(platform, batch * value_heads)
    return reason or cuda_build.unavailable_reason(device)


def launch_params(rows: int, dv: int) -> dict[str, int]:
    """block_v and num_warps for `rows` = requests x value heads: 64 columns on 4 warps once the grid fills the
    GPU several times over, 32 columns below (more, smaller blocks)."""
    block_v = 64 if dv % 64 == 0 and rows * (dv // 64) >= 4096 else 32
    return {"block_v": block_v, "num_warps": 4}


def _library() -> None:
    cuda_build.load_library(SOURCE, ((TARGET, "HybraxKdaDecode"),))


@functools.partial(
    jax.jit, static_argnames=("gate", "beta_is_logits", "use_qk_l2norm", "block_v", "num_warps", "programmatic_launch"),
)
def fused_recurrent_decode_cuda(
    q: Float[Array, "B 1 H K"],
    k: Float[Array, "B 1 H K"],
    v: Float[Array, "B 1 HV V"],
    g: Float[Array, "B 1 HV Kg"],
    beta: Float[Array, "B 1 HV"],
    state: Float[Array, "S HV K V"],
    slots: Int[Array, " B"] | None = None,
    a_log: Float[Array, " HV"] | None = None,
    dt_bias: Float[Array, "HV K"] | None = None,
    *,
    scale: Any,
    lower_bound: Any = None,
    gate: str = "activated",
    beta_is_logits: bool = False,
    use_qk_l2norm: bool = True,
    block_v: int = 32,
    num_warps: int = 4,
    programmatic_launch: bool = False,
) -> tuple[Float[Array, "B 1 HV V"], Float[Array, "S HV K V"]]:
    """One token for each of B requests; returns (o in q's dtype, the new state). Arguments as
    `pallas_gpu.fused_recurrent_decode` (one token, K-first state); without `slots` request b owns row b.
    `programmatic_launch` (Hopper and later) lets the step start while the kernel before it finishes: its blocks
    wait for that kernel's writes before reading anything."""
    if gate not in GATES:
        raise ValueError(f"gate must be one of {GATES}, got {gate!r}")
    _, tokens, value_heads, dv = v.shape
    dk = q.shape[-1]
    reason = shape_reason(tokens, dk, dv)
    if reason:
        raise ValueError(f"fused_recurrent_decode_cuda {reason}")
    if (block_v, num_warps) not in LAUNCHES or dv % block_v:
        raise ValueError(f"(block_v, num_warps) must be one of {LAUNCHES} with block_v dividing V={dv}, "
                         f"got ({block_v}, {num_warps})")
    if jax.default_backend() == "gpu":  # built where it runs; lowering elsewhere (the CPU tests) needs only its name
        _library()
    dtype = jnp.result_type(q, k, v)
    f32 = lambda x: jnp.asarray(x, jnp.float32)  # noqa: E731
    scalars = step_scalars(scale, lower_bound)
    has_slots = slots is not None
    slots = slots.astype(jnp.int32) if has_slots else jnp.zeros((1,), jnp.int32)  # a constant the kernel never reads
    # Constants where a gate has no a_log or dt_bias: XLA embeds them, no launch.
    a_log = jnp.zeros((value_heads,), jnp.float32) if a_log is None else f32(a_log)
    dt_bias = jnp.zeros((value_heads, dk), jnp.float32) if dt_bias is None else f32(dt_bias)
    arrays = (q.astype(dtype), k.astype(dtype), v.astype(dtype), f32(g), f32(beta), a_log, dt_bias, scalars, slots,
              state)
    call = jax.ffi.ffi_call(
        TARGET, (jax.ShapeDtypeStruct(v.shape, dtype), jax.ShapeDtypeStruct(state.shape, jnp.float32)),
        input_output_aliases={len(arrays) - 1: 1}, vmap_method="sequential",
    )
    return call(*arrays, block_v=np.int32(block_v), threads=np.int32(32 * num_warps), gate=np.int32(GATES.index(gate)),
                beta_is_logits=bool(beta_is_logits), use_qk_l2norm=bool(use_qk_l2norm), has_slots=has_slots,
                programmatic=bool(programmatic_launch))


def _supports_single_token(inv: Invocation) -> str | None:
    if inv.arrays["cu_seqlens"] is not None:
        return "needs no cu_seqlens"
    return decline_reason(inv.arrays["q"].shape, inv.arrays["v"].shape, inv.platform, inv.device)


def _single_token(problem: KdaProblem, cfg: KernelDeltaAttentionConfig) -> tuple[jax.Array, jax.Array]:
    batch, _, value_heads, dv = problem.v.shape
    return fused_recurrent_decode_cuda(
        problem.q, problem.k, problem.v, problem.decay, problem.beta, problem.initial_states(), scale=problem.scale,
        use_qk_l2norm=problem.use_qk_l2norm, **launch_params(batch * value_heads, dv),
    )


# kernel_delta_attention's T == 1 path: before pallas:decode in the "gpu" row (ops/kda/api.py), where the GPU has nvcc.
register(
    OP_ID, "cuda", "decode", supports=_supports_single_token,
    heuristic_cfg=lambda inv: KernelDeltaAttentionConfig(), gradient_of=single_step,
)(_single_token)
