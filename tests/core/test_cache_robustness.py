"""The config caches only ever save time: a cache file that cannot be used reads as empty and the next write
replaces it, an entry whose config is doubtful is a miss (each warned once), and a cache that cannot be written
does not stop a call or an autotuning run."""

from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np
import pytest

from hybrax.core import Autotuner, Executor, MemoryCache, PersistentCache, cache as cache_module
from hybrax.ops.kda.api import KernelDeltaAttention
from tests.core.toy_op import OP_ID, Toy, ToyConfig
from tests.helpers import normal

HEURISTIC = ToyConfig("xla", "plain", 1)
CACHED = ToyConfig("xla", "plain", 2)  # what a usable entry holds: not what the heuristic gives


@pytest.fixture(autouse=True)
def fresh_warnings(monkeypatch):
    """Each test sees the warnings its own cache raises, whatever earlier tests warned about."""
    monkeypatch.setattr(cache_module, "_WARNED", set())


def _toy_invocation(squared=False):
    x = jnp.arange(8, dtype=jnp.float32)
    return Toy().invocation(Toy().prepare(x, jnp.float32(1.5), squared=squared))


def _entry(cfg):
    return {"cfg": {"platform": cfg.platform, "backend": cfg.backend, "block": cfg.block}}


UNUSABLE_FILES = {
    "not UTF-8": b'{"k": "\xff\xfe"}',
    "a JSON list": b"[1, 2]",
    "JSON null": b"null",
    "a JSON string": b'"text"',
    "a JSON number": b"42",
    "truncated JSON": b'{"a": {"cfg": ',
    "empty": b"",
    "nested too deep to parse": b"[" * 100_000,
}


@pytest.mark.parametrize("contents", UNUSABLE_FILES.values(), ids=UNUSABLE_FILES.keys())
def test_an_unusable_file_reads_as_empty_and_the_next_write_replaces_it(tmp_path, contents):
    cache = PersistentCache(tmp_path)
    cache.path(OP_ID).write_bytes(contents)
    inv = _toy_invocation()
    with pytest.warns(RuntimeWarning, match="ignoring the config cache .*toy_scale.json"):
        assert Executor(persistent_cache=cache).select_config(Toy(), inv) == HEURISTIC
    cache.put(OP_ID, inv.key, _entry(CACHED))  # re-reads the file (warned about already) and replaces it
    assert json.loads(cache.path(OP_ID).read_text()) == {inv.key: _entry(CACHED)}
    assert Executor(persistent_cache=cache).select_config(Toy(), inv) == CACHED


def test_each_unusable_file_warns_once(tmp_path):
    cache = PersistentCache(tmp_path)
    cache.path(OP_ID).write_text("[]")
    with pytest.warns(RuntimeWarning) as warned:
        for _ in range(3):
            Executor(persistent_cache=cache).select_config(Toy(), _toy_invocation())
    assert len(warned) == 1


def test_a_directory_where_the_file_should_be_is_a_miss(tmp_path):
    cache = PersistentCache(tmp_path)
    cache.path(OP_ID).mkdir()
    with pytest.warns(RuntimeWarning, match="ignoring the config cache"):
        assert Executor(persistent_cache=cache).select_config(Toy(), _toy_invocation()) == HEURISTIC
    with pytest.raises(OSError):
        cache.put(OP_ID, "key", _entry(CACHED))


def test_a_file_where_the_cache_directory_should_be_is_a_miss(tmp_path):
    (tmp_path / "cache").write_text("not a directory")
    cache = PersistentCache(tmp_path / "cache")
    with pytest.warns(RuntimeWarning, match="ignoring the config cache"):
        assert Executor(persistent_cache=cache).select_config(Toy(), _toy_invocation()) == HEURISTIC
    with pytest.raises(OSError):
        cache.put(OP_ID, "key", _entry(CACHED))


def _tuner():
    return Autotuner(warmup=0, iterations=1, progress=False)


def test_autotuning_over_a_corrupted_file_rebuilds_it(tmp_path):
    cache = PersistentCache(tmp_path)
    cache.path(OP_ID).write_bytes(b"\x80\x81 not json")
    inv = _toy_invocation()
    with pytest.warns(RuntimeWarning, match="ignoring the config cache"):
        best = Executor(persistent_cache=cache, autotuner=_tuner()).select_config(Toy(), inv)
    (stored,) = json.loads(cache.path(OP_ID).read_text()).values()
    assert ToyConfig.from_dict(stored["cfg"]) == best and best.backend in ("plain", "custom_vjp")
    assert Executor(persistent_cache=cache).select_config(Toy(), inv) == best


def test_autotuning_goes_on_when_the_cache_cannot_be_written(tmp_path):
    (tmp_path / "cache").write_text("not a directory")
    executor = Executor(persistent_cache=PersistentCache(tmp_path / "cache"), autotuner=_tuner())
    inv = _toy_invocation()
    with pytest.warns(RuntimeWarning) as warned:
        best = executor.select_config(Toy(), inv)
    assert [str(w.message).split(" /")[0] for w in warned] == [
        "hybrax: ignoring the config cache", "hybrax: cannot write the config cache"]
    assert best.backend in ("plain", "custom_vjp")
    assert executor.select_config(Toy(), inv) == best  # kept in memory


