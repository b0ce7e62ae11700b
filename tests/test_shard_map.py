"""Every implementation inside `jax.shard_map`: data parallel over the batch and tensor parallel over the heads,
forward and gradients, against the same implementation unsharded.

XLA implementations run with check_vma on, as JAX defaults (scans whose carries start as constants must mark them
varying over the mesh, or JAX refuses the loop). Pallas kernels run here in interpret mode, which JAX cannot
evaluate under check_vma (its interpreter slices the kernel's varying blocks with invariant indices), so they run
with it off; `test_pallas_lowers_for_h200_under_shard_map` lowers the compiled kernels with it on."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from hybrax import attention, kernel_delta_attention, recurrent_attention
from hybrax.ops.attention.api import AttentionConfig
from hybrax.ops.kda.api import KernelDeltaAttentionConfig
from hybrax.ops.recurrent.api import RecurrentAttentionConfig
from hybrax.parallel import kda_context_parallel
from hybrax.serving import (
    AttentionDecodePoolConfig, attention_decode_pool, kda_decode_pool, kda_prefill_pool,
)
from tests.helpers import assert_close, normal

BATCH_HEADS = P("data", None, "model")  # [B, T, H, ...]
STATE = P("data", "model")  # [B, H, K, V]
POOL = P(None, "model")  # [slots, H, K, V]: every data shard serves its requests from the whole pool
TIME_HEADS = P(None, "data", "model")  # context parallel: the time axis over "data"


@functools.cache
def mesh() -> jax.sharding.Mesh:
    if jax.device_count() < 4:
        pytest.skip("needs 4 devices (tests/conftest.py asks JAX for 4 CPU devices)")
    return jax.make_mesh((2, 2), ("data", "model"))


def split(name: str) -> tuple[str, str]:
    """"pallas:flash" -> ("pallas", "flash"); a bare backend name is XLA's."""
    return tuple(name.split(":")) if ":" in name else ("xla", name)


def sharded(fn, in_specs, out_specs, check_vma=True):
    """fn under shard_map, its array inputs placed by in_specs first."""
    mapped = jax.shard_map(fn, mesh=mesh(), in_specs=in_specs, out_specs=out_specs, check_vma=check_vma)

    def call(*args):
        return mapped(*(jax.device_put(a, NamedSharding(mesh(), s)) for a, s in zip(args, in_specs, strict=True)))

    return call


def square_sum(fn):
    """A loss of fn's outputs: the sum of their squares."""
    return lambda *args: sum(jnp.sum(jnp.square(x.astype(jnp.float32))) for x in jax.tree.leaves(fn(*args)))


def check_sharded(fn, args, in_specs, out_specs, platform, grad_of=None, tol=1e-5):
    """Sharded == unsharded, and so are the gradients of sum(out ** 2) w.r.t. the arguments in grad_of."""
    sharded_fn = sharded(fn, in_specs, out_specs, check_vma=platform != "pallas")
    want, got = jax.jit(fn)(*args), jax.jit(sharded_fn)(*args)
    assert_close(got, want, tol)
    if grad_of:
        grads = [jax.jit(jax.grad(square_sum(call), argnums=grad_of))(*args) for call in (fn, sharded_fn)]
        assert_close(grads[1], grads[0], tol, "gradient")


@pytest.mark.parametrize("backend", ["direct", "blockwise", "pallas:flash"])
def test_attention(backend):
    platform, backend = split(backend)
    cfg = AttentionConfig(platform=platform, backend=backend)
    q, k, v = normal(0, (2, 24, 4, 16)), normal(1, (2, 24, 2, 16)), normal(2, (2, 24, 2, 16))
    fn = functools.partial(attention, causal=True, cfg=cfg)
    check_sharded(fn, (q, k, v), (BATCH_HEADS,) * 3, BATCH_HEADS, platform, grad_of=(0, 1, 2))


@pytest.mark.parametrize("backend", ["chunked", "scan", "pallas:chunked"])
def test_recurrent_attention(backend):
    platform, backend = split(backend)
    cfg = RecurrentAttentionConfig(platform=platform, backend=backend, chunk_size=16)
    q, k, v = normal(0, (2, 20, 4, 16)), normal(1, (2, 20, 4, 16)), normal(2, (2, 20, 4, 16))
    gk = -jax.nn.softplus(normal(3, (2, 20, 4, 16)))

    def fn(q, k, v, gk):
        return recurrent_attention(q, k, v, None, None, gk, return_state=True, cfg=cfg)

    check_sharded(fn, (q, k, v, gk), (BATCH_HEADS,) * 4, (BATCH_HEADS, STATE), platform, grad_of=(0, 1, 2, 3))


