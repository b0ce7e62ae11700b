"""hybrax.nn.Attention against a float64 reference of flash-linear-attention's attention layer (with sinks, a
sliding window, qk norm, GQA), dense and packed, its gradients, and its serving: prefill into the KV pool then decode
token by token equals the full forward."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from hybrax.nn import Attention
from hybrax.serving.attention_prefill import attention_prefill_pool
from tests.helpers import TOLERANCE, assert_close
from tests.nn import reference

HIDDEN, TOL = 24, TOLERANCE[jnp.float32]
PLAIN = dict(num_heads=4, num_kv_heads=2, head_dim=8, rope_theta=10000.0, sliding_window=None, qk_norm=False,
             sinks=False, norm_eps=1e-5)
EVERYTHING = dict(PLAIN, num_kv_heads=1, rope_theta=500.0, sliding_window=3, qk_norm=True, sinks=True)


def make_layer(cfg, qkv_bias=False, seed=0):
    weights = reference.random_attention_weights(np.random.default_rng(seed), HIDDEN, cfg, qkv_bias)
    layer = nnx.eval_shape(lambda: Attention(  # shapes only: every parameter comes from the weights
        HIDDEN, cfg["num_heads"], cfg["num_kv_heads"], cfg["head_dim"], rope_theta=cfg["rope_theta"],
        sliding_window=cfg["sliding_window"], sinks=cfg["sinks"], qk_norm=cfg["qk_norm"], qkv_bias=qkv_bias,
        norm_eps=cfg["norm_eps"], rngs=nnx.Rngs(seed)))
    layer.load_fla_state_dict(weights)
    return layer, weights


def reference_layer(weights, cfg):
    weights = reference.f64(weights)
    return lambda x: reference.attention_layer(weights, x, cfg)


@nnx.jit
def run(layer, x, cu_seqlens=None, segment_ids=None):
    return layer(x, cu_seqlens=cu_seqlens, segment_ids=segment_ids)


def inputs(seed, shape):
    return jnp.asarray(np.random.default_rng(seed).normal(size=shape), jnp.float32)


@pytest.mark.parametrize("cfg, qkv_bias", [(PLAIN, True), (EVERYTHING, False)], ids=["gqa-bias", "everything"])
def test_forms_match_fla(cfg, qkv_bias):
    """Dense rows, packed by cu_seqlens (an empty sequence, a token past the end) and by segment_ids (a repeated id
    is a new sequence; padding)."""
    layer, weights = make_layer(cfg, qkv_bias)
    ref = reference_layer(weights, cfg)
    x = inputs(1, (2, 9, HIDDEN))
    assert_close(run(layer, x), reference.per_sequence(ref, np.asarray(x), [(0, slice(0, 9)), (1, slice(0, 9))]), TOL)
    cu = np.array([0, 4, 4, 8], np.int32)
    got = run(layer, x[:1], cu_seqlens=jnp.asarray(cu))
    assert_close(got, reference.per_sequence(ref, np.asarray(x[:1]), [(0, slice(0, 4)), (0, slice(4, 8))]), TOL)
    assert np.all(np.asarray(got[0, 8]) == 0)
    ids = np.array([[2, 2, 2, 5, 5, 2, 2, 2, -1], [0, 0, 0, 0, 0, 0, 1, 1, 1]], np.int32)
    pieces = [(0, slice(0, 3)), (0, slice(3, 5)), (0, slice(5, 8)), (1, slice(0, 6)), (1, slice(6, 9))]
    got = run(layer, x, segment_ids=jnp.asarray(ids))
    assert_close(got, reference.per_sequence(ref, np.asarray(x), pieces), TOL)
    assert np.all(np.asarray(got[0, 8]) == 0)


def test_gradients_match_float64_autodiff():
    layer, weights = make_layer(EVERYTHING)
    x, cotangent = inputs(2, (1, 7, HIDDEN)), inputs(3, (1, 7, HIDDEN))
    d_layer, d_x = nnx.jit(nnx.grad(lambda layer, x: jnp.sum(layer(x) * cotangent), argnums=(0, 1)))(layer, x)
    with jax.enable_x64(True):
        def theirs(w, x):
            return jnp.sum(reference.attention_layer(w, x[0], EVERYTHING, jnp) * jnp.asarray(cotangent[0], jnp.float64))

        w64 = {name: jnp.asarray(value, jnp.float64) for name, value in weights.items()}
        want_w, want_x = jax.jit(jax.grad(theirs, argnums=(0, 1)))(w64, jnp.asarray(x, jnp.float64))
        want_w, want_x = {name: np.asarray(value) for name, value in want_w.items()}, np.asarray(want_x)
    assert_close(d_x, want_x, TOL, "dx")
    for module in ("q_proj", "k_proj", "v_proj", "o_proj"):
        assert_close(np.asarray(getattr(d_layer, module).kernel[...]).T, want_w[module + ".weight"], TOL, module)
    for norm in ("q_norm", "k_norm"):
        assert_close(getattr(d_layer, norm).weight[...], want_w[norm + ".weight"], TOL, norm)
    assert_close(d_layer.sinks[...], want_w["sinks"], TOL, "sinks")


@pytest.mark.parametrize("cfg", [PLAIN, EVERYTHING], ids=["plain", "everything"])
def test_prefill_then_decode_equals_the_full_forward(cfg):
    """Prefill two packed prompts (and a padded one) into slots 3 and 0 of 5, then decode their next tokens with a
    padded row, against the layer on the whole sequences; rows no request names stay zero."""
    layer, _ = make_layer(cfg)
    lengths, new_tokens = [3, 6], 3
    full = inputs(4, (2, max(lengths) + new_tokens, HIDDEN))
    want = np.asarray(run(layer, full))
    slots = jnp.array([3, -1, 0], jnp.int32)
    cu = jnp.array([0, 3, 5, 11], jnp.int32)
    prompts = jnp.concatenate([full[0, :3], full[0, :2], full[1, :6]])[None]
    cache = layer.empty_cache(5, max_len=12)
    y, cache = nnx.jit(lambda layer, x, cache: layer.prefill(x, cache, slots, cu_seqlens=cu))(layer, prompts, cache)
    assert_close(y[0, :3], want[0, :3], TOL, "prompt 0")
    assert_close(y[0, 5:], want[1, :6], TOL, "prompt 1")
    assert np.all(np.asarray(y[0, 3:5]) == 0)
    np.testing.assert_array_equal(np.asarray(cache.lengths), [6, 0, 0, 3, 0])
    decode = nnx.jit(lambda layer, x, cache, slots: layer.decode(x, cache, slots), donate_argnums=2)
    step_slots = jnp.array([3, -1, 0], jnp.int32)
    for step in range(new_tokens):
        x = jnp.stack([full[0, 3 + step], jnp.ones(HIDDEN), full[1, 6 + step]])[:, None]
        y, cache = decode(layer, x, cache, step_slots)
        assert_close(y[0, 0], want[0, 3 + step], TOL, f"step {step} request 0")
        assert_close(y[2, 0], want[1, 6 + step], TOL, f"step {step} request 1")
        assert np.all(np.asarray(y[1]) == 0)
    np.testing.assert_array_equal(np.asarray(cache.lengths), [9, 0, 0, 6, 0])
    for pool in (cache.k, cache.v):
        assert np.all(np.asarray(pool)[[1, 2, 4]] == 0)


def test_prefill_pool_dense_rows_and_errors():
    """The dense form (one prompt per row) writes each row's keys at positions 0.., a recycled row keeps nothing of
    its past (the new prompt is shorter); prompts longer than the rows are refused."""
    q, k, v = inputs(5, (2, 4, 4, 8)), inputs(6, (2, 4, 2, 8)), inputs(7, (2, 4, 2, 8))
    k_pool, v_pool = inputs(8, (3, 6, 2, 8)), inputs(9, (3, 6, 2, 8))
    out, new_k, new_v = attention_prefill_pool(q, k, v, k_pool, v_pool, jnp.array([2, -1]))
    want = jax.nn.dot_product_attention(q[:1], k[:1], v[:1], is_causal=True)
    assert_close(out[:1], np.asarray(want), TOL)
    assert np.all(np.asarray(out[1]) == 0)
    np.testing.assert_array_equal(np.asarray(new_k[2, :4]), np.asarray(k[0]))
    np.testing.assert_array_equal(np.asarray(new_v[2, 4:]), np.asarray(v_pool[2, 4:]))  # past the prompt: unread
    np.testing.assert_array_equal(np.asarray(new_k[:2]), np.asarray(k_pool[:2]))
    with pytest.raises(ValueError, match=r"prompts must fit their rows: lengths <= max_len = 3"):
        attention_prefill_pool(q, k, v, k_pool[:, :3], v_pool[:, :3], jnp.array([2, 0]))
    with pytest.raises(ValueError, match=r"slots must have shape \[num_sequences\]"):
        attention_prefill_pool(q[:1], k[:1], v[:1], k_pool, v_pool, jnp.array([0, 1, 2]),
                               cu_seqlens=jnp.array([0, 2, 4]))


def test_bad_input_is_named():
    layer, weights = make_layer(PLAIN)
    with pytest.raises(ValueError, match=r"x must have shape \[batch, 1, hidden_size\] = \[\*, 1, 24\], got \[2, 2, "):
        layer.decode(jnp.zeros((2, 2, HIDDEN)), layer.empty_cache(2, max_len=4), jnp.array([0, 1]))
    with pytest.raises(ValueError, match="cache must be this layer's AttentionCache"):
        layer.decode(jnp.zeros((2, 1, HIDDEN)), None, jnp.array([0, 1]))
    del weights["o_proj.weight"]
    with pytest.raises(ValueError, match=r"missing \['o_proj.weight'\]"):
        layer.load_fla_state_dict(weights)
    with pytest.raises(ValueError, match=r"num_heads \(4\) must be a multiple of num_kv_heads \(3\)"):
        Attention(HIDDEN, 4, 3, 8, rngs=nnx.Rngs(0))
