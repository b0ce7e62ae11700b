"""Slots outside [0, num_slots) under jit, where their values cannot be checked: each is a padded request, as -1 is.

Its outputs are zeros, the other requests' outputs equal the call without it, and it reads and writes no row: rows
no valid request names come back bit-for-bit. (Eager calls refuse such slots: the bad-input tests beside this file.)
Every implementation that runs here is called (XLA, the Pallas kernels in interpret mode), the GPU kernels
themselves too (a row past the pool would be read out of bounds), and the CUDA kernel on a GPU with nvcc.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hybrax.ops import cuda_build
from hybrax.ops.attention.pallas_pool_decode import PoolGeometry, pool_decode_splits
from hybrax.ops.kda.decode import pallas_gpu as pallas_decode
from hybrax.serving import (
    attention_decode_pool, kda_decode_pool, kda_prefill_pool, short_conv_decode, short_conv_prefill,
)
from tests.helpers import assert_close, normal

ON_GPU = jax.default_backend() == "gpu" and cuda_build.nvcc_path() is not None
gpu_only = pytest.mark.skipif(not ON_GPU, reason="needs an NVIDIA GPU and nvcc")

NUM_SLOTS = 6
# Requests 1, 3 and 4 name rows the pool lacks: one past it, below -1, and far past it (no wrap into the pool).
SLOTS = np.array([4, NUM_SLOTS, 0, -2, 2**31 - 1, 2], np.int32)
BAD = (SLOTS < 0) | (SLOTS >= NUM_SLOTS)
GOOD = np.flatnonzero(~BAD)
TOL = 1e-6  # the same arithmetic in a batch of another size


def as_padding(slots):
    """The slots with every row the pool lacks written as -1."""
    slots = np.asarray(slots)
    return np.where((slots >= 0) & (slots < NUM_SLOTS), slots, -1).astype(np.int32)


def check_pool(new_pool, want_pool, pool, named_rows, what="pool"):
    """Rows a valid request names as in want_pool; every other row bit-for-bit as before the call."""
    new_pool, pool = np.asarray(new_pool), np.asarray(pool)
    untouched = np.setdiff1d(np.arange(NUM_SLOTS), named_rows)
    np.testing.assert_array_equal(new_pool[untouched], pool[untouched], err_msg=f"{what}: a row no request names")
    assert_close(new_pool[named_rows], np.asarray(want_pool)[named_rows], TOL, what)


def check_padded_outputs(out, want_good, bad=BAD):
    """Zeros for the padded requests (batch axis 0), the others as want_good (theirs alone)."""
    out = np.asarray(out)
    assert np.all(out[bad] == 0), "a request with a row the pool lacks must output zeros"
    assert_close(out[~bad], want_good, TOL)


def kda_step(batch, tokens, dk, dv, seed=0):
    q, k = normal(seed, (batch, tokens, 1, dk)), normal(seed + 1, (batch, tokens, 1, dk))
    v = normal(seed + 2, (batch, tokens, 2, dv))
    g = jax.nn.log_sigmoid(normal(seed + 3, (batch, tokens, 2, dk)))
    beta = jax.nn.sigmoid(normal(seed + 4, (batch, tokens, 2)))
    return q, k, v, g, beta


KDA_DECODE_CASES = [
    pytest.param("xla", 16, False, id="xla"),
    pytest.param("xla", 16, True, id="xla-token_slots"),
    pytest.param("pallas", 16, False, id="pallas"),
    pytest.param("pallas", 16, True, id="pallas-token_slots"),
    pytest.param("cuda", 64, False, id="cuda", marks=gpu_only),  # K = 64: the CUDA kernel's smallest
]


@pytest.mark.parametrize("platform, dk, with_token_slots", KDA_DECODE_CASES)
def test_kda_decode_pool(platform, dk, with_token_slots):
    """With token_slots (two tokens), a valid request's entries that name rows the pool lacks keep nothing."""
    tokens = 2 if with_token_slots else 1
    inputs = kda_step(len(SLOTS), tokens, dk, 32)
    pool = normal(9, (NUM_SLOTS, 2, dk, 32))
    token_slots = None
    if with_token_slots:  # per token: rows the pool lacks, then each request's own row (or -1: not kept)
        token_slots = np.stack([np.array([NUM_SLOTS + 1, 9, 1, 7, 3, -5]), np.where(BAD, -1, SLOTS)], axis=1)
    step = jax.jit(functools.partial(kda_decode_pool, platform=platform))

    def call(rows, slots, token_slots):
        kept = None if token_slots is None else jnp.asarray(token_slots, jnp.int32)
        return step(*(x[rows] for x in inputs), pool, jnp.asarray(slots), token_slots=kept)

    out, new_pool = call(np.arange(len(SLOTS)), SLOTS, token_slots)
    good_token_slots = None if token_slots is None else as_padding(token_slots[GOOD])
    want_out, want_pool = call(GOOD, SLOTS[GOOD], good_token_slots)
    check_padded_outputs(out, want_out)
    named = SLOTS[GOOD] if token_slots is None else good_token_slots[good_token_slots >= 0]
    check_pool(new_pool, want_pool, pool, named)


