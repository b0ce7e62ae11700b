"""The TPU kernels' matrix products: operands and passes on the MXU, which multiplies bf16 natively.

    passes 1  bf16 operands, fp32 accumulation (as flash-linear-attention's bf16 path)
    passes 3  fp32 operands split as hi + lo in bf16, hi hi + hi lo + lo hi: ~16 bits of each operand
              (Mosaic takes `Precision.HIGH` only from JAX 0.11 on; the split works on both)
    passes 6  fp32 operands at `Precision.HIGHEST` (Mosaic's fp32 contraction)

An operand used in several products is converted once (`Dot.operand`), not at every product. On the CPU
(interpret mode) bf16 products are exact and fp32 ones too.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

_CONTRACT = {"nn": ((1,), (0,)), "nt": ((1,), (1,))}


class Operand(NamedTuple):
    """A matrix as the MXU takes it at some number of passes: its bf16 parts, or itself in fp32."""

    parts: tuple[jax.Array, ...]


def _dot(a: jax.Array, b: jax.Array, layout: str, precision=None) -> jax.Array:
    return lax.dot_general(
        a, b, (_CONTRACT[layout], ((), ())), precision=precision, preferred_element_type=jnp.float32
    )


class Dot(NamedTuple):
    """a @ b (layout "nn"), a @ b.T ("nt") or a.T @ b ("tn") in fp32, at `passes` (see the module)."""

    passes: int

    def operand(self, x: jax.Array) -> Operand:
        if self.passes == 1:
            return Operand((x.astype(jnp.bfloat16),))
        if self.passes == 3:
            x = x.astype(jnp.float32)
            high = x.astype(jnp.bfloat16)
            return Operand((high, (x - high.astype(jnp.float32)).astype(jnp.bfloat16)))
        if self.passes == 6:
            return Operand((x.astype(jnp.float32),))
        raise ValueError(f"passes must be 1, 3 or 6, got {self.passes!r}")

    def __call__(self, a: jax.Array | Operand, b: jax.Array | Operand, layout: str = "nn") -> jax.Array:
        if layout == "tn":  # transposed before any cast: Mosaic transposes 32-bit tiles on every chip
            a, layout = a.T, "nn"
        a, b = (x if isinstance(x, Operand) else self.operand(x) for x in (a, b))
        if self.passes == 6:
            return _dot(a.parts[0], b.parts[0], layout, lax.Precision.HIGHEST)
        products = [_dot(a.parts[0], b.parts[0], layout)]
        if self.passes == 3:  # lo lo is below the product's fp32 rounding
            products += [_dot(a.parts[0], b.parts[1], layout), _dot(a.parts[1], b.parts[0], layout)]
        return sum(products[1:], products[0])
