"""Serving: KDA decode and prefill over a slot-indexed state pool, the short convolution's pool, and the
attention layers' KV cache pool."""

from hybrax.serving.attention_pool import AttentionDecodePool, AttentionDecodePoolConfig, attention_decode_pool
from hybrax.serving.attention_prefill import attention_prefill_pool
from hybrax.serving.kda_pool import KdaDecodePool, KdaDecodePoolConfig, kda_decode_pool
from hybrax.serving.prefill import kda_prefill_pool
from hybrax.serving.short_conv import short_conv_decode, short_conv_prefill
from hybrax.ops.kda.pallas_tpu import pool_register  # noqa: E402,F401  (registers the TPU pool step)

__all__ = [
    "AttentionDecodePool", "AttentionDecodePoolConfig", "KdaDecodePool", "KdaDecodePoolConfig",
    "attention_decode_pool", "attention_prefill_pool", "kda_decode_pool", "kda_prefill_pool", "short_conv_decode", "short_conv_prefill",
]
