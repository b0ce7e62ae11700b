"""Attention decode over a KV cache pool on a GPU: `attention_decode_pool`'s XLA implementation (gather the rows,
then masked attention) against its Pallas in-place kernel (flash decoding by slot), and the floor of reading the
cached keys and values once.

    XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH=src python3 benchmarks/attention_pool_gpu.py [--smoke]

A Kimi-style attention layer: 32 query heads on 8 kv heads of 128, bf16 cache [slots, max_len, 8, 128]. Each
case decodes one token for B requests whose rows hold `context` cached tokens, `STEPS` steps inside one jitted
lax.fori_loop with the pools carried (as a server's step would donate them), timed from the host around the loop
and divided by the steps. Correctness first: the in-place kernel against the XLA implementation on the same step.
The floor moves B * context * KV * D * 2 (keys and values) * 2 bytes at the copy bandwidth. `--smoke` runs tiny
shapes on the CPU in interpret mode (the script's own check).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from timing import copy_bandwidth, print_table  # noqa: E402

from hybrax.core import relative_error  # noqa: E402
from hybrax.serving import AttentionDecodePoolConfig, attention_decode_pool  # noqa: E402

HEADS = (32, 8, 128)  # query heads, kv heads, head dim
SMOKE_HEADS = (4, 2, 16)
CASES = [(1, 4096), (8, 4096), (64, 4096), (8, 32768), (64, 32768)]  # (requests, cached context)
IMPLEMENTATIONS = {"xla:gather": AttentionDecodePoolConfig("xla", "gather"),
                   "pallas:in_place": AttentionDecodePoolConfig("pallas", "in_place")}


def make_step(batch: int, context: int, max_len: int, heads: tuple[int, int, int], seed: int = 0):
    query_heads, kv_heads, dim = heads
    keys = jax.random.split(jax.random.key(seed), 5)
    slots_total = batch + 2
    k_pool, v_pool = (jax.random.normal(key, (slots_total, max_len, kv_heads, dim), jnp.bfloat16) for key in keys[:2])
    q = jax.random.normal(keys[2], (batch, 1, query_heads, dim), jnp.bfloat16)
    k, v = (jax.random.normal(key, (batch, 1, kv_heads, dim), jnp.bfloat16) for key in keys[3:5])
    slots = jnp.arange(batch, dtype=jnp.int32)[::-1] + 1  # rows out of order, slot 0 unused
    cached = jnp.full((batch,), context, jnp.int32)
    return (q, k, v, k_pool, v_pool, slots, cached)


def time_loop(cfg: AttentionDecodePoolConfig, inputs: tuple, steps: int) -> float:
    """Microseconds per step of `steps` decode steps in one jitted loop (the cached length held fixed, so every
    step reads the same number of keys)."""
    q, k, v, k_pool, v_pool, slots, cached = inputs

    @jax.jit
    def loop(k_pool, v_pool):
        def body(_, carry):
            out, k_pool, v_pool = attention_decode_pool(q, k, v, *carry[1:], slots, cached, cfg=cfg)
            return out, k_pool, v_pool

        return lax.fori_loop(0, steps, body, (jnp.zeros(q.shape, q.dtype), k_pool, v_pool))

    jax.block_until_ready(loop(k_pool, v_pool))
    start = time.perf_counter()
    jax.block_until_ready(loop(k_pool, v_pool))
    return (time.perf_counter() - start) / steps * 1e6


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU")
    args = parser.parse_args()
    heads, cases, steps, max_extra = HEADS, CASES, 20, 64
    if args.smoke:
        heads, cases, steps, max_extra = SMOKE_HEADS, [(2, 40)], 2, 24
    print(f"{jax.devices()[0].device_kind}, jax {jax.__version__}")
    bandwidth = None if args.smoke else copy_bandwidth()
    rows = []
    for batch, context in cases:
        inputs = make_step(batch, context, context + max_extra, heads)
        outputs = {name: attention_decode_pool(*inputs, cfg=cfg)[0] for name, cfg in IMPLEMENTATIONS.items()}
        error = relative_error(np.asarray(outputs["pallas:in_place"], np.float32),
                               np.asarray(outputs["xla:gather"], np.float32))
        row = {"B": batch, "context": context, "in_place vs gather": f"{error:.1e}"}
        for name, cfg in IMPLEMENTATIONS.items():
            row[f"{name} us"] = f"{time_loop(cfg, inputs, steps):.1f}"
        if bandwidth:
            cache_bytes = batch * context * heads[1] * heads[2] * 2 * 2  # keys and values, bf16
            row["floor us"] = f"{cache_bytes / bandwidth * 1e6:.1f}"  # read once at the copy's bytes per second
        rows.append(row)
    print_table(rows, list(rows[0]))


if __name__ == "__main__":
    main()
