"""The registry: (op_id, platform, backend) -> implementation, with priorities and support checks.

Backend files register themselves when their op's package is imported:

    @register("kernel_delta_attention", "xla", "chunked", priority=10,
              heuristic_cfg=..., candidate_cfgs=..., supports=...)
    def chunked(problem, cfg): ...

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
from typing import TYPE_CHECKING, Any, Callable, Sequence

import jax

from hybrax.core.config import KernelConfig

if TYPE_CHECKING:
    from hybrax.core.kernel import Invocation

Fn = Callable[[Any, KernelConfig], Any]
Supports = Callable[..., "str | None"]


@dataclasses.dataclass(frozen=True)
class Implementation:
    op_id: str
    platform: str
    backend: str
    fn: Fn
    priority: int
    # Runtime devices on which `auto` may choose it; an explicit platform may run it anywhere
    # its `supports` allows (Pallas kernels run on the CPU in interpret mode).
    devices: frozenset[str]
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


_REGISTRY: dict[tuple[str, str, str], Implementation] = {}


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
    priority: int = 0,
    devices: Sequence[str] = ("cpu", "gpu", "tpu"),
    fwd: Fn | None = None,
    bwd: Callable[[KernelConfig, Any, Any], Any] | None = None,
    gradient_of: Fn | None = None,
) -> Callable[[Fn], Fn]:
    """Decorator registering `fn(problem, cfg) -> out` as an implementation of `op_id`. Its gradient: autodiff,
    or a custom VJP (`fwd`, `bwd`), or `gradient_of`'s: another implementation of the same math that autodiff
    can differentiate, for kernels that have no backward (decode steps updating state in place)."""
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
            priority=priority,
            devices=frozenset(devices),
            supports=_supports_with_cfg(supports),
            make_heuristic_cfg=heuristic_cfg,
            make_candidate_cfgs=candidate_cfgs or (lambda inv: [heuristic_cfg(inv)]),
        )
        return fn

    return decorate


def implementations(op_id: str) -> list[Implementation]:
    """Every implementation registered for `op_id`, highest priority first."""
    found = [impl for (op, _, _), impl in _REGISTRY.items() if op == op_id]
    return sorted(found, key=lambda impl: -impl.priority)


def _listing(op_id: str) -> str:
    return ", ".join(impl.name for impl in implementations(op_id)) or "none"


def lookup(op_id: str, platform: str, backend: str) -> Implementation:
    try:
        return _REGISTRY[(op_id, platform, backend)]
    except KeyError:
        raise ValueError(
            f"{op_id}: no implementation {platform}:{backend}; registered: {_listing(op_id)}"
        ) from None


def supported(op_id: str, inv: "Invocation") -> list[Implementation]:
    """Implementations that can run `inv` on the platform it asked for, best first.

    `auto` takes those whose `devices` include the runtime device. Raises ValueError that lists
    what exists (and why each candidate declined) when nothing fits.
    """
    if inv.platform == "auto":
        candidates = [impl for impl in implementations(op_id) if inv.device in impl.devices]
    else:
        candidates = [impl for impl in implementations(op_id) if impl.platform == inv.platform]
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
