"""Placeholder until KDA lands (issue 4)."""
import dataclasses
from hybrax.core import Kernel, KernelConfig


@dataclasses.dataclass(frozen=True)
class KernelDeltaAttentionConfig(KernelConfig):
    pass


class KernelDeltaAttention(Kernel):
    op_id = "kernel_delta_attention"
    config_type = KernelDeltaAttentionConfig


def kernel_delta_attention(*args, **kwargs):
    raise NotImplementedError("kernel_delta_attention")


kda_attention = kernel_delta_attention