@pytest.mark.parametrize("platform", ["xla", "pallas"])
def test_kda_prefill_pool(platform):
    inputs = kda_step(len(SLOTS), 5, 16, 16, seed=20)
    pool = normal(29, (NUM_SLOTS, 2, 16, 16))
    has_initial_state = jnp.asarray(np.arange(len(SLOTS)) % 3 != 1)
    step = jax.jit(functools.partial(kda_prefill_pool, platform=platform))

    def call(rows, slots):
        return step(*(x[rows] for x in inputs), pool, jnp.asarray(slots), has_initial_state=has_initial_state[rows])

    out, new_pool = call(np.arange(len(SLOTS)), SLOTS)
    want_out, want_pool = call(GOOD, SLOTS[GOOD])
    check_padded_outputs(out, want_out)
    check_pool(new_pool, want_pool, pool, SLOTS[GOOD])


def test_kda_prefill_pool_packed():
    """Packed sequences (an empty one too): a sequence whose slot the pool lacks outputs zeros over its tokens."""
    cu_seqlens = np.array([0, 3, 3, 7, 8, 12, 13], np.int32)
    q, k, v, g, beta = kda_step(1, 14, 16, 16, seed=30)
    pool = normal(39, (NUM_SLOTS, 2, 16, 16))
    step = jax.jit(kda_prefill_pool)
    out, new_pool = step(q, k, v, g, beta, pool, jnp.asarray(SLOTS), cu_seqlens=jnp.asarray(cu_seqlens))
    want_out, want_pool = step(q, k, v, g, beta, pool, jnp.asarray(as_padding(SLOTS)), cu_seqlens=cu_seqlens)
    sequence = np.searchsorted(cu_seqlens, np.arange(14), side="right") - 1
    padded_token = (sequence >= len(SLOTS)) | BAD[np.minimum(sequence, len(SLOTS) - 1)]
    check_padded_outputs(out[0], np.asarray(want_out)[0][~padded_token], padded_token)
    check_pool(new_pool, want_pool, pool, SLOTS[GOOD])


def test_short_conv_decode():
    x, weight, bias = normal(40, (len(SLOTS), 8)), normal(41, (8, 4)), normal(42, (8,))
    pool = normal(43, (NUM_SLOTS, 8, 3))
    step = jax.jit(functools.partial(short_conv_decode, bias=bias))
    y, new_pool = step(x, pool, weight, jnp.asarray(SLOTS))
    want_y, want_pool = step(x[GOOD], pool, weight, jnp.asarray(SLOTS[GOOD]))
    check_padded_outputs(y, want_y)
    check_pool(new_pool, want_pool, pool, SLOTS[GOOD])


@pytest.mark.parametrize("packed", [False, True])
def test_short_conv_prefill(packed):
    pool, weight = normal(50, (NUM_SLOTS, 8, 3)), normal(51, (8, 4))
    has_initial_state = jnp.asarray(np.arange(len(SLOTS)) % 2 == 0)
    step = jax.jit(short_conv_prefill)
    if packed:
        cu_seqlens = jnp.asarray([0, 2, 5, 5, 9, 10, 12], jnp.int32)
        x = normal(52, (1, 12, 8))
        y, new_pool = step(x, pool, weight, jnp.asarray(SLOTS), has_initial_state=has_initial_state,
                           cu_seqlens=cu_seqlens)
        want_y, want_pool = step(x, pool, weight, jnp.asarray(as_padding(SLOTS)), has_initial_state=has_initial_state,
                                 cu_seqlens=cu_seqlens)
        sequence = np.searchsorted(np.asarray(cu_seqlens), np.arange(12), side="right") - 1
        check_padded_outputs(y[0], np.asarray(want_y)[0][~BAD[sequence]], BAD[sequence])
    else:
        x = normal(52, (len(SLOTS), 5, 8))
        y, new_pool = step(x, pool, weight, jnp.asarray(SLOTS), has_initial_state=has_initial_state)
        want_y, want_pool = step(x[GOOD], pool, weight, jnp.asarray(SLOTS[GOOD]),
                                 has_initial_state=has_initial_state[GOOD])
        check_padded_outputs(y, want_y)
    check_pool(new_pool, want_pool, pool, SLOTS[GOOD])


