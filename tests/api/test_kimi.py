"""kimi_delta_attention against float64 references written from flash-linear-attention's conventions: every
option fla names (gate in kernel, flat dt_bias, A_log, lower_bound, beta logits, allow_neg_eigval,
state_v_first, per-head g, cu_seqlens), keywords, jit and grad, and the errors bad values raise."""

from __future__ import annotations

import inspect

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hybrax.core.checks import checked
from hybrax.ops.kda.api import kernel_delta_attention
from hybrax.ops.kda.kimi import kimi_delta_attention
from tests.api import fla_reference as ref
from tests.helpers import TOLERANCE, assert_close, normal, to64

B, T, H, HV, K, V = 2, 13, 2, 4, 8, 6


def inputs(seed: int = 0, batch: int = B, length: int = T, dtype=jnp.float32) -> dict:
    """fla-style inputs: g the activated log decay per channel, beta in (0, 1), raw gate parameters."""
    return {
        "q": normal(seed, (batch, length, H, K), dtype), "k": normal(seed + 1, (batch, length, H, K), dtype),
        "v": normal(seed + 2, (batch, length, HV, V), dtype),
        "g": -jax.nn.softplus(normal(seed + 3, (batch, length, HV, K))),
        "beta": jax.nn.sigmoid(normal(seed + 4, (batch, length, HV))),
        "h0": normal(seed + 5, (batch, HV, K, V), scale=0.5),
        "raw": normal(seed + 6, (batch, length, HV, K)),
        "A_log": normal(seed + 7, (HV,), scale=0.5), "dt_bias": normal(seed + 8, (HV * K,), scale=0.5),
        "logits": normal(seed + 9, (batch, length, HV), scale=2.0),
    }


def fla_reference(x: dict, g, beta, *, gate=None, beta_sigmoid=False, allow_neg_eigval=False, h0=None, scale=None,
                  use_qk_l2norm=False, cu_seqlens=None, xp=np):
    """fla's math in float64: gate = (A_log, dt_bias, lower_bound) makes g the raw gate input (per head g
    broadcast over K); beta_sigmoid: beta holds logits. xp=jax.numpy (inside jax.enable_x64) to differentiate."""
    f64 = to64 if xp is np else (lambda a: a)
    g = f64(g)
    if g.ndim == 3:
        g = g[..., None]
    g = xp.broadcast_to(g, (*g.shape[:3], K))
    if gate is not None:
        A_log, dt_bias, lower_bound = gate
        g = ref.kda_gate(g, f64(A_log), f64(dt_bias), lower_bound, xp)
    beta = f64(beta)
    if beta_sigmoid:
        beta = (2.0 if allow_neg_eigval else 1.0) * ref.sigmoid(beta, xp)
    return ref.kda(f64(x["q"]), f64(x["k"]), f64(x["v"]), g, beta, scale=scale, initial_state=f64(h0),
                   cu_seqlens=cu_seqlens, use_qk_l2norm=use_qk_l2norm, xp=xp)


def check(out, expected, tol=TOLERANCE[jnp.float32]):
    o, state = out
    assert_close(o, expected[0], tol, "o")
    assert_close(state, expected[1], tol, "final_state")


def test_signature_is_fla_order_with_keywords():
    parameters = inspect.signature(kimi_delta_attention).parameters
    assert list(parameters)[:5] == ["q", "k", "v", "g", "beta"]
    assert all(p.kind is p.KEYWORD_ONLY for p in list(parameters.values())[5:])
    # fla's defaults: no L2 norm, no gate or beta activation in the kernel, no final state.
    for name in ("output_final_state", "use_qk_l2norm_in_kernel", "use_gate_in_kernel", "use_beta_sigmoid_in_kernel",
                 "allow_neg_eigval", "state_v_first"):
        assert parameters[name].default is False, name


def test_precomputed_gate_with_state_and_l2norm():
    x = inputs()
    out = kimi_delta_attention(x["q"], x["k"], x["v"], x["g"], x["beta"], scale=0.4, initial_state=x["h0"],
                               output_final_state=True, use_qk_l2norm_in_kernel=True)
    check(out, fla_reference(x, x["g"], x["beta"], h0=x["h0"], scale=0.4, use_qk_l2norm=True))


def test_keywords_match_positions_and_no_state_is_none():
    x = inputs(1)
    o, state = kimi_delta_attention(q=x["q"], k=x["k"], v=x["v"], g=x["g"], beta=x["beta"])
    assert state is None
    positional, _ = kimi_delta_attention(x["q"], x["k"], x["v"], x["g"], x["beta"])
    np.testing.assert_array_equal(o, positional)
    assert_close(o, fla_reference(x, x["g"], x["beta"])[0], TOLERANCE[jnp.float32])


