"""Configs: every op's config rejects what no implementation could take, by field, when it is made; each
implementation's `supports(inv, cfg)` says which knob values it takes, so an explicit config it cannot run is an
error with that reason (never a crash inside the kernel), and `auto` passes it over. Empty heads and head dims are
named errors."""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hybrax import KernelConfig
from hybrax.core import implementations
from hybrax.ops.attention.api import Attention, AttentionConfig, attention
from hybrax.ops.kda.api import KernelDeltaAttention, KernelDeltaAttentionConfig, kernel_delta_attention
from hybrax.ops.recurrent.api import RecurrentAttention, RecurrentAttentionConfig, recurrent_attention
from hybrax.serving.attention_pool import AttentionDecodePool, AttentionDecodePoolConfig, attention_decode_pool
from hybrax.serving.kda_pool import KdaDecodePool, KdaDecodePoolConfig, kda_decode_pool
from tests.helpers import on_h200

B, T, H, D = 1, 12, 2, 16

POSITIVE_KNOBS = [(AttentionConfig, "block_q"), (AttentionConfig, "block_k"), (KdaDecodePoolConfig, "block_v"),
                  (KdaDecodePoolConfig, "num_warps"), (AttentionDecodePoolConfig, "block_k"),
                  (AttentionDecodePoolConfig, "num_splits")]
POWER_OF_TWO_KNOBS = [(KernelDeltaAttentionConfig, "chunk_size"), (RecurrentAttentionConfig, "chunk_size")]
NOT_INTEGERS = ["64", 16.0, True, 1.5, float("nan"), [16], jnp.int32(16)]


@pytest.mark.parametrize("config_type, field", POSITIVE_KNOBS + POWER_OF_TWO_KNOBS)
@pytest.mark.parametrize("value", [0, -16, -1] + NOT_INTEGERS)
def test_knob_values_no_implementation_takes_are_rejected_by_field(config_type, field, value):
    need = "a power of two" if (config_type, field) in POWER_OF_TWO_KNOBS else "a positive integer"
    with pytest.raises(ValueError, match=rf"^{config_type.__name__}\.{field} must be {need} .*got {re.escape(repr(value))}"):
        config_type(**{field: value})


@pytest.mark.parametrize("config_type, field", POWER_OF_TWO_KNOBS)
@pytest.mark.parametrize("value", [3, 7, 24, 96])
def test_chunk_sizes_must_be_powers_of_two(config_type, field, value):
    with pytest.raises(ValueError, match=rf"{field} must be a power of two .*got {value}"):
        config_type(**{field: value})


@pytest.mark.parametrize("config_type, field", POSITIVE_KNOBS + POWER_OF_TWO_KNOBS)
def test_good_values_and_none_are_kept(config_type, field):
    assert getattr(config_type(**{field: 16}), field) == 16
    from_numpy = getattr(config_type(**{field: np.int64(32)}), field)
    assert from_numpy == 32 and type(from_numpy) is int  # hashes as 32 does, and the cache's JSON takes it
    assert getattr(config_type(**{field: None}), field) is None  # the chosen implementation's heuristic value


@pytest.mark.parametrize("config_type", [KernelConfig, AttentionConfig, KernelDeltaAttentionConfig])
@pytest.mark.parametrize("field, value, need", [
    ("platform", "gpu", "one of"), ("platform", None, "one of"), ("backend", "", "an implementation's name"),
    ("backend", 3, "an implementation's name"),
])
def test_platform_and_backend_are_checked(config_type, field, value, need):
    with pytest.raises(ValueError, match=rf"{config_type.__name__}\.{field} must be {need}"):
        config_type(**{field: value})


def test_replace_checks_too():
    with pytest.raises(ValueError, match="chunk_size must be a power of two"):
        dataclasses.replace(KernelDeltaAttentionConfig(), chunk_size=7)


@pytest.mark.parametrize("values, match", [
    ({"platform": "xla", "backend": "chunked", "chunk_size": 7}, "chunk_size must be a power of two"),
    ({"platform": "xla", "backend": "chunked", "block": 16}, "has no field block"),
    ([("platform", "xla")], "needs a dict of its fields, got list"),
    ({"platform": "xla", "backend": "chunked", 3: 1}, "has no field 3"),
])
def test_from_dict_rejects_what_is_not_a_config(values, match):
    with pytest.raises(ValueError, match=match):
        KernelDeltaAttentionConfig.from_dict(values)


def _kda_inputs(length=T, heads=H, dk=D, dv=D, batch=B, value_heads=None):
    value_heads = heads if value_heads is None else value_heads
    q, k = jnp.ones((batch, length, heads, dk)), jnp.ones((batch, length, heads, dk))
    v = jnp.ones((batch, length, value_heads, dv))
    return q, k, v, jnp.full((batch, length, value_heads), 0.5), -jnp.ones((batch, length, value_heads))


def _recurrent_inputs(length=T, heads=H, kv_heads=H, dk=D, dv=D):
    return jnp.ones((B, length, heads, dk)), jnp.ones((B, length, kv_heads, dk)), jnp.ones((B, length, kv_heads, dv))