@pytest.mark.parametrize("backend,length", [
    ("chunked", 20), ("scan", 20), ("pallas:chunked", 20), ("single_step", 1), ("pallas:decode", 1),
])
def test_kernel_delta_attention(backend, length):
    platform, backend = split(backend)
    cfg = KernelDeltaAttentionConfig(platform=platform, backend=backend, chunk_size=16)
    q, k, v = (normal(seed, (2, length, 4, 16)) for seed in range(3))
    beta, g = jax.nn.sigmoid(normal(3, (2, length, 4))), -jax.nn.softplus(normal(4, (2, length, 4, 16)))

    def fn(q, k, v, beta, g):
        return kernel_delta_attention(q, k, v, beta, g, return_state=True, cfg=cfg)

    grad_of = (0, 1, 2, 3, 4) if length > 1 else None  # the decode step has no gradient
    check_sharded(fn, (q, k, v, beta, g), (BATCH_HEADS,) * 5, (BATCH_HEADS, STATE), platform, grad_of=grad_of)


HEAD_PARAMETER = P("model")  # [H]: a parameter per head, replicated over the data axis
HEAD_ROWS = P("model", None)  # [H, ...]


@pytest.mark.parametrize("backend", ["chunked", "scan", "pallas:chunked"])
def test_recurrent_attention_replicated_decay_parameters(backend):
    """g_gamma [H] beside the key-axis gate: a parameter replicated over the data axis, whose gradient is the sum of
    the data shards' (the custom backward's cotangent varies over that axis, the parameter does not)."""
    platform, backend = split(backend)
    cfg = RecurrentAttentionConfig(platform=platform, backend=backend, chunk_size=16)
    q, k, v = normal(0, (2, 20, 4, 16)), normal(1, (2, 20, 4, 16)), normal(2, (2, 20, 4, 16))
    g_gamma, gk = -jax.nn.softplus(normal(3, (4,))), -jax.nn.softplus(normal(4, (2, 20, 4, 16)))

    def fn(q, k, v, g_gamma, gk):
        return recurrent_attention(q, k, v, None, g_gamma, gk, return_state=True, cfg=cfg)

    specs = (BATCH_HEADS,) * 3 + (HEAD_PARAMETER, BATCH_HEADS)
    check_sharded(fn, (q, k, v, g_gamma, gk), specs, (BATCH_HEADS, STATE), platform, grad_of=(0, 3, 4))


@pytest.mark.parametrize("backend", ["chunked", "scan", "pallas:chunked"])
def test_kernel_delta_attention_replicated_gate_parameters(backend):
    """The fused gate's a_log [HV] and dt_bias [HV, K], replicated over the data axis."""
    platform, backend = split(backend)
    cfg = KernelDeltaAttentionConfig(platform=platform, backend=backend, chunk_size=16)
    q, k, v = (normal(seed, (2, 20, 4, 16)) for seed in range(3))
    beta, raw_gate = normal(3, (2, 20, 4)), normal(4, (2, 20, 4, 16))
    a_log, dt_bias = normal(5, (4,), scale=0.5), normal(6, (4, 16))

    def fn(q, k, v, beta, raw_gate, a_log, dt_bias):
        return kernel_delta_attention(q, k, v, beta, raw_gate, return_state=True, a_log=a_log, dt_bias=dt_bias,
                                      beta_is_logits=True, cfg=cfg)

    specs = (BATCH_HEADS,) * 5 + (HEAD_PARAMETER, HEAD_ROWS)
    check_sharded(fn, (q, k, v, beta, raw_gate, a_log, dt_bias), specs, (BATCH_HEADS, STATE), platform,
                  grad_of=(0, 4, 5, 6))


