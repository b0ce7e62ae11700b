"""hybrax's explain: for a CPU call, the implementation and config the executor would run and why each other
implementation declines; explicit platforms and configs, cached configs, calls inside jit, no cache written."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from hybrax.core import Executor, MemoryCache, PersistentCache, default_executor, set_default_executor
from hybrax.core.explain import CHOSEN, COULD_RUN, DECLINED, explain
from hybrax.ops.attention.dot_product import dot_product_attention
from hybrax.ops.kda.api import KernelDeltaAttentionConfig, kernel_delta_attention
from hybrax.ops.kda.kimi import kimi_delta_attention
from hybrax.ops.recurrent.api import recurrent_attention

QK = jax.ShapeDtypeStruct((1, 20, 2, 8), jnp.float32)
V = jax.ShapeDtypeStruct((1, 20, 2, 4), jnp.float32)
GATE = jax.ShapeDtypeStruct((1, 20, 2), jnp.float32)


class CountingCache(MemoryCache):
    def __init__(self) -> None:
        super().__init__()
        self.puts = 0

    def put(self, op_id, key, entry) -> None:
        self.puts += 1
        super().put(op_id, key, entry)


@pytest.fixture
def executor(tmp_path):
    """A fresh default executor (own caches) for the test; the previous one back afterwards."""
    previous = default_executor()
    fresh = Executor(memory_cache=CountingCache(), persistent_cache=PersistentCache(tmp_path))
    set_default_executor(fresh)
    yield fresh
    set_default_executor(previous)


def by_name(call):
    return {candidate.implementation: candidate for candidate in call.candidates}


def test_cpu_call_names_the_chosen_implementation_and_why_others_decline(executor, tmp_path):
    report = explain(kimi_delta_attention, QK, QK, V, GATE, GATE, output_final_state=True)
    assert len(report) == 1
    call = report[0]
    assert (call.op_id, call.device, call.platform) == ("kernel_delta_attention", "cpu", "auto")
    candidates = by_name(call)
    assert [c.implementation for c in call.candidates if c.status == CHOSEN] == ["xla:chunked"]
    assert call.config == KernelDeltaAttentionConfig("xla", "chunked", chunk_size=64)
    assert call.source == "the heuristic's choice"
    assert candidates["xla:single_step"].status == DECLINED
    assert candidates["xla:single_step"].reason == "needs seq_len == 1"
    assert candidates["pallas:chunked"].status == DECLINED
    assert candidates["pallas:chunked"].reason.startswith("auto chooses it only on gpu")
    assert candidates["xla:scan"].status == COULD_RUN
    text = str(report)
    assert "runs xla:chunked with KernelDeltaAttentionConfig(platform='xla', backend='chunked', chunk_size=64)" in text
    # One line per implementation, the CPU's auto row first with each one's place in it, then the rest; the
    # columns' widths follow the longest registered name.
    assert "implementations in auto order for cpu:" in text
    assert "1 xla:single_step declined: needs seq_len == 1" in " ".join(text.split())
    assert [(c.implementation, c.auto_rank) for c in call.candidates[:3]] == [
        ("xla:single_step", 1), ("xla:chunked", 2), ("xla:scan", 3)]
    assert all(c.auto_rank is None and c.status == DECLINED for c in call.candidates[3:])
    assert candidates["pallas_tpu:decode"].reason.startswith("opt-in: auto never chooses it, not yet run")
    # Nothing was written: neither the in-memory cache nor the disk.
    assert executor.memory_cache.puts == 0 and not any(tmp_path.iterdir())


def test_explicit_platform_and_cfg(executor):
    call = explain(recurrent_attention, QK, QK, QK, platform="pallas")[0]
    assert call.chosen == "pallas:chunked" and call.source == "the heuristic's choice"
    assert by_name(call)["xla:scan"].reason == "platform='pallas' was asked for"
    call = explain(kernel_delta_attention, QK, QK, V, GATE, cfg=KernelDeltaAttentionConfig("xla", "scan"))[0]
    assert call.chosen == "xla:scan" and call.source == "the cfg given"
    assert by_name(call)["xla:chunked"].reason == "cfg names xla:scan"


def test_a_call_nothing_can_run_says_why(executor):
    call = explain(recurrent_attention, QK, QK, QK, platform="cuda")[0]
    assert call.config is None and call.chosen is None
    assert "platform 'cuda' has no implementation" in call.source
    assert "runs nothing: " in str(call)


def test_cached_config_is_reported_from_the_cache(executor):
    q = jnp.zeros((1, 20, 2, 8))
    kernel_delta_attention(q, q, jnp.zeros((1, 20, 2, 4)), jnp.zeros((1, 20, 2)), jnp.zeros((1, 20, 2)))
    call = explain(kernel_delta_attention, QK, QK, V, GATE, GATE)[0]
    assert call.source == "from the in-memory cache" and call.chosen == "xla:chunked"


def test_every_op_inside_a_jitted_function_traced_before(executor):
    """The ops inside a function jax.jit has already traced are still reached (explain traces anew)."""
    def layer(q, k, v):
        return dot_product_attention(q, k, v, is_causal=True) + recurrent_attention(q, k, v)

    step = jax.jit(layer)
    q = jnp.ones((1, 20, 2, 8))
    step(q, q, q)
    report = explain(step, q, q, q)
    assert [call.op_id for call in report] == ["attention", "recurrent_attention"]
    assert report[0].chosen == "xla:direct" and report[1].chosen == "xla:scan"
    assert by_name(report[0])["cuda:cudnn"].status == DECLINED


def test_bad_arguments_raise_the_ops_error(executor):
    with pytest.raises(ValueError, match="beta must have shape"):
        explain(kimi_delta_attention, QK, QK, V, GATE, V)
