"""What the flash attention kernels share: the static geometry of a call (blocks, window, alignment) and the
score tile every kernel recomputes the same way.

The query heads of a group share their kv head, so the kernels take them together: row r of a kv head's
[q_len * group, D] query rows is query position r // group of head r % group. A block of rows then reads
each key block once for all heads of the group, and a decode step (q_len = 1) fills its rows with the
group's heads instead of padding.

Positions are hybrax's: query i sits at the aligned position i + kv_len - q_len, and key j is visible when
the window allows it around that position, j < kv_len, i < q_len, and the segment ids match (id -1 sees
nothing). Key blocks a row block cannot see, and row blocks a key block cannot be seen by, are never
loaded: the kernels' loops run over `key_blocks` / `query_blocks` only.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from hybrax.ops.attention.mask import PADDING_SEGMENT
from hybrax.ops.pallas_shared import mm_t


class Geometry(NamedTuple):
    """Static description of one call's tiling (hashable: a jit static argument)."""

    q_len: int  # query positions
    kv_len: int
    block_q: int  # query rows (position, head of the group) per block
    block_k: int
    group: int  # query heads per kv head
    window_left: int | None
    window_right: int | None
    scale: float
    soft_cap: float | None
    has_segments: bool

    @property
    def offset(self) -> int:
        """Aligned position of query i: i + offset (bottom-right alignment)."""
        return self.kv_len - self.q_len

    @property
    def num_rows(self) -> int:
        return self.q_len * self.group

    @property
    def num_q_blocks(self) -> int:
        return -(-self.num_rows // self.block_q)

    @property
    def num_k_blocks(self) -> int:
        return -(-self.kv_len // self.block_k)

    def key_blocks(self, q_block: jax.Array) -> tuple[jax.Array, jax.Array]:
        """[first, end) of the key blocks that row block `q_block` may see."""
        first_position = q_block * self.block_q // self.group
        last_position = (q_block * self.block_q + self.block_q - 1) // self.group
        first, end = jnp.int32(0), jnp.int32(self.num_k_blocks)
        if self.window_left is not None:
            first = jnp.maximum(first_position + self.offset - self.window_left, 0) // self.block_k
        if self.window_right is not None:
            last_key = last_position + self.offset + self.window_right
            end = jnp.minimum((jnp.maximum(last_key, -1) + self.block_k) // self.block_k, end)
        return first, end

    def query_blocks(self, k_block: jax.Array) -> tuple[jax.Array, jax.Array]:
        """[first, end) of the row blocks that may see key block `k_block`."""
        first_key = k_block * self.block_k
        first, end = jnp.int32(0), jnp.int32(self.num_q_blocks)
        if self.window_right is not None:
            first_position = jnp.maximum(first_key - self.window_right - self.offset, 0)
            first = first_position * self.group // self.block_q
        if self.window_left is not None:
            last_position = first_key + self.block_k - 1 + self.window_left - self.offset
            last_row = jnp.maximum(last_position * self.group + self.group - 1, -1)
            end = jnp.minimum((last_row + self.block_q) // self.block_q, end)
        return first, end

    def whole_key_blocks(self, q_block: jax.Array, first: jax.Array, end: jax.Array) -> tuple[jax.Array, jax.Array]:
        """[a, b) within [first, end): key blocks that every row of row block `q_block` sees whole, whose tiles
        need no mask (empty with segment ids, which only a mask can apply)."""
        if self.has_segments:
            return end, end
        first_row = q_block * self.block_q
        last_row = first_row + self.block_q - 1
        whole_first, whole_end = first, jnp.minimum(end, self.kv_len // self.block_k)
        if self.window_left is not None:  # key >= last position + offset - left
            lowest_key = last_row // self.group + self.offset - self.window_left
            whole_first = jnp.maximum(whole_first, (jnp.maximum(lowest_key, 0) + self.block_k - 1) // self.block_k)
        if self.window_right is not None:  # key <= first position + offset + right
            keys_below = first_row // self.group + self.offset + self.window_right + 1
            whole_end = jnp.minimum(whole_end, jnp.maximum(keys_below, 0) // self.block_k)
        whole_first = jnp.minimum(whole_first, end)
        whole_end = jnp.where(last_row < self.num_rows, jnp.maximum(whole_end, whole_first), whole_first)
        return whole_first, whole_end

    def whole_query_blocks(self, k_block: jax.Array, first: jax.Array, end: jax.Array) -> tuple[jax.Array, jax.Array]:
        """[a, b) within [first, end): row blocks whose every row sees key block `k_block` whole (no mask)."""
        if self.has_segments:
            return end, end
        first_key = k_block * self.block_k
        last_key = first_key + self.block_k - 1
        whole_first, whole_end = first, jnp.minimum(end, self.num_rows // self.block_q)
        if self.window_right is not None:  # first position of the block >= last key - offset - right
            lowest_position = jnp.maximum(last_key - self.offset - self.window_right, 0)
            whole_first = jnp.maximum(whole_first, (lowest_position * self.group + self.block_q - 1) // self.block_q)
        if self.window_left is not None:  # last position of the block <= first key - offset + left
            rows_below = (first_key - self.offset + self.window_left + 1) * self.group
            whole_end = jnp.minimum(whole_end, jnp.maximum(rows_below, 0) // self.block_q)
        whole_first = jnp.minimum(whole_first, end)
        whole_end = jnp.where(last_key < self.kv_len, jnp.maximum(whole_end, whole_first), whole_first)
        return whole_first, whole_end

    def visible(
        self, q_block: jax.Array, k_block: jax.Array, q_segments: jax.Array | None, kv_segments: jax.Array | None
    ) -> jax.Array:
        """bool [block_q, block_k]: which keys of the tile each query row sees (`q_segments` by row)."""
        # A column of rows and a row of columns: comparisons broadcast them, and neither index is held per entry.
        rows = (q_block * self.block_q + lax.iota(jnp.int32, self.block_q))[:, None]
        positions = rows // self.group if self.group > 1 else rows
        cols = (k_block * self.block_k + lax.iota(jnp.int32, self.block_k))[None, :]
        seen = (rows < self.num_rows) & (cols < self.kv_len)
        if self.window_left is not None:
            seen &= cols >= positions + (self.offset - self.window_left)
        if self.window_right is not None:
            seen &= cols <= positions + (self.offset + self.window_right)
        if self.has_segments:
            seen &= (q_segments[:, None] == kv_segments[None, :]) & (q_segments[:, None] != PADDING_SEGMENT)
        return seen

    def logits(self, q: jax.Array, k: jax.Array, dtype, precision) -> tuple[jax.Array, jax.Array | None]:
        """(cap(scale q k^T), tanh of the capped argument or None): fp32 [block_q, block_k]. The backward
        multiplies by cap's slope 1 - tanh^2."""
        logits = mm_t(q, k, dtype, precision) * self.scale
        if self.soft_cap is None:
            return logits, None
        tanh = jnp.tanh(logits / self.soft_cap)
        return self.soft_cap * tanh, tanh


def masked_loop(bounds: tuple[jax.Array, jax.Array], whole: tuple[jax.Array, jax.Array], step, carry):
    """carry after step(index, carry, masked) over bounds [first, end), unmasked on `whole` [a, b) within it:
    tiles that every row sees whole skip the visibility mask (most tiles of a long causal or windowed call)."""
    (first, end), (whole_first, whole_end) = bounds, whole
    carry = lax.fori_loop(first, whole_first, lambda index, c: step(index, c, True), carry)
    carry = lax.fori_loop(whole_first, whole_end, lambda index, c: step(index, c, False), carry)
    return lax.fori_loop(whole_end, end, lambda index, c: step(index, c, True), carry)
