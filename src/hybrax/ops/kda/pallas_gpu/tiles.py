"""Register-tile helpers shared by the KDA Pallas kernels (Triton lowering).

Triton tiles cannot be sliced or indexed in registers: blocks are assembled from full-tile
operations under iota masks, and rows are read from the kernel's refs instead. With packed sequences
the per-chunk kernels read their token inputs in place, through masked windows (`ChunkWindow`).

The per-chunk kernels launch on the grid (value head, chunk, batch). Blocks start in grid order, first
axis fastest, so the programs in flight read adjacent heads' rows of a chunk: whole [heads, width] rows
of the [B, T, heads, width] inputs. By chunk they read one head's rows, 256- or 512-byte pieces kilobytes
apart: the gate cumsum at (1, 32768, 16, 128) fp32 on the H200 took 0.158 ms that way, 0.142 heads first
(H200 measurements).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

SUB = 16  # sub-chunk rows: the smallest tile a Triton dot takes
# Triton's software pipelining of the kernels' loops over K slices and chunks (the next slice's loads
# issued as asynchronous copies while the current one computes). At (1, 8192, 32, 128) bf16 on the
# H200, 3 stages against 1 (2 for the state passes): stage 1 0.797 -> 0.758 ms, state pass 0.291 ->
# 0.223, reverse state pass 0.331 -> 0.269, grad 0.988 -> 0.870, intra backward 1.250 -> 1.121
# (H200 measurements).
PIPELINE_STAGES = 3


def pipeline_stages(dtype, dk: int, before: int = 1) -> int:
    """The kernels' `num_stages` for inputs of `dtype` and K = dk: PIPELINE_STAGES where that was
    measured (bf16, K <= 128); for fp32 up to K = 128 the earlier setting `before`; one stage at K = 256,
    where every stage keeps another set of [C, K] slices in shared memory: the reverse state pass with
    two asked the H200 for 241664 bytes (bf16) of its 232448."""
    if dk > 128:
        return 1
    return PIPELINE_STAGES if dtype == jnp.bfloat16 else before


def chunk_rows_spec(chunk: int, width: int, group: int = 1) -> pl.BlockSpec:
    """One chunk's rows [chunk, width] of a [B, T, heads, width] array, for the program (value head h,
    chunk t, batch b) of a per-chunk kernel; `group` value heads share each of the array's heads."""
    return pl.BlockSpec((None, chunk, None, width), lambda h, t, b: (b, t, h // group, 0))


def chunk_column_spec(chunk: int) -> pl.BlockSpec:
    """One chunk's [chunk] entries of a [B, T, HV] array (beta), for a per-chunk kernel."""
    return pl.BlockSpec((None, chunk, None), lambda h, t, b: (b, t, h))


def chunk_state_spec(dk: int, dv: int) -> pl.BlockSpec:
    """The [K, V] state of one chunk of a [B, NT, HV, K, V] array, for a per-chunk kernel."""
    return pl.BlockSpec((None, None, None, dk, dv), lambda h, t, b: (b, t, h, 0, 0))


def index_grid(n: int) -> tuple[jax.Array, jax.Array]:
    """Row and column indices of an n x n tile."""
    return lax.broadcasted_iota(jnp.int32, (n, n), 0), lax.broadcasted_iota(jnp.int32, (n, n), 1)


class PackedChunks(NamedTuple):
    """Where the padded layout's chunks of packed sequences (`common.layout.packed_layout`: each sequence
    from a chunk boundary) lie in the packed row, so that the per-chunk kernels read their token inputs in
    place instead of from gathered copies: per padded chunk [NT] int32, its first token and how many of its
    rows hold tokens of its sequence (the rest read as zeros, as padding)."""

    start: jax.Array
    count: jax.Array


def packed_rows_spec(length: int, width: int, group: int = 1) -> pl.BlockSpec:
    """The whole [T, width] of a [1, T, heads, width] packed array, for the program (value head h, chunk t,
    batch 0) of a per-chunk kernel, which reads its chunk's rows through a `ChunkWindow`."""
    return pl.BlockSpec((None, length, None, width), lambda h, t, b: (b, 0, h // group, 0))


def packed_column_spec(length: int) -> pl.BlockSpec:
    """The whole [T] of a [1, T, HV] packed array (beta), for a per-chunk kernel."""
    return pl.BlockSpec((None, length, None), lambda h, t, b: (b, 0, h))


def packed_chunk_specs(packed: PackedChunks | None, n_chunks: int) -> list[pl.BlockSpec]:
    """`PackedChunks`' two [NT] arrays, whole, for a per-chunk kernel (none without packed rows)."""
    return [] if packed is None else [pl.BlockSpec((n_chunks,), lambda h, t, b: (0,))] * 2


class ChunkWindow:
    """A chunk's [chunk, ...] rows of a whole packed ref, from row `start`, rows from `count` on read as
    zeros (masked: nothing past the array is touched). Reads as the chunk's own block would:
    `window[:, cols]`, `window[j, cols]`, `window[...]`."""

    def __init__(self, ref, start: jax.Array, count: jax.Array, chunk: int):
        self.ref, self.start, self.count = ref, start, count
        self.shape = (chunk, *ref.shape[1:])

    def __getitem__(self, index):
        row, *rest = index if isinstance(index, tuple) else (index,)
        if row is Ellipsis:
            row, rest = slice(None), [slice(None)] * (len(self.shape) - 1)
        if isinstance(row, slice):  # the whole chunk
            inside = lax.broadcasted_iota(jnp.int32, self.shape[:1], 0) < self.count
            mask = inside.reshape(self.shape[:1] + (1,) * len(rest))
            return pltriton.load(self.ref.at[(pl.ds(self.start, self.shape[0]), *rest)], mask=mask, other=0)
        return pltriton.load(self.ref.at[(self.start + row, *rest)], mask=row < self.count, other=0)


def token_rows_spec(chunk: int, width: int, group: int = 1, packed_length: int | None = None) -> pl.BlockSpec:
    """A per-chunk kernel's spec of a [B, T, heads, width] token input: the chunk's block, or with packed
    rows (`packed_length` = T of the packed row) the whole row, read through `chunk_window`."""
    if packed_length is None:
        return chunk_rows_spec(chunk, width, group)
    return packed_rows_spec(packed_length, width, group)


def token_column_spec(chunk: int, packed_length: int | None = None) -> pl.BlockSpec:
    """`token_rows_spec` for a [B, T, HV] token input (beta)."""
    return chunk_column_spec(chunk) if packed_length is None else packed_column_spec(packed_length)


def split_packed(refs: tuple, packed: bool) -> tuple[tuple | None, tuple]:
    """(PackedChunks' two refs or None, the refs after them) of the refs that follow a per-chunk kernel's
    regular inputs (the packed chunks' arrays come right after them)."""
    return (refs[:2], refs[2:]) if packed else (None, refs)


def chunk_window(ref, packed_refs, chunk: int):
    """`ref` itself (the chunk's block) without packed sequences, else its `ChunkWindow` for this program's
    chunk (packed_refs: the kernel's refs of `PackedChunks`)."""
    if packed_refs is None:
        return ref
    t = pl.program_id(1)
    start_ref, count_ref = packed_refs
    return ChunkWindow(ref, start_ref[t], count_ref[t], chunk)


def chunk_windows(refs, packed_refs, chunk: int) -> tuple:
    """`chunk_window` of each of `refs`."""
    return tuple(chunk_window(ref, packed_refs, chunk) for ref in refs)
