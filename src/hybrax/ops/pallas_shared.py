"""What every op's Pallas GPU kernels (Triton lowering) share: where they run, how they are called, and their
dots' operand dtypes and precisions."""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from hybrax.core import varying_axes


def interpret_here() -> bool:
    """Pallas runs compiled on a GPU and in interpret mode anywhere else (the CPU tests)."""
    return jax.default_backend() != "gpu"


def pallas_call(kernel: Callable, *, out_shape: Any, **options: Any) -> Callable:
    """`pl.pallas_call`, its outputs marked as varying over the manual mesh axes its inputs vary over: inside
    `jax.shard_map` (check_vma on) Pallas asks every out_shape for that set, and a kernel's outputs vary
    wherever its inputs do."""

    def call(*args: Any) -> Any:
        mesh_axes = jax.sharding.ManualAxisType(varying=varying_axes(*args))
        shapes = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, manual_axis_type=mesh_axes), out_shape)
        return pl.pallas_call(kernel, out_shape=shapes, **options)(*args)

    return call


EXACT = lax.Precision.HIGHEST  # fp32 dots without tf32 rounding
# fp32 dots on the GPU (A_kk, A_qk, T; every dot of fp32 inputs): for fp32 inputs three tf32 passes on the
# tensor cores keep fp32 accuracy (Triton's exact fp32 dot runs on the FMA units and made stage 1 2x
# slower); for bf16 inputs one tf32 pass, as flash-linear-attention: on the H200 it gave the same output
# and state errors as three passes (4.2e-3, 3.2e-3 at (1, 8192, 32, 128)) in 25% less
# time. The CPU (interpret mode) has no tf32 and computes them exactly.
FP32_INPUT_PRECISION = lax.DotAlgorithmPreset.TF32_TF32_F32_X3
BF16_INPUT_PRECISION = lax.DotAlgorithmPreset.TF32_TF32_F32


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
