"""`explain(fn, *args, **kwargs)`: which implementation and config each hybrax op that fn calls would run, and
why every other implementation would not.

fn is traced abstractly (jax.eval_shape: shapes and dtypes only, nothing computed; arrays may be given as
jax.ShapeDtypeStruct) with a recording executor standing in for the default one. For each op call it walks
the op's auto table (`hybrax.core.registry.set_auto_order`): the device's row in order, then the implementations
`auto` does not take here, and asks what `auto` asks (the platform wanted, whether the row holds the
implementation, its `supports`), then resolves the config as the default executor does (an explicit cfg, the
in-memory and persistent caches, the heuristic) without writing any cache or autotuning.

    print(hybrax.explain(hybrax.kernel_delta_attention, q, k, v, beta, decay))
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any, Callable

import jax
import numpy as np

from hybrax.core import registry
from hybrax.core.cache import MemoryCache
from hybrax.core.config import KernelConfig
from hybrax.core.executor import Executor, default_executor, set_default_executor
from hybrax.core.kernel import Invocation, Kernel

CHOSEN, COULD_RUN, DECLINED = "chosen", "could run", "declined"

# Part of jax.jit's cache key: every explain traces fn anew, so jitted functions inside it reach the recorder.
_TRACE = jax.make_user_context(default_value=None)
_TRACES = itertools.count()


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One registered implementation of the op. auto_rank: its place in the auto table's row for the device (1:
    tried first), None where `auto` does not take it on this device. status: 'chosen', 'could run' (supports
    the call, not chosen) or 'declined', with `reason` saying why it was not chosen; `config` is the chosen
    one's."""

    implementation: str
    auto_rank: int | None
    status: str
    reason: str | None
    config: KernelConfig | None


@dataclasses.dataclass(frozen=True)
class OpExplanation:
    """One op call: where it runs, the config it would run (None when no implementation can) and from where."""

    op_id: str
    device: str
    device_kind: str
    platform: str
    arrays: str
    config: KernelConfig | None
    source: str
    candidates: tuple[Candidate, ...]

    @property
    def chosen(self) -> str | None:
        return next((c.implementation for c in self.candidates if c.status == CHOSEN), None)

    def __str__(self) -> str:
        head = f"{self.op_id} on {self.device} ({self.device_kind}), platform={self.platform!r}\n  call: {self.arrays}"
        runs = (f"  runs {self.chosen} with {self.config} ({self.source})" if self.config is not None
                else f"  runs nothing: {self.source}")
        width = max(len(c.implementation) for c in self.candidates)
        rows = [f"    {'-' if c.auto_rank is None else c.auto_rank:>2}  {c.implementation:<{width}}  {c.status}"
                + (f": {c.reason}" if c.reason else "") for c in self.candidates]
        return "\n".join([head, runs, f"  implementations in auto order for {self.device}:", *rows])


class Explanation(tuple):
    """The OpExplanation of every op call fn made, in order; str() is the readable report."""

    def __str__(self) -> str:
        return "\n\n".join(str(call) for call in self) or "no hybrax op was called"


class _Stop(Exception):
    """Ends the abstract run at an op call that nothing can run (the rest could not be traced)."""


class _Overlay(MemoryCache):
    """Reads the default executor's in-memory cache; writes only to itself."""

    def __init__(self, base: MemoryCache) -> None:
        super().__init__()
        self._base = base

    def get(self, op_id: str, key: str) -> dict[str, Any] | None:
        return super().get(op_id, key) or self._base.get(op_id, key)


def _describe_arrays(inv: Invocation) -> str:
    arrays = [f"{name} {spec.dtype}{list(spec.shape)}" for name, spec in inv.arrays.items() if spec is not None]
    static = [f"{name}={value!r}" for name, value in inv.static.items()]
    return ", ".join(arrays + static)


def _not_in_row(impl: registry.Implementation) -> str:
    """Why `auto` does not take impl on this device: the devices whose row holds it, or why it is opt-in."""
    table = registry.auto_order(impl.op_id)
    if impl.name in table.opt_in:
        return f"opt-in: auto never chooses it, {table.opt_in[impl.name]} (ask for platform={impl.platform!r})"
    devices = [device for device, row in table.rows.items() if impl.name in row]
    return (f"auto chooses it only on {', '.join(devices)} (ask for platform={impl.platform!r} to run it here)"
            if devices else f"in no row of the auto table (ask for platform={impl.platform!r})")


def _in_auto_order(inv: Invocation) -> list[tuple[registry.Implementation, int | None]]:
    """Every implementation of the op with its place in the device's auto row: the row's first, in order, then
    the others in the table's order."""
    row = registry.auto_candidates(inv.op_id, inv.device)
    others = [impl for impl in registry.implementations(inv.op_id) if impl not in row]
    return [(impl, rank) for rank, impl in enumerate(row, 1)] + [(impl, None) for impl in others]


