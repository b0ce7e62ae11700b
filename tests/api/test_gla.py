"""gated_linear_attention against float64 references written from flash-linear-attention's chunk_gla /
fused_recurrent_gla conventions: g or gk, gv, per-head g, reverse, cu_seqlens, state_v_first, keywords, jit and
grad, and the errors bad values raise."""

from __future__ import annotations

import inspect

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hybrax.core.checks import checked
from hybrax.ops.recurrent.gla import gated_linear_attention
from tests.api import fla_reference as ref
from tests.helpers import TOLERANCE, assert_close, normal, to64

B, T, H, K, V = 2, 11, 2, 8, 6
TOL = TOLERANCE[jnp.float32]


def inputs(seed: int = 0, batch: int = B, length: int = T) -> dict:
    return {
        "q": normal(seed, (batch, length, H, K)), "k": normal(seed + 1, (batch, length, H, K)),
        "v": normal(seed + 2, (batch, length, H, V)),
        "g": jax.nn.log_sigmoid(normal(seed + 3, (batch, length, H, K)) + 2.0),
        "gv": jax.nn.log_sigmoid(normal(seed + 4, (batch, length, H, V)) + 2.0),
        "h0": normal(seed + 5, (batch, H, K, V), scale=0.5),
    }


def reference(x, g=None, gv=None, h0=None, xp=np, **options):
    f64 = to64 if xp is np else (lambda a: a)
    g = None if g is None else f64(g)
    if g is not None and g.ndim == 3:
        g = xp.broadcast_to(g[..., None], (*g.shape, K))
    return ref.gla(f64(x["q"]), f64(x["k"]), f64(x["v"]), g, None if gv is None else f64(gv),
                   initial_state=None if h0 is None else f64(h0), xp=xp, **options)


def check(out, expected):
    assert_close(out[0], expected[0], TOL, "o")
    assert_close(out[1], expected[1], TOL, "final_state")


def test_signature_follows_chunk_gla():
    parameters = inspect.signature(gated_linear_attention).parameters
    assert list(parameters)[:4] == ["q", "k", "v", "g"]
    assert all(p.kind is p.KEYWORD_ONLY for p in list(parameters.values())[4:])
    assert parameters["output_final_state"].default is False and parameters["state_v_first"].default is False


def test_per_channel_gate_with_state_and_scale():
    x = inputs()
    out = gated_linear_attention(x["q"], x["k"], x["v"], x["g"], scale=0.3, initial_state=x["h0"],
                                 output_final_state=True)
    check(out, reference(x, x["g"], h0=x["h0"], scale=0.3))


def test_fused_recurrent_names_gk_and_gv_as_keywords():
    x = inputs(1)
    out = gated_linear_attention(q=x["q"], k=x["k"], v=x["v"], gk=x["g"], gv=x["gv"], initial_state=x["h0"],
                                 output_final_state=True)
    check(out, reference(x, x["g"], x["gv"], h0=x["h0"]))
    o, state = gated_linear_attention(x["q"], x["k"], x["v"], x["g"])
    assert state is None
    assert_close(o, reference(x, x["g"])[0], TOL)


def test_per_head_gate_and_extreme_gates():
    x = inputs(2)
    g = x["g"][..., 0].at[0, 3, 1].set(-1000.0).at[1, 5, 0].set(-jnp.inf)
    out = gated_linear_attention(x["q"], x["k"], x["v"], g, initial_state=x["h0"], output_final_state=True)
    check(out, reference(x, g, h0=x["h0"]))


def test_one_token():
    x = inputs(3, length=1)
    out = gated_linear_attention(x["q"], x["k"], x["v"], x["g"], initial_state=x["h0"], output_final_state=True)
    check(out, reference(x, x["g"], h0=x["h0"]))


@pytest.mark.parametrize("reverse", [False, True])
def test_packed_sequences_with_an_empty_one(reverse):
    x = inputs(4, batch=1, length=18)
    cu_seqlens = jnp.array([0, 5, 5, 12, 18], jnp.int32)
    h0 = normal(20, (4, H, K, V), scale=0.5)
    out = gated_linear_attention(x["q"], x["k"], x["v"], x["g"], gv=x["gv"], initial_state=h0, reverse=reverse,
                                 cu_seqlens=cu_seqlens, output_final_state=True)
    check(out, reference(x, x["g"], x["gv"], h0=h0, cu_seqlens=np.asarray(cu_seqlens), reverse=reverse))


