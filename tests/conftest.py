"""Four CPU devices, so that the sharding tests (test_shard_map.py) have a mesh; set before any backend starts."""

import jax

jax.config.update("jax_num_cpu_devices", 4)
