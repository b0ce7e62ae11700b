"""Extreme log decays through every chunked implementation of gated linear attention (`recurrent_attention`),
against float64 autodiff of the reference: the patterns of tests/ops/kda/test_extreme_gates.py (runs of -1000,
single -1e30 tokens, -inf resets, mixtures, a bounded control), one per batch row (one per sequence when
packed), on per-key and per-head gates. The Pallas path runs KDA's kernels without the delta rule, so it
had KDA's faults (issue 43); XLA's chunked path multiplies per-token factors exp(g) and was exact already.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hybrax import RecurrentAttentionConfig, recurrent_attention
from hybrax.ops.recurrent.reference import recurrent_reference
from tests.ops.kda.test_extreme_gates import (
    FP32, PATTERNS, _gates, assert_rows_close, loss_weights, oracle_outputs_and_gradients, ours,
)

ARG_NAMES = ("query", "key", "value", "g", "g_gamma", "gk", "gv", "initial_state")


def gla_case(seed, *, length=64, heads=1, kv_heads=1, dim=16, gate="gk", packed=False):
    """(arrays, cu_seqlens or None): one batch row per gate pattern, or with `packed` one sequence per pattern
    (an empty one first) in a batch of one. `gate`: "gk" per key channel [B, T, H, K], "g" per head [B, T, H]."""
    rng = np.random.default_rng(seed)
    rows = len(PATTERNS)
    channels = (heads, dim) if gate == "gk" else (heads,)
    gates = _gates(length, channels, seed + 1)
    batch, cu_seqlens, states = rows, None, rows
    if packed:
        batch, cu_seqlens, states = 1, (0, 0, *range(length, rows * length + 1, length)), rows + 1
        gates, length = gates.reshape(1, rows * length, *channels), rows * length
    normal = lambda *shape: rng.standard_normal(shape)  # noqa: E731
    arrays = {
        "query": normal(batch, length, heads, dim), "key": normal(batch, length, kv_heads, dim),
        "value": normal(batch, length, kv_heads, dim), gate: gates,
        "initial_state": 0.5 * normal(states, heads, dim, dim),
    }
    return {name: jnp.asarray(x, jnp.float32) for name, x in arrays.items()}, cu_seqlens


def _run(cfg, cu_seqlens):
    def run(arrays):
        args = [arrays.get(name) for name in ARG_NAMES]
        if cfg is None:  # the reference, in float64
            return recurrent_reference(*args, cu_seqlens, xp=jnp)
        cu = None if cu_seqlens is None else jnp.array(cu_seqlens, jnp.int32)
        return recurrent_attention(*args, cu, return_state=True, cfg=cfg)

    return run


IMPLS = {
    "xla_chunked16": RecurrentAttentionConfig("xla", "chunked", chunk_size=16),
    "xla_chunked64": RecurrentAttentionConfig("xla", "chunked", chunk_size=64),
    "pallas_chunked16": RecurrentAttentionConfig("pallas", "chunked", chunk_size=16),  # interpret mode here
    "pallas_chunked64": RecurrentAttentionConfig("pallas", "chunked", chunk_size=64),
}
LAYOUTS = {
    "per_key_gqa_odd_length": dict(heads=2, kv_heads=1, length=45),
    "per_head": dict(gate="g"),
    "packed": dict(packed=True, length=21),
}
# Each layout on chunks of 16 and 64; the Pallas path (KDA's kernels, tested there on every layout) on 64, and
# on 16 per key channel.
CASES = [(layout, impl) for layout in LAYOUTS for impl in IMPLS]
CASES = [case for case in CASES if case[1] != "pallas_chunked16" or case[0] == "per_key_gqa_odd_length"]


@functools.lru_cache
def gla_reference(layout):
    arrays, cu_seqlens = gla_case(530, **LAYOUTS[layout])
    weights = loss_weights(_run(None, cu_seqlens), arrays, 531)
    return arrays, cu_seqlens, weights, oracle_outputs_and_gradients(_run(None, cu_seqlens), arrays, weights)


@pytest.mark.parametrize(("layout", "impl"), CASES)
def test_gla_extreme_gates(layout, impl):
    arrays, cu_seqlens, weights, (want_outputs, want_grads) = gla_reference(layout)
    outputs, grads = ours(_run(IMPLS[impl], cu_seqlens), IMPLS[impl])(arrays, weights)
    tokens = states = None
    if cu_seqlens is not None:  # each pattern's sequence, and the whole (the empty sequence's state)
        tokens = {"all": ..., **{n: (0, slice(a, b)) for n, a, b in zip(PATTERNS, cu_seqlens[1:-1], cu_seqlens[2:])}}
        states = {"all": ..., **{name: index for index, name in enumerate(PATTERNS, start=1)}}
    assert_rows_close(outputs[0], want_outputs[0], FP32, "output", tokens)
    assert_rows_close(outputs[1], want_outputs[1], FP32, "final state", states)
    for name in ("query", "key", "value", "g", "gk"):
        if name in arrays:
            assert_rows_close(grads[name], want_grads[name], FP32, f"d {name}", tokens)
    assert_rows_close(grads["initial_state"], want_grads["initial_state"], FP32, "d initial_state", states)
