"""The registry: (op_id, platform, backend) -> implementation, with support checks, and per op the table of what
`auto` tries on each device.

Backend files register themselves when their op's package is imported:

    @register("kernel_delta_attention", "xla", "chunked", heuristic_cfg=..., candidate_cfgs=..., supports=...)
    def chunked(problem, cfg): ...

and the op's module (its `api.py`, after importing them) says in what order `auto` tries them:

    set_auto_order("kernel_delta_attention", {"gpu": ("pallas:chunked", "xla:chunked"), "cpu": ("xla:chunked",)},
                   opt_in={"pallas_tpu:chunked": "why auto never takes it"})

`auto` on a device walks that device's row (the "cpu" row on a device the table does not name) and runs the
first implementation whose `supports` accepts the call. An explicit platform may run every implementation of that
platform, wherever its `supports` allows (Pallas kernels run on the CPU in interpret mode): its opt-in ones first
(asking for the platform by name is how they are reached), then those of the device's row in the row's order,
then the rest in table order.

`supports(inv)` says why an implementation cannot run a call (None: it can). One whose knobs have limits of
its own (a Pallas kernel's chunk or tile sizes) takes the config too, `supports(inv, cfg=None)`, and says why
it cannot run the call with that config; the registry calls it without one when choosing the implementation,
and with the full config before an explicit or cached one runs.

An implementation may bring its own gradient (`fwd`, `bwd`): the registry then wraps it in a
`jax.custom_vjp` over the problem's arrays, so every caller gets it.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence

import jax

from hybrax.core.config import KernelConfig

if TYPE_CHECKING:
    from hybrax.core.kernel import Invocation

Fn = Callable[[Any, KernelConfig], Any]
Supports = Callable[..., "str | None"]
FALLBACK_DEVICE = "cpu"  # the row `auto` reads on a device platform the table does not name


@dataclasses.dataclass(frozen=True)
class Implementation:
    op_id: str
    platform: str
    backend: str
    fn: Fn
    supports: Callable[["Invocation", KernelConfig | None], str | None]  # called as supports(inv[, cfg])
    make_heuristic_cfg: Callable[["Invocation"], KernelConfig]
    make_candidate_cfgs: Callable[["Invocation"], Sequence[KernelConfig]]

    @property
    def name(self) -> str:
        return f"{self.platform}:{self.backend}"

    def _stamp(self, cfg: KernelConfig) -> KernelConfig:
        return dataclasses.replace(cfg, platform=self.platform, backend=self.backend)

    def heuristic_cfg(self, inv: "Invocation") -> KernelConfig:
        return self._stamp(self.make_heuristic_cfg(inv))

    def candidate_cfgs(self, inv: "Invocation") -> list[KernelConfig]:
        return [self._stamp(cfg) for cfg in self.make_candidate_cfgs(inv)]

    def __call__(self, problem: Any, cfg: KernelConfig) -> Any:
        return self.fn(problem, cfg)


@dataclasses.dataclass(frozen=True)
class AutoOrder:
    """One op's table: `rows` maps a device platform to the implementation names `auto` tries there, in order;
    `opt_in` maps each implementation `auto` never takes to why."""

    rows: Mapping[str, tuple[str, ...]]
    opt_in: Mapping[str, str]

    def row(self, device: str) -> tuple[str, ...]:
        return self.rows.get(device, self.rows[FALLBACK_DEVICE])

    @property
    def order(self) -> tuple[str, ...]:
        """Every name the table holds: the opt-in ones, then each row's in turn (each name once)."""
        return tuple(dict.fromkeys([*self.opt_in, *(name for row in self.rows.values() for name in row)]))


_REGISTRY: dict[tuple[str, str, str], Implementation] = {}
_AUTO: dict[str, AutoOrder] = {}


def _supports_with_cfg(supports: Supports | None) -> Callable[["Invocation", KernelConfig | None], str | None]:
    """`supports` as a function of (inv, cfg=None): one that reads only the invocation ignores the config."""
    if supports is None:
        return lambda inv, cfg=None: None
    if len(inspect.signature(supports).parameters) >= 2:
        return supports
    return lambda inv, cfg=None: supports(inv)


def _with_custom_vjp(fn: Fn, fwd: Fn, bwd: Callable[[KernelConfig, Any, Any], Any]) -> Fn:
    """Wrap `fn(problem, cfg)` with a custom VJP; `bwd(cfg, residuals, ct)` returns a problem-shaped
    cotangent (see `hybrax.core.problem.cotangent`)."""

    @functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
    def call(problem: Any, cfg: KernelConfig) -> Any:
        return fn(problem, cfg)

    def call_fwd(problem: Any, cfg: KernelConfig) -> tuple[Any, Any]:
        return fwd(problem, cfg)

    def call_bwd(cfg: KernelConfig, residuals: Any, ct: Any) -> tuple[Any]:
        return (bwd(cfg, residuals, ct),)

    call.defvjp(call_fwd, call_bwd)
    return functools.wraps(fn)(call)


