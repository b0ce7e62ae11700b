"""Context parallelism: KDA over a sequence split along time over 4 devices equals KDA over the whole sequence
(and the float64 reference), outputs, final state and gradients."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from hybrax import MaskInfo, attention, kernel_delta_attention, recurrent_attention
from hybrax.ops.kda import reference
from hybrax.parallel import attention_context_parallel, kda_context_parallel, recurrent_context_parallel
from tests.helpers import TOLERANCE, assert_close, normal, pretend_h200_with_cudnn, to64

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


@pytest.mark.parametrize("platform, bounds", [
    ("xla", (0, 5, 5, 30, 47)), ("pallas", (0, 5, 5, 30, 47)),
    ("xla", (0, 0, 12, 24, 48)),  # boundaries on the shards' (and an empty first sequence)
    ("xla", (0, 48, 48, 48, 48)),  # one sequence over every shard, then empty ones ending at the end
    ("xla", (0, 1, 2, 3, 20)),  # a shard of no sequence's tokens (past the end) after short ones
])
def test_packed_sequences_across_shards(platform, bounds):
    """Shards of 12 tokens. (0, 5, 5, 30, 47): sequence 2 spans shards 0-2, sequence 3 shards 2-3, sequence 1 is
    empty and the last token belongs to none. Outputs, final states (N of them) and gradients as the whole packed
    sequence."""
    q, k, v, beta, g, _ = (x[:1] for x in inputs(48))
    cu_seqlens = jnp.array(bounds, jnp.int32)
    initial = normal(9, (4, HV, K, V), scale=0.5)
    args = (q, k, v, beta, g, initial)

    def shard(q, k, v, beta, g, initial):
        return kda_context_parallel(q, k, v, beta, g, initial, axis_name="cp", return_state=True,
                                    cu_seqlens=cu_seqlens, platform=platform, chunk_size=16)

    mapped = jax.shard_map(shard, mesh=mesh(), in_specs=(TIME,) * 5 + (P(),), out_specs=(TIME, P()),
                           check_vma=platform != "pallas")
    placed = [jax.device_put(a, NamedSharding(mesh(), s)) for a, s in zip(args, (TIME,) * 5 + (P(),))]
    want = reference.kda_reference(*(to64(x) for x in args), cu_seqlens=np.asarray(cu_seqlens))
    assert_close(jax.jit(mapped)(*placed), want, 1e-5)
    if platform == "pallas":
        return  # gradients need check_vma on: XLA only here (the pass's backward is tested on its own)

    def loss(call, *args):
        out, final = call(*args)
        return jnp.sum(out * jnp.cos(out)) + jnp.sum(final ** 2)

    whole = functools.partial(kernel_delta_attention, return_state=True, cu_seqlens=cu_seqlens, chunk_size=16)
    grads = jax.grad(functools.partial(loss, whole), argnums=range(6))(*args)
    assert_close(jax.jit(jax.grad(functools.partial(loss, mapped), argnums=range(6)))(*placed), grads, 1e-5,
                 "gradient")


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


ATTENTION_CASES = {
    "causal_gqa": dict(causal=True),
    "causal_unbalanced": dict(causal=True, balance=False),
    "causal_odd_shard_length": dict(causal=True, length=44),  # halves do not split: the unbalanced branches
    "causal_three_shards": dict(causal=True, shards=3),  # the middle shard trades its second half with itself
    "causal_left_window_across_shards": dict(causal=True, sliding_window=(17, 0)),
    "full": dict(),
    "causal_packed_sinks_soft_cap": dict(causal=True, segments=True, softmax_aux=jnp.full((4, 2), 0.5),
                                         logits_soft_cap=2.0),
}


@pytest.mark.parametrize("case", ATTENTION_CASES)
def test_attention_matches_the_whole_sequence(case):
    """Shards of 12 tokens (of 11 at 44, of 16 on three devices); packed sequences of 7 / 20 / 21 tokens cross the
    shards' boundaries (and the halves the balanced causal split trades)."""
    options = dict(ATTENTION_CASES[case])
    packed, length, shards = options.pop("segments", False), options.pop("length", 48), options.pop("shards", SHARDS)
    devices = mesh() if shards == SHARDS else jax.sharding.Mesh(np.array(jax.devices()[:shards]), ("cp",))
    q, k, v = normal(20, (B, length, 4, 16)), normal(21, (B, length, 2, 16)), normal(22, (B, length, 2, 16))
    ids = jnp.broadcast_to(jnp.repeat(jnp.arange(3), jnp.array([7, 20, length - 27]), total_repeat_length=length),
                           (B, length))

    def shard(q, k, v, ids):
        mask_info = MaskInfo.from_segments(ids) if packed else None
        return attention_context_parallel(q, k, v, axis_name="cp", mask_info=mask_info, **options)

    mapped = jax.shard_map(shard, mesh=devices, in_specs=(TIME,) * 4, out_specs=TIME)
    placed = [jax.device_put(a, NamedSharding(devices, TIME)) for a in (q, k, v, ids)]

    def whole(q, k, v, ids):
        sinks = options.get("softmax_aux")
        rest = {name: value for name, value in options.items() if name not in ("softmax_aux", "balance")}
        return attention(q, k, v, None, None, sinks, mask_info=MaskInfo.from_segments(ids) if packed else None, **rest)

    assert_close(jax.jit(mapped)(*placed), jax.tree.map(to64, whole(q, k, v, ids)), 1e-5)
    loss = lambda call: lambda *a: jnp.sum(jnp.sin(call(*a)))  # noqa: E731
    want = jax.grad(loss(whole), argnums=(0, 1, 2))(q, k, v, ids)
    got = jax.jit(jax.grad(loss(mapped), argnums=(0, 1, 2)))(*placed)
    assert_close(got, want, 1e-5, "gradient")


