"""`Kernel[Cfg, Out]` and `Invocation`: the seam between a public operation and its implementations.

A kernel validates a call once (`prepare`) into a canonical problem; the executor turns that problem
into an `Invocation` (shapes, dtypes, static options, device) and picks a config; `execute` runs the
registered implementation the config names.
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Any, ClassVar, Generic, Sequence, TypeVar

import jax
import jax.numpy as jnp

from hybrax.core import registry
from hybrax.core.config import PLATFORMS, KernelConfig
from hybrax.core.problem import array_fields, static_fields
from hybrax.core.sharding import vary_like

Cfg = TypeVar("Cfg", bound=KernelConfig)
Out = TypeVar("Out")


def runtime_device() -> str:
    """The platform the default device runs on: 'cpu', 'gpu' or 'tpu'."""
    return jax.default_backend()


def device_kind() -> str:
    return jax.devices()[0].device_kind


def _platform(device: jax.Device) -> str:
    return "gpu" if device.platform in ("gpu", "cuda", "rocm") else device.platform


def arrays_device(problem: Any) -> jax.Device | None:
    """The device of the problem's arrays in an eager call; None under a trace (any tracer: the
    computation then runs where the trace is placed) or with no array."""
    arrays = [a for a in array_fields(problem).values() if isinstance(a, jax.Array)]
    if not arrays or any(isinstance(a, jax.core.Tracer) for a in arrays):
        return None
    return next(iter(arrays[0].devices()))


@dataclasses.dataclass(frozen=True)
class Invocation(Generic[Cfg, Out]):
    """One call as the executor sees it: never concrete values, only shapes, dtypes and options.

    `problem` may hold tracers (the executor runs at trace time); read only `.shape` and `.dtype`.
    """

    op_id: str
    version: int
    problem: Any
    platform: str  # what the caller asked for: one of PLATFORMS
    device: str  # where it runs: 'cpu', 'gpu', 'tpu'
    device_kind: str

    @property
    def arrays(self) -> dict[str, jax.ShapeDtypeStruct | None]:
        return {
            name: None if a is None else jax.ShapeDtypeStruct(jnp.shape(a), jnp.result_type(a))
            for name, a in array_fields(self.problem).items()
        }

    @property
    def static(self) -> dict[str, Any]:
        return static_fields(self.problem)

    def signature(self) -> str:
        """A readable, stable description of everything that selects a config."""
        arrays = ",".join(
            f"{name}=None" if s is None else f"{name}={s.dtype}{list(s.shape)}"
            for name, s in self.arrays.items()
        )
        static = ",".join(f"{k}={v!r}" for k, v in sorted(self.static.items()))
        return f"{self.op_id}@v{self.version}|{self.device_kind}|platform={self.platform}|{arrays}|{static}"

    @property
    def key(self) -> str:
        return hashlib.sha256(self.signature().encode()).hexdigest()[:32]


def _with_heuristic_knobs(cfg: Cfg, impl: registry.Implementation, inv: Invocation) -> Cfg:
    """`cfg` with each knob left None set to the implementation's heuristic value."""
    unset = [f.name for f in dataclasses.fields(cfg) if getattr(cfg, f.name) is None]
    if not unset:
        return cfg
    heuristic = impl.heuristic_cfg(inv)
    return dataclasses.replace(cfg, **{name: getattr(heuristic, name) for name in unset})


