"""Gated linear attention (`recurrent_attention`), forward and forward+backward.

Inputs: q, k, v N(0, 1) in the benchmark's dtype; a log decay log sigmoid(N(0, 1) + 3) (about -0.05 per step) in
fp32, per key channel (`gla-`, the gk gate) or per head (`simple_gla-`, the g gate); scale K^-0.5.

Work: the matmul FLOPs of the chunked form at chunk C = 64, per token and head 2CK + 2CV + 4KV (the [C, C]
scores, their product with v, the output's and the update's products with the state); forward + backward
counts 3x the forward. A nominal count for comparing shapes.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from hybrax import RecurrentAttentionConfig, recurrent_attention
from hybrax.bench.shapes import Shape
from hybrax.bench.workloads.base import MODES, Call, Inputs, Work, Workload, config_for, jax_call

CHUNK = 64


def make_inputs(shape: Shape, dtype: Any) -> Inputs:
    keys = jax.random.split(jax.random.key(0), 5)
    tokens = (shape.batch, shape.seq_len, shape.heads, shape.head_dim)
    q, k, v = (jax.random.normal(key, tokens, jnp.float32).astype(dtype) for key in keys[:3])
    gate_shape = tokens if shape.family == "gla" else tokens[:3]
    log_decay = jax.nn.log_sigmoid(jax.random.normal(keys[3], gate_shape, jnp.float32) + 3.0)
    return {"q": q, "k": k, "v": v, "log_decay": log_decay, "d_out": jax.random.normal(keys[4], tokens, jnp.float32)}


def ours(impl: str, shape: Shape, inputs: Inputs, mode: str) -> Call:
    cfg = config_for(RecurrentAttentionConfig, impl)
    per_key = shape.family == "gla"

    def forward(q, k, v, log_decay):
        g, gk = (None, log_decay) if per_key else (log_decay, None)
        return recurrent_attention(q, k, v, g, None, gk, cfg=cfg)

    args = [inputs[name] for name in ("q", "k", "v", "log_decay")]
    return jax_call(forward, args, mode, inputs["d_out"])


def work(shape: Shape, mode: str, dtype: Any) -> Work:
    dk = dv = shape.head_dim
    per_token = 2 * CHUNK * dk + 2 * CHUNK * dv + 4 * dk * dv
    return Work(flops=per_token * shape.tokens * shape.heads * (3 if mode == "fwd+bwd" else 1))


WORKLOAD = Workload(
    op="gla", families=("gla", "simple_gla"), impls=("auto",), anchors=("fla", "jla"), modes=MODES,
    inputs=make_inputs, ours=ours, work=work,
)
