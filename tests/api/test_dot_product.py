"""dot_product_attention against jax.nn.dot_product_attention's XLA path (same arguments, same results), under
jit and grad; its extras against `attention`; and the errors bad arguments raise."""

from __future__ import annotations

import inspect

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hybrax.ops.attention.api import attention
from hybrax.ops.attention.dot_product import dot_product_attention
from hybrax.ops.attention.mask import MaskInfo
from tests.helpers import TOLERANCE, assert_close, normal

B, N, KV, D = 2, 4, 2, 8
TOL = TOLERANCE[jnp.float32]


def qkv(q_len: int, kv_len: int, seed: int = 0, dtype=jnp.float32):
    return (normal(seed, (B, q_len, N, D), dtype), normal(seed + 1, (B, kv_len, KV, D), dtype),
            normal(seed + 2, (B, kv_len, KV, D), dtype))


def random_mask(seed: int, shape: tuple[int, ...]) -> jax.Array:
    """True with probability 0.7, and always on key 0 so that every query sees a key (jax.nn averages every
    value for a query that sees none, hybrax outputs zeros)."""
    return jax.random.bernoulli(jax.random.key(seed), 0.7, shape).at[..., 0].set(True)


LENGTHS = {"q": jnp.array([3, 5], jnp.int32), "kv": jnp.array([4, 9], jnp.int32)}
CASES = {
    "plain": (5, 9, {}),
    "scale": (5, 9, {"scale": 0.3}),
    "causal_q_shorter": (5, 9, {"is_causal": True}),
    "causal_q_longer": (9, 5, {"is_causal": True}),
    "causal_square": (7, 7, {"is_causal": True}),
    "window_int": (7, 7, {"local_window_size": 2}),
    "window_pair_q_shorter": (5, 9, {"local_window_size": (2, 1)}),
    "causal_window": (7, 7, {"is_causal": True, "local_window_size": (3, 0)}),
    "causal_window_q_shorter": (5, 9, {"is_causal": True, "local_window_size": 1}),
    "bias_per_head_row_broadcast": (5, 9, {"bias": normal(10, (1, N, 1, 9))}),
    "bias_2d": (5, 9, {"bias": normal(11, (5, 9))}),
    "mask_per_batch": (5, 9, {"mask": random_mask(12, (B, 1, 5, 9))}),
    "mask_per_head_and_bias": (5, 9, {"mask": random_mask(13, (1, N, 5, 9)), "bias": normal(14, (B, N, 5, 9))}),
    "seq_lengths": (5, 9, {"query_seq_lengths": LENGTHS["q"], "key_value_seq_lengths": LENGTHS["kv"]}),
    "seq_lengths_causal": (9, 9, {"query_seq_lengths": LENGTHS["kv"], "key_value_seq_lengths": LENGTHS["kv"],
                                  "is_causal": True}),
    "kv_lengths_mask_causal": (5, 9, {"key_value_seq_lengths": LENGTHS["kv"], "mask": random_mask(15, (B, 1, 5, 9)),
                                      "is_causal": True}),
}


def test_signature_is_jax_nn():
    ours = inspect.signature(dot_product_attention).parameters
    theirs = inspect.signature(jax.nn.dot_product_attention).parameters
    assert list(ours)[:len(theirs)] == list(theirs)
    for name, parameter in theirs.items():
        assert ours[name].kind == parameter.kind and ours[name].default == parameter.default, name


@pytest.mark.parametrize("case", CASES)
def test_matches_jax_nn(case):
    q_len, kv_len, options = CASES[case]
    q, k, v = qkv(q_len, kv_len)
    want = jax.nn.dot_product_attention(q, k, v, implementation="xla", **options)
    assert_close(dot_product_attention(q, k, v, **options), np.asarray(want, np.float64), TOL)


def test_unbatched_and_bfloat16():
    q, k, v = qkv(5, 9, 1, jnp.bfloat16)
    got = dot_product_attention(q[0], k[0], v[0], is_causal=True)
    want = jax.nn.dot_product_attention(q[0], k[0], v[0], is_causal=True, implementation="xla")
    assert got.shape == (5, N, D) and got.dtype == jnp.bfloat16
    assert_close(got, np.asarray(want.astype(jnp.float32), np.float64), TOLERANCE[jnp.bfloat16])


def test_jit_and_grad_match_jax_nn():
    q, k, v = qkv(6, 6, 2)
    bias = normal(20, (1, N, 6, 6))
    weights = normal(21, (B, 6, N, D))

    def loss(fn, q, k, v, bias):
        out = fn(q, k, v, bias, is_causal=True, local_window_size=(2, 0), key_value_seq_lengths=jnp.array([4, 6]))
        return jnp.sum(out * weights)

    xla = lambda *args, **kw: jax.nn.dot_product_attention(*args, implementation="xla", **kw)  # noqa: E731
    got = jax.jit(jax.grad(lambda *a: loss(dot_product_attention, *a), argnums=(0, 1, 2, 3)))(q, k, v, bias)
    want = jax.grad(lambda *a: loss(xla, *a), argnums=(0, 1, 2, 3))(q, k, v, bias)
    for name, g, w in zip(("query", "key", "value", "bias"), got, want):
        assert_close(g, np.asarray(w, np.float64), TOL, f"d{name}")