def _decline_reason(impl: registry.Implementation, inv: Invocation, cfg: KernelConfig | None) -> str | None:
    """Why `auto` (or the platform or cfg asked for) would not take impl for this call; None: it could run."""
    if inv.platform != "auto" and impl.platform != inv.platform:
        return f"platform={inv.platform!r} was asked for"
    if cfg is not None and (cfg.platform not in ("auto", impl.platform) or cfg.backend not in ("auto", impl.backend)):
        return f"cfg names {cfg.platform}:{cfg.backend}"
    reasons = []
    if inv.platform == "auto" and impl.name not in registry.auto_order(impl.op_id).row(inv.device):
        reasons.append(_not_in_row(impl))
    supports = impl.supports(inv)
    if supports is not None:
        reasons.append(supports)
    return "; ".join(reasons) or None


def _source(executor: Executor, kernel: Kernel, inv: Invocation, cfg: KernelConfig | None,
            chosen: KernelConfig) -> str:
    """Where the default executor's resolution order finds `chosen`."""
    if cfg is not None:
        return "the cfg given"
    caches = [("the in-memory cache", executor.memory_cache)]
    if executor.persistent_cache is not None:
        caches.append(("the persistent cache", executor.persistent_cache))
    for where, cache in caches:
        entry = cache.get(inv.op_id, inv.key)
        try:
            if entry is not None and kernel.config_type.from_dict(entry["cfg"]) == chosen:
                return f"from {where}"
        except (KeyError, TypeError, ValueError):
            continue
    if executor.autotuner is not None:
        runnable = [c for c in kernel.candidate_cfgs(inv) if kernel.get_impl(c).supports(inv, c) is None]
        if len(runnable) > 1:
            return (f"the heuristic's; autotuning is on, so the first real call times {len(runnable)} candidates "
                    f"and may choose another")
    return "the heuristic's choice"


def _explain_call(executor: Executor, kernel: Kernel, inv: Invocation, cfg: KernelConfig | None,
                  chosen: KernelConfig | None, error: str | None) -> OpExplanation:
    chosen_name = None if chosen is None else f"{chosen.platform}:{chosen.backend}"
    candidates = []
    for impl, rank in _in_auto_order(inv):
        reason = _decline_reason(impl, inv, cfg)
        if impl.name == chosen_name:
            candidates.append(Candidate(impl.name, rank, CHOSEN, None, chosen))
        elif reason is None:
            candidates.append(Candidate(impl.name, rank, COULD_RUN, chosen_name and f"{chosen_name} was chosen", None))
        else:
            candidates.append(Candidate(impl.name, rank, DECLINED, reason, None))
    source = error if chosen is None else _source(executor, kernel, inv, cfg, chosen)
    return OpExplanation(inv.op_id, inv.device, inv.device_kind, inv.platform, _describe_arrays(inv), chosen, source,
                         tuple(candidates))


class _Recorder(Executor):
    """Resolves each call as `default` would, records it, and runs it (abstractly) so fn can go on."""

    def __init__(self, default: Executor) -> None:
        super().__init__(memory_cache=_Overlay(default.memory_cache), persistent_cache=default.persistent_cache)
        self.default = default
        self.calls: list[OpExplanation] = []

    def __call__(self, kernel: Kernel, *args: Any, platform: str | None = None, cfg: KernelConfig | None = None,
                 **kwargs: Any) -> Any:
        problem = kernel.prepare(*args, **kwargs)
        inv = kernel.invocation(problem, platform)
        try:
            chosen = self.select_config(kernel, inv, cfg)
        except ValueError as exc:
            self.calls.append(_explain_call(self.default, kernel, inv, cfg, None, str(exc)))
            raise _Stop from exc
        self.calls.append(_explain_call(self.default, kernel, inv, cfg, chosen, None))
        return kernel.execute(problem, chosen)


def _is_array(leaf: Any) -> bool:
    return isinstance(leaf, (jax.Array, np.ndarray, jax.ShapeDtypeStruct))


def explain(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Explanation:
    """Which implementation and config each hybrax op in fn(*args, **kwargs) would run on this device, and why
    each other implementation would not; nothing is computed and no cache is written.

    Args:
        fn: any function calling hybrax ops (a public op itself, a layer, a jitted step).
        *args, **kwargs: its arguments; arrays may be jax.ShapeDtypeStruct.

    Returns:
        An Explanation: a tuple of OpExplanation (op_id, device, config, source, candidates in auto order for
        the device: each implementation's name, auto_rank, status 'chosen' / 'could run' / 'declined' and
        reason), one per op call; print it for the report. Bad arguments raise the op's own error.
    """
    leaves, tree = jax.tree.flatten((args, kwargs))
    arrays = [leaf for leaf in leaves if _is_array(leaf)]

    def call(arrays: list[Any]) -> Any:
        given = iter(arrays)
        call_args, call_kwargs = jax.tree.unflatten(tree, [next(given) if _is_array(x) else x for x in leaves])
        return fn(*call_args, **call_kwargs)

    default = default_executor()
    recorder = _Recorder(default)
    set_default_executor(recorder)
    try:
        with _TRACE(next(_TRACES)):
            jax.eval_shape(call, arrays)
    except _Stop:
        pass
    finally:
        set_default_executor(default)
    return Explanation(recorder.calls)
