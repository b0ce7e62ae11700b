"""Placeholder until recurrent attention lands (issue 3)."""
import dataclasses
from hybrax.core import Kernel, KernelConfig


@dataclasses.dataclass(frozen=True)
class RecurrentAttentionConfig(KernelConfig):
    pass


class RecurrentAttention(Kernel):
    op_id = "recurrent_attention"
    config_type = RecurrentAttentionConfig


def recurrent_attention(*args, **kwargs):
    raise NotImplementedError("recurrent_attention")
