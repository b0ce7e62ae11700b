"""The executor: `executor(kernel, *args, **kwargs)` validates, picks a config, runs.

Config resolution, first hit wins: explicit `cfg` -> in-memory cache -> persistent cache ->
autotune (when enabled) -> heuristic. It needs only shapes and dtypes, so it works at trace time
under jit, vmap, grad and checkpoint. An explicit config that cannot run the call is an error; a cached
one that cannot (or that does not parse) is a miss, warned once, and a cache that cannot be written is
warned about once: the call goes on.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Sequence

from hybrax.core.autotune import Autotuner
from hybrax.core.cache import MemoryCache, PersistentCache, warn_once
from hybrax.core.config import KernelConfig
from hybrax.core.kernel import Invocation, Kernel


class Executor:
    """Runs operations: `executor(kernel, *args, platform=None, cfg=None, **kwargs)` validates the arguments
    (`kernel.prepare`), resolves a config as the module says, and runs the chosen implementation.

    Args:
        memory_cache: configs chosen in this process, by call signature (default: a fresh `MemoryCache`).
        persistent_cache: configs kept on disk between processes (None: none; the default executor keeps them
            under $HYBRAX_CACHE_DIR).
        autotuner: when given, an uncached call times the implementation's candidate configs and keeps the
            fastest; None: the heuristic config.
    """

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

    def _load(self, kernel: Kernel, inv: Invocation, entry: Any, where: str) -> KernelConfig | None:
        """The cached config, ready to run; None when absent or doubtful (warned once): an entry that is not
        {"cfg": {...}}, a field the config lacks or a value it cannot hold, an implementation that does not
        exist or that declines the call."""
        if entry is None:
            return None
        try:
            if not isinstance(entry, dict) or "cfg" not in entry:
                raise ValueError('the entry is not {"cfg": {...}, ...}')
            cfg = kernel.config_type.from_dict(entry["cfg"])
            if not cfg.is_resolved:
                raise ValueError(f"it names no implementation ({cfg.platform}:{cfg.backend})")
            return kernel.resolve(inv, cfg)
        except ValueError as exc:
            warn_once(f"hybrax: ignoring the {where} config cached for {inv.signature()}: {exc}")
            return None

    def select_config(self, kernel: Kernel, inv: Invocation, cfg: KernelConfig | None = None) -> KernelConfig:
        if cfg is not None:
            if not isinstance(cfg, kernel.config_type):
                raise TypeError(
                    f"{kernel.op_id}: cfg must be a {kernel.config_type.__name__}, got {type(cfg).__name__}"
                )
            return kernel.resolve(inv, cfg)
        found = self._load(kernel, inv, self.memory_cache.get(inv.op_id, inv.key), "in-memory")
        if found is not None:
            return found
        if self.persistent_cache is not None:
            found = self._load(kernel, inv, self.persistent_cache.get(inv.op_id, inv.key), "persistent")
            if found is not None:
                self.memory_cache.put(inv.op_id, inv.key, {"cfg": dataclasses.asdict(found)})
                return found
        if self.autotuner is not None:
            candidates = self._runnable(kernel, inv, kernel.candidate_cfgs(inv))
            if len(candidates) > 1:
                return self._tune(kernel, inv, candidates)
        best = kernel.heuristic_cfg(inv)
        self.memory_cache.put(inv.op_id, inv.key, {"cfg": dataclasses.asdict(best)})
        return best

    @staticmethod
    def _runnable(kernel: Kernel, inv: Invocation, candidates: Sequence[KernelConfig]) -> list[KernelConfig]:
        """The candidates whose implementation supports the call with their knobs."""
        return [cfg for cfg in candidates if kernel.get_impl(cfg).supports(inv, cfg) is None]

    def _tune(self, kernel: Kernel, inv: Invocation, candidates: Sequence[KernelConfig]) -> KernelConfig:
        """The autotuner's choice, kept in memory and, where the disk allows, in the persistent cache: a cache
        that cannot be written (warned once) costs this process nothing but a later process the tuning."""
        best, trials = self.autotuner.tune(kernel, inv, candidates)
        timed = {t.cfg: t.time_s for t in trials}
        entry = {"cfg": dataclasses.asdict(best), "signature": inv.signature(), "time_s": timed.get(best)}
        self.memory_cache.put(inv.op_id, inv.key, entry)
        if self.persistent_cache is not None:
            try:
                self.persistent_cache.put(inv.op_id, inv.key, entry)
            except OSError as exc:
                warn_once(f"hybrax: cannot write the config cache {self.persistent_cache.path(inv.op_id)}: {exc}")
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
