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


def conv_params(seed, dtype=jnp.float32):
    return normal(seed, (D, W), dtype), normal(seed + 1, (D,), dtype)


def untouched_equal(after, before, written):
    rest = np.setdiff1d(np.arange(SLOTS), written)
    np.testing.assert_array_equal(np.asarray(after)[rest], np.asarray(before)[rest])


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_decode_steps_by_slot(dtype):
    """bf16 x, weight and bias keep the fp32 pool, which holds their inputs exactly."""
    weight, bias = conv_params(1, dtype)
    slots = np.array([2, -1, 5], np.int32)
    pool = normal(2, (SLOTS, D, W - 1))
    x = normal(3, (3, D), dtype)
    y, new_pool = jax.jit(short_conv_decode, static_argnames="activation")(x, pool, weight, jnp.asarray(slots),
                                                                          bias=bias)
    assert y.dtype == dtype and new_pool.dtype == jnp.float32
    for row in (0, 2):
        ref_y, ref_state = short_conv_reference(x[row:row + 1], pool[slots[row]], weight, bias)
        assert_close(y[row], ref_y[0], TOLERANCE[dtype])
        assert_close(new_pool[slots[row]], ref_state, TOL, "state")
    assert np.all(np.asarray(y[1]) == 0)
    untouched_equal(new_pool, pool, [2, 5])


@pytest.mark.parametrize("packed, dtype", [(False, jnp.float32), (True, jnp.float32), (True, jnp.bfloat16)])
def test_prefill_continues_from_the_pool(packed, dtype):
    """Short and long sequences (shorter than the window too), a fresh one, an empty one, a padded one; bf16 inputs
    keep the fp32 pool."""
    weight, bias = conv_params(10, dtype)
    pool = normal(11, (SLOTS, D, W - 1))
    if packed:
        lengths, slots = [5, 1, 0, 2, 3], np.array([0, 3, 4, -1, 1], np.int32)
        has_initial = np.array([True, True, True, True, False])
        cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
        x = normal(12, (1, int(cu[-1]) + 1, D), dtype)  # one token past the end: output 0
        y, new_pool = short_conv_prefill(x, pool, weight, jnp.asarray(slots), bias=bias,
                                         has_initial_state=jnp.asarray(has_initial), cu_seqlens=jnp.asarray(cu))
        pieces = [(0, slice(s, e)) for s, e in zip(cu[:-1], cu[1:])]
        assert np.all(np.asarray(y[0, cu[-1]:]) == 0)
    else:
        slots, has_initial = np.array([1, -1, 4], np.int32), np.array([True, True, False])
        x = normal(12, (3, 2, D), dtype)
        y, new_pool = short_conv_prefill(x, pool, weight, jnp.asarray(slots), bias=bias,
                                         has_initial_state=jnp.asarray(has_initial))
        pieces = [(b, slice(0, 2)) for b in range(3)]
    assert y.dtype == dtype and new_pool.dtype == jnp.float32
    for n, (b, tokens) in enumerate(pieces):
        if slots[n] < 0:
            assert np.all(np.asarray(y[b, tokens]) == 0)
            continue
        history = pool[slots[n]] if has_initial[n] else jnp.zeros((D, W - 1))
        ref_y, ref_state = short_conv_reference(x[b, tokens], history, weight, bias)
        if ref_y.size:
            assert_close(y[b, tokens], ref_y, TOLERANCE[dtype])
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


