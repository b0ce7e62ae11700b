"""The call's chunk_size is the chunk the chosen chunked implementation runs, on every device (the invocation as a
GPU or TPU call would build it): honoured wherever the implementation takes it, declined with the reason where it
does not, so that `auto` moves on; never silently replaced."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import pytest

from hybrax.core import lookup
from hybrax.ops.kda.api import KernelDeltaAttention, KernelDeltaAttentionConfig
from hybrax.ops.kda.base import CHUNK_SIZES, OP_ID

CHOSEN = {"cpu": "xla:chunked", "gpu": "pallas:chunked", "tpu": "pallas_tpu:chunked"}


def _invocation(device: str, chunk_size: int = 64):
    kernel = KernelDeltaAttention()
    q, v = jnp.ones((1, 40, 2, 16)), jnp.ones((1, 40, 2, 8))
    problem = kernel.prepare(q, q, v, jnp.full((1, 40, 2), 0.5), -jnp.ones((1, 40, 2)), chunk_size=chunk_size)
    return kernel, dataclasses.replace(kernel.invocation(problem), device=device)


@pytest.mark.parametrize("device", list(CHOSEN))
@pytest.mark.parametrize("chunk_size", CHUNK_SIZES)
def test_the_calls_chunk_size_is_the_one_that_runs(device, chunk_size):
    kernel, inv = _invocation(device, chunk_size)
    default = kernel.heuristic_cfg(inv)
    assert (f"{default.platform}:{default.backend}", default.chunk_size) == (CHOSEN[device], chunk_size)
    # A config that leaves the chunk to the implementation takes the same.
    assert kernel.resolve(inv, KernelDeltaAttentionConfig(chunk_size=None)) == default


@pytest.mark.parametrize("device", ["gpu", "tpu"])
def test_a_chunk_the_kernel_does_not_take_is_declined_and_auto_moves_on(device):
    kernel, inv = _invocation(device)
    name = CHOSEN[device]
    assert "needs chunk_size in" in lookup(OP_ID, *name.split(":")).supports(inv, KernelDeltaAttentionConfig(
        chunk_size=8))
    assert kernel.resolve(inv, KernelDeltaAttentionConfig(chunk_size=8)) == KernelDeltaAttentionConfig(
        "xla", "chunked", chunk_size=8)
