"""`jax.nn.dot_product_attention` on the benchmark's attention inputs: anchor "cudnn" (implementation="cudnn":
cuDNN's fused kernels, bf16 / fp16 on NVIDIA GPUs) and anchor "jax_nn" (implementation="xla"). Neither takes
segment ids, so packed shapes decline.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from hybrax.bench.shapes import Shape
from hybrax.bench.workloads.attention import left_window
from hybrax.bench.workloads.base import Call, Declined, Inputs, jax_call

PACKAGES = ("jax",)
IMPLEMENTATIONS = {"cudnn": "cudnn", "jax_nn": "xla"}


def build(name: str, op: str, shape: Shape, inputs: Inputs, mode: str) -> Call:
    if op != "attention":
        raise Declined(f"{name} is an anchor of attention, not {op}")
    if shape.segments > 1:
        raise Declined("jax.nn.dot_product_attention takes no segment ids")
    if name == "cudnn":
        if jax.default_backend() != "gpu":
            raise Declined("cuDNN needs an NVIDIA GPU")
        if jnp.dtype(inputs["q"].dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
            raise Declined(f"cuDNN attention takes bf16 or fp16, not {jnp.dtype(inputs['q'].dtype).name}")
    forward = functools.partial(jax.nn.dot_product_attention, is_causal=True, implementation=IMPLEMENTATIONS[name],
                                local_window_size=left_window(shape))
    return jax_call(forward, [inputs["q"], inputs["k"], inputs["v"]], mode, inputs["d_out"])