OUTSIDE = r"must be -1 \(none\) or a row in \[0, num_slots = 6\), got "
TWICE = r"must name each row at most once \(two writes to one row would race\), got "
BAD_DECODE = {
    "weight shape": (dict(weight=jnp.zeros((D + 1, W))), r"weight must have shape \[dim, width\]"),
    "slot past the pool": (dict(slots=jnp.array([0, SLOTS], jnp.int32)), "slots " + OUTSIDE + r"\[6\]"),
    "slot below -1": (dict(slots=jnp.array([-3, 0], jnp.int32)), "slots " + OUTSIDE + r"\[-3\]"),
    "repeated slot": (dict(slots=jnp.array([4, 4], jnp.int32)), "slots " + TWICE + r"\[4\]"),
    "int x": (dict(x=jnp.zeros((2, D), jnp.int32)), "x must be a floating-point array, got dtype int32"),
    "int weight": (dict(weight=jnp.zeros((D, W), jnp.int32)), "weight must be a floating-point array"),
    "int bias": (dict(bias=jnp.zeros((D,), jnp.int32)), "bias must be a floating-point array"),
    "bf16 pool": (dict(conv_pool=jnp.zeros((SLOTS, D, W - 1), jnp.bfloat16)),
                  r"conv_pool must be float32 \(the conv state, as the KDA state pool\), got bfloat16"),
}


@pytest.mark.parametrize("case", BAD_DECODE)
def test_bad_decode_input_is_named(case):
    arguments = dict(x=jnp.zeros((2, D)), conv_pool=jnp.zeros((SLOTS, D, W - 1)), weight=jnp.zeros((D, W)),
                     slots=jnp.array([0, 1], jnp.int32), bias=None)
    change, message = BAD_DECODE[case]
    arguments.update(change)
    bias = arguments.pop("bias")
    with pytest.raises(ValueError, match=message):
        short_conv_decode(*arguments.values(), bias=bias)


BAD_PREFILL = {  # two packed sequences of 3 tokens each
    "float cu_seqlens": (dict(cu_seqlens=jnp.array([0.0, 3.0, 6.0])), "cu_seqlens must be an integer array"),
    "2-D cu_seqlens": (dict(cu_seqlens=jnp.array([[0, 3, 6]], jnp.int32)),
                       r"cu_seqlens must have shape \[num_sequences \+ 1\] \(1 dims\), got \[1, 3\]"),
    "one bound": (dict(cu_seqlens=jnp.array([0], jnp.int32)), "cu_seqlens .* at least 2 entries"),
    "decreasing": (dict(cu_seqlens=jnp.array([0, 5, 3], jnp.int32)), r"never decrease .* got \[0, 5, 3\]"),
    "past the end": (dict(cu_seqlens=jnp.array([0, 3, 9], jnp.int32)), r"at most at seq_len 6, got \[0, 3, 9\]"),
    "late start": (dict(cu_seqlens=jnp.array([1, 3, 6], jnp.int32)), r"cu_seqlens must start at 0"),
    "packed batch of two": (dict(x=jnp.zeros((2, 6, D))), "cu_seqlens needs a batch of one .* got x batch 2"),
    "float has_initial_state": (dict(has_initial_state=jnp.ones((2,))),
                                "has_initial_state must be a bool array, got dtype float32"),
    "slot past the pool": (dict(slots=jnp.array([SLOTS + 2, 0], jnp.int32)), "slots " + OUTSIDE + r"\[8\]"),
    "repeated slot": (dict(slots=jnp.array([1, 1], jnp.int32)), "slots " + TWICE + r"\[1\]"),
    "bf16 pool": (dict(conv_pool=jnp.zeros((SLOTS, D, W - 1), jnp.bfloat16)), "conv_pool must be float32"),
}


@pytest.mark.parametrize("case", BAD_PREFILL)
def test_bad_prefill_input_is_named(case):
    arguments = dict(x=jnp.zeros((1, 6, D)), conv_pool=jnp.zeros((SLOTS, D, W - 1)), weight=jnp.zeros((D, W)),
                     slots=jnp.array([0, 1], jnp.int32), has_initial_state=None,
                     cu_seqlens=jnp.array([0, 3, 6], jnp.int32))
    change, message = BAD_PREFILL[case]
    arguments.update(change)
    keywords = {name: arguments.pop(name) for name in ("has_initial_state", "cu_seqlens")}
    with pytest.raises(ValueError, match=message):
        short_conv_prefill(*arguments.values(), **keywords)


