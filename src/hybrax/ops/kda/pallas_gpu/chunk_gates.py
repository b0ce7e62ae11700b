"""How the KDA Pallas kernels exponentiate log decays: exactly for every gate <= 0, -inf included.

Stage 0 (`chunk_cumsum`) sums each chunk's gates into G (G_i: the decay from the chunk's start through
row i), and the per-chunk kernels' fast arithmetic exponentiates differences of it: exp(G_i - G_j) in the
scores, exp(G_last - G) for the keys' decay to the chunk's end. A difference of two fp32 cumulative sums keeps
the rounding of the larger one: after a gate of -1000 G sits near -1000, where one rounding step is 6e-5, and
a gate of -1e30 swallows every later gate of the chunk (G_i - G_j = 0 for any later i, j); -inf gives
-inf - -inf = NaN. So every kernel first tests its chunk (`steep_chunk`, a few rows of G):

- not steep (no 16-row sub-chunk decays by more than exp(STEEP) in any channel, its first row's gate
  included): every |G| <= STEEP * C / 16, so the differences carry at most that times 2^-24 (1.4e-5 at C = 64);
  the fast arithmetic runs as it always did. Bounded gates (the common case) are always here.
- steep: the kernel reads the per-token gates themselves (stage 0's input) and forms every exponent as a sum
  of only the gates between its two positions: `exact_decays` for the chunk-wide factors (running sums down
  and up the chunk), `pair_exponents` column by column for the scores. No difference of two sums is taken,
  so each decay has the accuracy of a sum of the gates that matter, and a huge gate underflows to exactly 0
  wherever it lies between.

Gates enter clamped at FLOOR = -1e30 (`clamp`; stage 0 clamps the gates it sums too, so G is always finite,
never -inf), as XLA's chunked path clamps them (`base.GATE_FLOOR`). That is exact: every exponent that
holds a clamped gate is <= -1e30, and exp of it is 0 in fp32, as exp of the true sum (down to -inf) is; a sum
of 128 of them (-1.3e32) stays far from fp32's limit, so no -inf - -inf or 0 * inf ever arises. The gradient
w.r.t. such a gate is 0 (every term that holds it carries its exp, 0): the backward's dg, a suffix sum of dG
within the chunk in which the terms of the pairs after the gate cancel, is set to 0 at every gate below
UNDERFLOW (`chunk_cumsum.gate_gradient`), so that the fused gate's a_log gradient (dg times the gate)
does not multiply that rounding by -1e30.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from hybrax.ops.kda.base import GATE_FLOOR
from hybrax.ops.kda.pallas_gpu.tiles import SUB

# The largest decay within one sub-chunk (the decay from the row before it through its last row, in any
# channel) that the fast arithmetic takes: its factors stay within exp(60) = 1e26, far from fp32's limits
# (3e38), and G within 60 per sub-chunk.
STEEP = 60.0
FLOOR = GATE_FLOOR
UNDERFLOW = -104.0  # exp(x) rounds to 0 in fp32 below about -103.97
# K columns per slice in the steep chunks' branches: each kernel's registers are allocated for its heaviest
# branch, so the rarely taken one keeps small tiles (the fast one's widths would spill more, as ptxas for sm_90
# says: tools/triton_shared_memory.py).
EXACT_BLOCK_K = 16


def clamp(gates: jax.Array) -> jax.Array:
    """Gates clamped at FLOOR (exact: see the module docstring)."""
    return jnp.maximum(gates, FLOOR)


def steep_chunk(g_ref) -> jax.Array:
    """Whether some sub-chunk of the chunk decays by more than exp(STEEP) in some channel, counting its first
    row's gate: G at the row before it minus G at its last row (0 before the chunk). From each sub-chunk's
    last row of G, all read before the one reduction (ptxas moves no load across a reduction's barriers).

    Sound for any gates: G is non-increasing down the chunk (fp32 addition of a gate <= 0 never increases a
    sum), so the first sub-chunk that decays by more than STEEP starts from a G >= -STEEP * its index, where
    the difference is accurate, and is caught; before it every G is within STEEP per sub-chunk."""
    ends = [g_ref[a * SUB + SUB - 1, :] for a in range(g_ref.shape[0] // SUB)]
    drops = [-ends[0]] + [before - end for before, end in zip(ends, ends[1:])]
    return jnp.max(functools.reduce(jnp.maximum, drops)) > STEEP


class ChunkDecays(NamedTuple):
    """The chunk-wide decays of one K slice's [C, BK] gates."""

    growth: jax.Array  # [C, BK] exp(G_i): from the chunk's start through row i
    to_end: jax.Array  # [C, BK] exp(G_last - G_i): after row i to the chunk's end
    total: jax.Array  # [BK] exp(G_last): the whole chunk


def cumulative_decays(gates: jax.Array, last: jax.Array) -> ChunkDecays:
    """The fast arithmetic's `ChunkDecays`, from a slice of G and its last row (chunks that are not steep)."""
    return ChunkDecays(jnp.exp(gates), jnp.exp(last[None, :] - gates), jnp.exp(last))


def exact_decays(raw_ref, cols) -> ChunkDecays:
    """`ChunkDecays` of the per-token gates' columns `cols` (steep chunks): running sums down the chunk for
    the prefixes and up it for the suffixes, row by row from the ref (two [C, BK] tiles and two [BK] sums
    live: this rarely taken branch must not raise the register count every program pays)."""
    chunk = raw_ref.shape[0]
    rows = jax.lax.broadcasted_iota(jnp.int32, (chunk, cols.size), 0)

    def row(t, carry):
        prefix, suffix, through, after = carry  # through: sum of g_0..g_t; after: sum of g_{u+1}..g_{C-1}
        u = chunk - 1 - t
        through = through + clamp(raw_ref[t, cols])
        prefix = jnp.where(rows == t, through[None, :], prefix)
        suffix = jnp.where(rows == u, after[None, :], suffix)
        return prefix, suffix, through, after + clamp(raw_ref[u, cols])

    tile, sums = jnp.zeros(rows.shape, jnp.float32), jnp.zeros((cols.size,), jnp.float32)
    prefix, suffix, total, _ = jax.lax.fori_loop(0, chunk, row, (tile, tile, sums, sums))
    return ChunkDecays(jnp.exp(prefix), jnp.exp(suffix), jnp.exp(total))


class CumulativeGates(NamedTuple):
    """A K slice's decays from G (the fast arithmetic): `read` loads (the WY pass reads a slice ahead),
    `decays` computes."""

    g_ref: object

    def read(self, cols) -> tuple[jax.Array, jax.Array]:
        return self.g_ref[:, cols], self.g_ref[self.g_ref.shape[0] - 1, cols]

    def decays(self, loaded, cols) -> ChunkDecays:
        return cumulative_decays(*loaded)


class ExactGates(NamedTuple):
    """A K slice's decays from the per-token gates (steep chunks), as `CumulativeGates` (reading as it sums)."""

    raw_ref: object

    def read(self, cols) -> tuple:
        return ()

    def decays(self, loaded, cols) -> ChunkDecays:
        return exact_decays(self.raw_ref, cols)


def pair_exponents(exponents: jax.Array, raw_ref, j, cols) -> jax.Array:
    """Column j's exponents from column j + 1's, for a walk over the columns from the last to the first:
    [C, BK], row i > j holding sum_{j < t <= i} g_t (each a sum of only those gates: row i of column j + 1
    plus g_{j+1}), rows i <= j 0 (row j: no decay; above it callers drop the entries). `exponents` of the
    last column are anything (every row is reset)."""
    rows = jax.lax.broadcasted_iota(jnp.int32, exponents.shape, 0)
    following = clamp(raw_ref[jnp.minimum(j + 1, exponents.shape[0] - 1), cols])
    return jnp.where(rows > j, exponents + following[None, :], 0.0)
