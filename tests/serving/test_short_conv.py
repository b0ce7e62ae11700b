"""The short convolution's decode and prefill over a conv-state pool, against the float64 reference."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hybrax.serving import short_conv_decode, short_conv_prefill
from hybrax.serving.reference import short_conv_reference
from tests.helpers import TOLERANCE, assert_close, normal

D, W, SLOTS = 8, 4, 6
TOL = TOLERANCE[jnp.float32]


def conv_params(seed):
    return normal(seed, (D, W)), normal(seed + 1, (D,))


def untouched_equal(after, before, written):
    rest = np.setdiff1d(np.arange(SLOTS), written)
    np.testing.assert_array_equal(np.asarray(after)[rest], np.asarray(before)[rest])


def test_decode_steps_by_slot():
    weight, bias = conv_params(1)
    slots = np.array([2, -1, 5], np.int32)
    pool = normal(2, (SLOTS, D, W - 1))
    x = normal(3, (3, D))
    y, new_pool = jax.jit(short_conv_decode, static_argnames="activation")(x, pool, weight, jnp.asarray(slots),
                                                                          bias=bias)
    for row in (0, 2):
        ref_y, ref_state = short_conv_reference(x[row:row + 1], pool[slots[row]], weight, bias)
        assert_close((y[row], new_pool[slots[row]]), (ref_y[0], ref_state), TOL)
    assert np.all(np.asarray(y[1]) == 0)
    untouched_equal(new_pool, pool, [2, 5])


@pytest.mark.parametrize("packed", [False, True])
def test_prefill_continues_from_the_pool(packed):
    """Short and long sequences (shorter than the window too), a fresh one, an empty one, a padded one."""
    weight, bias = conv_params(10)
    pool = normal(11, (SLOTS, D, W - 1))
    if packed:
        lengths, slots = [5, 1, 0, 2, 3], np.array([0, 3, 4, -1, 1], np.int32)
        has_initial = np.array([True, True, True, True, False])
        cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
        x = normal(12, (1, int(cu[-1]) + 1, D))  # one token past the end: output 0
        y, new_pool = short_conv_prefill(x, pool, weight, jnp.asarray(slots), bias=bias,
                                         has_initial_state=jnp.asarray(has_initial), cu_seqlens=jnp.asarray(cu))
        pieces = [(0, slice(s, e)) for s, e in zip(cu[:-1], cu[1:])]
        assert np.all(np.asarray(y[0, cu[-1]:]) == 0)
    else:
        slots, has_initial = np.array([1, -1, 4], np.int32), np.array([True, True, False])
        x = normal(12, (3, 2, D))
        y, new_pool = short_conv_prefill(x, pool, weight, jnp.asarray(slots), bias=bias,
                                         has_initial_state=jnp.asarray(has_initial))
        pieces = [(b, slice(0, 2)) for b in range(3)]
    for n, (b, tokens) in enumerate(pieces):
        if slots[n] < 0:
            assert np.all(np.asarray(y[b, tokens]) == 0)
            continue
        history = pool[slots[n]] if has_initial[n] else jnp.zeros((D, W - 1))
        ref_y, ref_state = short_conv_reference(x[b, tokens], history, weight, bias)
        if ref_y.size:
            assert_close(y[b, tokens], ref_y, TOL)
        assert_close(new_pool[slots[n]], ref_state, TOL, f"state of sequence {n}")
    untouched_equal(new_pool, pool, slots[slots >= 0])


def test_prefill_then_decode_equals_one_sequence():
    weight, bias = conv_params(20)
    pool = normal(21, (SLOTS, D, W - 1))
    x = normal(22, (1, 6, D))
    slots = jnp.asarray([3], jnp.int32)
    y_prefill, pool = short_conv_prefill(x[:, :4], pool, weight, slots, bias=bias,
                                         has_initial_state=jnp.asarray([False]))
    outputs = [y_prefill[0]]
    for t in (4, 5):
        y, pool = short_conv_decode(x[:, t], pool, weight, slots, bias=bias)
        outputs.append(y)
    ref_y, ref_state = short_conv_reference(x[0], jnp.zeros((D, W - 1)), weight, bias)
    assert_close((jnp.concatenate(outputs), pool[3]), (ref_y, ref_state), TOL)


def test_bad_weight_is_named():
    with pytest.raises(ValueError, match=r"weight must have shape \[dim, width\]"):
        short_conv_decode(jnp.zeros((2, D)), jnp.zeros((SLOTS, D, W - 1)), jnp.zeros((D + 1, W)),
                          jnp.zeros((2,), jnp.int32))
