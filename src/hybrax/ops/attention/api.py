"""Placeholder until the attention op lands (issue 2)."""
import dataclasses
from hybrax.core import Kernel, KernelConfig


@dataclasses.dataclass(frozen=True)
class AttentionConfig(KernelConfig):
    pass


class MaskInfo:
    pass


class Attention(Kernel):
    op_id = "attention"
    config_type = AttentionConfig


def attention(*args, **kwargs):
    raise NotImplementedError("attention")