def test_state_v_first():
    x = inputs(5)
    o, state = gated_linear_attention(x["q"], x["k"], x["v"], x["g"], initial_state=jnp.swapaxes(x["h0"], -1, -2),
                                      state_v_first=True, output_final_state=True)
    expected_o, expected_state = reference(x, x["g"], h0=x["h0"])
    assert state.shape == (B, H, V, K)
    check((o, state), (expected_o, np.swapaxes(expected_state, -1, -2)))


def test_jit_and_grad_against_the_reference():
    x = inputs(6)
    names = ["q", "k", "v", "g", "gv", "h0"]
    weights_o, weights_s = normal(30, (B, T, H, V)), normal(31, (B, H, K, V))

    def loss(args):
        q, k, v, g, gv, h0 = args
        o, state = gated_linear_attention(q, k, v, g, gv=gv, initial_state=h0, reverse=True, output_final_state=True)
        return jnp.sum(o * weights_o) + jnp.sum(state * weights_s)

    def reference_loss(args):
        q, k, v, g, gv, h0 = args
        o, state = reference({"q": q, "k": k, "v": v}, g, gv, h0=h0, reverse=True, xp=jnp)
        return jnp.sum(o * to64(weights_o)) + jnp.sum(state * to64(weights_s))

    args = [x[name] for name in names]
    grads = jax.jit(jax.grad(loss))(args)
    with jax.enable_x64(True):
        want = [np.asarray(w) for w in jax.grad(reference_loss)([jnp.asarray(to64(a)) for a in args])]
    for name, got, expected in zip(names, grads, want):
        assert_close(got, expected, TOL, f"d{name}")


@pytest.mark.parametrize("changes, message", [
    (lambda x: {"g": x["g"].at[1, 2, 0, 3].set(0.5)}, r"g must be <= 0 \(a log decay: exp\(g\) in \[0, 1\]\), "
                                                      r"got 0.5 at index \[1, 2, 0, 3\] \(1 of"),
    (lambda x: {"gk": x["g"].at[0, 0, 0, 0].set(jnp.nan)}, r"gk must be <= 0 .* got nan"),
    (lambda x: {"gv": x["gv"].at[0, 1, 1, 1].set(2.0)}, r"gv must be <= 0 .* got 2.0 at index \[0, 1, 1, 1\]"),
    (lambda x: {"g": x["g"], "gk": x["g"]}, r"g and gk are the same gate"),
    (lambda x: {"k": x["k"].at[0, 0, 0, 0].set(-jnp.inf)}, r"k must be finite .* got -inf"),
    (lambda x: {"initial_state": x["h0"].at[1, 1, 1, 1].set(jnp.nan)}, r"initial_state must be finite"),
    (lambda x: {"initial_state": x["h0"], "state_v_first": True},
     r"initial_state must have shape \[batch, num_heads, v_head_dim, head_dim\] = \[2, 2, 6, 8\]"),
    (lambda x: {"scale": float("nan")}, r"scale must be a finite number"),
])
def test_bad_values_name_the_argument(changes, message):
    x = inputs(7)
    args = {"q": x["q"], "k": x["k"], "v": x["v"], **changes(x)}
    with pytest.raises(ValueError, match=message):
        gated_linear_attention(**args)


def test_checked_under_jit():
    x = inputs(8)
    step = checked(jax.jit(lambda g: gated_linear_attention(x["q"], x["k"], x["v"], g)[0]))
    step(x["g"])
    with pytest.raises(ValueError, match=r"g must be <= 0 .* got 0.25 at index \[1, 4, 1, 0\]"):
        step(x["g"].at[1, 4, 1, 0].set(0.25))


def test_vmap_over_the_batch():
    x = inputs(9)
    args = (x["q"], x["k"], x["v"], x["g"], x["h0"])
    mapped = jax.vmap(lambda q, k, v, g, h0: gated_linear_attention(
        q[None], k[None], v[None], g[None], initial_state=h0[None], output_final_state=True))(*args)
    batched = gated_linear_attention(*args[:4], initial_state=x["h0"], output_final_state=True)
    for got, want in zip(mapped, batched):
        np.testing.assert_allclose(got[:, 0], want, rtol=1e-5, atol=1e-5)
