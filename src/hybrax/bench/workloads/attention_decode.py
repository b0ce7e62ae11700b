"""One attention decode step per request over a KV cache pool (`attention_decode_pool`), as a server runs it.

Inputs: bf16 (the benchmark's dtype) pools [B + 2, C + 64, KV, D] of keys and values, the requests' rows named by
slots out of order (slot 0 unused); each request has C cached tokens and brings one new token (q [B, 1, H, D],
k and v [B, 1, KV, D]), written at position C every step, so every step reads the same C + 1 keys.

Work: the cached keys and values read once, 2 B C KV D times the element size in bytes per step. Beside every row: the
copy bandwidth (the floor is those bytes at that bandwidth).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from hybrax.bench.shapes import Shape
from hybrax.bench.workloads import decode
from hybrax.bench.workloads.base import Call, Inputs, Work, Workload, check_mode, config_for, to_numpy
from hybrax.serving import AttentionDecodePoolConfig, attention_decode_pool

MODES = ("fwd",)
SPARE_POSITIONS = 64


def make_inputs(shape: Shape, dtype: Any) -> Inputs:
    keys = jax.random.split(jax.random.key(0), 5)
    batch, rows = shape.batch, shape.batch + 2
    pool_shape = (rows, shape.context + SPARE_POSITIONS, shape.kv_heads, shape.head_dim)
    k_pool, v_pool = (jax.random.normal(key, pool_shape, dtype) for key in keys[:2])
    q = jax.random.normal(keys[2], (batch, 1, shape.heads, shape.head_dim), dtype)
    k, v = (jax.random.normal(key, (batch, 1, shape.kv_heads, shape.head_dim), dtype) for key in keys[3:5])
    return {"q": q, "k": k, "v": v, "k_pool": k_pool, "v_pool": v_pool,
            "slots": jnp.arange(batch, dtype=jnp.int32)[::-1] + 1,
            "cached": jnp.full((batch,), shape.context, jnp.int32)}


def steps() -> tuple[int, int]:
    """(steps per call, unroll): a step reads megabytes to gigabytes, so 20 steps keep a call far above its
    dispatch (2 on the CPU)."""
    return (2, 1) if jax.default_backend() == "cpu" else (20, 1)


def ours(impl: str, shape: Shape, inputs: Inputs, mode: str) -> Call:
    check_mode("attention_decode", mode, MODES)
    cfg = config_for(AttentionDecodePoolConfig, impl)

    def step(pools, arrays):
        q, k, v, slots, cached = arrays
        out, k_pool, v_pool = attention_decode_pool(q, k, v, *pools, slots, cached, cfg=cfg)
        return out, (k_pool, v_pool)

    arrays = tuple(inputs[name] for name in ("q", "k", "v", "slots", "cached"))
    fresh = lambda: (inputs["k_pool"].copy(), inputs["v_pool"].copy())  # noqa: E731 - the loop donates its pools
    one_step = jax.jit(step)
    return decode.carried_call(step, fresh(), arrays, steps(),
                               output=lambda: to_numpy(one_step(fresh(), arrays)[0]))


def work(shape: Shape, mode: str, dtype: Any) -> Work:
    element = jnp.dtype(dtype).itemsize
    return Work(bytes=2 * shape.batch * shape.context * shape.kv_heads * shape.head_dim * element)


def extras(shape: Shape, inputs: Inputs, mode: str, measure) -> dict[str, Any]:
    bandwidth = decode.copy_bandwidth(measure)
    return {"copy_gbps": bandwidth / 1e9} if bandwidth else {}


WORKLOAD = Workload(
    op="attention_decode", families=("attn_decode",), impls=("auto",), anchors=(), modes=MODES,
    inputs=make_inputs, ours=ours, work=work, extras=extras,
)
