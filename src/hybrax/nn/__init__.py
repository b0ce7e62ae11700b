"""hybrax.nn: Kimi-Linear layers on Flax NNX that train, serve by slot, and load flash-linear-attention weights.

Needs Flax (the `nn` extra); the rest of hybrax does not.
"""

try:
    from flax import nnx  # noqa: F401
except ImportError as error:
    raise ImportError(
        "hybrax.nn needs Flax (flax.nnx), which hybrax installs with its `nn` extra: pip install 'hybrax[nn]'"
    ) from error

from hybrax.core.packing import sequence_lengths
from hybrax.nn.attention import Attention, AttentionCache
from hybrax.nn.cache import HybridCache, SlotAllocator
from hybrax.nn.conv import ShortConvolution
from hybrax.nn.gla import GatedLinearAttention, GlaCache
from hybrax.nn.kda import KdaCache, KimiDeltaAttention, kimi_linear_to_fla
from hybrax.nn.mla import MultiheadLatentAttention, mla_to_fla
from hybrax.nn.norm import GatedRMSNorm, RMSNorm

__all__ = [
    "Attention", "AttentionCache", "GatedLinearAttention", "GatedRMSNorm", "GlaCache", "HybridCache", "KdaCache",
    "KimiDeltaAttention", "MultiheadLatentAttention", "RMSNorm", "ShortConvolution", "SlotAllocator",
    "kimi_linear_to_fla", "mla_to_fla", "sequence_lengths",
]