def test_implementation_xla_and_explicit_platform_agree():
    q, k, v = qkv(5, 9, 3)
    np.testing.assert_allclose(dot_product_attention(q, k, v, implementation="xla"),
                               dot_product_attention(q, k, v, platform="xla"), rtol=0, atol=0)


def test_extras_are_attention_arguments():
    """sinks, logits_soft_cap and segment ids (with key padding) run as attention's softmax_aux,
    logits_soft_cap and mask_info."""
    q, k, v = qkv(7, 7, 4)
    sinks = normal(22, (N, 2))
    segments = jnp.array([[0, 0, 0, 1, 1, 1, 1], [0, 1, 1, 1, 2, 2, 2]], jnp.int32)
    got = dot_product_attention(q, k, v, is_causal=True, sinks=sinks, logits_soft_cap=5.0, segment_ids=segments,
                                key_value_seq_lengths=jnp.array([7, 5], jnp.int32))
    padded = segments.at[1, 5:].set(-1)
    want = attention(q, k, v, None, None, sinks, causal=True, logits_soft_cap=5.0,
                     mask_info=MaskInfo.from_segments(segments, padded))
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


def test_a_query_that_sees_no_key_outputs_zeros():
    """The one documented difference from jax.nn's XLA path (which averages every value there)."""
    q, k, v = qkv(4, 4, 5)
    out = dot_product_attention(q, k, v, key_value_seq_lengths=jnp.array([0, 4], jnp.int32))
    np.testing.assert_array_equal(out[0], 0)
    assert np.abs(np.asarray(out[1])).sum() > 0


@pytest.mark.parametrize("changes, message", [
    ({"return_residual": True}, r"return_residual=True \(the logsumexp\) is not available"),
    ({"implementation": "triton"}, r"implementation must be one of \['cudnn', 'xla'\] or None, got 'triton'"),
    ({"implementation": "xla", "platform": "xla"}, r"give implementation .* or platform / cfg .*, not both"),
    ({"implementation": "cudnn"}, r"cuda:cudnn cannot run this call"),
    ({"local_window_size": -1}, r"local_window_size must be an int >= 0 or a pair"),
    ({"local_window_size": (1, 2, 3)}, r"local_window_size must be an int >= 0 or a pair"),
    ({"is_causal": 1}, r"is_causal must be a bool, got 1"),
    ({"mask": jnp.ones((1, 1, 5, 9), jnp.int32)}, r"mask must be a bool array"),
    ({"bias": jnp.ones((1, 3, 5, 9))}, r"bias must broadcast to \[batch, num_heads, q_len, kv_len\] = \[2, 4, 5, 9\], "
                                       r"got \[1, 3, 5, 9\]"),
    ({"query_seq_lengths": jnp.array([3, 6], jnp.int32)},
     r"query_seq_lengths must be in \[0, 5\], got 6 at index \[1\]"),
    ({"key_value_seq_lengths": jnp.array([3.0, 6.0])}, r"key_value_seq_lengths must be an integer array"),
    ({"kv_segment_ids": jnp.zeros((B, 9), jnp.int32)}, r"kv_segment_ids needs segment_ids"),
    ({"sinks": jnp.zeros((3, 2))}, r"sinks must have shape \[num_heads, num_sinks\] = \[4, \*\] or \[num_sinks\]"),
    ({"segment_ids": jnp.zeros((B, 4), jnp.int32)}, r"segment_ids must have shape \[batch, q_len\] = \[2, 5\]"),
])
def test_bad_arguments_name_the_argument(changes, message):
    q, k, v = qkv(5, 9, 6)
    with pytest.raises(ValueError, match=message):
        dot_product_attention(q, k, v, **changes)


def test_non_finite_inputs_name_the_argument():
    q, k, v = qkv(5, 9, 7)
    with pytest.raises(ValueError, match=r"key must be finite \(no NaN or inf\), got nan at index \[1, 8, 1, 7\]"):
        dot_product_attention(q, k.at[1, 8, 1, 7].set(jnp.nan), v)


def test_vmap_over_the_batch():
    q, k, v = qkv(5, 9, 8)
    mapped = jax.vmap(lambda q, k, v: dot_product_attention(q, k, v, is_causal=True))(q, k, v)  # unbatched calls
    np.testing.assert_allclose(mapped, dot_product_attention(q, k, v, is_causal=True), rtol=1e-6, atol=1e-6)