class Kernel(Generic[Cfg, Out]):
    """Base of every operation.

    Subclasses set `op_id` and `config_type` and implement `prepare`. The defaults of
    `get_impl`, `heuristic_cfg` and `candidate_cfgs` ask the registry, where each implementation
    brings its own heuristic and candidates.
    """

    op_id: ClassVar[str]
    config_type: ClassVar[type[KernelConfig]] = KernelConfig
    version: ClassVar[int] = 1

    def prepare(self, *args: Any, **kwargs: Any) -> Any:
        """Validate the call and return its canonical problem. Raises ValueError on bad input."""
        raise NotImplementedError

    def finalize(self, problem: Any, result: Any) -> Any:
        """Turn an implementation's result into the public return value (default: unchanged)."""
        return result

    def invocation(self, problem: Any, platform: str | None = None) -> Invocation:
        platform = platform or "auto"
        if platform not in PLATFORMS:
            raise ValueError(f"platform must be one of {PLATFORMS}, got {platform!r}")
        # Where the arrays live (eager calls); under jit, where the computation runs by default.
        device = arrays_device(problem)
        if device is None:
            return Invocation(self.op_id, self.version, problem, platform, runtime_device(), device_kind())
        return Invocation(self.op_id, self.version, problem, platform, _platform(device), device.device_kind)

    def implementations(self, inv: Invocation) -> list[registry.Implementation]:
        """Registered implementations that support `inv`, best first."""
        return registry.supported(self.op_id, inv)

    def get_impl(self, cfg: Cfg) -> registry.Implementation:
        return registry.lookup(self.op_id, cfg.platform, cfg.backend)

    def heuristic_cfg(self, inv: Invocation) -> Cfg:
        return self.implementations(inv)[0].heuristic_cfg(inv)

    def candidate_cfgs(self, inv: Invocation) -> Sequence[Cfg]:
        return [cfg for impl in self.implementations(inv) for cfg in impl.candidate_cfgs(inv)]

    def resolve(self, inv: Invocation, cfg: Cfg) -> Cfg:
        """Fill an explicit config's 'auto' platform/backend with the best implementation that supports the call
        with the config's knobs; a config that names one must name one that does (else ValueError with its
        reason). Knobs left None take that implementation's heuristic values."""
        if cfg.is_resolved:
            impl = self.get_impl(cfg)
            reason = impl.supports(inv)
            if reason is None:
                cfg = _with_heuristic_knobs(cfg, impl, inv)
                reason = impl.supports(inv, cfg)
            if reason is not None:
                raise ValueError(f"{self.op_id}: {cfg.platform}:{cfg.backend} cannot run this call: {reason}")
            return cfg
        reasons = {}
        for impl in self.implementations(inv):
            if cfg.platform in ("auto", impl.platform) and cfg.backend in ("auto", impl.backend):
                resolved = dataclasses.replace(cfg, platform=impl.platform, backend=impl.backend)
                resolved = _with_heuristic_knobs(resolved, impl, inv)
                reasons[impl.name] = impl.supports(inv, resolved)
                if reasons[impl.name] is None:
                    return resolved
        why = "".join(f"; {name}: {reason}" for name, reason in reasons.items())
        raise ValueError(f"{self.op_id}: no implementation matches cfg {cfg}{why}")

    def execute(self, problem: Any, cfg: Cfg) -> Out:
        """Run the implementation `cfg` names. Inside `jax.shard_map` every array of the problem first varies over
        every mesh axis that one of them does: a custom backward returns cotangents varying there (they mix all the
        inputs), which JAX accepts only for inputs of that type, and the cast's transpose sums a replicated input's
        cotangent over the axes it was replicated on (a psum), as JAX's own autodiff would."""
        problem = vary_like(problem, problem)
        return self.finalize(problem, self.get_impl(cfg)(problem, cfg))

    def run(self, *args: Any, platform: str | None = None, cfg: Cfg | None = None, **kwargs: Any) -> Out:
        """Run with an explicit config (or the heuristic one), without the executor's caches."""
        problem = self.prepare(*args, **kwargs)
        inv = self.invocation(problem, platform)
        cfg = self.heuristic_cfg(inv) if cfg is None else self.resolve(inv, cfg)
        return self.execute(problem, cfg)

    def autotune_problem(self, inv: Invocation, rng: jax.Array) -> Any:
        """Concrete random inputs of the invocation's shapes for timing candidates.

        Floating arrays get N(0, 1) draws; integer arrays zeros. Kernels with constrained inputs
        (negative gates, cumulative lengths) override this.
        """
        arrays = {}
        for index, (name, spec) in enumerate(inv.arrays.items()):
            if spec is None:
                arrays[name] = None
            elif jnp.issubdtype(spec.dtype, jnp.inexact):
                arrays[name] = jax.random.normal(jax.random.fold_in(rng, index), spec.shape, spec.dtype)
            else:
                arrays[name] = jnp.zeros(spec.shape, spec.dtype)
        return dataclasses.replace(inv.problem, **arrays)
