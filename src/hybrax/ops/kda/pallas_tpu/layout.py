"""The TPU kernels' rows: tokens as chunks of C rows, one sequence per run of chunks, and how each chunk's
grid step finds its sequence.

Dense rows: each batch row is one sequence of T tokens, padded with zero rows to NC = ceil(T / C) chunks.

Packed sequences: cu_seqlens [N + 1] packs N sequences in a batch of one. The kernels read them in
`hybrax.core.packing.chunk_layout`'s layout: sequence n, of L_n tokens, from a chunk boundary over
ceil(L_n / C) chunks, zero rows after its tokens, NC <= (T + N (C - 1)) / C chunks in all (a static bound;
the chunks past the last sequence hold zero rows only). A zero row (k = v = 0, gate 0, beta 0) leaves the
state as it is and its output is dropped, so no chunk mixes two sequences and nothing is masked in the
kernels. Both directions are gathers (tokens -> rows by `source`, rows -> tokens by `destination`), in the
forward and in the backward.

Each chunk's place comes to the kernels as one int32 per chunk, scalar-prefetched into SMEM
(`pltpu.PrefetchScalarGridSpec`): info[c] = 4 sequence(c) + 2 first(c) + last(c), with first / last whether
chunk c starts / ends its sequence. The state blocks' index maps read sequence(c) (the initial and final state,
and their cotangents, of that sequence); the kernels read first and last: the forward loads the initial state
into its VMEM state at a first chunk and writes the final state at a last one, the backward the reverse. One
word per chunk: SMEM holds 1 MiB on a v5e, 2^18 chunks. A sequence with no tokens has no chunk: its final state
is its initial state (and the initial state's cotangent the final state's), set outside the kernels.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jaxtyping import Array, Int

from hybrax.core.packing import ChunkLayout, chunk_layout

MAX_CHUNKS = 2**17  # packed chunks per call: half of a v5e's SMEM for the chunk info


class Rows(NamedTuple):
    """Where the tokens of a call sit in the kernels' rows: `chunks` chunks of `chunk` rows; `packed` the
    layout of packed sequences and `info` its chunk info [NC] (both None for dense rows)."""

    chunks: int
    chunk: int
    packed: ChunkLayout | None
    info: Int[Array, " NC"] | None

    @property
    def length(self) -> int:
        """Rows per batch row: NC * C."""
        return self.chunks * self.chunk

    def from_tokens(self, x: jax.Array, axis: int = 1) -> jax.Array:
        """x [..., T, ...] (tokens on `axis`) -> [..., NC * C, ...]: zero rows after each sequence."""
        if self.packed is None:
            pads = [(0, 0)] * x.ndim
            pads[axis] = (0, self.length - x.shape[axis])
            return jnp.pad(x, pads)
        return jnp.take(x, self.packed.source, axis=axis, mode="fill", fill_value=0)

    def to_tokens(self, x: jax.Array, length: int, axis: int = 1) -> jax.Array:
        """x [..., NC * C, ...] -> [..., T, ...]: each token's row; tokens of no sequence read zeros."""
        if self.packed is None:
            return lax.slice_in_dim(x, 0, length, axis=axis)
        return jnp.take(x, self.packed.destination, axis=axis, mode="fill", fill_value=0)

    def states(self, computed: jax.Array, unchanged: jax.Array) -> jax.Array:
        """The kernel's per-sequence states [N, ...] with `unchanged`'s where a sequence has no tokens (the
        kernel never writes those)."""
        if self.packed is None:
            return computed
        return jnp.where(self.packed.nonempty.reshape(-1, *[1] * (computed.ndim - 1)), computed, unchanged)


def packed_chunks(length: int, sequences: int, chunk: int) -> int:
    """NC of N = `sequences` packed sequences over `length` tokens: the static bound of the module."""
    return (length + sequences * (chunk - 1)) // chunk


def rows_of(length: int, chunk: int, cu_seqlens: Int[Array, " N1"] | None = None) -> Rows:
    """The rows of T = `length` tokens at `chunk`: dense, or the packed sequences of cu_seqlens [N + 1]."""
    if cu_seqlens is None:
        return Rows(-(-length // chunk), chunk, None, None)
    chunks = packed_chunks(length, cu_seqlens.shape[0] - 1, chunk)
    if chunks > MAX_CHUNKS:
        raise ValueError(f"cu_seqlens: the packed layout needs {chunks} chunks of {chunk}, more than the {MAX_CHUNKS} "
                         f"whose chunk info fits in SMEM (a larger chunk, or fewer tokens or sequences per call)")
    packed = chunk_layout(jnp.asarray(cu_seqlens, jnp.int32), length, chunk)
    info = 4 * packed.chunk_sequence + 2 * packed.first.astype(jnp.int32) + packed.last.astype(jnp.int32)
    return Rows(packed.num_chunks, chunk, packed, info.astype(jnp.int32))


def sequence_of(info_refs: tuple, chunk: jax.Array) -> jax.Array | int:
    """In an index map: the sequence of grid chunk `chunk` (0 for dense rows, whose sequence is the batch row)."""
    return lax.shift_right_logical(info_refs[0][chunk], 2) if info_refs else 0


def boundaries(info_ref, chunk: jax.Array, count: jax.Array) -> tuple[jax.Array, jax.Array]:
    """In a kernel: (first, last), whether grid chunk `chunk` of `count` starts / ends its sequence (dense rows,
    `info_ref` None: the first and the last chunk)."""
    if info_ref is None:
        return chunk == 0, chunk == count - 1
    info = info_ref[chunk]
    return lax.bitwise_and(info, 2) != 0, lax.bitwise_and(info, 1) != 0


def fold_vmap_into_batch(launch, shared: int = 0):
    """`launch` (arrays -> tuple of arrays, every one with the batch axis first) with a vmap rule that folds
    the mapped axis into the batch axis. Pallas' own rule would add a grid axis, which the kernel's
    dimension semantics (one per grid axis) do not name. The first `shared` arrays (the chunk info) serve
    every batch row: when one of them is mapped, the call runs once per mapped index (`lax.map`)."""

    @jax.custom_batching.custom_vmap
    def call(*arrays):
        return launch(*arrays)

    @call.def_vmap
    def _rule(axis_size, in_batched, *arrays):
        if any(in_batched[:shared]):
            def one(mapped):
                slices = iter(mapped)
                return call(*(next(slices) if batched else x for x, batched in zip(arrays, in_batched)))

            outputs = lax.map(one, tuple(x for x, batched in zip(arrays, in_batched) if batched))
            return outputs, (True,) * len(outputs)
        arrays = [x if mapped or index < shared else jnp.broadcast_to(x, (axis_size, *x.shape))
                  for index, (x, mapped) in enumerate(zip(arrays, in_batched))]
        outputs = call(*(x if index < shared else x.reshape(-1, *x.shape[2:]) for index, x in enumerate(arrays)))
        return tuple(x.reshape(axis_size, -1, *x.shape[1:]) for x in outputs), (True,) * len(outputs)

    return call
