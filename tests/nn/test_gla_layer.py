"""hybrax.nn.GatedLinearAttention against a float64 NumPy reference of flash-linear-attention's layer computed from
the same fla-format weights: outputs (dense rows, cu_seqlens, segment_ids), gradients against float64 autodiff,
serving (prefill into the state pool then decode token by token equals the full forward), the weight loader and bad
input."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from hybrax.nn import GatedLinearAttention, GlaCache, HybridCache
from tests.helpers import TOLERANCE, assert_close
from tests.nn import reference

HIDDEN, RANK, TOL = 32, 8, TOLERANCE[jnp.float32]
# fla's defaults: one KV head per head, no convolutions, the fused swish output gate.
DEFAULT = dict(num_heads=2, num_kv_heads=2, head_k_dim=8, head_v_dim=16, use_short_conv=False, feature_map=None,
               use_output_gate=True, gate_fn="swish", norm_name="g_norm_swish_gate", gate_logit_normalizer=16.0,
               clamp_min=None, norm_eps=1e-5)
# Grouped KV heads, short convolutions, a feature map, a sigmoid gate (unfused: g_norm), sharper clamped gates.
VARIANT = dict(DEFAULT, num_heads=4, head_k_dim=4, head_v_dim=8, use_short_conv=True, feature_map="sigmoid",
               gate_fn="sigmoid", norm_name="g_norm", gate_logit_normalizer=2.0, clamp_min=-1.5)
NO_GATE = dict(DEFAULT, use_output_gate=False, norm_name="g_norm")


def make_layer(cfg, conv_bias=False, seed=0, mode="fused_recurrent"):
    """A layer with random fla-format weights loaded. The token-by-token mode compiles faster; the chunked one
    runs where it is the point."""
    weights = reference.random_gla_weights(np.random.default_rng(seed), HIDDEN, cfg, RANK, conv_bias=conv_bias)
    layer = nnx.eval_shape(lambda: GatedLinearAttention(  # shapes only: every parameter comes from the weights
        HIDDEN, cfg["num_heads"], num_kv_heads=cfg["num_kv_heads"],
        expand_k=cfg["num_heads"] * cfg["head_k_dim"] / HIDDEN, expand_v=cfg["num_heads"] * cfg["head_v_dim"] / HIDDEN,
        mode=mode, feature_map=cfg["feature_map"], use_short_conv=cfg["use_short_conv"], conv_bias=conv_bias,
        use_output_gate=cfg["use_output_gate"], gate_fn=cfg["gate_fn"], norm_eps=cfg["norm_eps"],
        gate_logit_normalizer=cfg["gate_logit_normalizer"], gate_low_rank_dim=RANK, clamp_min=cfg["clamp_min"],
        rngs=nnx.Rngs(seed)))
    layer.load_fla_state_dict(weights)
    return layer, weights


def reference_layer(weights, cfg):
    weights = reference.f64(weights)
    return lambda x: reference.gla_layer(weights, x, cfg)


@nnx.jit(static_argnames="max_segments")
def run(layer, x, cu_seqlens=None, segment_ids=None, max_segments=None):
    return layer(x, cu_seqlens=cu_seqlens, segment_ids=segment_ids, max_segments=max_segments)


def inputs(seed, shape):
    return jnp.asarray(np.random.default_rng(seed).normal(size=shape), jnp.float32)


@pytest.mark.parametrize("cfg, conv_bias", [(DEFAULT, False), (VARIANT, True), (NO_GATE, False)],
                         ids=["default", "gqa-conv-map-sigmoid-clamp", "no-gate"])
def test_forms_match_fla(cfg, conv_bias):
    """Dense rows, packed by cu_seqlens (an empty sequence, a token past the end) and by segment_ids (a repeated id
    is a new sequence; padding)."""
    layer, weights = make_layer(cfg, conv_bias)
    ref = reference_layer(weights, cfg)
    x = inputs(1, (2, 9, HIDDEN))
    assert_close(run(layer, x), reference.per_sequence(ref, np.asarray(x), [(0, slice(0, 9)), (1, slice(0, 9))]), TOL)
    cu = np.array([0, 4, 4, 8], np.int32)
    got = run(layer, x[:1], cu_seqlens=jnp.asarray(cu))
    assert_close(got, reference.per_sequence(ref, np.asarray(x[:1]), [(0, slice(0, 4)), (0, slice(4, 8))]), TOL)
    assert np.all(np.asarray(got[0, 8]) == 0)
    ids = np.array([[2, 2, 2, 5, 5, 2, 2, 2, -1], [0, 0, 0, 0, 0, 0, 1, 1, 1]], np.int32)
    pieces = [(0, slice(0, 3)), (0, slice(3, 5)), (0, slice(5, 8)), (1, slice(0, 6)), (1, slice(6, 9))]
    got = run(layer, x, segment_ids=jnp.asarray(ids), max_segments=6)
    assert_close(got, reference.per_sequence(ref, np.asarray(x), pieces), TOL)
    assert np.all(np.asarray(got[0, 8]) == 0)


def test_chunk_mode_matches_fla():
    """The chunked kernels (fla's default mode) on packed sequences longer than a chunk."""
    layer, weights = make_layer(VARIANT, conv_bias=True, mode="chunk")
    cu = np.array([0, 21, 40], np.int32)
    x = inputs(2, (1, 40, HIDDEN))
    want = reference.per_sequence(reference_layer(weights, VARIANT), np.asarray(x), [(0, slice(0, 21)),
                                                                                     (0, slice(21, 40))])
    assert_close(run(layer, x, cu_seqlens=jnp.asarray(cu)), want, TOL)


OUR_NAMES = {"gk_a_proj": "gk_proj.0", "gk_b_proj": "gk_proj.1", "o_norm": VARIANT["norm_name"]}


def in_fla_layout(grads: nnx.State) -> dict[str, np.ndarray]:
    """Our parameters' gradients under fla's names and PyTorch layouts."""
    out = {}
    for path, value in nnx.to_flat_state(grads):
        module, leaf = OUR_NAMES.get(str(path[0]), str(path[0])), str(path[-1])
        value = np.asarray(value[...] if hasattr(value, "get_value") else value, np.float64)
        if leaf == "kernel":
            out[module + ".weight"] = value.T
        elif module.endswith("conv1d") and leaf == "weight":
            out[module + ".weight"] = value[:, None, :]
        else:
            out[module + "." + leaf] = value
    return out


def test_gradients_match_float64_autodiff():
    """Two packed sequences through the variant layer: d/dx and d/d every weight."""
    layer, weights = make_layer(VARIANT, conv_bias=True)
    x, cotangent = inputs(3, (1, 11, HIDDEN)), inputs(4, (1, 11, HIDDEN))
    cu = jnp.array([0, 4, 11], jnp.int32)
    d_layer, d_x = nnx.jit(nnx.grad(lambda layer, x: jnp.sum(layer(x, cu_seqlens=cu) * cotangent),
                                    argnums=(0, 1)))(layer, x)
    with jax.enable_x64(True):
        def theirs(w, x):
            return sum(jnp.sum(reference.gla_layer(w, x[0, piece], VARIANT, jnp) *
                               jnp.asarray(cotangent, jnp.float64)[0, piece])
                       for piece in (slice(0, 4), slice(4, 11)))

        w64 = {name: jnp.asarray(value, jnp.float64) for name, value in weights.items()}
        want_w, want_x = jax.jit(jax.grad(theirs, argnums=(0, 1)))(w64, jnp.asarray(x, jnp.float64))
        want_w, want_x = {name: np.asarray(value) for name, value in want_w.items()}, np.asarray(want_x)
    got_w = in_fla_layout(nnx.state(d_layer, nnx.Param))
    assert sorted(got_w) == sorted(want_w)
    assert_close(d_x, want_x, TOL, "dx")
    for name in want_w:
        assert_close(got_w[name], want_w[name], TOL, "d" + name)


@pytest.mark.parametrize("cfg, state_v_first, mode", [(VARIANT, False, "fused_recurrent"), (DEFAULT, True, "chunk")],
                         ids=["conv", "v-first-chunk"])
def test_prefill_then_decode_equals_the_full_forward(cfg, state_v_first, mode):
    """Prefill two packed prompts (and a padded one) into slots 3 and 0 of 5, then decode their next tokens with a
    padded row, against the layer on the whole sequences; rows no request names stay zero."""
    layer, _ = make_layer(cfg, conv_bias=True, mode=mode)
    lengths, new_tokens = [3, 6], 3
    full = inputs(5, (2, max(lengths) + new_tokens, HIDDEN))
    want = np.asarray(run(layer, full))
    slots = jnp.array([3, -1, 0], jnp.int32)
    cu = jnp.array([0, 3, 5, 11], jnp.int32)
    prompts = jnp.concatenate([full[0, :3], full[0, :2], full[1, :6]])[None]
    cache = HybridCache.create([layer], 5, max_len=12).layers[0]
    if state_v_first:
        cache = layer.empty_cache(5, state_v_first=True)
    assert isinstance(cache, GlaCache) and cache.state_v_first == state_v_first
    y, cache = nnx.jit(lambda layer, x, cache: layer.prefill(x, cache, slots, cu_seqlens=cu))(layer, prompts, cache)
    assert_close(y[0, :3], want[0, :3], TOL, "prompt 0")
    assert_close(y[0, 5:], want[1, :6], TOL, "prompt 1")
    assert np.all(np.asarray(y[0, 3:5]) == 0)
    decode = nnx.jit(lambda layer, x, cache, slots: layer.decode(x, cache, slots), donate_argnums=2)
    step_slots = jnp.array([3, -1, 0], jnp.int32)
    for step in range(new_tokens):
        x = jnp.stack([full[0, 3 + step], jnp.ones(HIDDEN), full[1, 6 + step]])[:, None]
        y, cache = decode(layer, x, cache, step_slots)
        assert_close(y[0, 0], want[0, 3 + step], TOL, f"step {step} request 0")
        assert_close(y[2, 0], want[1, 6 + step], TOL, f"step {step} request 1")
        assert np.all(np.asarray(y[1]) == 0)
    for pool in (cache.conv, cache.state):
        if pool is not None:
            assert np.all(np.asarray(pool)[[1, 2, 4]] == 0)


def test_dense_prefill_recycles_a_slot():
    """One prompt per row: a slot that held another request's state starts afresh."""
    layer, _ = make_layer(VARIANT)
    x = inputs(6, (2, 5, HIDDEN))
    prefill = nnx.jit(lambda layer, x, cache, slots: layer.prefill(x, cache, slots))
    _, cache = prefill(layer, inputs(7, (2, 4, HIDDEN)), layer.empty_cache(2), jnp.array([0, 1]))
    y, cache = prefill(layer, x, cache, jnp.array([1, -1]))
    assert_close(y[0], np.asarray(run(layer, x[:1]))[0], TOL)
    assert np.all(np.asarray(y[1]) == 0)


def test_loader_names_what_is_wrong_and_writes_nothing():
    layer, weights = make_layer(DEFAULT)
    x = inputs(8, (1, 5, HIDDEN))
    before = np.asarray(run(layer, x))
    broken = dict(weights)
    del broken["gk_proj.1.bias"]
    broken["g_norm.weight"] = broken.pop("g_norm_swish_gate.weight")
    with pytest.raises(ValueError, match=r"missing \['g_norm_swish_gate.weight', 'gk_proj.1.bias'\], "
                                         r"unexpected \['g_norm.weight'\]"):
        layer.load_fla_state_dict(broken)
    wrong = dict(reference.random_gla_weights(np.random.default_rng(3), HIDDEN, DEFAULT, RANK))
    wrong["gk_proj.0.weight"] = wrong["gk_proj.0.weight"].T
    with pytest.raises(ValueError, match=r"gk_proj.0.weight must have shape \[8, 32\] \(PyTorch layout\), got \[32, "):
        layer.load_fla_state_dict(wrong)
    np.testing.assert_array_equal(np.asarray(run(layer, x)), before)


def test_bad_input_is_named():
    layer, _ = make_layer(VARIANT)
    with pytest.raises(ValueError, match=r"x must have shape \[batch, seq_len, hidden_size\] = \[\*, \*, 32\], "
                                         r"got \[1, 5, 31\]"):
        layer(jnp.zeros((1, 5, 31)))
    with pytest.raises(ValueError, match=r"x must have shape \[batch, 1, hidden_size\] = \[\*, 1, 32\], got \[2, 2, "):
        layer.decode(jnp.zeros((2, 2, HIDDEN)), layer.empty_cache(2), jnp.array([0, 1]))
    with pytest.raises(ValueError, match="cache must be this layer's GlaCache"):
        layer.decode(jnp.zeros((2, 1, HIDDEN)), None, jnp.array([0, 1]))
    with pytest.raises(ValueError, match=r"cache.conv must be an array for a layer with use_short_conv=True"):
        layer.decode(jnp.zeros((2, 1, HIDDEN)), make_layer(DEFAULT)[0].empty_cache(2), jnp.array([0, 1]))
    with pytest.raises(ValueError, match=r"slots must have shape \[batch\]"):
        layer.decode(jnp.zeros((2, 1, HIDDEN)), layer.empty_cache(2), jnp.array([0, 1, 2]))
    with pytest.raises(ValueError, match=r"num_heads \(4\) must be a multiple of num_kv_heads \(3\)"):
        GatedLinearAttention(HIDDEN, 4, num_kv_heads=3, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"hidden_size \* expand_k \(32 \* 0.5 = 16\) must be a positive multiple "
                                         r"of num_heads \(3\)"):
        GatedLinearAttention(HIDDEN, 3, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="clamp_min must be a number <= 0"):
        GatedLinearAttention(HIDDEN, 4, clamp_min=0.5, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="feature_map must be None or one of"):
        GatedLinearAttention(HIDDEN, 4, feature_map="elu", rngs=nnx.Rngs(0))
