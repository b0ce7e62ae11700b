"""A toy op registered only for the framework's tests: y = weight * x, with an optional offset."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from hybrax.core import Kernel, KernelConfig, cotangent, problem_dataclass, register, set_auto_order, static_field
from hybrax.core.validate import check_floating

OP_ID = "toy_scale"


@dataclasses.dataclass(frozen=True)
class ToyConfig(KernelConfig):
    block: int = 1


@problem_dataclass
class ToyProblem:
    x: jax.Array
    weight: jax.Array
    offset: jax.Array | None
    squared: bool = static_field(False)


class Toy(Kernel[ToyConfig, jax.Array]):
    op_id = OP_ID
    config_type = ToyConfig

    def prepare(self, x, weight, offset=None, *, squared=False):
        check_floating("x", x)
        return ToyProblem(x, weight, offset, squared)


def _math(p: ToyProblem) -> jax.Array:
    y = p.weight * (p.x * p.x if p.squared else p.x)
    return y if p.offset is None else y + p.offset


# Two "backends": a plain one, and a custom-VJP one whose backward is deliberately exact.
@register(OP_ID, "xla", "plain", heuristic_cfg=lambda inv: ToyConfig(block=1),
          candidate_cfgs=lambda inv: [ToyConfig(block=b) for b in (1, 2)])
def plain(p: ToyProblem, cfg: ToyConfig) -> jax.Array:
    return _math(p)


def _fwd(p, cfg):
    return _math(p), p


def _bwd(cfg, p, ct):
    dx = ct * p.weight * (2 * p.x if p.squared else 1.0)
    dw = jnp.sum(ct * (p.x * p.x if p.squared else p.x))
    return cotangent(p, x=dx, weight=dw, offset=None if p.offset is None else ct)


@register(OP_ID, "xla", "custom_vjp", heuristic_cfg=lambda inv: ToyConfig(), fwd=_fwd, bwd=_bwd)
def custom(p: ToyProblem, cfg: ToyConfig) -> jax.Array:
    return _math(p)


# Registered on the 'pallas' platform and wrong on purpose: autotuning must discard it. It declines squared
# calls, so that an explicit config naming it for one must fail with that reason.
@register(OP_ID, "pallas", "wrong", heuristic_cfg=lambda inv: ToyConfig(),
          supports=lambda inv: "no squared calls" if inv.static["squared"] else None)
def wrong(p: ToyProblem, cfg: ToyConfig) -> jax.Array:
    return _math(p) + 1.0


# The plain one first everywhere; the wrong one last, and on the CPU only (so that autotuning meets it there).
set_auto_order(OP_ID, {
    "gpu": ("xla:plain", "xla:custom_vjp"),
    "tpu": ("xla:plain", "xla:custom_vjp"),
    "cpu": ("xla:plain", "xla:custom_vjp", "pallas:wrong"),
})
