"""Chunked KDA (`kernel_delta_attention`) over dense or packed sequences, forward and forward+backward.

Inputs as a KDA layer sees them in training: q, k, v N(0, 1) in the benchmark's dtype; a log decay per key
channel g = -0.5 U(0, 1) and beta = sigmoid(N(0, 1)) in fp32; the L2 norm of q and k inside; scale K^-0.5;
the final state returned. Packed shapes (`-varN`) give cu_seqlens.

Work: the matmul FLOPs of the chunked form at chunk C = 64, per token and head 6CK + 4CV + 6KV + 2C^2/3
(the [C, C] scores of q and k against k, the inverse, w and u, the state pass with the output); forward +
backward counts 3x the forward. A nominal count for comparing shapes, not what a kernel executes.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from hybrax import KernelDeltaAttentionConfig, kernel_delta_attention
from hybrax.bench.shapes import Shape
from hybrax.bench.workloads.base import MODES, Call, Inputs, Work, Workload, config_for, jax_call

CHUNK = 64


def make_inputs(shape: Shape, dtype: Any) -> Inputs:
    keys = jax.random.split(jax.random.key(0), 5)
    tokens = (shape.batch, shape.seq_len, shape.heads, shape.head_dim)
    q, k, v = (jax.random.normal(keys[i], tokens, dtype) for i in range(3))
    g = -0.5 * jax.random.uniform(keys[3], tokens, jnp.float32)
    beta = jax.nn.sigmoid(jax.random.normal(keys[4], tokens[:3], jnp.float32))
    d_out = jax.random.normal(jax.random.key(1), tokens, jnp.float32)
    bounds = shape.cu_seqlens()
    return {"q": q, "k": k, "v": v, "g": g, "beta": beta, "d_out": d_out,
            "cu_seqlens": None if bounds is None else jnp.asarray(bounds)}


def ours(impl: str, shape: Shape, inputs: Inputs, mode: str) -> Call:
    cfg = config_for(KernelDeltaAttentionConfig, impl)
    scale = shape.head_dim ** -0.5

    def forward(q, k, v, g, beta):
        return kernel_delta_attention(q, k, v, beta, g, softmax_scale=scale, return_state=True,
                                      cu_seqlens=inputs["cu_seqlens"], cfg=cfg)

    args = [inputs[name] for name in ("q", "k", "v", "g", "beta")]
    return jax_call(forward, args, mode, inputs["d_out"])


def work(shape: Shape, mode: str, dtype: Any) -> Work:
    dk = dv = shape.head_dim
    per_token = 6 * CHUNK * dk + 4 * CHUNK * dv + 6 * dk * dv + 2 * CHUNK**2 / 3
    return Work(flops=per_token * shape.tokens * shape.heads * (3 if mode == "fwd+bwd" else 1))


WORKLOAD = Workload(
    op="kda", families=("kda",), impls=("auto",), anchors=("fla", "tokamax", "jla"), modes=MODES,
    inputs=make_inputs, ours=ours, work=work,
)
