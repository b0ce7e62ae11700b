"""Four CPU devices, so that the sharding tests (test_shard_map.py) have a mesh; set before any backend starts.

After each test module its compiled code is dropped: XLA maps about three memory regions per CPU executable and
keeps every executable a jitted function ever compiled, so the whole suite in one process would pass the kernel's
limit on mappings (vm.max_map_count, 65530 by default) and crash inside a compile.
"""

import gc

import jax
import pytest

jax.config.update("jax_num_cpu_devices", 4)


@pytest.fixture(autouse=True, scope="module")
def _drop_compiled_code_after_module():
    yield
    jax.clear_caches()
    gc.collect()
