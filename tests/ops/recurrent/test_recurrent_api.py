"""The public signature, bad input, and how the executor chooses an implementation."""

from __future__ import annotations

import dataclasses
import inspect

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hybrax import RecurrentAttention, RecurrentAttentionConfig, create_default_executor, recurrent_attention
from hybrax.core import Autotuner, Executor
from hybrax.ops.recurrent.base import CHUNKED_MIN_SEQ_LEN
from hybrax.ops.recurrent.xla_chunked import CHUNK_SIZES
from tests.helpers import TOLERANCE, assert_close
from tests.ops.recurrent.inputs import ARG_NAMES, IMPLS, make_call, normal


def test_signature_is_the_seeds():
    parameters = inspect.signature(recurrent_attention).parameters
    positional = [n for n, p in parameters.items() if p.kind is inspect.Parameter.POSITIONAL_ONLY]
    keyword = [n for n, p in parameters.items() if p.kind is inspect.Parameter.KEYWORD_ONLY]
    assert positional == list(ARG_NAMES)
    assert keyword == ["softmax_scale", "reverse", "return_state", "platform", "cfg", "segment_ids", "max_segments"]
    assert all(parameters[n].default is None for n in ARG_NAMES[3:])


@pytest.mark.parametrize("cfg", [None, IMPLS["chunked"]], ids=["heuristic", "chunked"])
def test_executor_run_and_function_agree(cfg):
    """Packed and reversed, so that every keyword reaches prepare/finalize through each entry point; bitwise
    equal, so an explicit cfg that one entry point dropped (the scan instead of chunked) would show.
    Jitted: eager dispatch of the chunked algorithm's many small ops takes seconds on 2 cores."""
    call = make_call(5, cu_seqlens=[0, 7, 7, 26], key_dim=4, value_dim=3, reverse=True)
    options = dict(reverse=True, return_state=True, cfg=cfg)
    executor = create_default_executor(persistent=False)
    function = jax.jit(lambda *args: recurrent_attention(*args, **options))(*call.args())
    assert_close(function, call.reference(), TOLERANCE[jnp.float32])
    # Kernel.run takes seed 001's order: (..., gv, softmax_scale, initial_state, reverse, cu_seqlens, return_state).
    run = lambda *args: RecurrentAttention().run(*args[:7], None, args[7], True, args[8], True, cfg=cfg)  # noqa: E731
    for name, entry in (("executor", lambda *args: executor(RecurrentAttention(), *args, **options)), ("run", run)):
        for got, want in zip(jax.jit(entry)(*call.args()), function, strict=True):
            np.testing.assert_array_equal(got, want, err_msg=name)


def _bad(**changes):
    """Arguments of a valid call (B=2, T=5, H=4, HKV=2, K=8, V=6) with some replaced."""
    args = {
        "query": normal(0, (2, 5, 4, 8)), "key": normal(1, (2, 5, 2, 8)), "value": normal(2, (2, 5, 2, 6)),
    }
    args.update(changes)
    return [args.get(name) for name in ARG_NAMES]


@pytest.mark.parametrize("changes, message", [
    (dict(query=normal(0, (2, 5, 4))), "query must have shape"),
    (dict(key=normal(1, (2, 5, 2, 7))), "key must have shape"),
    (dict(key=normal(1, (2, 6, 2, 8))), "key must have shape"),
    (dict(key=normal(1, (2, 5, 3, 8)), value=normal(2, (2, 5, 3, 6))), r"num_kv_heads of key \(3\) must divide"),
    (dict(value=normal(2, (2, 5, 4, 6))), "value must have shape"),
    (dict(g=normal(3, (2, 5, 3))), r"g must have shape .*got \[2, 5, 3\]"),
    (dict(g_gamma=normal(3, (3,))), "g_gamma must have shape"),
    (dict(gk=normal(3, (2, 5, 4, 6))), "gk must have shape"),
    (dict(gv=normal(3, (2, 5, 4, 8))), "gv must have shape"),
    (dict(initial_state=normal(3, (2, 4, 6, 8))), r"initial_state must have shape .*\[2, 4, 8, 6\]"),
    (dict(cu_seqlens=jnp.array([0, 5], jnp.int32)), "cu_seqlens needs a batch of one"),
    (dict(query=normal(0, (1, 0, 4, 8)), key=normal(1, (1, 0, 2, 8)), value=normal(2, (1, 0, 2, 6))),
     "query must have seq_len of at least 1"),
    (dict(query=jnp.ones((2, 5, 4, 8), jnp.int32)), "query must be a floating-point array"),
    (dict(query=normal(0, (2, 5, 4, 0)), key=normal(1, (2, 5, 2, 0))), "query must have head_dim of at least 1"),
])
def test_bad_shapes_name_the_argument(changes, message):
    with pytest.raises(ValueError, match=message):
        recurrent_attention(*_bad(**changes))


