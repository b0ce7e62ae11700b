"""Packed sequences: one description of which tokens belong together, read by every op and layer.

A call takes one of two forms (or neither: every row of x [B, T, ...] is one sequence):
    cu_seqlens [N + 1]    N sequences packed in a batch of one; sequence n is tokens cu_seqlens[n]:cu_seqlens[n + 1],
                          and tokens from cu_seqlens[N] on belong to no sequence (`hybrax.core.validate.
                          check_cu_seqlens` states the rule).
    segment_ids [B, T]    each row holds runs of equal ids, and every run is a sequence of its own (a later run that
                          repeats an earlier id is still a new sequence); ids < 0 are padding.

The token -> sequence map of cu_seqlens counts the boundaries at or before each token,
    sequence(t) = #{n >= 1 : cu_seqlens[n] <= t}        (N for tokens past the last sequence),
as a cumulative sum over the tokens of markers added at cu_seqlens[1:]: O(T + N) work and no search (a binary
search per token is log N dependent steps, each a loop trip on a GPU). An empty sequence adds its marker at the
same token as the boundary after it, so it owns no token. Hence a cu_seqlens padded to a fixed length by repeating
its last value (empty sequences at the end) maps every token as before: the number of sequences may then vary
between calls without a retrace.

segment_ids reach the packed form by flattening: the B rows become one row of B * T tokens, and each run (padding
runs included) a sequence of the flattened cu_seqlens [R + 1], in row-major order. Its length is static: R is
counted when the ids are concrete, else `max_segments` bounds it and pads cu_seqlens with empty sequences.

Both become a `Packing`:
    segments [B, T]       the sequence of each token, distinct within a row, -1 for padding (the short convolution's
                          and attention's masks: a token sees only tokens of its own segment);
    positions [B, T]      each token's index within its sequence (rotary embeddings);
    cu_seqlens [R + 1]    the same sequences over the B * T tokens flattened into one row (the recurrences' packed
                          form), with padding runs as sequences of their own whose outputs are zeroed.

Chunked ops lay packed sequences out so that each starts on a chunk boundary (`chunk_layout`): sequence n, of
L_n tokens, takes ceil(L_n / C) chunks of C rows from chunk c_n = sum_{m < n} ceil(L_m / C); the rows past its
tokens are zeros. sum_n ceil(L_n / C) <= (T + N (C - 1)) / C bounds the number of chunks statically.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jaxtyping import Array, Bool, Int

from hybrax.core.validate import check_cu_seqlens, check_integer, check_shape, describe, is_concrete


def token_sequence(cu_seqlens: Int[Array, " num_sequences_plus_1"], length: int) -> Int[Array, " seq_len"]:
    """The sequence of each of `length` packed tokens: n for tokens in cu_seqlens[n]:cu_seqlens[n + 1], N (one past
    the last) for tokens past cu_seqlens[N]. Any boundaries [N + 1] from 0, never decreasing (not checked)."""
    ends = jnp.zeros((length,), jnp.int32).at[jnp.asarray(cu_seqlens)[1:]].add(1, mode="drop")
    return jnp.cumsum(ends, dtype=jnp.int32)


def first_token_mask(cu_seqlens: Int[Array, " num_sequences_plus_1"], length: int) -> Bool[Array, " seq_len"]:
    """Whether each token starts its sequence (tokens of no sequence: False)."""
    sequence = token_sequence(cu_seqlens, length)
    before = jnp.concatenate([jnp.full((1,), -1, jnp.int32), sequence[:-1]])
    return (sequence != before) & (sequence < jnp.shape(cu_seqlens)[0] - 1)


def last_token_mask(cu_seqlens: Int[Array, " num_sequences_plus_1"], length: int) -> Bool[Array, " seq_len"]:
    """Whether each token ends its sequence (tokens of no sequence: False)."""
    sequence = token_sequence(cu_seqlens, length)
    after = jnp.concatenate([sequence[1:], jnp.full((1,), -1, jnp.int32)])
    return (sequence != after) & (sequence < jnp.shape(cu_seqlens)[0] - 1)


def reversed_cu_seqlens(cu_seqlens: Int[Array, " num_sequences_plus_1"], length: int
                        ) -> Int[Array, " num_sequences_plus_1"]:
    """The boundaries of the `length` packed tokens read backwards in time: sequence n becomes sequence N - 1 - n."""
    return length - cu_seqlens[::-1]


def sequence_lengths(batch: int, length: int, cu_seqlens: Any) -> Int[Array, " num_sequences"]:
    """Each sequence's token count: T per row of a dense batch, or the cu_seqlens differences."""
    if cu_seqlens is None:
        return jnp.full((batch,), length, jnp.int32)
    cu_seqlens = jnp.asarray(cu_seqlens, jnp.int32)
    return cu_seqlens[1:] - cu_seqlens[:-1]


