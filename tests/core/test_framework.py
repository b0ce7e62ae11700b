import json
import multiprocessing
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hybrax.core import (
    Autotuner, Executor, MemoryCache, PersistentCache, create_default_executor, implementations,
)
from hybrax.core.kernel import arrays_device
from tests.core.toy_op import OP_ID, Toy, ToyConfig


def _inputs(n=8):
    x = jax.random.normal(jax.random.key(1), (n,))
    return x, jnp.float32(1.5)


def test_heuristic_picks_the_first_in_auto_order_on_device():
    x, w = _inputs()
    ex = Executor()
    inv = Toy().invocation(Toy().prepare(x, w))
    assert ex.select_config(Toy(), inv) == ToyConfig("xla", "plain", 1)


def test_invocation_device_is_the_arrays_then_the_default():
    x, w = _inputs()
    (device,) = x.devices()
    assert Toy().invocation(Toy().prepare(x, w)).device_kind == device.device_kind
    seen = []
    jax.jit(lambda x: seen.append(arrays_device(Toy().prepare(x, w))) or x)(x)
    assert seen == [None]  # tracers carry no device: the default backend decides


def test_explicit_platform_without_impl_lists_what_exists():
    x, w = _inputs()
    with pytest.raises(ValueError, match=r"platform 'triton' has no implementation; registered: .*xla:plain"):
        Executor()(Toy(), x, w, platform="triton")


def test_bad_platform_name():
    x, w = _inputs()
    with pytest.raises(ValueError, match="platform must be one of"):
        Executor()(Toy(), x, w, platform="tpu-magic")


def test_explicit_cfg_is_used_and_checked():
    x, w = _inputs()
    ex = Executor()
    out = ex(Toy(), x, w, cfg=ToyConfig("pallas", "wrong"))
    np.testing.assert_allclose(out, 1.5 * x + 1.0, rtol=1e-6)
    with pytest.raises(ValueError, match="no implementation xla:nonexistent"):
        ex(Toy(), x, w, cfg=ToyConfig("xla", "nonexistent"))
    with pytest.raises(ValueError, match="pallas:wrong cannot run this call: no squared calls"):
        ex(Toy(), x, w, squared=True, cfg=ToyConfig("pallas", "wrong"))


def test_custom_vjp_through_registry_under_jit_vmap_checkpoint():
    x, w = _inputs()
    off = jnp.ones_like(x)
    ex = Executor()
    cfg = ToyConfig("xla", "custom_vjp")

    def loss(x, w, off):
        return jnp.sum(ex(Toy(), x, w, off, squared=True, cfg=cfg) ** 2)

    def ref_loss(x, w, off):
        return jnp.sum((w * x * x + off) ** 2)

    got = jax.jit(jax.grad(jax.checkpoint(loss), argnums=(0, 1, 2)))(x, w, off)
    want = jax.grad(ref_loss, argnums=(0, 1, 2))(x, w, off)
    for g, r in zip(got, want):
        np.testing.assert_allclose(g, r, rtol=1e-5)
    batched = jax.vmap(lambda x: ex(Toy(), x, w, cfg=cfg))(jnp.stack([x, 2 * x]))
    np.testing.assert_allclose(batched[1], 3.0 * x, rtol=1e-6)


def test_autotune_discards_wrong_candidate_and_caches(tmp_path, capsys):
    x, w = _inputs()
    cache = PersistentCache(tmp_path)
    ex = Executor(persistent_cache=cache, autotuner=Autotuner(warmup=1, iterations=2))

    wrong = ToyConfig("pallas", "wrong")
    candidates = [wrong, ToyConfig("xla", "plain", 1), ToyConfig("xla", "plain", 2)]

    class ToyWithWrong(Toy):
        def candidate_cfgs(self, inv):
            return candidates

    # Under jit: the executor runs at trace time with tracers, autotuning on random inputs.
    out = jax.jit(lambda x: ex(ToyWithWrong(), x, w))(x)
    np.testing.assert_allclose(out, 1.5 * x, rtol=1e-6)
    assert "discarded" in capsys.readouterr().err
    entries = json.loads((tmp_path / f"{OP_ID}.json").read_text())
    (entry,) = entries.values()
    assert entry["cfg"]["backend"] == "plain"
    # A new executor over the same directory finds it without tuning.
    fresh = Executor(persistent_cache=cache)
    inv = Toy().invocation(Toy().prepare(x, w))
    assert fresh.select_config(Toy(), inv).backend == "plain"


def test_import_writes_nothing(tmp_path):
    env = dict(os.environ, HYBRAX_CACHE_DIR=str(tmp_path / "cache"), HOME=str(tmp_path))
    import subprocess, sys
    subprocess.run([sys.executable, "-c", "import hybrax; hybrax.create_default_executor()"], env=env, check=True)
    assert not (tmp_path / "cache").exists() and not (tmp_path / ".cache").exists()


def _writer(args):
    directory, worker = args
    cache = PersistentCache(directory)
    for i in range(20):
        cache.put("concurrent", f"w{worker}-{i}", {"cfg": {"platform": "xla", "backend": "b", "i": i}})


def test_concurrent_writers_lose_nothing(tmp_path):
    with multiprocessing.get_context("spawn").Pool(4) as pool:
        pool.map(_writer, [(str(tmp_path), w) for w in range(4)])
    entries = PersistentCache(tmp_path).entries("concurrent")
    assert len(entries) == 80


def test_cache_key_depends_on_shape_dtype_and_static():
    x, w = _inputs()
    keys = {
        Toy().invocation(Toy().prepare(x, w)).key,
        Toy().invocation(Toy().prepare(x[:4], w)).key,
        Toy().invocation(Toy().prepare(x.astype(jnp.bfloat16), w)).key,
        Toy().invocation(Toy().prepare(x, w, squared=True)).key,
        Toy().invocation(Toy().prepare(x, w), "xla").key,
    }
    assert len(keys) == 5


def test_registry_lists_toy():
    assert {i.name for i in implementations(OP_ID)} == {"xla:plain", "xla:custom_vjp", "pallas:wrong"}


def test_stale_persistent_entry_is_ignored(tmp_path):
    x, w = _inputs()
    cache = PersistentCache(tmp_path)
    inv = Toy().invocation(Toy().prepare(x, w))
    cache.put(OP_ID, inv.key, {"cfg": {"platform": "xla", "backend": "removed_long_ago"}})
    assert Executor(persistent_cache=cache).select_config(Toy(), inv).backend == "plain"
