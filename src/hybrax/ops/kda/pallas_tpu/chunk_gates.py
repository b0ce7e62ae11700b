"""In-chunk gate sums for the TPU kernels, on values in VMEM: every exponent a sum of gates, never a difference.

For one chunk of C rows of log decays g [C, K] (fp32, <= 0) split into sub-chunks of SUB = 16 rows, with
a(i) the sub-chunk of row i and Σ over the rows named:

    prefix  P_i = Σ_{s in a(i), s <= i} g_s        (inclusive, within the sub-chunk)
    suffix  S_j = Σ_{s in a(j), s > j} g_s         (exclusive, within the sub-chunk)
    total   T_m = Σ_{s in m} g_s                   (one [1, K] row per sub-chunk)

and from them, all sums of nonpositive terms (so exp never overflows, a gate of -inf makes every decay
across it exactly 0, and a large cumulative decay costs no precision in the decays after it):

    G_i        = P_i + Σ_{m < a(i)} T_m             the decay from the chunk's start through row i
    G_C - G_j  = S_j + Σ_{m > a(j)} T_m             the decay after row j to the chunk's end
    G_i - G_j  = P_i + Σ_{b < m < a} T_m + S_j      for j in an earlier sub-chunk b < a = a(i)

The scans are log-step (Hillis-Steele) passes of `pltpu.roll` along the rows with a select and an add: a
few VPU operations per [8, 128] register, no cumsum primitive (Mosaic lowers none) and no masked matmul (an
fp32 matmul would round the gates or cost six MXU passes).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental.pallas import tpu as pltpu

SUB = 16  # rows per sub-chunk: the diagonal blocks of the scores, and the scans' segments


def block_of(index: jax.Array, size: int) -> jax.Array:
    """index // size for int32 indices >= 0 and a power of two `size`, as a shift: the TPU's vector units
    have no integer division (and jnp's // and % lower a sign, which Mosaic takes only on some chips)."""
    return lax.shift_right_logical(index, size.bit_length() - 1)


def row_in_segment(shape: tuple[int, int], segment: int) -> jax.Array:
    """Each row's index within its segment of `segment` rows (a power of two), as an int32 array of `shape`."""
    return lax.bitwise_and(lax.broadcasted_iota(jnp.int32, shape, 0), segment - 1)


def segment_prefix(x: jax.Array, segment: int) -> jax.Array:
    """Inclusive prefix sums along the rows of x [R, L] within aligned segments of `segment` rows (a power of
    two dividing R): log2(segment) steps, each adding the rows `step` above where they lie in the segment."""
    local = row_in_segment(x.shape, segment)
    step = 1
    while step < segment:
        x = x + jnp.where(local >= step, pltpu.roll(x, step, 0), 0.0)
        step *= 2
    return x


def segment_suffix(x: jax.Array, segment: int) -> jax.Array:
    """Exclusive suffix sums along the rows within aligned segments: row j gets the sum of the rows after it
    in its segment (0 for the last), with no subtraction (the row's own value never enters)."""
    rows = x.shape[0]
    local = row_in_segment(x.shape, segment)
    # Shift up by one within the segment (roll by rows - 1 is a roll by -1), then inclusive suffix sums.
    x = jnp.where(local < segment - 1, pltpu.roll(x, rows - 1, 0), 0.0)
    step = 1
    while step < segment:
        x = x + jnp.where(local < segment - step, pltpu.roll(x, rows - step, 0), 0.0)
        step *= 2
    return x


def block_rows(rows: list[jax.Array], width: int) -> jax.Array:
    """[len(rows) * SUB, width]: each [1, width] row repeated over its sub-chunk's SUB rows."""
    return jnp.concatenate([jnp.broadcast_to(row, (SUB, width)) for row in rows], axis=0)


class ChunkGates(NamedTuple):
    """A chunk's gate sums (see the module docstring), fp32."""

    prefix: jax.Array  # [C, K] P
    suffix: jax.Array  # [C, K] S
    totals: list[jax.Array]  # C / SUB rows [1, K]: T_m

    @property
    def sub_chunks(self) -> int:
        return len(self.totals)

    def before(self, a: int) -> jax.Array:
        """[1, K] Σ_{m < a} T_m: the decay from the chunk's start to sub-chunk a's start."""
        return functools.reduce(jnp.add, self.totals[:a], jnp.zeros_like(self.totals[0]))

    def after(self, b: int) -> jax.Array:
        """[1, K] Σ_{m > b} T_m: the decay from sub-chunk b's end to the chunk's end."""
        return functools.reduce(jnp.add, self.totals[b + 1:], jnp.zeros_like(self.totals[0]))

    def between(self, b: int, a: int) -> jax.Array:
        """[1, K] Σ_{b < m < a} T_m: the sub-chunks strictly between b and a."""
        return functools.reduce(jnp.add, self.totals[b + 1:a], jnp.zeros_like(self.totals[0]))

    def total(self) -> jax.Array:
        """[1, K] the chunk's whole decay G_C."""
        return self.before(self.sub_chunks)

    def from_start(self) -> jax.Array:
        """[C, K] G_i: the decay from the chunk's start through row i."""
        width = self.prefix.shape[1]
        return self.prefix + block_rows([self.before(a) for a in range(self.sub_chunks)], width)

    def to_end(self) -> jax.Array:
        """[C, K] G_C - G_j: the decay after row j to the chunk's end."""
        width = self.prefix.shape[1]
        return self.suffix + block_rows([self.after(b) for b in range(self.sub_chunks)], width)

    def steepest(self) -> jax.Array:
        """The largest decay of one sub-chunk in any channel, -min T_m (a scalar >= 0, inf after a -inf gate)."""
        return -jnp.min(functools.reduce(jnp.minimum, self.totals))


def chunk_gates(g: jax.Array) -> ChunkGates:
    """The gate sums of one chunk's log decays g [C, K] (C a multiple of SUB)."""
    totals = [jnp.sum(g[m * SUB:(m + 1) * SUB], axis=0, keepdims=True) for m in range(g.shape[0] // SUB)]
    return ChunkGates(segment_prefix(g, SUB), segment_suffix(g, SUB), totals)
