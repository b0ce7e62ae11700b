"""Context parallelism: KDA over a sequence split along time over 4 devices equals KDA over the whole sequence
(and the float64 reference), outputs, final state and gradients."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from hybrax import kernel_delta_attention, recurrent_attention
from hybrax.ops.kda import reference
from hybrax.parallel import kda_context_parallel, recurrent_context_parallel
from tests.helpers import TOLERANCE, assert_close, normal, to64

SHARDS = 4
TIME = P(None, "cp")  # token inputs: the time axis split over the devices
B, H, HV, K, V = 2, 1, 2, 8, 8


@functools.cache
def mesh() -> jax.sharding.Mesh:
    if jax.device_count() < SHARDS:
        pytest.skip("needs 4 devices (tests/conftest.py asks JAX for 4 CPU devices)")
    return jax.make_mesh((SHARDS,), ("cp",))


def inputs(length, dtype=jnp.float32, hard_gates=False):
    q, k = normal(0, (B, length, H, K), dtype), normal(1, (B, length, H, K), dtype)
    v = normal(2, (B, length, HV, V), dtype)
    beta = jax.nn.sigmoid(normal(3, (B, length, HV)))
    g = -jax.nn.softplus(normal(4, (B, length, HV, K)))
    if hard_gates:  # a shard that forgets everything before it: its transition is ~0
        g = g.at[:, length // 2 + 1].set(-1000.0)
    return q, k, v, beta, g, normal(5, (B, HV, K, V), scale=0.5)


def context_parallel(check_vma=True, **options):
    """(q, k, v, beta, g, initial_state) -> (output, final state), the tokens split over the mesh. Pallas kernels
    in interpret mode need check_vma off (tests/test_shard_map.py says why)."""
    def shard(q, k, v, beta, g, initial):
        return kda_context_parallel(q, k, v, beta, g, initial, axis_name="cp", return_state=True, **options)

    mapped = jax.shard_map(shard, mesh=mesh(), in_specs=(TIME,) * 5 + (P(),), out_specs=(TIME, P()),
                           check_vma=check_vma)

    def call(*args):
        specs = (TIME,) * 5 + (P(),)
        return mapped(*(jax.device_put(a, NamedSharding(mesh(), s)) for a, s in zip(args, specs, strict=True)))

    return call


@pytest.mark.parametrize("length,hard_gates,platform", [
    (48, False, "xla"), (40, True, "xla"), (48, False, "pallas"),  # 40: shards of 10 tokens, chunks of 16
])
def test_matches_the_whole_sequence(length, hard_gates, platform):
    args = inputs(length, hard_gates=hard_gates)
    got = jax.jit(context_parallel(platform != "pallas", platform=platform, chunk_size=16))(*args)
    assert_close(got, reference.kda_reference(*(to64(x) for x in args)), 3e-5 if hard_gates else 1e-5)


def test_gradients_match_the_whole_sequence():
    args = inputs(48)

    def loss(call, *args):
        out, final = call(*args)
        return jnp.sum(out * jnp.cos(out)) + jnp.sum(final ** 2)

    whole = functools.partial(kernel_delta_attention, return_state=True, chunk_size=16)
    want = jax.grad(functools.partial(loss, whole), argnums=range(6))(*args)
    got = jax.jit(jax.grad(functools.partial(loss, context_parallel(chunk_size=16)), argnums=range(6)))(*args)
    assert_close(got, want, 1e-5, "gradient")


def test_fused_gate_bf16_and_no_initial_state():
    q, k, v, beta, raw, _ = inputs(48, jnp.bfloat16)
    a_log, dt_bias = normal(6, (HV,), scale=0.5), normal(7, (HV, K))
    options = dict(a_log=a_log, dt_bias=dt_bias, beta_is_logits=True)

    def shard(q, k, v, beta, raw):
        return kda_context_parallel(q, k, v, beta, raw, axis_name="cp", return_state=True, **options)

    mapped = jax.shard_map(shard, mesh=mesh(), in_specs=(TIME,) * 5, out_specs=(TIME, P()))
    got = jax.jit(mapped)(*(jax.device_put(a, NamedSharding(mesh(), TIME)) for a in (q, k, v, beta, raw)))
    want = kernel_delta_attention(q, k, v, beta, raw, return_state=True, **options)
    assert got[0].dtype == jnp.bfloat16
    assert_close(got, jax.tree.map(to64, want), TOLERANCE[jnp.bfloat16])


def test_packed_sequences_are_refused():
    q, k, v, beta, g, _ = inputs(8)
    with pytest.raises(ValueError, match="cu_seqlens"):
        kda_context_parallel(q[:1], k[:1], v[:1], beta[:1], g[:1], axis_name="cp",
                             cu_seqlens=jnp.array([0, 8], jnp.int32))


def recurrent_inputs(length):
    q, k, v = normal(10, (B, length, 2, K)), normal(11, (B, length, 1, K)), normal(12, (B, length, 1, V))
    g = jax.nn.log_sigmoid(normal(13, (B, length, 2)) + 2.0)
    g_gamma = jnp.array([-0.05, -0.2])
    gk = jax.nn.log_sigmoid(normal(14, (B, length, 2, K)) + 2.0)
    gv = jax.nn.log_sigmoid(normal(15, (B, length, 2, V)) + 2.0)
    return q, k, v, g, g_gamma, gk, gv, normal(16, (B, 2, K, V), scale=0.5)


@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize("gates", ["all", "key", "none"])
def test_recurrent_matches_the_whole_sequence(reverse, gates):
    """Gated linear attention (GQA 2:1), every gate form, both directions: outputs, final state, gradients."""
    q, k, v, g, g_gamma, gk, gv, initial = recurrent_inputs(40)
    g, g_gamma, gv = (g, g_gamma, gv) if gates == "all" else (None, None, None)
    gk = None if gates == "none" else gk
    time_or_none = lambda x: None if x is None else TIME  # noqa: E731

    def shard(q, k, v, g, gk, gv, initial):
        return recurrent_context_parallel(q, k, v, g, g_gamma, gk, gv, initial, axis_name="cp", reverse=reverse,
                                          return_state=True)

    specs = (TIME,) * 3 + tuple(map(time_or_none, (g, gk, gv))) + (P(),)
    mapped = jax.shard_map(shard, mesh=mesh(), in_specs=specs, out_specs=(TIME, P()))

    def whole(q, k, v, g, gk, gv, initial):
        return recurrent_attention(q, k, v, g, g_gamma, gk, gv, initial, reverse=reverse, return_state=True)

    args = (q, k, v, g, gk, gv, initial)
    placed = [None if a is None else jax.device_put(a, NamedSharding(mesh(), s)) for a, s in zip(args, specs)]
    assert_close(jax.jit(mapped)(*placed), jax.tree.map(to64, whole(*args)), 1e-5)

    def loss(call, *args):
        out, final = call(*args)
        return jnp.sum(out * jnp.cos(out)) + jnp.sum(final ** 2)

    argnums = tuple(i for i, a in enumerate(args) if a is not None)
    want = jax.grad(functools.partial(loss, whole), argnums=argnums)(*args)
    got = jax.jit(jax.grad(functools.partial(loss, mapped), argnums=argnums))(*placed)
    assert_close(got, want, 1e-5, "gradient")
