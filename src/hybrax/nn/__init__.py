"""hybrax.nn: Kimi-Linear layers on Flax NNX that train, serve by slot, and load flash-linear-attention weights.

Needs Flax (the `nn` extra); the rest of hybrax does not.
"""

try:
    from flax import nnx  # noqa: F401
except ImportError as error:
    raise ImportError(
        "hybrax.nn needs Flax (flax.nnx), which hybrax installs with its `nn` extra: pip install 'hybrax[nn]'"
    ) from error

from hybrax.nn.conv import ShortConvolution
from hybrax.nn.kda import KdaCache, KimiDeltaAttention, kimi_linear_to_fla
from hybrax.nn.norm import GatedRMSNorm, RMSNorm

__all__ = [
    "GatedRMSNorm", "KdaCache", "KimiDeltaAttention", "RMSNorm", "ShortConvolution", "kimi_linear_to_fla",
]