class ChunkLayout(NamedTuple):
    """Packed sequences laid out from chunk boundaries (see the module docstring): num_chunks chunks of C rows."""

    destination: Int[Array, " seq_len"]  # each token's row; num_chunks * C for tokens of no sequence
    source: Int[Array, " rows"]  # each row's token; seq_len for rows that hold none
    chunk_sequence: Int[Array, " num_chunks"]  # each chunk's sequence (N - 1 for chunks past them all)
    first: Bool[Array, " num_chunks"]  # whether the chunk starts its sequence
    last: Bool[Array, " num_chunks"]  # whether it ends its sequence
    last_chunk: Int[Array, " num_sequences"]  # each sequence's last chunk (clipped into range for empty ones)
    nonempty: Bool[Array, " num_sequences"]  # whether the sequence has tokens (and so chunks)
    num_chunks: int


def chunk_layout(cu_seqlens: Int[Array, " num_sequences_plus_1"], length: int, chunk: int) -> ChunkLayout:
    """Where the `length` packed tokens of cu_seqlens sit once every sequence starts on a chunk of `chunk` rows."""
    sequences = cu_seqlens.shape[0] - 1
    count = (length + sequences * (chunk - 1)) // chunk  # the bound of the module docstring
    lengths = cu_seqlens[1:] - cu_seqlens[:-1]
    chunk_begin = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum((lengths + chunk - 1) // chunk)])
    chunk_begin = chunk_begin.astype(jnp.int32)
    tokens = jnp.arange(length, dtype=jnp.int32)
    owner = token_sequence(cu_seqlens, length)
    inside = owner < sequences
    owner = jnp.minimum(owner, sequences - 1)
    destination = jnp.where(inside, chunk_begin[owner] * chunk + tokens - cu_seqlens[owner], count * chunk)
    chunks = jnp.arange(count, dtype=jnp.int32)
    sequence = token_sequence(chunk_begin, count)
    real = sequence < sequences
    sequence = jnp.minimum(sequence, sequences - 1)
    first = real & (chunks == chunk_begin[sequence])
    last = real & (chunks == chunk_begin[sequence + 1] - 1)
    # Each row's token, the inverse of `destination`: both directions of the layout are then gathers.
    rows = jnp.arange(count * chunk, dtype=jnp.int32)
    row_sequence = sequence[rows // chunk]
    offset = rows - chunk_begin[row_sequence] * chunk
    holds_token = real[rows // chunk] & (offset < lengths[row_sequence])
    source = jnp.where(holds_token, cu_seqlens[row_sequence] + offset, length)
    last_chunk = jnp.clip(chunk_begin[1:] - 1, 0, count - 1)
    return ChunkLayout(destination.astype(jnp.int32), source.astype(jnp.int32), sequence, first, last, last_chunk,
                       lengths > 0, count)


class Packing(NamedTuple):
    """segments, positions [B, T] int32 and the flattened cu_seqlens [R + 1] int32 (None unless given or asked
    for); all None for dense rows (positions then run 0 .. T - 1 in every row)."""

    segments: Int[Array, "batch seq_len"] | None
    positions: Int[Array, "batch seq_len"] | None
    cu_seqlens: Int[Array, " num_sequences_plus_1"] | None

    def token_positions(self, batch: int, length: int) -> Int[Array, "batch seq_len"]:
        if self.positions is not None:
            return self.positions
        return jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (batch, length))

    def zero_padding(self, y: jax.Array) -> jax.Array:
        """y [B, T, ...] with padding tokens' rows set to zero."""
        if self.segments is None:
            return y
        keep = (self.segments >= 0).reshape(*self.segments.shape, *([1] * (y.ndim - 2)))
        return jnp.where(keep, y, jnp.zeros((), y.dtype))

    def flatten(self, name: str, x: Any) -> Any:
        """x [B, T, ...] (the segments' B and T; None stays None) as one row [1, B * T, ...] for cu_seqlens."""
        if x is None:
            return None
        batch, length = self.segments.shape
        if tuple(jnp.shape(x)[:2]) != (batch, length):
            raise ValueError(f"{name} must have shape [batch, seq_len, ...] = {describe((batch, length, '...'))} "
                             f"(segment_ids'), got {describe(jnp.shape(x))}")
        return jnp.reshape(x, (1, batch * length, *jnp.shape(x)[2:]))

    def unflatten(self, y: jax.Array) -> jax.Array:
        """y [1, B * T, ...] back to [B, T, ...], padding tokens' rows zero."""
        return self.zero_padding(y.reshape(*self.segments.shape, *y.shape[2:]))


DENSE = Packing(None, None, None)


def from_cu_seqlens(cu_seqlens: Any, batch: int, length: int) -> Packing:
    check_cu_seqlens(cu_seqlens, batch, length, "x")
    cu_seqlens = jnp.asarray(cu_seqlens, jnp.int32)
    sequences = cu_seqlens.shape[0] - 1
    sequence = token_sequence(cu_seqlens, length)
    inside = sequence < sequences
    positions = jnp.arange(length, dtype=jnp.int32) - cu_seqlens[jnp.minimum(sequence, sequences - 1)]
    return Packing(jnp.where(inside, sequence, -1)[None], jnp.where(inside, positions, 0)[None], cu_seqlens)


def _run_starts(segment_ids: jax.Array) -> jax.Array:
    """[B, T] True where a run of equal ids begins (the first token of every row included)."""
    changed = segment_ids[:, 1:] != segment_ids[:, :-1]
    return jnp.concatenate([jnp.ones_like(segment_ids[:, :1], bool), changed], axis=1)


def _count_runs(starts: jax.Array, max_segments: int | None) -> int:
    if is_concrete(starts):
        runs = int(np.asarray(starts).sum())
        if max_segments is not None and runs > max_segments:
            raise ValueError(f"max_segments ({max_segments}) must be at least the number of runs of equal "
                             f"segment_ids in the batch, got {runs} runs")
        return runs if max_segments is None else max_segments
    if max_segments is None:
        raise ValueError("segment_ids under jit need max_segments (a static bound on the runs of equal ids in the "
                         "batch, padding runs included): the packed form has one sequence, and one state, per run")
    return max_segments


def _flat_cu_seqlens(starts: jax.Array, max_segments: int | None) -> jax.Array:
    """cu_seqlens over the flattened tokens: every run's first token, then empty sequences up to max_segments."""
    tokens = starts.size
    first_tokens = jnp.nonzero(starts.reshape(-1), size=_count_runs(starts, max_segments), fill_value=tokens)[0]
    return jnp.concatenate([first_tokens, jnp.array([tokens])]).astype(jnp.int32)


def from_segment_ids(segment_ids: Any, batch: int, length: int, max_segments: int | None,
                     with_cu_seqlens: bool, of: str = "x") -> Packing:
    """`of` names the array whose [batch, seq_len] segment_ids must match."""
    check_shape("segment_ids", segment_ids, (batch, length), f"[batch, seq_len] ({of}'s)")
    check_integer("segment_ids", segment_ids)
    if max_segments is not None and not (isinstance(max_segments, int) and max_segments >= 1):
        raise ValueError(f"max_segments must be an int >= 1 or None, got {max_segments!r}")
    segment_ids = jnp.asarray(segment_ids, jnp.int32)
    starts = _run_starts(segment_ids)
    token = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (batch, length))
    positions = token - lax.cummax(jnp.where(starts, token, 0), axis=1)
    segments = jnp.where(segment_ids >= 0, jnp.cumsum(starts, axis=1, dtype=jnp.int32) - 1, -1)
    return Packing(segments, positions, _flat_cu_seqlens(starts, max_segments) if with_cu_seqlens else None)


def packing(x: Any, cu_seqlens: Any = None, segment_ids: Any = None, *, max_segments: int | None = None,
            with_cu_seqlens: bool = False) -> Packing:
    """The packing of x [B, T, ...] from at most one of cu_seqlens and segment_ids; `with_cu_seqlens`: also the
    flattened cu_seqlens from segment_ids (the recurrences' form)."""
    batch, length = jnp.shape(x)[:2]
    if cu_seqlens is not None and segment_ids is not None:
        raise ValueError("give cu_seqlens or segment_ids, not both")
    if cu_seqlens is not None:
        return from_cu_seqlens(cu_seqlens, batch, length)
    if segment_ids is not None:
        return from_segment_ids(segment_ids, batch, length, max_segments, with_cu_seqlens)
    return DENSE


def segment_packing(name: str, x: Any, cu_seqlens: Any, segment_ids: Any, max_segments: int | None
                    ) -> Packing | None:
    """For an op that takes segment_ids [B, T] besides cu_seqlens: the packing that flattens its arrays [B, T, ...]
    (x, called `name`, and its siblings) into one row of B * T tokens with the flattened cu_seqlens; None without
    segment_ids."""
    if segment_ids is None:
        if max_segments is not None:
            raise ValueError(f"max_segments bounds the runs of segment_ids: give it with segment_ids, "
                             f"got max_segments={max_segments!r} and no segment_ids")
        return None
    if cu_seqlens is not None:
        raise ValueError("give cu_seqlens or segment_ids, not both")
    if len(jnp.shape(x)) < 2:
        raise ValueError(f"{name} must have shape [batch, seq_len, ...], got {describe(jnp.shape(x))}")
    batch, length = jnp.shape(x)[:2]
    return from_segment_ids(segment_ids, batch, length, max_segments, with_cu_seqlens=True, of=name)


def unflatten_output(pack: Packing | None, result: Any) -> Any:
    """An op's output o [1, B * T, ...], or (o, ...) with states, back to [B, T, ...] (unchanged without `pack`)."""
    if pack is None:
        return result
    if isinstance(result, tuple):
        return (pack.unflatten(result[0]), *result[1:])
    return pack.unflatten(result)


def check_hidden(name: str, x: Any, hidden_size: int, tokens: int | None = None) -> None:
    """x [batch, seq_len (= tokens when given), hidden_size], floating: a layer's input."""
    layout = "[batch, seq_len, hidden_size]" if tokens is None else f"[batch, {tokens}, hidden_size]"
    if len(jnp.shape(x)) != 3 or jnp.shape(x)[2] != hidden_size or (tokens is not None and jnp.shape(x)[1] != tokens):
        want = describe(["*", "*" if tokens is None else tokens, hidden_size])
        raise ValueError(f"{name} must have shape {layout} = {want}, got {describe(jnp.shape(x))}")
    if not jnp.issubdtype(jnp.result_type(x), jnp.floating):
        raise ValueError(f"{name} must be a floating-point array, got dtype {jnp.result_type(x)}")