@pytest.mark.parametrize("shape", ["BTH", "BTH1"])
def test_per_head_g(shape):
    x = inputs(2)
    g = x["g"][..., 0] if shape == "BTH" else x["g"][..., :1]
    out = kimi_delta_attention(x["q"], x["k"], x["v"], g, x["beta"], initial_state=x["h0"], output_final_state=True)
    check(out, fla_reference(x, g, x["beta"], h0=x["h0"]))


def test_gates_of_minus_1000_and_minus_inf_and_one_token():
    x = inputs(3, length=1)
    g = x["g"].at[0, 0, 0, :3].set(-1000.0).at[1, 0, 2].set(-jnp.inf)
    out = kimi_delta_attention(x["q"], x["k"], x["v"], g, x["beta"], initial_state=x["h0"], output_final_state=True)
    check(out, fla_reference(x, g, x["beta"], h0=x["h0"]))


@pytest.mark.parametrize("dt_bias_layout", ["flat", "heads_by_dim", "none"])
def test_gate_in_kernel_softplus(dt_bias_layout):
    x = inputs(4)
    dt_bias = {"flat": x["dt_bias"], "heads_by_dim": x["dt_bias"].reshape(HV, K), "none": None}[dt_bias_layout]
    out = kimi_delta_attention(x["q"], x["k"], x["v"], x["raw"], x["beta"], use_gate_in_kernel=True, A_log=x["A_log"],
                               dt_bias=dt_bias, initial_state=x["h0"], output_final_state=True)
    check(out, fla_reference(x, x["raw"], x["beta"], gate=(x["A_log"], dt_bias, None), h0=x["h0"]))


def test_gate_in_kernel_per_head_raw_g_with_dt_bias():
    x = inputs(5)
    raw = x["raw"][..., 0]
    out = kimi_delta_attention(x["q"], x["k"], x["v"], raw, x["beta"], use_gate_in_kernel=True, A_log=x["A_log"],
                               dt_bias=x["dt_bias"], output_final_state=True)
    check(out, fla_reference(x, raw, x["beta"], gate=(x["A_log"], x["dt_bias"], None)))


@pytest.mark.parametrize("with_A_log", [True, False])
def test_gate_in_kernel_bounded(with_A_log):
    x = inputs(6)
    A_log = x["A_log"] if with_A_log else None
    out = kimi_delta_attention(x["q"], x["k"], x["v"], x["raw"], x["beta"], use_gate_in_kernel=True, A_log=A_log,
                               dt_bias=x["dt_bias"], lower_bound=-5.0, safe_gate=True, output_final_state=True)
    check(out, fla_reference(x, x["raw"], x["beta"], gate=(A_log, x["dt_bias"], -5.0)))


@pytest.mark.parametrize("allow_neg_eigval", [False, True])
def test_beta_logits(allow_neg_eigval):
    x = inputs(7)
    out = kimi_delta_attention(x["q"], x["k"], x["v"], x["g"], x["logits"], use_beta_sigmoid_in_kernel=True,
                               allow_neg_eigval=allow_neg_eigval, initial_state=x["h0"], output_final_state=True)
    check(out, fla_reference(x, x["g"], x["logits"], beta_sigmoid=True, allow_neg_eigval=allow_neg_eigval,
                             h0=x["h0"]))


def test_state_v_first():
    x = inputs(8)
    o, state = kimi_delta_attention(x["q"], x["k"], x["v"], x["g"], x["beta"], state_v_first=True,
                                    initial_state=jnp.swapaxes(x["h0"], -1, -2), output_final_state=True)
    expected_o, expected_state = fla_reference(x, x["g"], x["beta"], h0=x["h0"])
    assert state.shape == (B, HV, V, K)
    check((o, state), (expected_o, np.swapaxes(expected_state, -1, -2)))


def test_packed_sequences_with_an_empty_one():
    x = inputs(9, batch=1, length=20)
    cu_seqlens = jnp.array([0, 7, 7, 15, 20], jnp.int32)
    h0 = normal(20, (4, HV, K, V), scale=0.5)
    out = kimi_delta_attention(x["q"], x["k"], x["v"], x["g"], x["beta"], cu_seqlens=cu_seqlens, initial_state=h0,
                               output_final_state=True, use_qk_l2norm_in_kernel=True)
    check(out, fla_reference(x, x["g"], x["beta"], h0=h0, cu_seqlens=np.asarray(cu_seqlens), use_qk_l2norm=True))


