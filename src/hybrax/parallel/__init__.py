"""Parallelism over devices beyond what sharding the batch and the heads gives: context parallelism (one
sequence split along time over a mesh axis)."""

from hybrax.parallel.context import kda_context_parallel, recurrent_context_parallel

__all__ = ["kda_context_parallel", "recurrent_context_parallel"]
