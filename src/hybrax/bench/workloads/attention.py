"""Causal softmax attention (`attention`), forward and forward+backward, with GQA, a left window or packed sequences.

Inputs: q [B, T, H, D], k and v [B, T, KV, D], N(0, 1) in the benchmark's dtype. `-wW` keeps W keys left of each
query (and itself); `-segN` packs N equal sequences by segment ids.

Work: 4 D FLOPs per visible (query, key) pair and query head (the two matmuls); forward + backward counts 3.5x
the forward (the backward's five matmuls against the forward's two, as FlashAttention counts).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from hybrax import AttentionConfig, MaskInfo, attention
from hybrax.bench.shapes import Shape
from hybrax.bench.workloads.base import MODES, Call, Inputs, Work, Workload, config_for, jax_call


def make_inputs(shape: Shape, dtype: Any) -> Inputs:
    keys = jax.random.split(jax.random.key(0), 4)
    q = jax.random.normal(keys[0], (shape.batch, shape.seq_len, shape.heads, shape.head_dim), jnp.float32)
    k, v = (jax.random.normal(key, (shape.batch, shape.seq_len, shape.kv_heads, shape.head_dim), jnp.float32)
            for key in keys[1:3])
    ids = shape.segment_ids()
    return {"q": q.astype(dtype), "k": k.astype(dtype), "v": v.astype(dtype),
            "d_out": jax.random.normal(keys[3], q.shape, jnp.float32),
            "segment_ids": None if ids is None else jnp.asarray(ids)}


def left_window(shape: Shape) -> tuple[int, int] | None:
    """The (left, right) window of the shape's `-wW` variant, in the form `attention` and jax.nn take."""
    return None if shape.window is None else (shape.window, 0)


def ours(impl: str, shape: Shape, inputs: Inputs, mode: str) -> Call:
    cfg = config_for(AttentionConfig, impl)
    ids = inputs["segment_ids"]
    mask_info = None if ids is None else MaskInfo.from_segments(ids)

    def forward(q, k, v):
        return attention(q, k, v, causal=True, sliding_window=left_window(shape), mask_info=mask_info, cfg=cfg)

    return jax_call(forward, [inputs["q"], inputs["k"], inputs["v"]], mode, inputs["d_out"])


def visible_pairs(shape: Shape) -> int:
    """(query, key) pairs a causal query of one sequence sees, summed over the shape's packed sequences."""
    length = shape.seq_len // shape.segments
    window = length if shape.window is None else shape.window
    keys_per_query = [min(position, window) + 1 for position in range(length)]
    return sum(keys_per_query) * shape.segments


def work(shape: Shape, mode: str, dtype: Any) -> Work:
    forward = 4 * shape.head_dim * visible_pairs(shape) * shape.batch * shape.heads
    return Work(flops=forward * (3.5 if mode == "fwd+bwd" else 1))


WORKLOAD = Workload(
    op="attention", families=("attn",), impls=("auto",), anchors=("cudnn", "jax_nn"), modes=MODES,
    inputs=make_inputs, ours=ours, work=work,
)