def test_bfloat16():
    x = inputs(10, dtype=jnp.bfloat16)
    o, state = kimi_delta_attention(x["q"], x["k"], x["v"], x["g"], x["beta"], output_final_state=True,
                                    use_qk_l2norm_in_kernel=True)
    assert o.dtype == jnp.bfloat16 and state.dtype == jnp.float32
    check((o, state), fla_reference(x, x["g"], x["beta"], use_qk_l2norm=True), TOLERANCE[jnp.bfloat16])


def test_same_math_as_kernel_delta_attention():
    """The fla mapping and the ejkernel-order function are one computation: beta and decay swap places."""
    x = inputs(11)
    o, state = kimi_delta_attention(x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=x["h0"],
                                    output_final_state=True, use_qk_l2norm_in_kernel=True)
    o2, state2 = kernel_delta_attention(x["q"], x["k"], x["v"], x["beta"], x["g"], x["h0"], return_state=True)
    np.testing.assert_allclose(o, o2, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(state, state2, rtol=1e-6, atol=1e-6)


def test_jit_and_grad_against_the_reference():
    """Gradients of a loss over o and the final state, under jit(grad), against the float64 reference's
    (gate in kernel, beta logits, flat dt_bias, L2 norm, V-first state)."""
    x = inputs(12)
    names = ["q", "k", "v", "raw", "logits", "A_log", "dt_bias", "h0"]
    weights_o, weights_s = normal(30, (B, T, HV, V)), normal(31, (B, HV, V, K))

    def loss(args):
        q, k, v, raw, logits, A_log, dt_bias, h0 = args
        o, state = kimi_delta_attention(q, k, v, raw, logits, use_gate_in_kernel=True, A_log=A_log, dt_bias=dt_bias,
                                        use_beta_sigmoid_in_kernel=True, use_qk_l2norm_in_kernel=True,
                                        initial_state=jnp.swapaxes(h0, -1, -2), state_v_first=True,
                                        output_final_state=True)
        return jnp.sum(o * weights_o) + jnp.sum(state * weights_s)

    def reference_loss(args):
        q, k, v, raw, logits, A_log, dt_bias, h0 = args
        o, state = fla_reference({"q": q, "k": k, "v": v}, raw, logits, gate=(A_log, dt_bias, None), beta_sigmoid=True,
                                 h0=h0, use_qk_l2norm=True, xp=jnp)
        return jnp.sum(o * to64(weights_o)) + jnp.sum(jnp.swapaxes(state, -1, -2) * to64(weights_s))

    args = [x[name] for name in names]
    grads = jax.jit(jax.grad(loss))(args)
    with jax.enable_x64(True):
        want = jax.grad(reference_loss)([jnp.asarray(to64(a)) for a in args])
        want = [np.asarray(w) for w in want]
    for name, got, expected in zip(names, grads, want):
        assert_close(got, expected, TOLERANCE[jnp.float32], f"d{name}")


def bad_call(**changes):
    x = inputs(13)
    args = {"q": x["q"], "k": x["k"], "v": x["v"], "g": x["g"], "beta": x["beta"]}
    args.update(changes)
    return kimi_delta_attention(**args)


@pytest.mark.parametrize("changes, message", [
    (lambda x: {"g": x["g"].at[1, 3, 2, 5].set(0.25)},
     r"g must be <= 0 \(a log decay: exp\(g\) in \[0, 1\]\), got 0.25 at index \[1, 3, 2, 5\] \(1 of"),
    (lambda x: {"g": x["g"].at[0, 0, 0, 0].set(jnp.nan)}, r"g must be <= 0 .* got nan at index \[0, 0, 0, 0\]"),
    (lambda x: {"beta": x["beta"].at[0, 2, 1].set(1.5)},
     r"beta must be in \[0, 1\], got 1.5 at index \[0, 2, 1\] .*use_beta_sigmoid_in_kernel=True if beta holds logits"),
    (lambda x: {"beta": x["beta"].at[0, 2, 1].set(-0.5)}, r"beta must be in \[0, 1\], got -0.5"),
    (lambda x: {"q": x["q"].at[1, 0, 1, 2].set(jnp.inf)}, r"q must be finite .* got inf at index \[1, 0, 1, 2\]"),
    (lambda x: {"v": x["v"].at[0, 1, 0, 0].set(jnp.nan)}, r"v must be finite .* got nan"),
    (lambda x: {"initial_state": x["h0"].at[0, 0, 0, 0].set(jnp.nan)}, r"initial_state must be finite"),
    (lambda x: {"beta": x["logits"].at[0, 0, 0].set(jnp.nan), "use_beta_sigmoid_in_kernel": True},
     r"beta must be free of NaN"),
    (lambda x: {"g": x["raw"].at[0, 0, 0, 0].set(jnp.nan), "use_gate_in_kernel": True, "A_log": x["A_log"]},
     r"g must be free of NaN"),
    (lambda x: {"g": x["raw"], "use_gate_in_kernel": True, "A_log": x["A_log"].at[1].set(jnp.inf)},
     r"A_log must be finite"),
    (lambda x: {"g": x["raw"], "use_gate_in_kernel": True, "A_log": x["A_log"], "dt_bias": x["dt_bias"].at[3].set(
        jnp.nan)}, r"dt_bias must be finite"),
    (lambda x: {"scale": -1.0}, r"scale must be a number > 0"),
    (lambda x: {"allow_neg_eigval": True}, r"allow_neg_eigval=True .* needs use_beta_sigmoid_in_kernel=True"),
    (lambda x: {"A_log": x["A_log"]}, r"A_log belongs to the gate computed from the raw g: pass use_gate_in_kernel"),
    (lambda x: {"dt_bias": x["dt_bias"]}, r"dt_bias belongs to the gate"),
    (lambda x: {"lower_bound": -5.0}, r"lower_bound belongs to the gate"),
    (lambda x: {"g": x["raw"], "use_gate_in_kernel": True}, r"use_gate_in_kernel=True needs A_log"),
    (lambda x: {"g": x["raw"], "use_gate_in_kernel": True, "A_log": x["A_log"][:2]}, r"A_log must have shape"),
    (lambda x: {"g": x["raw"], "use_gate_in_kernel": True, "A_log": jnp.zeros(HV, jnp.int32)},
     r"A_log must be a floating-point array"),
    (lambda x: {"g": x["raw"], "use_gate_in_kernel": True, "A_log": x["A_log"], "lower_bound": -6.0,
                "safe_gate": True}, r"lower_bound must be a number in \[-5, 0\) with safe_gate=True"),
    (lambda x: {"initial_state": x["h0"], "state_v_first": True},
     r"initial_state must have shape \[batch, num_value_heads, v_head_dim, head_dim\] = \[2, 4, 6, 8\]"),
    (lambda x: {"g": x["g"][..., :3]}, r"g must have shape \[batch, seq_len, num_value_heads, head_dim\]"),
])
def test_bad_values_name_the_argument(changes, message):
    with pytest.raises(ValueError, match=message):
        bad_call(**changes(inputs(13)))


def test_ejkernel_order_gets_a_hint():
    """(query, key, value, beta, decay) passed to the fla-order function: per-channel decay lands in beta (a
    shape error), per-head decay in beta and beta in g (a value error); both name the two orders."""
    x = inputs(14)
    with pytest.raises(ValueError, match=r"g and beta look swapped; kimi_delta_attention takes \(q, k, v, g, beta\)"):
        kimi_delta_attention(x["q"], x["k"], x["v"], x["beta"], x["g"])
    with pytest.raises(ValueError, match=r"g must be <= 0 .*kernel_delta_attention takes \(query, key, value, beta"):
        kimi_delta_attention(x["q"], x["k"], x["v"], x["beta"], x["g"][..., 0])


def test_checked_under_jit():
    x = inputs(15)
    step = checked(jax.jit(lambda g, beta: kimi_delta_attention(x["q"], x["k"], x["v"], g, beta)[0]))
    eager, _ = kimi_delta_attention(x["q"], x["k"], x["v"], x["g"], x["beta"])
    np.testing.assert_allclose(step(x["g"], x["beta"]), eager, rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match=r"g must be <= 0 .* got 0.5 at index \[0, 4, 1, 2\]"):
        step(x["g"].at[0, 4, 1, 2].set(0.5), x["beta"])
    with pytest.raises(ValueError, match=r"beta must be in \[0, 1\], got 2.0"):
        step(x["g"], x["beta"].at[1, 1, 1].set(2.0))
    # Outside `checked` a traced value is not checked (and the program still runs).
    jax.jit(lambda g: kimi_delta_attention(x["q"], x["k"], x["v"], g, x["beta"])[0])(x["g"].at[0, 0, 0, 0].set(0.5))


def test_vmap_over_the_batch():
    """vmap over the batch (each call sees a batch of one) gives the batched call's output and states."""
    x = inputs(16)
    args = (x["q"], x["k"], x["v"], x["g"], x["beta"], x["h0"])
    mapped = jax.vmap(lambda q, k, v, g, beta, h0: kimi_delta_attention(
        q[None], k[None], v[None], g[None], beta[None], initial_state=h0[None], output_final_state=True))(*args)
    batched = kimi_delta_attention(*args[:5], initial_state=x["h0"], output_final_state=True)
    for got, want in zip(mapped, batched):
        np.testing.assert_allclose(got[:, 0], want, rtol=1e-5, atol=1e-5)