@pytest.mark.parametrize("backend", ["direct", "blockwise", "pallas:flash"])
def test_attention_replicated_sinks_and_bias(backend):
    """Sinks [H, S] and a bias shared by the batch [1, H, Q, K], replicated over the data axis."""
    platform, backend = split(backend)
    cfg = AttentionConfig(platform=platform, backend=backend)
    q, k, v = normal(0, (2, 24, 4, 16)), normal(1, (2, 24, 2, 16)), normal(2, (2, 24, 2, 16))
    bias, sinks = normal(3, (1, 4, 24, 24)), normal(4, (4, 2))

    def fn(q, k, v, bias, sinks):
        return attention(q, k, v, bias, None, sinks, causal=True, cfg=cfg)

    specs = (BATCH_HEADS,) * 3 + (P(None, "model"), HEAD_ROWS)
    check_sharded(fn, (q, k, v, bias, sinks), specs, BATCH_HEADS, platform, grad_of=(0, 3, 4))


def check_pool_step(step, args, platform):
    """step(q, k, v, g, beta, pool, slots) -> (out, pool) with requests over the data axis and heads (the pool's
    too) over the model axis. Each data shard writes its own requests' rows, so its pool comes back alone: the
    shards' pools stacked, each request's row is compared in its shard's pool, and every other row unchanged."""
    pool, slots = args[5], np.asarray(args[6])
    specs = (BATCH_HEADS,) * 5 + (POOL, P("data"))
    call = sharded(step, specs, (BATCH_HEADS, P("data", "model")), check_vma=platform == "xla")
    out, pools = jax.jit(call)(*args)
    want_out, want_pool = step(*args)
    assert_close(out, want_out, 1e-5)
    pools = np.asarray(pools).reshape(2, *pool.shape)
    for shard, requests in enumerate(np.split(slots, 2)):
        for row in range(pool.shape[0]):
            want = want_pool[row] if row in requests else pool[row]
            assert_close(pools[shard, row], want, 1e-5, f"pool row {row} of data shard {shard}")


@pytest.mark.parametrize("platform", ["xla", "pallas"])
def test_kda_pools(platform):
    """A decode step, then a prefill, by slot."""
    pool, slots = normal(5, (6, 4, 16, 16)), jnp.array([4, 1], jnp.int32)
    for length in (1, 20):
        q, k, v = (normal(seed, (2, length, 4, 16)) for seed in range(3))
        beta, g = jax.nn.sigmoid(normal(3, (2, length, 4))), -jax.nn.softplus(normal(4, (2, length, 4, 16)))
        step = kda_decode_pool if length == 1 else kda_prefill_pool
        check_pool_step(functools.partial(step, platform=platform), (q, k, v, g, beta, pool, slots), platform)


@pytest.mark.parametrize("backend", ["xla:gather", "pallas:in_place"])
def test_attention_decode_pool(backend):
    platform, backend = backend.split(":")
    cfg = AttentionDecodePoolConfig(platform=platform, backend=backend)
    q, k, v = normal(0, (2, 1, 4, 16)), normal(1, (2, 1, 2, 16)), normal(2, (2, 1, 2, 16))
    k_pool, v_pool = normal(3, (3, 32, 2, 16)), normal(4, (3, 32, 2, 16))
    slots, lengths = jnp.array([2, 0], jnp.int32), jnp.array([7, 20], jnp.int32)

    def step(q, k, v, k_pool, v_pool, slots, lengths):
        return attention_decode_pool(q, k, v, k_pool, v_pool, slots, lengths, cfg=cfg)[0]

    specs = (BATCH_HEADS,) * 3 + (P(None, None, "model"),) * 2 + (P("data"),) * 2
    check_sharded(step, (q, k, v, k_pool, v_pool, slots, lengths), specs, BATCH_HEADS, platform)


PALLAS_MODULES = ["hybrax.ops.attention.pallas_flash", "hybrax.ops.kda.pallas_gpu.chunk",
                  "hybrax.ops.kda.decode.pallas_gpu", "hybrax.serving.attention_pool", "hybrax.serving.kda_pool"]


