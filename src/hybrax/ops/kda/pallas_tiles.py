"""Register-tile helpers shared by the KDA Pallas kernels (Triton lowering).

Triton tiles cannot be sliced or indexed in registers: blocks are assembled from full-tile
operations under iota masks, and rows are read from the kernel's refs instead.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

SUB = 16  # sub-chunk rows: the smallest tile a Triton dot takes
# Triton's software pipelining of the kernels' loops over K slices and chunks (the next slice's loads
# issued as asynchronous copies while the current one computes). At (1, 8192, 32, 128) bf16 on the
# H200, 3 stages against 1 (2 for the state passes): stage 1 0.797 -> 0.758 ms, state pass 0.291 ->
# 0.223, reverse state pass 0.331 -> 0.269, grad 0.988 -> 0.870, intra backward 1.250 -> 1.121
# (BENCHMARKS.md).
PIPELINE_STAGES = 3
EXACT = lax.Precision.HIGHEST  # fp32 dots without tf32 rounding
# fp32 dots on the GPU (A_kk, A_qk, T; every dot of fp32 inputs): for fp32 inputs three tf32 passes on the
# tensor cores keep fp32 accuracy (Triton's exact fp32 dot runs on the FMA units and made stage 1 2x
# slower); for bf16 inputs one tf32 pass, as flash-linear-attention: on the H200 it gave the same output
# and state errors as three passes (4.2e-3, 3.2e-3 at (1, 8192, 32, 128); BENCHMARKS.md) in 25% less
# time. The CPU (interpret mode) has no tf32 and computes them exactly.
FP32_INPUT_PRECISION = lax.DotAlgorithmPreset.TF32_TF32_F32_X3
BF16_INPUT_PRECISION = lax.DotAlgorithmPreset.TF32_TF32_F32


def pipeline_stages(dtype, dk: int, before: int = 1) -> int:
    """The kernels' `num_stages` for inputs of `dtype` and K = dk: PIPELINE_STAGES where that was
    measured (bf16, K <= 128); for fp32 up to K = 128 the earlier setting `before`; one stage at K = 256,
    where every stage keeps another set of [C, K] slices in shared memory: the reverse state pass with
    two asked the H200 for 241664 bytes (bf16) of its 232448."""
    if dk > 128:
        return 1
    return PIPELINE_STAGES if dtype == jnp.bfloat16 else before


def solve_precision(interpret: bool, dtype=jnp.float32):
    """Precision of the fp32 dots of a kernel on inputs of `dtype`."""
    if interpret:
        return EXACT
    return FP32_INPUT_PRECISION if dtype == jnp.float32 else BF16_INPUT_PRECISION


def dot_settings(dtype, interpret: bool):
    """(operand dtype, precision) of the dots on inputs of `dtype`: bf16 tensor-core dots for bf16
    inputs, as flash-linear-attention; fp32-accurate dots for fp32 inputs."""
    return (jnp.float32, solve_precision(interpret)) if dtype == jnp.float32 else (dtype, None)


def mm(a: jax.Array, b: jax.Array, dtype, precision) -> jax.Array:
    """a @ b with operands cast to `dtype`, accumulated in fp32."""
    return jnp.dot(a.astype(dtype), b.astype(dtype), precision=precision, preferred_element_type=jnp.float32)


def mm_t(a: jax.Array, b: jax.Array, dtype, precision) -> jax.Array:
    """a @ b.T (contracting the last axis of both)."""
    return lax.dot_general(
        a.astype(dtype), b.astype(dtype), (((1,), (1,)), ((), ())),
        precision=precision, preferred_element_type=jnp.float32,
    )


def mm_tn(a: jax.Array, b: jax.Array, dtype, precision) -> jax.Array:
    """a.T @ b (contracting the first axis of both)."""
    return lax.dot_general(
        a.astype(dtype), b.astype(dtype), (((0,), (0,)), ((), ())),
        precision=precision, preferred_element_type=jnp.float32,
    )


def chunk_rows_spec(chunk: int, width: int, group: int = 1) -> pl.BlockSpec:
    """One chunk's rows [chunk, width] of a [B, T, heads, width] array, for the program (chunk t, value
    head h, batch b) of a per-chunk kernel; `group` value heads share each of the array's heads."""
    return pl.BlockSpec((None, chunk, None, width), lambda t, h, b: (b, t, h // group, 0))


def chunk_column_spec(chunk: int) -> pl.BlockSpec:
    """One chunk's [chunk] entries of a [B, T, HV] array (beta), for a per-chunk kernel."""
    return pl.BlockSpec((None, chunk, None), lambda t, h, b: (b, t, h))


def chunk_state_spec(dk: int, dv: int) -> pl.BlockSpec:
    """The [K, V] state of one chunk of a [B, NT, HV, K, V] array, for a per-chunk kernel."""
    return pl.BlockSpec((None, None, None, dk, dv), lambda t, h, b: (b, t, h, 0, 0))


def index_grid(n: int) -> tuple[jax.Array, jax.Array]:
    """Row and column indices of an n x n tile."""
    return lax.broadcasted_iota(jnp.int32, (n, n), 0), lax.broadcasted_iota(jnp.int32, (n, n), 1)
