"""The executor: `executor(kernel, *args, **kwargs)` validates, picks a config, runs.

Config resolution, first hit wins: explicit `cfg` -> in-memory cache -> persistent cache ->
autotune (when enabled) -> heuristic. It needs only shapes and dtypes, so it works at trace time
under jit, vmap, grad and checkpoint.
"""

from __future__ import annotations

import os
from typing import Any

from hybrax.core.autotune import Autotuner
from hybrax.core.cache import MemoryCache, PersistentCache
from hybrax.core.config import KernelConfig
from hybrax.core.kernel import Invocation, Kernel


class Executor:
    def __init__(
        self,
        *,
        memory_cache: MemoryCache | None = None,
        persistent_cache: PersistentCache | None = None,
        autotuner: Autotuner | None = None,
    ) -> None:
        self.memory_cache = memory_cache if memory_cache is not None else MemoryCache()
        self.persistent_cache = persistent_cache
        self.autotuner = autotuner

    def __call__(
        self,
        kernel: Kernel,
        *args: Any,
        platform: str | None = None,
        cfg: KernelConfig | None = None,
        **kwargs: Any,
    ) -> Any:
        problem = kernel.prepare(*args, **kwargs)
        inv = kernel.invocation(problem, platform)
        return kernel.execute(problem, self.select_config(kernel, inv, cfg))

    def _load(self, kernel: Kernel, entry: dict[str, Any] | None) -> KernelConfig | None:
        """The cached config, or None when absent or naming an implementation that no longer exists."""
        if entry is None:
            return None
        cfg = kernel.config_type.from_dict(entry["cfg"])
        try:
            kernel.get_impl(cfg)
        except ValueError:
            return None
        return cfg

    def select_config(self, kernel: Kernel, inv: Invocation, cfg: KernelConfig | None = None) -> KernelConfig:
        if cfg is not None:
            if not isinstance(cfg, kernel.config_type):
                raise TypeError(
                    f"{kernel.op_id}: cfg must be a {kernel.config_type.__name__}, got {type(cfg).__name__}"
                )
            return kernel.resolve(inv, cfg)
        found = self._load(kernel, self.memory_cache.get(inv.op_id, inv.key))
        if found is not None:
            return found
        if self.persistent_cache is not None:
            found = self._load(kernel, self.persistent_cache.get(inv.op_id, inv.key))
            if found is not None:
                self.memory_cache.put(inv.op_id, inv.key, {"cfg": found.__dict__})
                return found
        if self.autotuner is not None:
            candidates = list(kernel.candidate_cfgs(inv))
            if len(candidates) > 1:
                best, trials = self.autotuner.tune(kernel, inv, candidates)
                timed = {t.cfg: t.time_s for t in trials}
                entry = {"cfg": best.__dict__, "signature": inv.signature(), "time_s": timed.get(best)}
                self.memory_cache.put(inv.op_id, inv.key, entry)
                if self.persistent_cache is not None:
                    self.persistent_cache.put(inv.op_id, inv.key, entry)
                return best
        best = kernel.heuristic_cfg(inv)
        self.memory_cache.put(inv.op_id, inv.key, {"cfg": best.__dict__})
        return best


def create_default_executor(*, autotune: bool | None = None, persistent: bool = True) -> Executor:
    """The executor the public functions use.

    Autotuning is off unless asked for (`autotune=True` or `HYBRAX_AUTOTUNE=1`): it compiles and
    times every candidate the first time a shape is seen, and stores the winner on disk.
    """
    if autotune is None:
        autotune = os.environ.get("HYBRAX_AUTOTUNE", "0") not in ("", "0", "false", "False")
    return Executor(
        persistent_cache=PersistentCache() if persistent else None,
        autotuner=Autotuner() if autotune else None,
    )


_DEFAULT: Executor | None = None


def default_executor() -> Executor:
    """A process-wide executor, created on first use."""
    global _DEFAULT
    if _DEFAULT is None:
        _DEFAULT = create_default_executor()
    return _DEFAULT


def set_default_executor(executor: Executor | None) -> None:
    """Replace the executor the public functions use (None: recreate from the environment)."""
    global _DEFAULT
    _DEFAULT = executor
