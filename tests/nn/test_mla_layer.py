"""hybrax.nn.MultiheadLatentAttention against a float64 reference of flash-linear-attention's MLA layer (Kimi
Linear's NoPE form and DeepSeek-V3's low-rank query with rotary keys), dense and packed, its gradients, its serving
(prefill into the KV pool then decode token by token equals the full forward), Hugging Face names and bad input."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from hybrax.nn import AttentionCache, HybridCache, MultiheadLatentAttention, mla_to_fla
from tests.helpers import TOLERANCE, assert_close
from tests.nn import reference

HIDDEN, TOL = 24, TOLERANCE[jnp.float32]
# Kimi Linear's: a full-rank query, no rotary embedding; values narrower than the keys.
KIMI = dict(num_heads=4, q_lora_rank=None, kv_lora_rank=8, qk_nope_head_dim=6, qk_rope_head_dim=4, v_head_dim=5,
            rope_theta=None, sliding_window=None, softmax_scale=None, norm_eps=1e-5)
# DeepSeek-V3's: a low-rank query, rotary keys; with a sliding window and its own softmax scale.
DEEPSEEK = dict(KIMI, q_lora_rank=12, rope_theta=500.0, v_head_dim=8, sliding_window=3, softmax_scale=0.45,
                norm_eps=1e-6)


def make_layer(cfg, seed=0):
    weights = reference.random_mla_weights(np.random.default_rng(seed), HIDDEN, cfg)
    layer = nnx.eval_shape(lambda: MultiheadLatentAttention(  # shapes only: every parameter comes from the weights
        HIDDEN, cfg["num_heads"], q_lora_rank=cfg["q_lora_rank"], kv_lora_rank=cfg["kv_lora_rank"],
        qk_nope_head_dim=cfg["qk_nope_head_dim"], qk_rope_head_dim=cfg["qk_rope_head_dim"],
        v_head_dim=cfg["v_head_dim"], rope_theta=cfg["rope_theta"], sliding_window=cfg["sliding_window"],
        softmax_scale=cfg["softmax_scale"], norm_eps=cfg["norm_eps"], rngs=nnx.Rngs(seed)))
    layer.load_fla_state_dict(weights)
    return layer, weights


def reference_layer(weights, cfg):
    weights = reference.f64(weights)
    return lambda x: reference.mla_layer(weights, x, cfg)


@nnx.jit
def run(layer, x, cu_seqlens=None, segment_ids=None):
    return layer(x, cu_seqlens=cu_seqlens, segment_ids=segment_ids)


def inputs(seed, shape):
    return jnp.asarray(np.random.default_rng(seed).normal(size=shape), jnp.float32)


@pytest.mark.parametrize("cfg", [KIMI, DEEPSEEK], ids=["kimi-nope", "deepseek-rope-window"])
def test_forms_match_fla(cfg):
    """Dense rows, packed by cu_seqlens (an empty sequence, a token past the end) and by segment_ids (a repeated id
    is a new sequence; padding)."""
    layer, weights = make_layer(cfg)
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


OUR_NAMES = {"q_a_proj": "q_proj.0", "q_a_norm": "q_proj.1", "q_b_proj": "q_proj.2", "kv_a_proj": "kv_proj.0",
             "kv_a_norm": "kv_proj.1", "kv_b_proj": "kv_proj.2"}


@pytest.mark.parametrize("cfg", [KIMI, DEEPSEEK], ids=["kimi-nope", "deepseek-rope-window"])
def test_gradients_match_float64_autodiff(cfg):
    """Two packed sequences: d/dx and d/d every weight."""
    layer, weights = make_layer(cfg)
    x, cotangent = inputs(2, (1, 9, HIDDEN)), inputs(3, (1, 9, HIDDEN))
    cu = jnp.array([0, 4, 9], jnp.int32)
    d_layer, d_x = nnx.jit(nnx.grad(lambda layer, x: jnp.sum(layer(x, cu_seqlens=cu) * cotangent),
                                    argnums=(0, 1)))(layer, x)
    with jax.enable_x64(True):
        def theirs(w, x):
            return sum(jnp.sum(reference.mla_layer(w, x[0, piece], cfg, jnp) *
                               jnp.asarray(cotangent, jnp.float64)[0, piece]) for piece in (slice(0, 4), slice(4, 9)))

        w64 = {name: jnp.asarray(value, jnp.float64) for name, value in weights.items()}
        want_w, want_x = jax.jit(jax.grad(theirs, argnums=(0, 1)))(w64, jnp.asarray(x, jnp.float64))
        want_w, want_x = {name: np.asarray(value) for name, value in want_w.items()}, np.asarray(want_x)
    got_w = {}
    for path, value in nnx.to_flat_state(nnx.state(d_layer, nnx.Param)):
        value, module = np.asarray(value[...]), OUR_NAMES.get(str(path[0]), str(path[0]))
        got_w[module + ".weight"] = value.T if path[-1] == "kernel" else value
    assert sorted(got_w) == sorted(want_w)
    assert_close(d_x, want_x, TOL, "dx")
    for name in want_w:
        assert_close(got_w[name], want_w[name], TOL, "d" + name)


@pytest.mark.parametrize("cfg", [KIMI, DEEPSEEK], ids=["kimi-nope", "deepseek-rope-window"])
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
    cache = HybridCache.create([layer], 5, max_len=12).layers[0]
    assert isinstance(cache, AttentionCache) and cache.k.shape == (5, 12, 4, 10) and cache.v.shape[-1] == \
        cfg["v_head_dim"]
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


@pytest.mark.parametrize("cfg", [KIMI, DEEPSEEK], ids=["kimi", "deepseek"])
def test_hugging_face_names_load_as_fla(cfg):
    """A checkpoint's layer (q_proj or q_a_proj / q_a_layernorm / q_b_proj, kv_a_proj_with_mqa holding the latent's
    rows then the rotary key's, kv_a_layernorm, kv_b_proj, o_proj) computes what fla's names do."""
    layer, weights = make_layer(cfg)
    hf = {"kv_a_proj_with_mqa.weight": np.concatenate([weights["kv_proj.0.weight"], weights["k_rope.weight"]]),
          "kv_a_layernorm.weight": weights["kv_proj.1.weight"], "kv_b_proj.weight": weights["kv_proj.2.weight"],
          "o_proj.weight": weights["o_proj.weight"]}
    if cfg["q_lora_rank"] is None:
        hf["q_proj.weight"] = weights["q_proj.weight"]
    else:
        hf.update({"q_a_proj.weight": weights["q_proj.0.weight"], "q_a_layernorm.weight": weights["q_proj.1.weight"],
                   "q_b_proj.weight": weights["q_proj.2.weight"]})
    other, _ = make_layer(cfg, seed=9)
    other.load_fla_state_dict(mla_to_fla(hf))
    x = inputs(5, (1, 6, HIDDEN))
    np.testing.assert_array_equal(np.asarray(run(other, x)), np.asarray(run(layer, x)))
    del hf["kv_a_layernorm.weight"]
    with pytest.raises(ValueError, match="mla_to_fla needs kv_a_layernorm.weight to split kv_a_proj_with_mqa"):
        mla_to_fla(hf)


def test_bad_input_is_named():
    layer, weights = make_layer(DEEPSEEK)
    x = inputs(6, (1, 5, HIDDEN))
    before = np.asarray(run(layer, x))
    with pytest.raises(ValueError, match=r"x must have shape \[batch, seq_len, hidden_size\] = \[\*, \*, 24\], "
                                         r"got \[1, 5, 23\]"):
        layer(jnp.zeros((1, 5, 23)))
    with pytest.raises(ValueError, match=r"x must have shape \[batch, 1, hidden_size\] = \[\*, 1, 24\], got \[2, 2, "):
        layer.decode(jnp.zeros((2, 2, HIDDEN)), layer.empty_cache(2, max_len=4), jnp.array([0, 1]))
    with pytest.raises(ValueError, match="cache must be this layer's AttentionCache"):
        layer.decode(jnp.zeros((2, 1, HIDDEN)), None, jnp.array([0, 1]))
    broken = dict(weights)
    del broken["q_proj.1.weight"]
    broken["q_proj.weight"] = np.zeros((40, HIDDEN), np.float32)
    with pytest.raises(ValueError, match=r"missing \['q_proj.1.weight'\], unexpected \['q_proj.weight'\]"):
        layer.load_fla_state_dict(broken)
    wrong = dict(weights, **{"kv_proj.2.weight": weights["kv_proj.2.weight"].T})
    with pytest.raises(ValueError, match=r"kv_proj.2.weight must have shape \[56, 8\] \(PyTorch layout\), got \[8, "):
        layer.load_fla_state_dict(wrong)
    np.testing.assert_array_equal(np.asarray(run(layer, x)), before)
    with pytest.raises(ValueError, match="rotary embeddings need an even qk_rope_head_dim, got 3"):
        MultiheadLatentAttention(HIDDEN, 4, kv_lora_rank=8, qk_nope_head_dim=6, qk_rope_head_dim=3, v_head_dim=5,
                                 rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="kv_lora_rank must be an int >= 1, got 0"):
        MultiheadLatentAttention(HIDDEN, 4, kv_lora_rank=0, qk_nope_head_dim=6, qk_rope_head_dim=4, v_head_dim=5,
                                 rngs=nnx.Rngs(0))