@pytest.mark.parametrize("call, reason", [
    (lambda: kernel_delta_attention(*_kda_inputs(), cfg=KernelDeltaAttentionConfig("pallas", "chunked", chunk_size=8)),
     r"pallas:chunked cannot run this call: needs chunk_size in \(16, 32, 64, 128\), got 8"),
    (lambda: kernel_delta_attention(*_kda_inputs(), cfg=KernelDeltaAttentionConfig("pallas", "chunked",
                                                                                   chunk_size=256)),
     "needs chunk_size in .*got 256"),
    (lambda: recurrent_attention(*_recurrent_inputs(), cfg=RecurrentAttentionConfig("pallas", "chunked",
                                                                                   chunk_size=8)),
     "pallas:chunked cannot run this call: needs chunk_size in .*got 8"),
    (lambda: attention(*_recurrent_inputs(), cfg=AttentionConfig("pallas", "flash", block_q=24)),
     r"pallas:flash cannot run this call: .*powers of two >= 16, got \{'block_q': 24\}"),
    (lambda: attention(*_recurrent_inputs(), cfg=AttentionConfig("pallas", "flash", block_k=8)),
     r"powers of two >= 16, got \{'block_k': 8\}"),
    (lambda: kernel_delta_attention(*_kda_inputs(), cfg=KernelDeltaAttentionConfig("xla", "single_step")),
     "xla:single_step cannot run this call: needs seq_len == 1"),
])
def test_an_explicit_config_its_implementation_declines_is_an_error_with_the_reason(call, reason):
    with pytest.raises(ValueError, match=reason):
        call()


def _pool_decode_call(block_v, num_warps, platform="pallas"):
    q, k, v, beta, _ = _kda_inputs(length=1, batch=2)
    pool, slots = jnp.zeros((3, H, D, D)), jnp.array([0, 2], jnp.int32)
    cfg = KdaDecodePoolConfig(platform, "fused_recurrent", block_v=block_v, num_warps=num_warps)
    return lambda: kda_decode_pool(q, k, v, -jnp.ones((2, 1, H, 1)), beta, pool, slots, cfg=cfg)


@pytest.mark.parametrize("block_v, num_warps", [(24, 4), (16, 3)])
def test_pool_decode_kernel_declines_odd_launches(block_v, num_warps):
    with pytest.raises(ValueError, match="fused_recurrent cannot run this call: needs block_v and num_warps powers"):
        _pool_decode_call(block_v, num_warps)()


@pytest.mark.parametrize("block_k", [24, 32])  # 32 does not divide max_len 48
def test_attention_pool_kernel_declines_odd_key_blocks(block_k):
    q, k, v = _recurrent_inputs(length=1)
    pools = jnp.zeros((2, 48, H, D)), jnp.zeros((2, 48, H, D))
    cfg = AttentionDecodePoolConfig("pallas", "in_place", block_k=block_k)
    with pytest.raises(ValueError, match=f"in_place cannot run this call: .*block_k a power of two .*got {block_k}"):
        attention_decode_pool(q, k, v, *pools, jnp.array([1], jnp.int32), jnp.array([3], jnp.int32), cfg=cfg)


def _invocations():
    """(kernel, invocation) of one small call per op, on the CPU and as an H200 would see it."""
    q, k, v, beta, g = _kda_inputs()
    pool_q, pool_k, pool_v, pool_beta, _ = _kda_inputs(length=1, batch=2)
    calls = [
        (KernelDeltaAttention(), (q, k, v, beta, g), {}),
        (KernelDeltaAttention(), tuple(x[:, :1] for x in (q, k, v, beta, g)), {}),
        (RecurrentAttention(), _recurrent_inputs(), {}),
        (Attention(), _recurrent_inputs(), {}),
        (KdaDecodePool(), (pool_q, pool_k, pool_v, -jnp.ones((2, 1, H, 1)), pool_beta, jnp.zeros((3, H, D, D)),
                           jnp.array([0, 2], jnp.int32)), {}),
        (AttentionDecodePool(), (*_recurrent_inputs(length=1), jnp.zeros((2, 48, H, D)), jnp.zeros((2, 48, H, D)),
                                 jnp.array([1], jnp.int32), jnp.array([3], jnp.int32)), {}),
    ]
    for kernel, args, options in calls:
        inv = kernel.invocation(kernel.prepare(*args, **options))
        yield kernel, inv
        yield kernel, on_h200(inv)


def test_every_heuristic_and_candidate_config_is_one_its_implementation_takes():
    """What the implementations propose passes the checks that explicit and cached configs go through."""
    checked = 0
    for kernel, inv in _invocations():
        for impl in implementations(kernel.op_id):
            if impl.supports(inv) is not None:
                continue
            for cfg in [impl.heuristic_cfg(inv), *impl.candidate_cfgs(inv)]:
                cfg.validate()
                assert impl.supports(inv, cfg) is None, (impl.name, cfg, impl.supports(inv, cfg))
                assert kernel.resolve(inv, cfg) == cfg
                checked += 1
    assert checked > 20