def _packed(cu_seqlens, initial_state=None):
    return _bad(query=normal(0, (1, 5, 4, 8)), key=normal(1, (1, 5, 2, 8)), value=normal(2, (1, 5, 2, 6)),
                cu_seqlens=cu_seqlens, initial_state=initial_state)


@pytest.mark.parametrize("cu_seqlens, message", [
    (jnp.array([0.0, 5.0]), "cu_seqlens must be an integer array"),
    (jnp.array([[0, 5]], jnp.int32), "cu_seqlens must have shape"),
    (jnp.array([5], jnp.int32), "at least 2 entries"),
    (jnp.array([0, 3, 2, 5], jnp.int32), "never decrease"),
    (jnp.array([1, 5], jnp.int32), "start at 0"),
    (jnp.array([0, 6], jnp.int32), "end at most at seq_len 5"),
])
def test_bad_cu_seqlens(cu_seqlens, message):
    with pytest.raises(ValueError, match=message):
        recurrent_attention(*_packed(cu_seqlens))


def test_packed_initial_state_is_per_sequence():
    with pytest.raises(ValueError, match=r"initial_state must have shape \[num_seqs.*\[3, 4, 8, 6\]"):
        recurrent_attention(*_packed(jnp.array([0, 2, 2, 5], jnp.int32), normal(3, (1, 4, 8, 6))))


@pytest.mark.parametrize("scale", [jnp.ones(3), "0.3", float("nan")])
def test_softmax_scale_must_be_a_number(scale):
    with pytest.raises(ValueError, match="softmax_scale must be a finite number or None"):
        recurrent_attention(*_bad(), softmax_scale=scale)


def test_chunk_size_must_be_a_power_of_two():
    with pytest.raises(ValueError, match="chunk_size must be a power of two"):
        recurrent_attention(*_bad(), cfg=RecurrentAttentionConfig("xla", "chunked", chunk_size=24))


def _invocation(seq_len):
    kernel = RecurrentAttention()
    call = make_call(0, batch=1, seq_len=seq_len, key_dim=4, value_dim=4)
    return kernel, kernel.invocation(kernel.prepare(*call.args()))


def test_heuristic_picks_scan_on_cpu_and_off_it_for_short_sequences_else_chunked():
    kernel, short = _invocation(8)
    kernel, long = _invocation(64)
    assert long.device == "cpu" and kernel.heuristic_cfg(long).backend == "scan"
    on_gpu = lambda inv: dataclasses.replace(inv, device="gpu")  # noqa: E731
    assert kernel.heuristic_cfg(on_gpu(short)).backend == "scan"
    assert kernel.heuristic_cfg(on_gpu(long)) == RecurrentAttentionConfig("xla", "chunked", chunk_size=64)


@pytest.mark.parametrize("device", ["cpu", "gpu", "tpu"])
@pytest.mark.parametrize("seq_len", [8, 64])
@pytest.mark.parametrize("platform", [None, "xla"])
def test_the_default_config_and_an_all_auto_one_pick_the_same_implementation(device, seq_len, platform):
    """cfg=None (the heuristic) and cfg=RecurrentAttentionConfig() (every knob auto) walk the same order."""
    kernel, inv = _invocation(seq_len)
    inv = dataclasses.replace(kernel.invocation(inv.problem, platform), device=device)
    default, all_auto = kernel.heuristic_cfg(inv), kernel.resolve(inv, RecurrentAttentionConfig())
    assert (default.platform, default.backend) == (all_auto.platform, all_auto.backend)
    scan = device == "cpu" or seq_len < CHUNKED_MIN_SEQ_LEN
    assert default.backend == ("scan" if scan else "chunked")


def test_autotune_candidates_cover_both_backends_and_chunk_sizes():
    kernel, inv = _invocation(64)
    candidates = kernel.candidate_cfgs(inv)
    assert {(c.backend, c.chunk_size) for c in candidates if c.backend == "chunked"} == {
        ("chunked", size) for size in CHUNK_SIZES}
    assert any(c.backend == "scan" for c in candidates)


def test_autotuning_times_every_candidate_on_valid_inputs():
    """The autotune problem (decaying gates, valid cu_seqlens) lets every candidate agree."""
    executor = Executor(autotuner=Autotuner(warmup=0, iterations=1, progress=False))
    call = make_call(1, cu_seqlens=[0, 10, 10, 40], key_dim=4, value_dim=4)
    kernel = RecurrentAttention()
    inv = kernel.invocation(kernel.prepare(*call.args()))
    _, trials = executor.autotuner.tune(kernel, inv, kernel.candidate_cfgs(inv))
    assert len(trials) == 1 + len(CHUNK_SIZES)
    assert all(trial.time_s is not None for trial in trials), [t.reason for t in trials]
