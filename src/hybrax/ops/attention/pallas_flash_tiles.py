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

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from hybrax.ops.attention.mask import PADDING_SEGMENT
from hybrax.ops.attention.scores import dropout_keep_of, dropout_row_hash
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
    has_bias: bool = False
    has_mask: bool = False
    dropout_prob: float = 0.0

    @property
    def masks_every_tile(self) -> bool:
        """Segment ids and dense masks can hide any entry: no tile is known whole without reading them."""
        return self.has_segments or self.has_mask

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
        need no mask (empty with segment ids or a dense mask)."""
        if self.masks_every_tile:
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
        if self.masks_every_tile:
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

    def visible(self, q_block: jax.Array, k_block: jax.Array, extras: "Extras", rows: Any, keys: Any) -> jax.Array:
        """bool [block_q, block_k]: which keys of the tile each query row sees; `rows` / `keys` index the
        extras' refs (a pl.ds, or slice(None) where the ref holds just the program's block)."""
        # A column of rows and a row of columns: comparisons broadcast them, and neither index is held per entry.
        row = (q_block * self.block_q + lax.iota(jnp.int32, self.block_q))[:, None]
        position = row // self.group if self.group > 1 else row
        col = (k_block * self.block_k + lax.iota(jnp.int32, self.block_k))[None, :]
        seen = (row < self.num_rows) & (col < self.kv_len)
        if self.window_left is not None:
            seen &= col >= position + (self.offset - self.window_left)
        if self.window_right is not None:
            seen &= col <= position + (self.offset + self.window_right)
        if self.has_segments:
            q_segments, kv_segments = extras.q_segments[rows][:, None], extras.kv_segments[keys][None, :]
            seen &= (q_segments == kv_segments) & (q_segments != PADDING_SEGMENT)
        if self.has_mask:
            seen &= extras.mask[rows, keys] != 0
        return seen

    def logits(self, q: jax.Array, k: jax.Array, extras: "Extras", rows: Any, keys: Any, dtype, precision
               ) -> tuple[jax.Array, jax.Array | None]:
        """(cap(scale q k^T + bias), tanh of the capped argument or None): fp32 [block_q, block_k]. The
        backward multiplies by cap's slope 1 - tanh^2."""
        logits = mm_t(q, k, dtype, precision) * self.scale
        if self.has_bias:
            logits = logits + extras.bias[rows, keys]
        if self.soft_cap is None:
            return logits, None
        tanh = jnp.tanh(logits / self.soft_cap)
        return self.soft_cap * tanh, tanh


    def dropout_rows(self, extras: "Extras", batch_index: jax.Array, kv_head: jax.Array, q_block: jax.Array
                     ) -> jax.Array | None:
        """uint32 [block_q]: each row's dropout hash of (seed, batch, head, query position), the prefix of
        `scores.dropout_keep`'s (so the kernels drop exactly what the XLA implementations drop); None without
        dropout."""
        if not self.dropout_prob:
            return None
        row = q_block * self.block_q + lax.iota(jnp.int32, self.block_q)
        head = kv_head * self.group + row % self.group
        return dropout_row_hash(extras.dropout_seed, batch_index, head, row // self.group)

    def dropout_keep(self, row_hashes: jax.Array | None, k_block: jax.Array) -> jax.Array | None:
        """bool [block_q, block_k]: the tile's kept entries (`scores.dropout_keep`'s); None without dropout."""
        if row_hashes is None:
            return None
        col = k_block * self.block_k + lax.iota(jnp.int32, self.block_k)
        return dropout_keep_of(row_hashes[:, None], col[None, :], self.dropout_prob)

    def dropout(self, keep: jax.Array | None, x: jax.Array) -> jax.Array:
        """x with the dropped entries 0 and the kept ones scaled by 1 / (1 - dropout_prob)."""
        if keep is None:
            return x
        return jnp.where(keep, x * (1.0 / (1.0 - self.dropout_prob)), 0.0)


class Extras(NamedTuple):
    """The refs of a call's optional inputs, by query row and key: segment ids [R] / [Tk], bias [R, Tk] fp32,
    mask [R, Tk] int8 (nonzero keeps), dropout seed [2] uint32. Launch order: segments, bias, mask, seed."""

    q_segments: Any = None
    kv_segments: Any = None
    bias: Any = None
    mask: Any = None
    dropout_seed: Any = None

    @classmethod
    def take(cls, geometry: Geometry, refs: list) -> tuple["Extras", list]:
        """The extras' refs from the front of `refs`, and the refs after them."""
        found = {}
        if geometry.has_segments:
            found["q_segments"], found["kv_segments"], *refs = refs
        if geometry.has_bias:
            found["bias"], *refs = refs
        if geometry.has_mask:
            found["mask"], *refs = refs
        if geometry.dropout_prob:
            found["dropout_seed"], *refs = refs
        return cls(**found), refs


def extras_specs(geometry: Geometry, extras: Extras, rows: int, kv_len: int, per_row_block: bool
                 ) -> tuple[list, list[pl.BlockSpec]]:
    """(arrays, block specs) of the present extras on the grid (block, batch, kv head): by the program's rows and
    all keys (per_row_block), or all rows and the program's keys. Bias and mask may broadcast over batch and kv
    heads (their leading dims of 1)."""
    row_block = geometry.block_q if per_row_block else rows
    key_block = kv_len if per_row_block else geometry.block_k

    def along(i):  # (row block index, key block index) of program i
        return (i, 0) if per_row_block else (0, i)

    arrays, specs = [], []
    if geometry.has_segments:
        arrays += [extras.q_segments, extras.kv_segments]
        specs += [pl.BlockSpec((None, row_block), lambda i, b, h: (b, along(i)[0])),
                  pl.BlockSpec((None, key_block), lambda i, b, h: (b, along(i)[1]))]
    for present, pairwise in ((geometry.has_bias, extras.bias), (geometry.has_mask, extras.mask)):
        if present:
            batch_of = (lambda b: b) if pairwise.shape[0] > 1 else (lambda b: 0)
            head_of = (lambda h: h) if pairwise.shape[1] > 1 else (lambda h: 0)
            arrays.append(pairwise)
            specs.append(pl.BlockSpec((None, None, row_block, key_block),
                                      lambda i, b, h, batch_of=batch_of, head_of=head_of:
                                      (batch_of(b), head_of(h), *along(i))))
    if geometry.dropout_prob:
        arrays.append(extras.dropout_seed)
        specs.append(pl.BlockSpec((2,), lambda i, b, h: (0,)))
    return arrays, specs


def to_rows(x: jax.Array, padded_rows: int) -> jax.Array:
    """[B, Tq, K, G, ...] -> [B, K, R', ...] by query row: row t * G + g is position t of head g, padded with
    zeros to `padded_rows`."""
    batch, q_len, kv_heads, group = x.shape[:4]
    rows = jnp.reshape(jnp.moveaxis(x, 1, 2), (batch, kv_heads, q_len * group, *x.shape[4:]))
    return jnp.pad(rows, [(0, 0), (0, 0), (0, padded_rows - q_len * group)] + [(0, 0)] * (x.ndim - 4))


def head_rows(per_head: jax.Array, q_len: int, padded_rows: int) -> jax.Array:
    """A value per query head [K, G, ...] -> per query row [K, R', ...] (row t * G + g holds head g's)."""
    return to_rows(jnp.broadcast_to(per_head, (1, q_len, *per_head.shape)), padded_rows)[0]


def from_rows(rows: jax.Array, q_len: int, group: int) -> jax.Array:
    """The inverse of `to_rows`: [B, K, R', ...] -> [B, Tq, K, G, ...], the padding rows dropped."""
    batch, kv_heads = rows.shape[:2]
    per_head = jnp.reshape(rows[:, :, :q_len * group], (batch, kv_heads, q_len, group, *rows.shape[3:]))
    return jnp.moveaxis(per_head, 2, 1)


def masked_loop(bounds: tuple[jax.Array, jax.Array], whole: tuple[jax.Array, jax.Array], step, carry):
    """carry after step(index, carry, masked) over bounds [first, end), unmasked on `whole` [a, b) within it:
    tiles that every row sees whole skip the visibility mask (most tiles of a long causal or windowed call)."""
    (first, end), (whole_first, whole_end) = bounds, whole
    carry = lax.fori_loop(first, whole_first, lambda index, c: step(index, c, True), carry)
    carry = lax.fori_loop(whole_first, whole_end, lambda index, c: step(index, c, False), carry)
    return lax.fori_loop(whole_end, end, lambda index, c: step(index, c, True), carry)


def online_softmax(row_max: jax.Array, row_sum: jax.Array, logits: jax.Array
                   ) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """One key block of the online softmax: (new running max, new denominator, the block's weights, the factor
    that rescales what was accumulated before). Hidden logits are -inf; rows that have seen nothing yet keep a
    max of -inf and shift by 0, so no inf - inf appears."""
    new_max = jnp.maximum(row_max, jnp.max(logits, axis=1))
    shift = jnp.where(new_max == -jnp.inf, 0.0, new_max)
    weights = jnp.exp(logits - shift[:, None])
    rescale = jnp.exp(row_max - shift)
    return new_max, row_sum * rescale + jnp.sum(weights, axis=1), weights, rescale