def test_auto_passes_over_an_implementation_that_declines_the_knobs():
    """On a GPU, `auto` with chunk_size 8 takes XLA's chunked path (Pallas takes 16..128), with 64 the Pallas one."""
    kernel = KernelDeltaAttention()
    inv = on_h200(kernel.invocation(kernel.prepare(*_kda_inputs())))
    assert kernel.resolve(inv, KernelDeltaAttentionConfig(chunk_size=8)) == KernelDeltaAttentionConfig(
        "xla", "chunked", chunk_size=8)
    assert kernel.resolve(inv, KernelDeltaAttentionConfig(chunk_size=64)) == KernelDeltaAttentionConfig(
        "pallas", "chunked", chunk_size=64)


def test_auto_with_knobs_nobody_takes_lists_the_reasons():
    kernel = RecurrentAttention()
    inv = on_h200(kernel.invocation(kernel.prepare(*_recurrent_inputs())))
    cfg = RecurrentAttentionConfig(platform="pallas", chunk_size=8)
    with pytest.raises(ValueError, match="no implementation matches cfg .*pallas:chunked: .*needs chunk_size in"):
        kernel.resolve(inv, cfg)


def test_explicit_config_checks_hold_under_jit():
    """The config is resolved at trace time: the error comes from tracing, not from inside the kernel."""
    cfg = KernelDeltaAttentionConfig("pallas", "chunked", chunk_size=8)
    with pytest.raises(ValueError, match="needs chunk_size in"):
        jax.jit(lambda *a: kernel_delta_attention(*a, cfg=cfg))(*_kda_inputs())


@pytest.mark.parametrize("shapes, match", [
    (dict(dk=0), r"^query must have head_dim of at least 1, got shape \[1, 12, 2, 0\]"),
    (dict(dv=0), r"^value must have v_head_dim of at least 1, got shape \[1, 12, 2, 0\]"),
    (dict(heads=0), "^query must have num_heads of at least 1"),
    (dict(value_heads=0), "^value must have num_value_heads of at least 1"),
    (dict(batch=0), "^query must have batch of at least 1"),
    (dict(heads=0, dk=0), "^query must have num_heads and head_dim of at least 1"),
])
def test_kda_rejects_empty_heads_and_head_dims_by_name(shapes, match):
    with pytest.raises(ValueError, match=match):
        kernel_delta_attention(*_kda_inputs(**shapes))


def test_kda_takes_zero_tokens():
    out = kernel_delta_attention(*_kda_inputs(length=0))
    assert out.shape == (B, 0, H, D)


@pytest.mark.parametrize("shapes, match", [
    (dict(dv=0), "^value must have v_head_dim of at least 1"),
    (dict(heads=0, kv_heads=0), "^query must have num_heads of at least 1"),
    (dict(kv_heads=0), "^key must have num_kv_heads of at least 1"),
    (dict(dk=0), "^query must have head_dim of at least 1"),
])
def test_recurrent_attention_rejects_empty_heads_and_head_dims_by_name(shapes, match):
    with pytest.raises(ValueError, match=match):
        recurrent_attention(*_recurrent_inputs(**shapes))


def _kda_pool_call(heads=H, dk=D, value_heads=H, dv=D):
    q, k = jnp.ones((2, 1, heads, dk)), jnp.ones((2, 1, heads, dk))
    v, beta = jnp.ones((2, 1, value_heads, dv)), jnp.full((2, 1, value_heads), 0.5)
    pool = jnp.zeros((3, value_heads, dk, dv))
    return kda_decode_pool(q, k, v, -jnp.ones((2, 1, value_heads, 1)), beta, pool, jnp.array([0, 2], jnp.int32))


def _attention_pool_call(heads=H, kv_heads=H, dk=D, dv=D):
    q, k, v = jnp.ones((1, 1, heads, dk)), jnp.ones((1, 1, kv_heads, dk)), jnp.ones((1, 1, kv_heads, dv))
    pools = jnp.zeros((2, 16, kv_heads, dk)), jnp.zeros((2, 16, kv_heads, dv))
    return attention_decode_pool(q, k, v, *pools, jnp.array([1], jnp.int32), jnp.array([3], jnp.int32))


@pytest.mark.parametrize("call, match", [
    (lambda: _kda_pool_call(dk=0), "^q must have head_dim of at least 1"),
    (lambda: _kda_pool_call(heads=0, value_heads=0), "^q must have num_heads of at least 1"),
    (lambda: _kda_pool_call(dv=0), "^v must have v_head_dim of at least 1"),
    (lambda: _attention_pool_call(dk=0), "^q must have head_dim of at least 1"),
    (lambda: _attention_pool_call(heads=0, kv_heads=0), "^q must have num_heads of at least 1"),
    (lambda: _attention_pool_call(kv_heads=0), "^k must have num_kv_heads of at least 1"),
    (lambda: _attention_pool_call(dv=0), "^v must have v_head_dim of at least 1"),
])
def test_decode_pools_reject_empty_heads_and_head_dims_by_name(call, match):
    with pytest.raises(ValueError, match=match):
        call()
