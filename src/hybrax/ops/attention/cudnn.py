"""cuDNN flash attention, through `jax.nn.dot_product_attention(implementation="cudnn")`.

NVIDIA's fused kernel, maintained by NVIDIA and JAX: on an H200 (bf16, causal, B=1, H=8, D=64) it took
0.39 / 1.09 ms forward / forward+backward at T=8192 where the blockwise XLA implementation took 4.17 / 8.78
(H200 measurements). It covers the core of `attention`: full, causal and causal sliding-window
attention with MHA / GQA / MQA heads in bf16 or fp16, any head dims up to 256. `supports` names each option
it lacks (bias, masks, segment ids, soft cap, sinks, dropout, ...), and `auto` then takes the XLA implementations.

jax.nn wants one head dim, a multiple of 8, for query, key and value. Other dims (MLA's 192 for q.k with 128
for values, or 80) are padded with zeros up to a common multiple of 8: zero key / query columns add nothing to
q.k (the scale is passed as is), and zero value columns only fill output columns that are sliced off.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

from hybrax.core import Invocation, register
from hybrax.ops.attention.base import OP_ID, AttentionConfig, AttentionProblem

# jax.nn.dot_product_attention's cuDNN checks (jax._src.cudnn.fused_attention_stablehlo).
HOPPER = (9, 0)
HEAD_DIM_MULTIPLE = 8
DTYPES = (jnp.bfloat16, jnp.float16)

# Options of the problem that cuDNN's path through jax.nn cannot express, and how to name them.
_UNSUPPORTED_ARRAYS = {
    "bias": "bias",
    "mask": "attention mask",
    "q_segment_ids": "segment ids",
    "softmax_aux": "attention sinks (softmax_aux)",
    "dropout_seed": "dropout",
}


def _window_reason(inv: Invocation) -> str | None:
    """cuDNN's windows end at the query (causal), and its causal mask is aligned top-left (query i sees
    keys <= i), which equals hybrax's bottom-right alignment only when Tq == Tk."""
    left, right = inv.static["window_left"], inv.static["window_right"]
    if left is None and right is None:
        return None
    if right != 0:
        return f"cuDNN windows end at the query: needs causal=True or a right window of 0, got ({left}, {right})"
    q_len, kv_len = inv.arrays["query"].shape[1], inv.arrays["key"].shape[1]
    if q_len != kv_len:
        return f"causal or windowed cuDNN attention needs q_len == kv_len, got {q_len} and {kv_len}"
    return None


def _supports(inv: Invocation) -> str | None:
    if inv.device != "gpu":
        return f"cuDNN needs a CUDA GPU, this call runs on {inv.device}"
    arrays, static = inv.arrays, inv.static
    for name, what in _UNSUPPORTED_ARRAYS.items():
        if arrays[name] is not None:
            return f"cuDNN attention takes no {what}"
    if static["logits_soft_cap"] is not None:
        return "cuDNN attention has no logits soft cap"
    if static["dtype"] not in DTYPES:
        return f"cuDNN attention needs dtype bfloat16 or float16, got {static['dtype']}"
    if static["softmax_dtype"] != jnp.float32:
        return f"cuDNN computes the softmax in float32, asked for softmax_dtype {static['softmax_dtype']}"
    head_dim, v_dim = arrays["query"].shape[-1], arrays["value"].shape[-1]
    if _padded_head_dim(head_dim, v_dim) > max_head_dim():
        return f"cuDNN attention here needs head dims <= {max_head_dim()}, got {head_dim} (query, key) and " \
               f"{v_dim} (value)"
    return _window_reason(inv)


def max_head_dim() -> int:
    """256 from Hopper on, 128 before (and wherever no CUDA device answers)."""
    capability = getattr(jax.devices()[0], "compute_capability", None)
    return 256 if capability and tuple(map(int, capability.split("."))) >= HOPPER else 128


def _padded_head_dim(head_dim: int, v_dim: int) -> int:
    return -(-max(head_dim, v_dim) // HEAD_DIM_MULTIPLE) * HEAD_DIM_MULTIPLE


def _pad_last(array: jax.Array, size: int) -> jax.Array:
    return jnp.pad(array, [(0, 0)] * (array.ndim - 1) + [(0, size - array.shape[-1])])


def jax_nn_attention(p: AttentionProblem, implementation: str = "cudnn") -> Float[Array, "B Tq K G Dv"]:
    """`p` through jax.nn.dot_product_attention. The tests run it with implementation="xla" on the CPU:
    the same arguments, so they check this translation where no cuDNN exists."""
    batch, q_len, num_kv_heads, group, head_dim = p.query.shape
    v_dim = p.value.shape[-1]
    size = _padded_head_dim(head_dim, v_dim)
    # Head n = kv_head * group + g: jax.nn groups query heads the same way (n // group is the kv head).
    query = jnp.reshape(p.query, (batch, q_len, num_kv_heads * group, head_dim))
    query, key, value = (_pad_last(x, size) for x in (query, p.key, p.value))
    causal = p.window_right == 0
    window: Any = None if p.window_left is None else (p.window_left, 0)
    out = jax.nn.dot_product_attention(
        query, key, value, scale=p.softmax_scale, is_causal=causal, local_window_size=window,
        implementation=implementation,
    )
    return jnp.reshape(out[..., :v_dim], (batch, q_len, num_kv_heads, group, v_dim)).astype(p.dtype)


@register(OP_ID, "cuda", "cudnn", supports=_supports,
          heuristic_cfg=lambda inv: AttentionConfig())
def cudnn(p: AttentionProblem, cfg: AttentionConfig) -> Float[Array, "B Tq K G Dv"]:
    # Gradients: jax.nn's cuDNN path brings its own (the fused backward kernel).
    return jax_nn_attention(p, "cudnn")