def test_attention_refuses_what_does_not_split():
    q = normal(0, (1, 8, 2, 16))
    with pytest.raises(ValueError, match="bias"):
        attention_context_parallel(q, q, q, axis_name="cp", causal=True, bias=jnp.zeros((1, 2, 8, 8)))
    with pytest.raises(ValueError, match="sliding_window only with causal"):
        attention_context_parallel(q, q, q, axis_name="cp", sliding_window=(4, 4))


def test_attention_lowers_for_h200(monkeypatch):
    """Causal bf16 for a mesh of 4 H200s: each shard's branch is two ordinary causal calls over their keys' prefix
    (its own first half of queries and its partner's second). Shard 0's first half (as many keys as queries) takes
    cuDNN's fused kernels, forward and backward; the others have more keys than queries, which cuDNN's causal mask
    (top-left) cannot express, and take `auto`'s next choice."""
    pretend_h200_with_cudnn(monkeypatch)  # cuDNN's primitives lower only on a mesh of devices: the CPU's 4 stand in
    mapped = jax.shard_map(lambda *a: attention_context_parallel(*a, axis_name="cp", causal=True),
                           mesh=mesh(), in_specs=(TIME,) * 3, out_specs=TIME)
    args = [jax.ShapeDtypeStruct((1, 4 * 256, heads, 128), jnp.bfloat16, sharding=NamedSharding(mesh(), TIME))
            for heads in (8, 2, 2)]
    loss = lambda *a: jnp.sum(mapped(*a).astype(jnp.float32))  # noqa: E731
    text = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("__cudnn$fmhaSoftmax(") == 1 and text.count("__cudnn$fmhaSoftmaxBackward(") == 1
    for shard in range(SHARDS):  # shard i attends half-shards 2i (own) and 2n - 1 - 2i (its partner's)
        for kv_len in ((2 * shard + 1) * 128, 2 * (SHARDS - shard) * 128):
            assert f"tensor<1x{kv_len}x2x128xbf16>" in text
    assert text.count("collective_permute") >= 2  # queries out, outputs back


@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize("bounds", [(0, 5, 5, 30, 48), (0, 0, 12, 24, 48), (0, 48, 48, 48, 48)])
def test_recurrent_packed_sequences_across_shards(bounds, reverse):
    """GLA with every gate, packed as the KDA test (but to the end: recurrent_attention's sequences cover it), both
    directions (reversed, the state crosses the shards from the last one down)."""
    q, k, v, g, g_gamma, gk, gv, _ = (x[:1] if x.ndim > 1 else x for x in recurrent_inputs(48))
    cu_seqlens = jnp.array(bounds, jnp.int32)
    initial = normal(17, (4, 2, K, V), scale=0.5)
    args = (q, k, v, g, gk, gv, initial)

    def shard(q, k, v, g, gk, gv, initial):
        return recurrent_context_parallel(q, k, v, g, g_gamma, gk, gv, initial, axis_name="cp", reverse=reverse,
                                          return_state=True, cu_seqlens=cu_seqlens)

    specs = (TIME,) * 6 + (P(),)
    mapped = jax.shard_map(shard, mesh=mesh(), in_specs=specs, out_specs=(TIME, P()))
    placed = [jax.device_put(a, NamedSharding(mesh(), s)) for a, s in zip(args, specs)]

    def whole(q, k, v, g, gk, gv, initial):
        return recurrent_attention(q, k, v, g, g_gamma, gk, gv, initial, cu_seqlens, reverse=reverse,
                                   return_state=True)

    assert_close(jax.jit(mapped)(*placed), jax.tree.map(to64, whole(*args)), 1e-5)

    def loss(call, *args):
        out, final = call(*args)
        return jnp.sum(out * jnp.cos(out)) + jnp.sum(final ** 2)

    want = jax.grad(functools.partial(loss, whole), argnums=range(7))(*args)
    got = jax.jit(jax.grad(functools.partial(loss, mapped), argnums=range(7)))(*placed)
    assert_close(got, want, 1e-5, "gradient")
