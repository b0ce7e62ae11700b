"""XLA KDA (chunked, scan, single step) against the float64 reference: outputs, states, gradients (more in
test_gradients.py)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hybrax.ops.kda import reference
from hybrax.ops.kda.api import KernelDeltaAttentionConfig, kernel_delta_attention
from hybrax.ops.kda.common.layout import from_packed_rows, packed_layout, to_packed_rows
from tests.helpers import TOLERANCE, assert_close, normal, to64
from tests.ops.kda.oracle import as64, kda64

B, T, H, HV, K, V = 2, 45, 2, 4, 8, 6
CHUNKED = {c: KernelDeltaAttentionConfig("xla", "chunked", chunk_size=c) for c in (16, 32, 64)}
SCAN = KernelDeltaAttentionConfig("xla", "scan")


def inputs(length=T, batch=B, decay="channel", dtype=jnp.float32):
    q, k = normal(0, (batch, length, H, K), dtype), normal(1, (batch, length, H, K), dtype)
    v = normal(2, (batch, length, HV, V), dtype)
    beta = jax.nn.sigmoid(normal(3, (batch, length, HV)))
    shape = (batch, length, HV, K) if decay != "head" else (batch, length, HV)
    g = -jax.nn.softplus(normal(4, shape))
    if decay == "hard":  # some tokens forget everything: -1000 must underflow, never overflow
        g = jnp.where(jax.random.bernoulli(jax.random.key(9), 0.1, shape), -1000.0, g)
    if decay == "strong":
        g = 5.0 * g
    return q, k, v, beta, g, normal(5, (batch, HV, K, V), jnp.float32, 0.5)


@pytest.mark.parametrize("decay", ["channel", "head", "hard", "strong"])
@pytest.mark.parametrize("cfg", [*CHUNKED.values(), SCAN], ids=lambda c: f"{c.backend}{c.chunk_size}")
def test_matches_reference(decay, cfg):
    args = inputs(decay=decay)
    out = kernel_delta_attention(*args, return_state=True, cfg=cfg)
    assert_close(out, reference.kda_reference(*(to64(x) for x in args)), TOLERANCE[jnp.float32])


def _softplus_gate(length):
    """The fused softplus gate (no lower_bound): decay holds the raw gate input, beta logits."""
    q, k, v, _, _, h0 = inputs(length)
    raw, beta = normal(4, (B, length, HV, K)), normal(3, (B, length, HV))
    gate = {"a_log": normal(8, (HV,), scale=0.5), "dt_bias": normal(9, (HV * K,)), "beta_is_logits": True}
    return (q, k, v, beta, raw, h0), gate


def _unnormalized(length):
    """q and k as they come (|k|^2 ~ 1, so the delta rule stays contractive), a scale of our own."""
    q, k, v, beta, g, h0 = inputs(length)
    return (q * K**-0.5, k * K**-0.5, v, beta, g, h0), {"use_qk_l2norm": False, "softmax_scale": 0.7}


CASES = {
    "softplus_gate": lambda: _softplus_gate(T),
    "no_l2norm_scale": lambda: _unnormalized(T),
    "one_token": lambda: (inputs(length=1), {}),
}


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("cfg", [CHUNKED[16], SCAN], ids=["chunked", "scan"])
def test_options_match_reference(case, cfg):
    args, options = CASES[case]()
    out = kernel_delta_attention(*args, return_state=True, cfg=cfg, **options)
    arrays_as64 = {n: to64(x) if isinstance(x, jax.Array) else x for n, x in options.items()}
    want = reference.kda_reference(*(to64(x) for x in args), **arrays_as64)
    assert_close(out, want, TOLERANCE[jnp.float32])


def test_chunk_128_over_two_chunks():
    args = inputs(length=150, batch=1)
    cfg = KernelDeltaAttentionConfig("xla", "chunked", chunk_size=128)
    out = kernel_delta_attention(*args, return_state=True, cfg=cfg)
    assert_close(out, reference.kda_reference(*(to64(x) for x in args)), TOLERANCE[jnp.float32])


@pytest.mark.parametrize("cfg", [None, SCAN], ids=["auto", "scan"])
def test_bf16(cfg):
    args = inputs(dtype=jnp.bfloat16)
    o, s = kernel_delta_attention(*args, return_state=True, cfg=cfg)
    assert o.dtype == jnp.bfloat16 and s.dtype == jnp.float32
    assert_close((o, s), reference.kda_reference(*(to64(x) for x in args)), TOLERANCE[jnp.bfloat16])


@pytest.mark.parametrize("cfg", [CHUNKED[16], SCAN], ids=["chunked", "scan"])
def test_varlen_with_empty_sequences(cfg):
    cu = jnp.array([0, 3, 3, 30, 45], jnp.int32)
    q, k, v, beta, g, _ = inputs(batch=1)
    h0 = normal(6, (4, HV, K, V))
    out = kernel_delta_attention(q, k, v, beta, g, h0, cu_seqlens=cu, return_state=True, cfg=cfg)
    assert_close(out, reference.kda_reference(*(to64(x) for x in (q, k, v, beta, g, h0)), cu_seqlens=cu), 1e-5)


def test_single_step_and_state_passthrough():
    q, k, v, beta, g, h0 = inputs()
    whole = kernel_delta_attention(q, k, v, beta, g, h0, return_state=True)
    o1, s1 = kernel_delta_attention(q[:, :20], k[:, :20], v[:, :20], beta[:, :20], g[:, :20], h0, return_state=True)
    o2, s2 = kernel_delta_attention(q[:, 20:], k[:, 20:], v[:, 20:], beta[:, 20:], g[:, 20:], s1, return_state=True)
    assert_close((jnp.concatenate([o1, o2], 1), s2), jax.tree.map(to64, whole), 1e-5)
    step = kernel_delta_attention(q[:, :1], k[:, :1], v[:, :1], beta[:, :1], g[:, :1], h0, return_state=True)
    assert_close(step, reference.kda_reference(*(to64(x[:, :1]) for x in (q, k, v, beta, g)), to64(h0)), 1e-5)


@pytest.mark.parametrize("lower_bound", [None, -3.0])
@pytest.mark.parametrize("cu", [None, (0, 5, 5, 37)])
def test_fused_gate_gradients_match_float64_oracle(lower_bound, cu):
    """Chunked gradients through both fused gates (beta logits, HV = 2 H, packed with an empty sequence) against
    float64 autodiff of the oracle (test_gradients.kda64); test_gradients.py runs every implementation."""
    q, k, v, _, _, _ = inputs(length=37, batch=1)
    beta, raw = normal(3, (1, 37, HV)), normal(4, (1, 37, HV, K))
    a_log, dt_bias = normal(8, (HV,), scale=0.5), normal(9, (HV, K))
    h0 = normal(6, (1 if cu is None else 3, HV, K, V))
    w, ws = normal(11, (1, 37, HV, V)), normal(12, h0.shape)

    def f(*a):
        o, s = kernel_delta_attention(
            *a[:5], a[7], return_state=True, cfg=CHUNKED[16], a_log=a[5], dt_bias=a[6], lower_bound=lower_bound,
            beta_is_logits=True, cu_seqlens=None if cu is None else jnp.array(cu, jnp.int32),
        )
        return jnp.sum(o * w) + jnp.sum(s * ws)

    args = (q, k, v, beta, raw, a_log, dt_bias, h0)
    got = jax.jit(jax.grad(f, argnums=tuple(range(8))))(*args)
    with jax.enable_x64(True):
        w64, ws64 = as64((w, ws))

        def f64(*a):
            o, s = kda64(*a[:5], a[7], a[5], a[6], cu_seqlens=cu, lower_bound=lower_bound, beta_is_logits=True)
            return jnp.sum(o * w64) + jnp.sum(s * ws64)

        want = jax.tree.map(np.asarray, jax.jit(jax.grad(f64, argnums=tuple(range(8))))(*as64(args)))
    assert_close(got, want, TOLERANCE[jnp.float32], "gradients")


def test_bad_inputs():
    q, k, v, beta, g, h0 = inputs()
    with pytest.raises(ValueError, match="beta"):
        kernel_delta_attention(q, k, v, beta[:, :, :1], g)
    with pytest.raises(ValueError, match="decay"):
        kernel_delta_attention(q, k, v, beta, g[..., :3])
    with pytest.raises(ValueError, match="initial_state"):
        kernel_delta_attention(q, k, v, beta, g, h0[:1])
    with pytest.raises(ValueError, match="chunk_size"):
        kernel_delta_attention(q, k, v, beta, g, chunk_size=48)
    with pytest.raises(ValueError, match="cu_seqlens"):
        kernel_delta_attention(q, k, v, beta, g, cu_seqlens=jnp.array([0, 45], jnp.int32))


def test_packed_rows_round_trip_and_gradients():
    # The packed layout's gathers (custom VJPs: each direction's gradient is the other gather) against
    # the plain gather's own autodiff, with an empty sequence, a one-token one and tokens after the last.
    cu_seqlens = jnp.array([0, 5, 5, 6, 20], jnp.int32)
    length, chunk = 23, 4
    layout = packed_layout(cu_seqlens, length, chunk)
    x = normal(0, (1, length, 3))
    padded = to_packed_rows(x, layout)
    assert padded.shape == (1, layout.num_chunks * chunk, 3)
    # Each sequence from a chunk boundary: tokens 0-4 -> rows 0-4, 5 -> 8, 6-19 -> 12-25, zeros between.
    rows = [*range(5), 8, *range(12, 26)]
    assert jnp.array_equal(padded[0, jnp.array(rows)], x[0, :20])
    assert float(jnp.abs(padded).sum()) == pytest.approx(float(jnp.abs(x[0, :20]).sum()), rel=1e-6)
    back = from_packed_rows(padded, layout)
    assert jnp.array_equal(back[0, :20], x[0, :20]) and not jnp.any(back[0, 20:])

    def plain(index):
        return lambda y: jnp.take(y, index, axis=1, mode="fill", fill_value=0)

    cotangent = normal(1, padded.shape)
    expected = jax.vjp(plain(layout.source), x)[1](cotangent)[0]
    assert jnp.array_equal(jax.vjp(lambda y: to_packed_rows(y, layout), x)[1](cotangent)[0], expected)
    cotangent = normal(2, x.shape)
    expected = jax.vjp(plain(layout.destination), padded)[1](cotangent)[0]
    assert jnp.array_equal(jax.vjp(lambda y: from_packed_rows(y, layout), padded)[1](cotangent)[0], expected)


def test_one_token_bf16_and_vmap():
    """The T = 1 path (pallas:decode's: test_pallas_decode.py): bf16 inputs against the float64 reference, and
    vmapped over a leading axis."""
    cfg = KernelDeltaAttentionConfig("xla", "single_step")
    args = inputs(length=1, dtype=jnp.bfloat16)
    o, s = kernel_delta_attention(*args, return_state=True, cfg=cfg)
    assert o.dtype == jnp.bfloat16 and s.dtype == jnp.float32
    assert_close((o, s), reference.kda_reference(*(to64(x) for x in args)), TOLERANCE[jnp.bfloat16])
    stacked = [jnp.stack([x, x * 0.5]) for x in inputs(length=1)]
    batched = jax.vmap(lambda *a: kernel_delta_attention(*a, return_state=True, cfg=cfg))(*stacked)
    for i in range(2):
        want = reference.kda_reference(*(to64(x[i]) for x in stacked))
        assert_close(jax.tree.map(lambda x: x[i], batched), want, TOLERANCE[jnp.float32], f"example {i}")
