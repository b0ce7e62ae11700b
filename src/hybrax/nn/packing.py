"""Packed sequences: one description of which tokens belong together, read by every layer.

A layer call takes one of two forms (or neither: every row of x [B, T, ...] is one sequence):
    cu_seqlens [N + 1]    N sequences packed in a batch of one; sequence n is tokens cu_seqlens[n]:cu_seqlens[n + 1],
                          and tokens past cu_seqlens[-1] are padding.
    segment_ids [B, T]    each row holds runs of equal ids, and every run is a sequence of its own (a later run that
                          repeats an earlier id is still a new sequence); ids < 0 are padding.
Both become a `Packing`:
    segments [B, T]       the sequence of each token, distinct within a row, -1 for padding (the short convolution's
                          and attention's masks: a token sees only tokens of its own segment);
    positions [B, T]      each token's index within its sequence (rotary embeddings);
    cu_seqlens [N' + 1]   the same sequences over the B * T tokens flattened into one row (KDA's packed form), with
                          padding runs as sequences of their own whose outputs the layers zero.
Only KDA asks for the flattened cu_seqlens (`with_cu_seqlens`): from segment_ids its length N' + 1 (N' runs) must be
static, counted when the ids are concrete, else `max_segments`, which pads cu_seqlens with empty sequences.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jaxtyping import Array, Int

from hybrax.core.validate import check_cu_seqlens, check_integer, check_shape, describe, is_concrete
from hybrax.serving.prefill import token_sequence


class Packing(NamedTuple):
    """segments, positions [B, T] int32 and the flattened cu_seqlens [N' + 1] int32 (None unless given or asked
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
                         "batch, padding runs included): KDA's packed form has one state per run")
    return max_segments


def _flat_cu_seqlens(starts: jax.Array, max_segments: int | None) -> jax.Array:
    """cu_seqlens over the flattened tokens: every run's first token, then empty sequences up to max_segments."""
    tokens = starts.size
    first_tokens = jnp.nonzero(starts.reshape(-1), size=_count_runs(starts, max_segments), fill_value=tokens)[0]
    return jnp.concatenate([first_tokens, jnp.array([tokens])]).astype(jnp.int32)


def from_segment_ids(segment_ids: Any, batch: int, length: int, max_segments: int | None,
                     with_cu_seqlens: bool) -> Packing:
    check_shape("segment_ids", segment_ids, (batch, length), "[batch, seq_len] (x's)")
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
    flattened cu_seqlens from segment_ids (KDA's form)."""
    batch, length = jnp.shape(x)[:2]
    if cu_seqlens is not None and segment_ids is not None:
        raise ValueError("give cu_seqlens or segment_ids, not both")
    if cu_seqlens is not None:
        return from_cu_seqlens(cu_seqlens, batch, length)
    if segment_ids is not None:
        return from_segment_ids(segment_ids, batch, length, max_segments, with_cu_seqlens)
    return DENSE


def sequence_lengths(batch: int, length: int, cu_seqlens: Any) -> Int[Array, " num_sequences"]:
    """Each sequence's token count: T per row of a dense batch, or the cu_seqlens differences."""
    if cu_seqlens is None:
        return jnp.full((batch,), length, jnp.int32)
    cu_seqlens = jnp.asarray(cu_seqlens, jnp.int32)
    return cu_seqlens[1:] - cu_seqlens[:-1]


def check_hidden(name: str, x: Any, hidden_size: int, tokens: int | None = None) -> None:
    """x [batch, seq_len (= tokens when given), hidden_size], floating."""
    layout = "[batch, seq_len, hidden_size]" if tokens is None else f"[batch, {tokens}, hidden_size]"
    if len(jnp.shape(x)) != 3 or jnp.shape(x)[2] != hidden_size or (tokens is not None and jnp.shape(x)[1] != tokens):
        want = describe(["*", "*" if tokens is None else tokens, hidden_size])
        raise ValueError(f"{name} must have shape {layout} = {want}, got {describe(jnp.shape(x))}")
    if not jnp.issubdtype(jnp.result_type(x), jnp.floating):
        raise ValueError(f"{name} must be a floating-point array, got dtype {jnp.result_type(x)}")
