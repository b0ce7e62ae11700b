"""Parallelism over devices beyond what sharding the batch and the heads gives: context parallelism (one
sequence split along time over a mesh axis)."""

from hybrax.parallel.context import attention_context_parallel, kda_context_parallel, recurrent_context_parallel

__all__ = ["attention_context_parallel", "kda_context_parallel", "recurrent_context_parallel"]