def lowering_cases():
    """(name, fn, argument shapes and dtypes, in_specs, out_specs, differentiable) of every Pallas path."""
    bf16, f32 = jnp.bfloat16, jnp.float32
    tokens = ((2, 128, 4, 64), bf16)
    gate, beta = ((2, 128, 4, 64), f32), ((2, 128, 4), f32)
    step, step_gate, step_beta = ((2, 1, 4, 64), bf16), ((2, 1, 4, 64), f32), ((2, 1, 4), f32)
    pool, slots = ((6, 4, 64, 64), f32), ((2,), jnp.int32)
    kv_pool, lengths = ((3, 256, 4, 64), bf16), ((2,), jnp.int32)
    kda_cfg = KernelDeltaAttentionConfig(platform="pallas", backend="chunked")
    return [
        ("attention flash", functools.partial(attention, causal=True, platform="pallas"),
         [tokens] * 3, (BATCH_HEADS,) * 3, BATCH_HEADS, True),
        ("kda chunked", lambda *a: kernel_delta_attention(*a, return_state=True, cfg=kda_cfg),
         [tokens] * 3 + [beta, gate], (BATCH_HEADS,) * 5, (BATCH_HEADS, STATE), True),
        ("recurrent chunked", lambda q, k, v, gk: recurrent_attention(q, k, v, None, None, gk, platform="pallas"),
         [tokens] * 3 + [gate], (BATCH_HEADS,) * 4, BATCH_HEADS, True),
        ("kda context parallel", lambda *a: kda_context_parallel(*a, axis_name="data", return_state=True,
                                                                  platform="pallas"),
         [tokens] * 3 + [beta, gate], (TIME_HEADS,) * 5, (TIME_HEADS, P(None, "model")), True),
        ("kda decode", lambda *a: kernel_delta_attention(*a, return_state=True, platform="pallas"),
         [step] * 3 + [step_beta, step_gate], (BATCH_HEADS,) * 5, (BATCH_HEADS, STATE), False),
        ("kda decode pool", functools.partial(kda_decode_pool, platform="pallas"),
         [step] * 3 + [step_gate, step_beta, pool, slots], (BATCH_HEADS,) * 5 + (POOL, P("data")),
         (BATCH_HEADS, P("data", "model")), False),
        ("recurrent chunked, replicated g_gamma",
         lambda q, k, v, g_gamma, gk: recurrent_attention(q, k, v, None, g_gamma, gk, platform="pallas"),
         [tokens] * 3 + [((4,), f32), gate], (BATCH_HEADS,) * 3 + (HEAD_PARAMETER, BATCH_HEADS), BATCH_HEADS, True),
        ("kda chunked, replicated a_log and dt_bias",
         lambda *a: kernel_delta_attention(*a[:5], a_log=a[5], dt_bias=a[6], return_state=True, cfg=kda_cfg),
         [tokens] * 3 + [beta, gate, ((4,), f32), ((4, 64), f32)], (BATCH_HEADS,) * 5 + (HEAD_PARAMETER, HEAD_ROWS),
         (BATCH_HEADS, STATE), True),
        ("attention flash, replicated sinks",
         lambda q, k, v, sinks: attention(q, k, v, None, None, sinks, causal=True, platform="pallas"),
         [tokens] * 3 + [((4, 2), f32)], (BATCH_HEADS,) * 3 + (HEAD_ROWS,), BATCH_HEADS, True),
        ("attention decode pool", lambda *a: attention_decode_pool(*a, platform="pallas")[0],
         [step] * 3 + [kv_pool] * 2 + [lengths] * 2,
         (BATCH_HEADS,) * 3 + (P(None, None, "model"),) * 2 + (P("data"),) * 2, BATCH_HEADS, False),
    ]


@pytest.mark.parametrize("case", lowering_cases(), ids=lambda case: case[0])
def test_pallas_lowers_for_h200_under_shard_map(case, monkeypatch):
    """The compiled kernels (not interpret mode) inside shard_map with check_vma on, lowered for a 2 x 2 mesh of
    H200s: Pallas needs each output's varying mesh axes (`pallas_shared.pallas_call`)."""
    import importlib

    _, fn, shapes, in_specs, out_specs, differentiable = case
    for module in PALLAS_MODULES:
        monkeypatch.setattr(importlib.import_module(module), "interpret_here", lambda: False)
    h200 = jax.sharding.AbstractDevice(device_kind="NVIDIA H200", num_cores=132, platform="cuda")
    abstract_mesh = jax.sharding.AbstractMesh((2, 2), ("data", "model"), abstract_device=h200)
    mapped = jax.shard_map(fn, mesh=abstract_mesh, in_specs=in_specs, out_specs=out_specs)
    args = [jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(abstract_mesh, spec))
            for (shape, dtype), spec in zip(shapes, in_specs, strict=True)]
    traced = jax.grad(square_sum(mapped), argnums=tuple(range(len(args)))) if differentiable else mapped
    with jax.sharding.use_abstract_mesh(abstract_mesh):
        text = jax.jit(traced).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("__gpu$xla.gpu.triton") >= (2 if differentiable else 1)
