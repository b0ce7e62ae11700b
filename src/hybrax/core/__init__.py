"""The kernel framework, op-agnostic: problems, configs, kernels, registry, caches, autotuning."""

from hybrax.core.autotune import Autotuner, relative_error, tolerance
from hybrax.core.cache import MemoryCache, PersistentCache, default_cache_dir
from hybrax.core.config import PLATFORMS, KernelConfig, Platform
from hybrax.core.executor import Executor, create_default_executor, default_executor, set_default_executor
from hybrax.core.kernel import Invocation, Kernel, device_kind, runtime_device
from hybrax.core.problem import array_fields, cotangent, problem_dataclass, static_field, static_fields
from hybrax.core.registry import Implementation, auto_order, implementations, lookup, register, set_auto_order
from hybrax.core.sharding import vary_like, varying_axes

__all__ = [
    "PLATFORMS", "Autotuner", "Executor", "Implementation", "Invocation", "Kernel", "KernelConfig",
    "MemoryCache", "PersistentCache", "Platform", "array_fields", "cotangent", "create_default_executor",
    "auto_order", "default_cache_dir", "default_executor", "device_kind", "implementations", "lookup",
    "problem_dataclass", "register", "relative_error", "runtime_device", "set_auto_order", "set_default_executor",
    "static_field", "static_fields", "tolerance", "vary_like", "varying_axes",
]
