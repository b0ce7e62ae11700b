"""hybrax.core.packing: the token -> sequence map against a binary search, the first / last token masks, the chunk
layout's invariants, a cu_seqlens padded with its last value mapping every token as before, and the errors of
segment_ids given to an op."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hybrax.core.packing import (
    chunk_layout, first_token_mask, last_token_mask, reversed_cu_seqlens, segment_packing, token_sequence,
    unflatten_output,
)

LENGTH = 13
BOUNDS = [
    (0, 13),  # one sequence
    (0, 1, 4, 4, 9, 13),  # an empty sequence inside, one of a single token
    (0, 0, 5, 5, 5),  # empty first, empty at the end, tokens 5.. of no sequence
    (0, 3, 3, 3, 3),  # a fixed-length cu_seqlens padded with its last value
    (0, 0),  # nothing but padding
]


def _searched(cu: tuple[int, ...]) -> np.ndarray:
    return np.searchsorted(np.asarray(cu), np.arange(LENGTH), side="right") - 1


@pytest.mark.parametrize("cu", BOUNDS)
def test_token_sequence_counts_the_boundaries_at_or_before_each_token(cu):
    expected = _searched(cu)
    np.testing.assert_array_equal(token_sequence(jnp.array(cu), LENGTH), expected)
    np.testing.assert_array_equal(jax.jit(token_sequence, static_argnums=1)(jnp.array(cu), LENGTH), expected)


@pytest.mark.parametrize("cu", BOUNDS)
def test_first_and_last_token_masks(cu):
    first, last = np.zeros(LENGTH, bool), np.zeros(LENGTH, bool)
    for start, end in zip(cu[:-1], cu[1:]):
        if end > start:
            first[start], last[end - 1] = True, True
    np.testing.assert_array_equal(first_token_mask(jnp.array(cu), LENGTH), first)
    np.testing.assert_array_equal(last_token_mask(jnp.array(cu), LENGTH), last)


def test_padding_cu_seqlens_with_its_last_value_maps_every_token_as_before():
    cu, padded = jnp.array([0, 4, 9]), jnp.array([0, 4, 9, 9, 9, 9])
    np.testing.assert_array_equal(token_sequence(cu, LENGTH)[:9], token_sequence(padded, LENGTH)[:9])
    np.testing.assert_array_equal(first_token_mask(cu, LENGTH), first_token_mask(padded, LENGTH))
    np.testing.assert_array_equal(last_token_mask(cu, LENGTH), last_token_mask(padded, LENGTH))


def test_reversed_cu_seqlens():
    np.testing.assert_array_equal(reversed_cu_seqlens(jnp.array([0, 1, 4, 4, 9]), 9), [0, 5, 5, 8, 9])


@pytest.mark.parametrize("cu", BOUNDS)
@pytest.mark.parametrize("chunk", [1, 4])
def test_chunk_layout_starts_every_sequence_on_a_chunk(cu, chunk):
    layout = chunk_layout(jnp.array(cu), LENGTH, chunk)
    sequences = len(cu) - 1
    lengths = np.diff(cu)
    assert layout.num_chunks * chunk >= sum(-(-n // chunk) * chunk for n in lengths)
    destination, source = np.asarray(layout.destination), np.asarray(layout.source)
    rows = layout.num_chunks * chunk
    begin = 0
    for n in range(sequences):
        tokens = np.arange(cu[n], cu[n + 1])
        np.testing.assert_array_equal(destination[tokens], begin * chunk + tokens - cu[n])
        np.testing.assert_array_equal(source[destination[tokens]], tokens)
        chunks = np.arange(begin, begin + -(-lengths[n] // chunk))
        if chunks.size:
            assert np.all(np.asarray(layout.chunk_sequence)[chunks] == n)
            assert layout.first[chunks[0]] and layout.last[chunks[-1]] and int(layout.last_chunk[n]) == chunks[-1]
            assert not np.any(np.asarray(layout.first)[chunks[1:]]) and not np.any(np.asarray(layout.last)[chunks[:-1]])
        assert bool(layout.nonempty[n]) == (lengths[n] > 0)
        begin += chunks.size
    assert np.all(destination[cu[-1]:] == rows)  # tokens of no sequence have no row
    assert np.sum(source < LENGTH) == cu[-1]  # every other row holds no token
    assert not np.any(np.asarray(layout.first)[begin:]) and not np.any(np.asarray(layout.last)[begin:])


def test_segment_packing_flattens_rows_and_zeroes_padding():
    ids = jnp.array([[0, 0, 1, -1, -1], [2, 2, 2, 3, 3]])
    x = jnp.arange(10.0).reshape(2, 5)[..., None]
    pack = segment_packing("q", x, None, ids, None)
    np.testing.assert_array_equal(pack.cu_seqlens, [0, 2, 3, 5, 8, 10])
    flat = pack.flatten("q", x)
    assert flat.shape == (1, 10, 1)
    o, state = unflatten_output(pack, (flat, "state"))
    np.testing.assert_array_equal(o[..., 0], [[0, 1, 2, 0, 0], [5, 6, 7, 8, 9]])
    assert state == "state"
    assert segment_packing("q", x, None, None, None) is None


def test_segment_packing_errors_name_the_argument():
    x, ids = jnp.zeros((2, 5, 1)), jnp.zeros((2, 5), jnp.int32)
    with pytest.raises(ValueError, match="give cu_seqlens or segment_ids, not both"):
        segment_packing("q", x, jnp.array([0, 5]), ids, None)
    with pytest.raises(ValueError, match=r"segment_ids must have shape \[batch, seq_len\] \(q's\) = \[2, 5\]"):
        segment_packing("q", x, None, ids[:, :4], None)
    with pytest.raises(ValueError, match="segment_ids must be an integer array"):
        segment_packing("q", x, None, ids.astype(jnp.float32), None)
    with pytest.raises(ValueError, match="max_segments bounds the runs of segment_ids"):
        segment_packing("q", x, None, None, 4)
    with pytest.raises(ValueError, match=r"max_segments \(1\) must be at least the number of runs"):
        segment_packing("q", x, None, ids, 1)
    with pytest.raises(ValueError, match="segment_ids under jit need max_segments"):
        jax.jit(lambda ids: segment_packing("q", x, None, ids, None).cu_seqlens)(ids)
    pack = segment_packing("q", x, None, ids, None)
    with pytest.raises(ValueError, match=r"k must have shape \[batch, seq_len, \.\.\.\] = \[2, 5, \.\.\.\]"):
        pack.flatten("k", jnp.zeros((2, 4, 1)))
