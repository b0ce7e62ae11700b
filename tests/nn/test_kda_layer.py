"""hybrax.nn.KimiDeltaAttention against a float64 NumPy reference of flash-linear-attention's layer computed from
the same fla-format weights: outputs (dense rows, cu_seqlens, segment_ids), gradients against float64 autodiff, the
weight loader and bad input."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from hybrax.nn import KimiDeltaAttention, kimi_linear_to_fla
from tests.helpers import TOLERANCE, assert_close
from tests.nn import reference

HIDDEN = 24
DEFAULT = dict(num_heads=2, num_v_heads=2, head_dim=8, head_v_dim=8, use_short_conv=True, allow_neg_eigval=False,
               lower_bound=None, norm_eps=1e-5)
# Grouped value heads with a wider value dim, the bounded gate, 2 sigmoid(beta), conv biases.
VARIANT = dict(DEFAULT, num_v_heads=4, head_v_dim=16, allow_neg_eigval=True, lower_bound=-4.0)
NO_CONV = dict(DEFAULT, use_short_conv=False)


def make_layer(cfg, conv_bias=False, seed=0, dtype=None, mode="fused_recurrent"):
    """A layer with random fla-format weights loaded. The token-by-token mode compiles several times faster; the
    chunked one runs where it is the point (its kernel has its own tests)."""
    rng = np.random.default_rng(seed)
    weights = reference.random_kda_weights(rng, HIDDEN, cfg, conv_bias=conv_bias)
    layer = nnx.eval_shape(lambda: KimiDeltaAttention(  # shapes only: every parameter comes from the weights
        HIDDEN, cfg["num_heads"], cfg["head_dim"], num_v_heads=cfg["num_v_heads"],
        expand_v=cfg["head_v_dim"] / cfg["head_dim"], mode=mode, use_short_conv=cfg["use_short_conv"],
        conv_bias=conv_bias, allow_neg_eigval=cfg["allow_neg_eigval"], lower_bound=cfg["lower_bound"],
        norm_eps=cfg["norm_eps"], dtype=dtype, rngs=nnx.Rngs(seed)))
    layer.load_fla_state_dict(weights)
    return layer, weights


@nnx.jit(static_argnames="max_segments")
def run(layer, x, cu_seqlens=None, segment_ids=None, max_segments=None):
    return layer(x, cu_seqlens=cu_seqlens, segment_ids=segment_ids, max_segments=max_segments)


def reference_layer(weights, cfg):
    weights = reference.f64(weights)
    return lambda x: reference.kda_layer(weights, x, cfg)


def inputs(seed, shape, dtype=jnp.float32):
    return jnp.asarray(np.random.default_rng(seed).normal(size=shape), dtype)


@pytest.mark.parametrize("cfg, conv_bias", [(DEFAULT, False), (VARIANT, True), (NO_CONV, False)],
                         ids=["default", "gva-bounded-negeig-bias", "no-conv"])
def test_dense_rows_match_fla(cfg, conv_bias):
    layer, weights = make_layer(cfg, conv_bias)
    x = inputs(1, (2, 13, HIDDEN))
    want = reference.per_sequence(reference_layer(weights, cfg), np.asarray(x), [(0, slice(0, 13)), (1, slice(0, 13))])
    assert_close(run(layer, x), want, TOLERANCE[jnp.float32])


def test_one_token():
    layer, weights = make_layer(DEFAULT)
    x = inputs(2, (3, 1, HIDDEN))
    pieces = [(b, slice(0, 1)) for b in range(3)]
    assert_close(run(layer, x), reference.per_sequence(reference_layer(weights, DEFAULT), np.asarray(x), pieces),
                 TOLERANCE[jnp.float32])


def test_cu_seqlens_keep_sequences_apart():
    """Sequences of 5, 0 (empty), 1 and 6 tokens, then a token past the end (zeros), chunked."""
    layer, weights = make_layer(VARIANT, conv_bias=True, mode="chunk")
    cu = np.array([0, 5, 5, 6, 12], np.int32)
    x = inputs(3, (1, 13, HIDDEN))
    pieces = [(0, slice(s, e)) for s, e in zip(cu[:-1], cu[1:])]
    want = reference.per_sequence(reference_layer(weights, VARIANT), np.asarray(x), pieces)
    got = run(layer, x, cu_seqlens=jnp.asarray(cu))
    assert_close(got, want, TOLERANCE[jnp.float32])
    assert np.all(np.asarray(got[0, 12]) == 0)


def segment_case():
    """Two rows: runs 0,0,0 | 1,1,1,1,1 | 0,0 (a repeated id starts a new sequence) | padding; and one of 2 runs."""
    ids = np.array([[0, 0, 0, 1, 1, 1, 1, 1, 0, 0, -1, -1],
                    [4, 4, 4, 4, 4, 4, 4, 7, 7, 7, 7, 7]], np.int32)
    pieces = [(0, slice(0, 3)), (0, slice(3, 8)), (0, slice(8, 10)), (1, slice(0, 7)), (1, slice(7, 12))]
    return ids, pieces


def test_segment_ids_keep_runs_apart():
    layer, weights = make_layer(DEFAULT)
    ids, pieces = segment_case()
    x = inputs(4, (2, 12, HIDDEN))
    want = reference.per_sequence(reference_layer(weights, DEFAULT), np.asarray(x), pieces)
    got = run(layer, x, segment_ids=jnp.asarray(ids), max_segments=8)  # 6 runs (with padding's): 2 empty added
    assert_close(got, want, TOLERANCE[jnp.float32])
    assert np.all(np.asarray(got[0, 10:]) == 0)


def test_bf16():
    layer, weights = make_layer(DEFAULT, dtype=jnp.bfloat16)
    x = inputs(5, (2, 9, HIDDEN), jnp.bfloat16)
    y = run(layer, x)
    assert y.dtype == jnp.bfloat16
    want = reference.per_sequence(reference_layer(weights, DEFAULT), np.asarray(x.astype(jnp.float32)),
                                  [(0, slice(0, 9)), (1, slice(0, 9))])
    assert_close(y, want, TOLERANCE[jnp.bfloat16])


# ------------------------------------------------------------------ gradients

OUR_NAMES = {"f_a_proj": "f_proj.0", "f_b_proj": "f_proj.1", "g_a_proj": "g_proj.0", "g_b_proj": "g_proj.1"}


def in_fla_layout(grads: nnx.State) -> dict[str, np.ndarray]:
    """Our parameters' gradients under fla's names and PyTorch layouts."""
    out = {}
    for path, value in nnx.to_flat_state(grads):
        module, leaf = ".".join(str(p) for p in path[:-1]), str(path[-1])
        value = np.asarray(value[...] if hasattr(value, "get_value") else value, np.float64)
        if leaf == "kernel":
            out[OUR_NAMES.get(module, module) + ".weight"] = value.T
        elif module.endswith("conv1d") and leaf == "weight":
            out[module + ".weight"] = value[:, None, :]
        else:
            out[(OUR_NAMES.get(module, module) + "." if module else "") + leaf] = value
    return out


def test_gradients_match_float64_autodiff():
    """Two packed sequences through the variant layer (grouped value heads, bounded gate, 2 sigmoid(beta), conv
    biases): d/dx and d/d every weight."""
    layer, weights = make_layer(VARIANT, conv_bias=True)
    x, cotangent = inputs(6, (1, 11, HIDDEN)), inputs(7, (1, 11, HIDDEN))
    cu = jnp.array([0, 4, 11], jnp.int32)
    d_layer, d_x = nnx.jit(nnx.grad(lambda layer, x: jnp.sum(layer(x, cu_seqlens=cu) * cotangent),
                                    argnums=(0, 1)))(layer, x)

    with jax.enable_x64(True):
        def theirs(w, x):
            return sum(jnp.sum(reference.kda_layer(w, x[0, piece], VARIANT, jnp) *
                               jnp.asarray(cotangent, jnp.float64)[0, piece])
                       for piece in (slice(0, 4), slice(4, 11)))

        w64 = {name: jnp.asarray(value, jnp.float64) for name, value in weights.items()}
        want_w, want_x = jax.jit(jax.grad(theirs, argnums=(0, 1)))(w64, jnp.asarray(x, jnp.float64))
        want_w = {name: np.asarray(value) for name, value in want_w.items()}
        want_x = np.asarray(want_x)
    got_w = in_fla_layout(nnx.state(d_layer, nnx.Param))
    assert sorted(got_w) == sorted(want_w)
    assert_close(d_x, want_x, TOLERANCE[jnp.float32], "dx")
    for name in want_w:
        assert_close(got_w[name], want_w[name], TOLERANCE[jnp.float32], "d" + name)


# ------------------------------------------------------------------ weights and bad input


FLA_TO_KIMI = {"f_proj.0.weight": "f_a_proj.weight", "f_proj.1.weight": "f_b_proj.weight",
               "g_proj.0.weight": "g_a_proj.weight", "g_proj.1.weight": "g_b_proj.weight"}


def test_kimi_linear_names_load_as_fla():
    """A Kimi-Linear layer's dict (its names, no output-gate bias, A_log [1, 1, HV, 1]) computes what fla's does
    with a zero bias."""
    layer, weights = make_layer(DEFAULT)
    weights["g_proj.1.bias"] = np.zeros_like(weights["g_proj.1.bias"])
    layer.load_fla_state_dict(weights)
    kimi = {FLA_TO_KIMI.get(name, name): value for name, value in weights.items() if name != "g_proj.1.bias"}
    kimi["A_log"] = weights["A_log"].reshape(1, 1, -1, 1)
    other, _ = make_layer(DEFAULT, seed=9)
    other.load_fla_state_dict(kimi_linear_to_fla(kimi))
    x = inputs(8, (1, 6, HIDDEN))
    np.testing.assert_array_equal(np.asarray(run(other, x)), np.asarray(run(layer, x)))


def test_loader_names_what_is_wrong_and_writes_nothing():
    layer, weights = make_layer(DEFAULT)
    x = inputs(9, (1, 5, HIDDEN))
    before = np.asarray(run(layer, x))
    broken = dict(weights)
    del broken["dt_bias"]
    broken["extra.weight"] = np.zeros(3, np.float32)
    with pytest.raises(ValueError, match=r"missing \['dt_bias'\], unexpected \['extra.weight'\]"):
        layer.load_fla_state_dict(broken)
    wrong = dict(reference.random_kda_weights(np.random.default_rng(3), HIDDEN, DEFAULT))
    wrong["q_proj.weight"] = wrong["q_proj.weight"].T
    with pytest.raises(ValueError, match=r"q_proj.weight must have shape \[16, 24\] \(PyTorch layout\), got \[24, "):
        layer.load_fla_state_dict(wrong)
    np.testing.assert_array_equal(np.asarray(run(layer, x)), before)


def test_bad_input_is_named():
    layer, _ = make_layer(DEFAULT)
    with pytest.raises(ValueError, match=r"x must have shape \[batch, seq_len, hidden_size\] = \[\*, \*, 24\], "
                                         r"got \[1, 5, 23\]"):
        layer(jnp.zeros((1, 5, 23)))
    with pytest.raises(ValueError, match="cu_seqlens needs a batch of one"):
        layer(jnp.zeros((2, 5, HIDDEN)), cu_seqlens=jnp.array([0, 5]))
    with pytest.raises(ValueError, match="segment_ids under jit need max_segments"):
        nnx.jit(lambda layer, ids: layer(jnp.zeros((1, 4, HIDDEN)), segment_ids=ids))(layer, jnp.zeros((1, 4), int))
    with pytest.raises(ValueError, match=r"num_v_heads \(3\) must be a multiple of num_heads \(2\)"):
        KimiDeltaAttention(HIDDEN, 2, 8, num_v_heads=3, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="lower_bound must be a number <= 0"):
        KimiDeltaAttention(HIDDEN, 2, 8, lower_bound=1.0, rngs=nnx.Rngs(0))


def test_fla_initialisation():
    layer = KimiDeltaAttention(HIDDEN, 2, 8, num_v_heads=4, rngs=nnx.Rngs(0))
    a = np.exp(np.asarray(layer.A_log[...]))
    assert layer.A_log[...].shape == (4,) and np.all((a >= 1) & (a <= 16))
    dt = np.log1p(np.exp(np.asarray(layer.dt_bias[...], np.float64)))  # softplus(dt_bias) is the dt drawn
    assert layer.dt_bias[...].shape == (32,) and layer.dt_bias[...].dtype == jnp.float32
    assert np.all((dt >= 1e-3 * 0.999) & (dt <= 0.1 * 1.001))
