"""One chunk of the raw inputs as stage 1's kernels read them (Pallas, Triton lowering).

Stage 1 (`pallas_chunk_intra`, and `pallas_chunk_wy` in the backward) takes q, k and the per-token log
decay g as the caller gave them: the L2 norm, the scale and the chunk-local cumulative decay G are
computed in the kernel, K slice by K slice, instead of by separate passes that write qn, kn and G to
memory for stage 1 to read back (those took 0.155 ms of the forward's 1.13 at (1, 8192, 32, 128) bf16
on the H200; BENCHMARKS.md). The cumulative sum runs along the chunk's tokens, so each K slice of G
needs only that slice of g.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from hybrax.ops.kda.reference import L2_EPS


class RawChunk(NamedTuple):
    """Refs to one chunk's q, k [C, K] (input dtype) and g [C, K] (fp32), and the factors that
    normalize q and k: row i of q times `q_scale[i]` is q_i / |q_i| * scale."""

    q_ref: jax.Array
    k_ref: jax.Array
    g_ref: jax.Array
    q_scale: jax.Array  # [C, 1] fp32
    k_scale: jax.Array  # [C, 1] fp32

    @classmethod
    def read(cls, q_ref, k_ref, g_ref, *, scale: float, l2_normalize: bool) -> RawChunk:
        if l2_normalize:
            q_scale, k_scale = (_inverse_norm(ref) for ref in (q_ref, k_ref))
        else:
            q_scale = k_scale = jnp.ones((q_ref.shape[0], 1), jnp.float32)
        return cls(q_ref, k_ref, g_ref, q_scale * scale, k_scale)

    def queries(self, cols=slice(None)) -> jax.Array:
        """Normalized, scaled queries [C, cols] fp32."""
        return self.q_ref[:, cols].astype(jnp.float32) * self.q_scale

    def keys(self, cols=slice(None)) -> jax.Array:
        """Normalized keys [C, cols] fp32."""
        return self.k_ref[:, cols].astype(jnp.float32) * self.k_scale

    def gates(self, cols=slice(None)) -> jax.Array:
        """G [C, cols] fp32: g summed over the chunk's tokens up to each row."""
        return jnp.cumsum(self.g_ref[:, cols].astype(jnp.float32), axis=0)


def _inverse_norm(ref) -> jax.Array:
    rows = ref[...].astype(jnp.float32)
    return lax.rsqrt(jnp.sum(rows * rows, axis=1, keepdims=True) + L2_EPS)


def tile_row(tile: jax.Array, index) -> jax.Array:
    """Row `index` [width] of a [rows, width] register tile (Triton tiles cannot be indexed: a masked
    sum, exact since every other term is zero)."""
    rows = lax.broadcasted_iota(jnp.int32, tile.shape, 0)
    return jnp.sum(jnp.where(rows == index, tile, 0.0), axis=0)