@pytest.mark.parametrize("platform", ["xla", "pallas"])
@pytest.mark.parametrize("tokens", [1, 3])
def test_attention_decode_pool(platform, tokens):
    batch = len(SLOTS)
    q, k, v = normal(60, (batch, tokens, 4, 16)), normal(61, (batch, tokens, 2, 16)), normal(62, (batch, tokens, 2, 16))
    k_pool, v_pool = normal(63, (NUM_SLOTS, 16, 2, 16)), normal(64, (NUM_SLOTS, 16, 2, 16))
    cached = jnp.asarray([5, 3, 0, 9, 12, 7], jnp.int32)
    new = jnp.asarray([tokens, tokens, 1, tokens, tokens, tokens], jnp.int32)
    step = jax.jit(functools.partial(attention_decode_pool, platform=platform))

    def call(rows, slots):
        return step(q[rows], k[rows], v[rows], k_pool, v_pool, jnp.asarray(slots), cached[rows], new_lengths=new[rows])

    out, new_k, new_v = call(np.arange(batch), SLOTS)
    want_out, want_k, want_v = call(GOOD, SLOTS[GOOD])
    check_padded_outputs(out, want_out)
    check_pool(new_k, want_k, k_pool, SLOTS[GOOD], "k_pool")
    check_pool(new_v, want_v, v_pool, SLOTS[GOOD], "v_pool")


def run_kda_kernel(kernel, inputs, pool, slots, token_slots):
    if kernel == "cuda":
        from hybrax.ops.kda.decode.cuda import fused_recurrent_decode_cuda

        return fused_recurrent_decode_cuda(*inputs, pool, slots, scale=0.25)
    return pallas_decode.fused_recurrent_decode(*inputs, pool, slots, token_slots, scale=0.25, interpret=not ON_GPU)


@pytest.mark.parametrize("kernel, dk, with_token_slots", [
    ("pallas", 16, False), ("pallas", 16, True), pytest.param("cuda", 64, False, marks=gpu_only),
])
def test_kda_decode_kernels_skip_rows_the_pool_lacks(kernel, dk, with_token_slots):
    """The kernels themselves, called with such slots: a padded request, as -1 is, in any row the pool lacks."""
    tokens = 2 if with_token_slots else 1
    inputs = kda_step(len(SLOTS), tokens, dk, 32, seed=70)
    pool = normal(79, (NUM_SLOTS, 2, dk, 32))
    token_slots = None
    if with_token_slots:
        token_slots = jnp.asarray(np.stack([np.array([1, NUM_SLOTS, 3, 5, -3, 2**31 - 1]), SLOTS], axis=1))
    out, new_pool = run_kda_kernel(kernel, inputs, pool, jnp.asarray(SLOTS), token_slots)
    want_token_slots = None if token_slots is None else jnp.asarray(as_padding(token_slots))
    want_out, want_pool = run_kda_kernel(kernel, inputs, pool, jnp.asarray(as_padding(SLOTS)), want_token_slots)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(want_out))
    assert np.all(np.asarray(out)[BAD] == 0)
    np.testing.assert_array_equal(np.asarray(new_pool), np.asarray(want_pool))


def test_attention_pool_kernel_skips_rows_the_pool_lacks():
    """The in-place kernel itself: a slot the pool lacks sees nothing (no split has a key), as -1 does."""
    geometry = PoolGeometry(rows=2, group=2, block_q=16, block_k=16, num_splits=2, blocks_per_split=1, window=None,
                            scale=0.25, soft_cap=None)
    q = normal(80, (len(SLOTS), 2, 16, 16))
    k_pool, v_pool = normal(81, (NUM_SLOTS, 32, 2, 16)), normal(82, (NUM_SLOTS, 32, 2, 16))
    cached, new = jnp.asarray([20, 4, 30, 9, 12, 17], jnp.int32), jnp.ones((len(SLOTS),), jnp.int32)
    run = functools.partial(pool_decode_splits, geometry=geometry, num_warps=4, interpret=not ON_GPU)
    out, lse = run(q, k_pool, v_pool, jnp.asarray(SLOTS), cached, new)
    want_out, want_lse = run(q, k_pool, v_pool, jnp.asarray(as_padding(SLOTS)), cached, new)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(want_out))
    np.testing.assert_array_equal(np.asarray(lse), np.asarray(want_lse))
    assert np.all(np.asarray(lse)[BAD] == -np.inf) and np.all(np.asarray(out)[BAD] == 0)
