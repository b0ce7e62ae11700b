"""Attention over a KV cache pool: chunked prefill then decode steps, each token against the float64 reference
attention over its request's whole sequence so far; padding, untouched rows, donation, bad input."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hybrax.core import Invocation
from hybrax.ops.attention import reference
from hybrax.serving import AttentionDecodePoolConfig, attention_decode_pool
from hybrax.serving.attention_pool import OP_ID, AttentionDecodePool
from tests.helpers import TOLERANCE, assert_close, normal

SLOTS, MAX_LEN, HEADS, KV_HEADS, D, DV = 5, 32, 4, 2, 16, 32
# The in-place kernel with two splits of 16-key blocks: the splits merge across a row.
IN_PLACE = AttentionDecodePoolConfig("pallas", "in_place", block_k=16, num_splits=2)


def _pools(seed):
    return normal(seed, (SLOTS, MAX_LEN, KV_HEADS, D)), normal(seed + 1, (SLOTS, MAX_LEN, KV_HEADS, DV))


def _tokens(seed, batch, tokens):
    return (normal(seed, (batch, tokens, HEADS, D)), normal(seed + 1, (batch, tokens, KV_HEADS, D)),
            normal(seed + 2, (batch, tokens, KV_HEADS, DV)))


@pytest.mark.parametrize("options", [
    {},
    dict(sliding_window=3, logits_soft_cap=2.0, softmax_scale=0.3),
    dict(softmax_aux=True),
    dict(platform="pallas"),
    dict(cfg=IN_PLACE, sliding_window=3, logits_soft_cap=2.0, softmax_scale=0.3),
    dict(cfg=IN_PLACE, softmax_aux=True),
])
def test_chunked_prefill_then_decode_matches_whole_sequence_attention(options):
    """Two requests (slots 3 and 1) and a padded row: a 5-token chunk (request 1 has 3 real tokens), then three
    decode steps; every real token's output equals causal attention over its request's tokens so far."""
    options = dict(options)
    if options.pop("softmax_aux", False):
        options["softmax_aux"] = normal(50, (HEADS, 2))
    k_pool, v_pool = _pools(0)
    slots = jnp.array([3, 1, -1], jnp.int32)
    cached = np.zeros(3, np.int32)
    history = [[], [], []]  # per request: (q, k, v) rows of every real token so far
    step = jax.jit(functools.partial(attention_decode_pool, **options), donate_argnums=(3, 4))
    for index, (tokens, new) in enumerate([(5, [5, 3, 5]), (1, [1, 1, 1]), (1, [1, 1, 1]), (1, [1, 1, 1])]):
        q, k, v = _tokens(10 * index + 100, 3, tokens)
        out, k_pool, v_pool = step(q, k, v, k_pool, v_pool, slots, jnp.asarray(cached),
                                   new_lengths=jnp.asarray(new, jnp.int32))
        for b in (0, 1):
            history[b] += [(q[b, t], k[b, t], v[b, t]) for t in range(new[b])]
            q_all, k_all, v_all = (np.stack([np.asarray(row[i]) for row in history[b]])[None] for i in range(3))
            want = reference.attention(
                q_all, k_all, v_all, None, options.get("softmax_aux"), causal=True,
                sliding_window=None if "sliding_window" not in options else (options["sliding_window"], 0),
                softmax_scale=options.get("softmax_scale"), logits_soft_cap=options.get("logits_soft_cap"),
            )[0, -new[b]:]
            assert_close(out[b, :new[b]], want, TOLERANCE[jnp.float32], f"step {index} request {b}")
            assert np.all(np.asarray(out[b, new[b]:]) == 0), "tokens past new_lengths output zeros"
        assert np.all(np.asarray(out[2]) == 0), "a padded request outputs zeros"
        cached += np.array(new) * (np.asarray(slots) >= 0)


def test_writes_only_the_new_tokens_of_named_rows():
    k_pool, v_pool = _pools(0)
    slots, cached = jnp.array([4, -1, 0], jnp.int32), jnp.array([2, 7, 20], jnp.int32)
    q, k, v = _tokens(1, 3, 2)
    _, new_k, new_v = attention_decode_pool(q, k, v, k_pool, v_pool, slots, cached,
                                            new_lengths=jnp.array([2, 2, 1], jnp.int32))
    want_k, want_v = np.array(k_pool), np.array(v_pool)
    want_k[4, 2:4], want_v[4, 2:4] = k[0], v[0]
    want_k[0, 20], want_v[0, 20] = k[2, 0], v[2, 0]
    np.testing.assert_array_equal(new_k, want_k)  # bit for bit: rows 1-3, row 4 outside 2:4, row 0 but 20
    np.testing.assert_array_equal(new_v, want_v)


@pytest.mark.parametrize("platform", ["xla", "pallas"])
def test_traced_lengths_outside_the_row_write_nothing_there(platform):
    """Under jit (lengths unchecked), a token at a negative position or past max_len writes nothing (a negative
    index must not wrap to the row's end); the request's tokens inside the row are written as usual."""
    k_pool, v_pool = _pools(0)
    q, k, v = _tokens(1, 2, 3)
    slots, cached = jnp.array([3, 1], jnp.int32), jnp.array([-2, MAX_LEN - 1], jnp.int32)
    step = jax.jit(functools.partial(attention_decode_pool, platform=platform))
    _, new_k, new_v = step(q, k, v, k_pool, v_pool, slots, cached)
    want_k, want_v = np.array(k_pool), np.array(v_pool)
    want_k[3, 0], want_v[3, 0] = k[0, 2], v[0, 2]  # positions -2, -1, 0: only the last is in the row
    want_k[1, MAX_LEN - 1], want_v[1, MAX_LEN - 1] = k[1, 0], v[1, 0]  # positions 31, 32, 33
    np.testing.assert_array_equal(new_k, want_k)
    np.testing.assert_array_equal(new_v, want_v)


def test_bf16_cache_through_the_in_place_kernel():
    """A bf16 cache, platform="pallas": each decode token against the reference over its row as written."""
    k_pool, v_pool = (x.astype(jnp.bfloat16) for x in _pools(0))
    q, k, v = (x.astype(jnp.bfloat16) for x in _tokens(5, 2, 1))
    slots, cached = jnp.array([0, 2], jnp.int32), jnp.array([9, 0], jnp.int32)
    out, k_pool, v_pool = attention_decode_pool(q, k, v, k_pool, v_pool, slots, cached, platform="pallas")
    assert out.dtype == k_pool.dtype == v_pool.dtype == jnp.bfloat16
    for b, length in ((0, 10), (1, 1)):
        keys, values = (np.asarray(pool[slots[b], :length], np.float32)[None] for pool in (k_pool, v_pool))
        want = reference.attention(np.asarray(q[b:b + 1], np.float32), keys, values, causal=True)
        assert_close(out[b], want[0], TOLERANCE[jnp.bfloat16], f"request {b}")


def test_in_place_kernel_names_what_it_declines():
    k_pool, v_pool = _pools(0)
    q, k, v = _tokens(1, 2, 1)
    args = (q, k, v, k_pool[:, :30], v_pool[:, :30], jnp.array([0, 1], jnp.int32), jnp.zeros((2,), jnp.int32))
    with pytest.raises(ValueError, match="pallas:in_place: the in-place kernel needs a max_len that is a multiple "
                                         "of 16, got 30"):
        attention_decode_pool(*args, platform="pallas")


@pytest.mark.parametrize("device, max_len, want", [("gpu", 32, ["pallas:in_place", "xla:gather"]),
                                                   ("gpu", 30, ["xla:gather"]), ("cpu", 32, ["xla:gather"])])
def test_auto_reads_in_place_on_gpus_where_the_kernel_fits(device, max_len, want):
    k_pool, v_pool = _pools(0)
    q, k, v = _tokens(1, 2, 1)
    kernel = AttentionDecodePool()
    problem = kernel.prepare(q, k, v, k_pool[:, :max_len], v_pool[:, :max_len], jnp.array([0, 1], jnp.int32),
                             jnp.zeros((2,), jnp.int32))
    invocation = Invocation(OP_ID, kernel.version, problem, "auto", device, "NVIDIA H200")
    assert [impl.name for impl in kernel.implementations(invocation)] == want


BAD = {
    "q rank": (dict(q=jnp.zeros((2, 1, HEADS))), r"q must have shape \[batch, tokens, num_heads, head_dim\]"),
    "k heads": (dict(k=jnp.zeros((2, 1, 3, D))), r"num_heads of q \(4\) must be a multiple of num_kv_heads of k \(3\)"),
    "pool dim": (dict(k_pool=jnp.zeros((SLOTS, MAX_LEN, KV_HEADS, D + 1))), r"k_pool must have shape"),
    "v_pool length": (dict(v_pool=jnp.zeros((SLOTS, MAX_LEN + 1, KV_HEADS, DV))), r"v_pool must have shape"),
    "slots": (dict(slots=jnp.zeros((3,), jnp.int32)), r"slots must have shape \[batch\] = \[2\], got \[3\]"),
    "slot past the pool": (dict(slots=jnp.array([1, SLOTS], jnp.int32)),
                           r"slots must be -1 \(none\) or a row in \[0, num_slots = 5\), got \[5\]"),
    "repeated slot": (dict(slots=jnp.array([2, 2], jnp.int32)), r"slots must name each row at most once .* got \[2\]"),
    "float lengths": (dict(cached_lengths=jnp.zeros((2,))), r"cached_lengths must be an integer array"),
    "no cached_lengths": (dict(cached_lengths=None), r"cached_lengths must be an integer array \[batch\] .* got None"),
    "new past tokens": (dict(new_lengths=jnp.array([1, 2], jnp.int32)),
                        r"new_lengths must be in \[0, tokens = 1\] .* got \[1, 2\]"),
    "negative new": (dict(new_lengths=jnp.array([-1, 1], jnp.int32)), r"new_lengths must be in \[0, tokens = 1\]"),
    "past max_len": (dict(cached_lengths=jnp.array([0, MAX_LEN], jnp.int32)),
                     r"cached_lengths \+ new_lengths must be in \[0, max_len = 32\] .* got cached_lengths \[0, 32\]"),
    "window": (dict(sliding_window=(2, 0)), r"sliding_window must be an int >= 0"),
    "zero soft cap": (dict(logits_soft_cap=0.0), r"logits_soft_cap must be a number > 0 .* got 0.0"),
    "zero scale": (dict(softmax_scale=0.0), r"softmax_scale must be a number > 0 .* got 0.0"),
    "array scale": (dict(softmax_scale=jnp.ones((2,))), r"softmax_scale must be a number > 0"),
}
KEYWORDS = ("new_lengths", "sliding_window", "softmax_scale", "logits_soft_cap")


@pytest.mark.parametrize("platform", ["xla", "pallas"])
@pytest.mark.parametrize("case", BAD)
def test_bad_input_names_the_argument(case, platform):
    """Both implementations refuse the same input, before either runs."""
    k_pool, v_pool = _pools(0)
    q, k, v = _tokens(1, 2, 1)
    arguments = dict(q=q, k=k, v=v, k_pool=k_pool, v_pool=v_pool, slots=jnp.array([0, 1], jnp.int32),
                     cached_lengths=jnp.zeros((2,), jnp.int32))
    overrides, message = BAD[case]
    arguments.update(overrides)
    keywords = {name: arguments.pop(name) for name in KEYWORDS if name in arguments}
    with pytest.raises(ValueError, match=message):
        attention_decode_pool(*arguments.values(), platform=platform, **keywords)


def test_padded_requests_lengths_are_not_checked():
    """A padded request (slot -1) reads and writes nothing, whatever its lengths say."""
    k_pool, v_pool = _pools(0)
    q, k, v = _tokens(1, 2, 1)
    out, new_k, _ = attention_decode_pool(q, k, v, k_pool, v_pool, jnp.array([-1, 1], jnp.int32),
                                          jnp.array([MAX_LEN + 9, 0], jnp.int32), softmax_scale=np.float32(0.5))
    assert np.all(np.asarray(out[0]) == 0)
    np.testing.assert_array_equal(np.asarray(new_k)[[0, 2, 3, 4]], np.asarray(k_pool)[[0, 2, 3, 4]])


@pytest.mark.parametrize("options", [dict(platform="xla"), dict(cfg=IN_PLACE)], ids=["gather", "in_place"])
def test_gradients_match_float64(options):
    """jax.grad through a 2-token step (a padded request among them) for q, k, v and both pools, against the XLA
    path's autodiff on float64 inputs. The in-place kernel has no backward of its own: it takes the gather's."""
    q, k, v = _tokens(60, 3, 2)
    k_pool, v_pool = _pools(70)
    slots, cached = jnp.array([3, -1, 1], jnp.int32), jnp.array([6, 0, 11], jnp.int32)

    def loss(q, k, v, k_pool, v_pool, **options):
        out, new_k, new_v = attention_decode_pool(q, k, v, k_pool, v_pool, slots, cached, sliding_window=7, **options)
        return jnp.sum(jnp.sin(out)) + jnp.sum(new_k * new_v[..., :D])

    arrays = (q, k, v, k_pool, v_pool)
    got = jax.grad(functools.partial(loss, **options), argnums=range(5))(*arrays)
    with jax.enable_x64(True):
        wide = [jnp.asarray(np.asarray(x), jnp.float64) for x in arrays]
        want = [np.asarray(g) for g in jax.grad(functools.partial(loss, platform="xla"), argnums=range(5))(*wide)]
    assert_close(got, want, TOLERANCE[jnp.float32], "gradient")