def test_traced_slots_and_bounds_still_jit():
    """Value checks skip traced arguments, so the ops jit with slots and cu_seqlens as arguments."""
    weight, bias = conv_params(30)
    pool, x = normal(31, (SLOTS, D, W - 1)), normal(32, (1, 5, D))
    slots, cu = jnp.array([2, 0], jnp.int32), jnp.array([0, 2, 5], jnp.int32)
    want = short_conv_prefill(x, pool, weight, slots, bias=bias, cu_seqlens=cu)
    got = jax.jit(lambda s, c: short_conv_prefill(x, pool, weight, s, bias=bias, cu_seqlens=c))(slots, cu)
    assert_close(got, want, TOL)


@pytest.mark.parametrize("width, bias, activation", [(2, False, None), (3, True, None), (5, False, "silu")])
def test_widths_without_bias_or_activation(width, bias, activation):
    """Kernel widths other than Kimi's 4, no bias, no SiLU: prefill of a packed batch, then one decode step."""
    weight = normal(70, (D, width))
    bias = normal(71, (D,)) if bias else None
    pool, slots = normal(72, (SLOTS, D, width - 1)), jnp.array([4, 0], jnp.int32)
    x, cu_seqlens = normal(73, (1, 9, D)), jnp.array([0, 2, 9], jnp.int32)  # a prompt shorter than the kernel
    y, new_pool = short_conv_prefill(x, pool, weight, slots, bias=bias, cu_seqlens=cu_seqlens, activation=activation)
    for n, (start, end) in enumerate([(0, 2), (2, 9)]):
        ref_y, ref_state = short_conv_reference(x[0, start:end], pool[slots[n]], weight, bias, activation)
        assert_close(y[0, start:end], ref_y, TOL)
        assert_close(new_pool[slots[n]], ref_state, TOL, "state")
    step = normal(74, (2, D))
    y, after = short_conv_decode(step, new_pool, weight, slots, bias=bias, activation=activation)
    for n in range(2):
        ref_y, ref_state = short_conv_reference(step[n:n + 1], new_pool[slots[n]], weight, bias, activation)
        assert_close(y[n], ref_y[0], TOL)
        assert_close(after[slots[n]], ref_state, TOL, "state")


def test_prefill_gradients_match_float64():
    """jax.grad of a packed prefill (a padded sequence among them) w.r.t. x, the pool, weight and bias, against
    autodiff of the float64 reference (jax.numpy) per sequence, with the pool's rows read and written both."""
    weight, bias = conv_params(80)
    pool, slots = normal(81, (SLOTS, D, W - 1)), [3, -1, 1]
    x, bounds = normal(82, (1, 11, D)), [0, 6, 8, 11]

    def loss_of(y, new_pool):
        return jnp.sum(jnp.sin(y)) + jnp.sum(new_pool ** 2)

    def loss(x, pool, weight, bias):
        y, new_pool = short_conv_prefill(x, pool, weight, jnp.array(slots, jnp.int32), bias=bias,
                                         cu_seqlens=jnp.array(bounds, jnp.int32))
        return loss_of(y, new_pool)

    def oracle_loss(x, pool, weight, bias):
        outputs, new_pool = [], pool
        for slot, start, end in zip(slots, bounds[:-1], bounds[1:]):
            y, state = short_conv_reference(x[0, start:end], pool[max(slot, 0)], weight, bias, xp=jnp)
            outputs.append(y if slot >= 0 else jnp.zeros_like(y))  # a padded sequence outputs zeros, writes nothing
            new_pool = new_pool.at[slot].set(state) if slot >= 0 else new_pool
        return loss_of(jnp.concatenate(outputs), new_pool)

    got = jax.grad(loss, argnums=range(4))(x, pool, weight, bias)
    with jax.enable_x64(True):
        wide = [jnp.asarray(np.asarray(a), jnp.float64) for a in (x, pool, weight, bias)]
        want = [np.asarray(g) for g in jax.grad(oracle_loss, argnums=range(4))(*wide)]
    assert_close(got, want, TOL, "gradient")