def test_a_failed_write_leaves_the_file_and_no_temporary(tmp_path):
    cache = PersistentCache(tmp_path)
    cache.put(OP_ID, "kept", _entry(CACHED))
    with pytest.raises(TypeError):
        cache.put(OP_ID, "unserializable", {"cfg": object()})
    assert json.loads(cache.path(OP_ID).read_text()) == {"kept": _entry(CACHED)}
    assert sorted(p.name for p in tmp_path.iterdir()) == [f".{OP_ID}.lock", f"{OP_ID}.json"]


DOUBTFUL_ENTRIES = {
    "not an object": 5,
    "a list": [_entry(CACHED)],
    "no cfg": {"time_s": 1.0},
    "cfg not an object": {"cfg": "xla:plain"},
    "cfg with a field the config lacks": {"cfg": {"platform": "xla", "backend": "plain", "chunk": 2}},
    "cfg with a knob of 0": {"cfg": {"platform": "xla", "backend": "plain", "block": 0}},
    "cfg with a knob as a string": {"cfg": {"platform": "xla", "backend": "plain", "block": "2"}},
    "cfg with a float knob": {"cfg": {"platform": "xla", "backend": "plain", "block": 2.0}},
    "cfg with an unknown platform": {"cfg": {"platform": "gpu", "backend": "plain", "block": 2}},
    "cfg naming no implementation": {"cfg": {"platform": "auto", "backend": "auto", "block": 2}},
    "cfg naming a missing implementation": {"cfg": {"platform": "xla", "backend": "removed", "block": 2}},
    "cfg naming an implementation that declines": {"cfg": {"platform": "pallas", "backend": "wrong", "block": 2}},
}


@pytest.mark.parametrize("entry", DOUBTFUL_ENTRIES.values(), ids=DOUBTFUL_ENTRIES.keys())
def test_a_doubtful_persistent_entry_is_a_miss(tmp_path, entry):
    cache = PersistentCache(tmp_path)
    inv = _toy_invocation(squared=True)  # pallas:wrong declines squared calls
    cache.path(OP_ID).write_text(json.dumps({inv.key: entry}))
    executor = Executor(persistent_cache=cache)
    with pytest.warns(RuntimeWarning, match="ignoring the persistent config cached for toy_scale"):
        assert executor.select_config(Toy(), inv) == HEURISTIC
    assert executor.select_config(Toy(), inv) == HEURISTIC  # from memory now: no second read, no second warning


@pytest.mark.parametrize("entry", DOUBTFUL_ENTRIES.values(), ids=DOUBTFUL_ENTRIES.keys())
def test_a_doubtful_in_memory_entry_is_a_miss(entry):
    memory = MemoryCache()
    inv = _toy_invocation(squared=True)
    memory.put(OP_ID, inv.key, entry)
    with pytest.warns(RuntimeWarning, match="ignoring the in-memory config cached for toy_scale"):
        assert Executor(memory_cache=memory).select_config(Toy(), inv) == HEURISTIC
    assert ToyConfig.from_dict(memory.get(OP_ID, inv.key)["cfg"]) == HEURISTIC


def test_a_usable_entry_is_used_and_its_unset_knobs_take_the_heuristic(tmp_path):
    cache = PersistentCache(tmp_path)
    inv = _toy_invocation()
    cache.put(OP_ID, inv.key, _entry(CACHED))
    assert Executor(persistent_cache=cache).select_config(Toy(), inv) == CACHED
    cache.put(OP_ID, inv.key, {"cfg": {"platform": "xla", "backend": "custom_vjp", "block": None}})
    assert Executor(persistent_cache=cache).select_config(Toy(), inv) == ToyConfig("xla", "custom_vjp", 1)


def _kda_call(length):
    q, k = normal(0, (1, length, 2, 16)), normal(1, (1, length, 2, 16))
    v, beta = normal(2, (1, length, 2, 16)), jnp.full((1, length, 2), 0.5)
    return q, k, v, beta, -jnp.ones((1, length, 2))


@pytest.mark.parametrize("cfg", [
    {"platform": "xla", "backend": "single_step", "chunk_size": 64},  # T = 1 only: gave [1, 1, ...] for T = 12
    {"platform": "xla", "backend": "chunked", "chunk_size": 7},
    {"platform": "pallas", "backend": "chunked", "chunk_size": 8},  # the kernels take 16..128
])
def test_kda_runs_what_it_should_whatever_the_cache_says(tmp_path, cfg):
    cache = PersistentCache(tmp_path)
    args = _kda_call(12)
    inv = KernelDeltaAttention().invocation(KernelDeltaAttention().prepare(*args))
    want = Executor()(KernelDeltaAttention(), *args)
    cache.put(KernelDeltaAttention.op_id, inv.key, {"cfg": cfg})
    with pytest.warns(RuntimeWarning, match="ignoring the persistent config cached for kernel_delta_attention"):
        got = Executor(persistent_cache=cache)(KernelDeltaAttention(), *args)
    assert got.shape == (1, 12, 2, 16)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_kda_uses_a_usable_entry(tmp_path):
    cache = PersistentCache(tmp_path)
    args = _kda_call(12)
    inv = KernelDeltaAttention().invocation(KernelDeltaAttention().prepare(*args))
    cache.put(KernelDeltaAttention.op_id, inv.key, {"cfg": {"platform": "xla", "backend": "scan"}})
    executor = Executor(persistent_cache=cache)
    assert executor.select_config(KernelDeltaAttention(), inv).backend == "scan"