def register(
    op_id: str,
    platform: str,
    backend: str,
    *,
    heuristic_cfg: Callable[["Invocation"], KernelConfig],
    candidate_cfgs: Callable[["Invocation"], Sequence[KernelConfig]] | None = None,
    supports: Supports | None = None,
    fwd: Fn | None = None,
    bwd: Callable[[KernelConfig, Any, Any], Any] | None = None,
    gradient_of: Fn | None = None,
) -> Callable[[Fn], Fn]:
    """Decorator registering `fn(problem, cfg) -> out` as an implementation of `op_id`. Its gradient: autodiff,
    or a custom VJP (`fwd`, `bwd`), or `gradient_of`'s: another implementation of the same math that autodiff
    can differentiate, for kernels that have no backward (decode steps updating state in place). Where `auto`
    takes it is the op's table's business (`set_auto_order`)."""
    if (fwd is None) != (bwd is None) or (gradient_of is not None and fwd is not None):
        raise ValueError("register: give both fwd and bwd, or gradient_of, or neither")

    def decorate(fn: Fn) -> Fn:
        call = fn
        if gradient_of is not None:
            call = _with_custom_vjp(fn, lambda problem, cfg: (fn(problem, cfg), problem),
                                    lambda cfg, problem, ct: jax.vjp(lambda p: gradient_of(p, cfg), problem)[1](ct)[0])
        elif fwd is not None:
            call = _with_custom_vjp(fn, fwd, bwd)
        _REGISTRY[(op_id, platform, backend)] = Implementation(
            op_id=op_id,
            platform=platform,
            backend=backend,
            fn=call,
            supports=_supports_with_cfg(supports),
            make_heuristic_cfg=heuristic_cfg,
            make_candidate_cfgs=candidate_cfgs or (lambda inv: [heuristic_cfg(inv)]),
        )
        return fn

    return decorate


def set_auto_order(op_id: str, rows: Mapping[str, Sequence[str]], opt_in: Mapping[str, str] | None = None) -> None:
    """Set what `auto` tries for `op_id`, in order, per device platform ("cpu", "gpu", "tpu"; the "cpu" row also
    serves any other). opt_in: implementation name -> why `auto` never takes it (an explicit platform still
    does). Names are "platform:backend"; each registered implementation belongs in some row or in opt_in
    (the tests check it)."""
    if FALLBACK_DEVICE not in rows:
        raise ValueError(f"{op_id}: the auto table needs a {FALLBACK_DEVICE!r} row (the fallback), got {sorted(rows)}")
    opt_in = dict(opt_in or {})
    both = sorted(set(opt_in) & {name for row in rows.values() for name in row})
    if both:
        raise ValueError(f"{op_id}: {both} are both in an auto row and opt-in")
    _AUTO[op_id] = AutoOrder({device: tuple(row) for device, row in rows.items()}, opt_in)


def auto_order(op_id: str) -> AutoOrder:
    """The table `set_auto_order` set for `op_id`."""
    try:
        return _AUTO[op_id]
    except KeyError:
        raise ValueError(f"{op_id}: no auto table (its module calls set_auto_order after its backends register)"
                         ) from None


def implementations(op_id: str) -> list[Implementation]:
    """Every implementation registered for `op_id`, in its table's order (opt-in ones first, then each row's),
    any the table does not name last."""
    found = {impl.name: impl for (op, _, _), impl in _REGISTRY.items() if op == op_id}
    order = auto_order(op_id).order if op_id in _AUTO else ()
    return [found[name] for name in order if name in found] + [impl for name, impl in found.items()
                                                                 if name not in order]


def _listing(op_id: str) -> str:
    return ", ".join(impl.name for impl in implementations(op_id)) or "none"


def lookup(op_id: str, platform: str, backend: str) -> Implementation:
    try:
        return _REGISTRY[(op_id, platform, backend)]
    except KeyError:
        raise ValueError(
            f"{op_id}: no implementation {platform}:{backend}; registered: {_listing(op_id)}"
        ) from None


def auto_candidates(op_id: str, device: str) -> list[Implementation]:
    """What `auto` tries on `device`, in order: the table's row, as registered."""
    found = {impl.name: impl for impl in implementations(op_id)}
    return [found[name] for name in auto_order(op_id).row(device) if name in found]


def platform_candidates(op_id: str, platform: str, device: str) -> list[Implementation]:
    """What an explicit `platform` tries on `device`, in order: its opt-in implementations, those of the device's
    row in the row's order, then the rest in table order."""
    table = auto_order(op_id)
    everything = [impl for impl in implementations(op_id) if impl.platform == platform]
    row = [impl for impl in auto_candidates(op_id, device) if impl.platform == platform]
    opt_in = [impl for impl in everything if impl.name in table.opt_in]
    return opt_in + row + [impl for impl in everything if impl not in opt_in and impl not in row]


def supported(op_id: str, inv: "Invocation") -> list[Implementation]:
    """Implementations that can run `inv` on the platform it asked for, best first.

    `auto` walks the table's row of the runtime device; an explicit platform takes every implementation of
    that platform (`platform_candidates`). Raises ValueError that lists what exists (and why each candidate
    declined) when nothing fits.
    """
    if inv.platform == "auto":
        candidates = auto_candidates(op_id, inv.device)
    else:
        candidates = platform_candidates(op_id, inv.platform, inv.device)
        if not candidates:
            raise ValueError(
                f"{op_id}: platform {inv.platform!r} has no implementation; registered: {_listing(op_id)}"
            )
    reasons = {impl.name: impl.supports(inv) for impl in candidates}
    chosen = [impl for impl in candidates if reasons[impl.name] is None]
    if not chosen:
        why = "; ".join(f"{name}: {reason}" for name, reason in reasons.items()) or "none for this device"
        raise ValueError(f"{op_id}: no implementation supports this call on {inv.device} ({why})")
    return chosen
