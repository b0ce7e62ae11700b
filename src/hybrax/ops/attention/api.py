"""`attention`: multi-head softmax attention (MHA / GQA / MQA), the public function; the problem, config and
kernel live in `base.py`, each implementation in its own module (imported here so that it registers).
"""

from __future__ import annotations

from typing import Any, Callable

import jax
from jaxtyping import Array, Float

from hybrax.core import default_executor, set_auto_order
from hybrax.ops.attention import cudnn, pallas_flash, xla, xla_blockwise  # noqa: F401  (they register)
from hybrax.ops.attention.base import OP_ID, Attention, AttentionConfig, AttentionProblem, MaskInfo

# What `auto` tries, in order, per device platform; the first whose supports() accepts the call runs (a device
# not named here reads the "cpu" row). One exception: a long call moves xla:direct last (`Attention.implementations`:
# its [B, H, Tq, Tk] scores would cost too much).
AUTO = {
    "gpu": ("cuda:cudnn", "pallas:flash", "xla:direct", "xla:blockwise"),
    "tpu": ("xla:direct", "xla:blockwise"),
    "cpu": ("xla:direct", "xla:blockwise"),
}
set_auto_order(OP_ID, AUTO)

__all__ = ["OP_ID", "Attention", "AttentionConfig", "AttentionProblem", "MaskInfo", "attention"]


def attention(
    query: Float[Array, "batch q_len num_heads head_dim"],
    key: Float[Array, "batch kv_len num_kv_heads head_dim"],
    value: Float[Array, "batch kv_len num_kv_heads v_head_dim"],
    bias: Float[Array, "batch heads q_len kv_len"] | None = None,
    dropout_rng: jax.Array | None = None,
    softmax_aux: Float[Array, "num_heads num_sinks"] | Float[Array, "num_sinks"] | None = None,
    /,
    *,
    mask_info: MaskInfo | None = None,
    init_bias: Callable[[], Float[Array, "batch heads q_len kv_len"]] | None = None,
    deterministic: bool = True,
    softmax_scale: float | None = None,
    logits_soft_cap: float | None = None,
    dtype: Any = None,
    softmax_dtype: Any = None,
    dropout_prob: float = 0.0,
    causal: bool = False,
    sliding_window: int | tuple[int, int] | None = None,
    platform: str | None = None,
    cfg: AttentionConfig | None = None,
) -> Float[Array, "batch q_len num_heads v_head_dim"]:
    """softmax(cap(scale * q k^T + bias) over visible keys and sinks) @ v, per query head.

    Query head h uses kv head h // (num_heads // num_kv_heads) (GQA / MQA). Causal and
    sliding_window use bottom-right alignment: query i sits at key position i + kv_len - q_len.
    `sliding_window` w or (left, right) keeps key j when pos - left <= j <= pos + right. `bias`
    [batch | 1, num_heads | num_kv_heads | 1, q_len, kv_len] is added before `logits_soft_cap` c
    (logits -> c tanh(logits / c)); `mask_info` applies together with the bias. `init_bias()`
    makes the bias when neither a bias nor a mask is given. `softmax_aux` (sinks) [num_heads, S] or
    [S] join each row's denominator without a value. A query that sees no key gives zeros.
    Dropout (`dropout_prob` > 0, `deterministic=False`, `dropout_rng`) drops each (batch, head,
    query, key) weight independently. `dtype` (default: the inputs' dtype) is the dtype of the
    matmul inputs and the output; `softmax_dtype` (default float32, or float64 for float64 inputs)
    the dtype of logits and softmax.
    """
    return default_executor()(
        Attention(), query, key, value, bias, dropout_rng, softmax_aux,
        mask_info=mask_info, init_bias=init_bias, deterministic=deterministic, softmax_scale=softmax_scale,
        logits_soft_cap=logits_soft_cap, dtype=dtype, softmax_dtype=softmax_dtype, dropout_prob=dropout_prob,
        causal=causal, sliding_window=sliding_window, platform=platform, cfg=cfg,
    )
