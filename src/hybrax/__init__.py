"""hybrax: attention kernels for hybrid models in JAX.

Softmax attention, gated linear-recurrent attention and Kimi Delta Attention (KDA), for training
and serving, on XLA and on GPU kernels, behind one executor that picks and caches configs.
"""

from hybrax.core import Executor, KernelConfig, create_default_executor
from hybrax.core.checks import checked
from hybrax.core.explain import explain
from hybrax.ops.attention.api import Attention, AttentionConfig, MaskInfo, attention
from hybrax.ops.attention.dot_product import dot_product_attention
from hybrax.ops.kda.api import (
    KernelDeltaAttention,
    KernelDeltaAttentionConfig,
    kda_attention,
    kernel_delta_attention,
)
from hybrax.ops.kda.kimi import kimi_delta_attention
from hybrax.ops.kda.tkg import kda_tkg
from hybrax.ops.recurrent.gla import gated_linear_attention
from hybrax.ops.recurrent.api import RecurrentAttention, RecurrentAttentionConfig, recurrent_attention

__version__ = "0.2.0"

__all__ = [
    "Attention",
    "AttentionConfig",
    "Executor",
    "KernelConfig",
    "KernelDeltaAttention",
    "KernelDeltaAttentionConfig",
    "MaskInfo",
    "RecurrentAttention",
    "RecurrentAttentionConfig",
    "attention",
    "checked",
    "create_default_executor",
    "dot_product_attention",
    "explain",
    "gated_linear_attention",
    "kda_attention",
    "kda_tkg",
    "kernel_delta_attention",
    "kimi_delta_attention",
    "recurrent_attention",
]
