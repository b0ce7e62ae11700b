"""The TPU kernels' matrix products: operands and passes on the MXU, which multiplies bf16 natively.

    passes 1  bf16 operands, fp32 accumulation (as flash-linear-attention's bf16 path)
    passes 3  fp32 operands split as hi + lo in bf16, hi hi + hi lo + lo hi: ~16 bits of each operand
              (Mosaic takes `Precision.HIGH` only from JAX 0.11 on; the split works on both)
    passes 6  fp32 operands at `Precision.HIGHEST` (Mosaic's fp32 contraction)

On the CPU (interpret mode) bf16 products are exact and fp32 ones too.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

_CONTRACT = {"nn": ((1,), (0,)), "nt": ((1,), (1,))}


def _dot(a: jax.Array, b: jax.Array, layout: str, precision=None) -> jax.Array:
    return lax.dot_general(
        a, b, (_CONTRACT[layout], ((), ())), precision=precision, preferred_element_type=jnp.float32
    )


def _split(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    high = x.astype(jnp.bfloat16)
    return high, (x - high.astype(jnp.float32)).astype(jnp.bfloat16)


class Dot(NamedTuple):
    """a @ b (layout "nn"), a @ b.T ("nt") or a.T @ b ("tn") in fp32, at `passes` (see the module)."""

    passes: int

    def __call__(self, a: jax.Array, b: jax.Array, layout: str = "nn") -> jax.Array:
        if layout == "tn":  # transposed before any cast: Mosaic transposes 32-bit tiles on every chip
            a, layout = a.T, "nn"
        if self.passes == 1:
            return _dot(a.astype(jnp.bfloat16), b.astype(jnp.bfloat16), layout)
        if self.passes == 3:
            (a_high, a_low), (b_high, b_low) = _split(a.astype(jnp.float32)), _split(b.astype(jnp.float32))
            return _dot(a_high, b_high, layout) + _dot(a_high, b_low, layout) + _dot(a_low, b_high, layout)
        if self.passes == 6:
            return _dot(a.astype(jnp.float32), b.astype(jnp.float32), layout, lax.Precision.HIGHEST)
        raise ValueError(f"passes must be 1, 3 or 6, got {self.passes!r}")
