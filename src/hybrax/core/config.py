"""Kernel configurations: which implementation runs, and the knobs that change only its speed.

A config is checked when it is made (`KernelConfig.validate`): `platform` one of PLATFORMS, `backend` a name,
and every knob None (the chosen implementation's heuristic value) or an int its field accepts: a positive one
unless the field is declared with `knob(..., need=..., accept=...)`. What a knob may hold for one
implementation (a Pallas kernel's tile sizes) is that implementation's `supports(inv, cfg)` to say.
"""

from __future__ import annotations

import dataclasses
import json
import numbers
from typing import Any, Callable, Literal, TypeVar

Platform = Literal["xla", "pallas", "pallas_tpu", "triton", "cuda", "auto"]
PLATFORMS: tuple[str, ...] = ("xla", "pallas", "pallas_tpu", "triton", "cuda", "auto")

C = TypeVar("C", bound="KernelConfig")

_NEED = "hybrax_knob_need"
_IDENTITY = ("platform", "backend")


def is_power_of_two(value: int) -> bool:
    return value >= 1 and value & (value - 1) == 0


def _positive(value: int) -> bool:
    return value >= 1


def knob(default: int | None = None, *, need: str = "a positive integer",
         accept: Callable[[int], bool] = _positive) -> Any:
    """A config field tuning speed: None or an int for which `accept` holds; `need` says which in words for the
    error message, e.g. 'a power of two'."""
    return dataclasses.field(default=default, metadata={_NEED: (need, accept)})


def _is_int(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


@dataclasses.dataclass(frozen=True)
class KernelConfig:
    """Base of every op's config.

    `platform` and `backend` name the implementation ("auto" lets the executor choose); subclasses
    add tuning fields (chunk sizes, block sizes) that never change the math. In an explicit config, a
    field left None takes the chosen implementation's heuristic value.
    """

    platform: Platform = "auto"
    backend: str = "auto"

    def __post_init__(self) -> None:
        self.validate()
        for field in dataclasses.fields(self):  # numpy integers become ints: one hash, and JSON takes them
            value = getattr(self, field.name)
            if field.name not in _IDENTITY and value is not None:
                object.__setattr__(self, field.name, int(value))

    def validate(self) -> None:
        """Raise ValueError naming the first field holding what no implementation could take."""
        name = type(self).__name__
        if not isinstance(self.platform, str) or self.platform not in PLATFORMS:
            raise ValueError(f"{name}.platform must be one of {PLATFORMS}, got {self.platform!r}")
        if not isinstance(self.backend, str) or not self.backend:
            raise ValueError(f"{name}.backend must be an implementation's name or 'auto', got {self.backend!r}")
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if field.name in _IDENTITY or value is None:
                continue
            need, accept = field.metadata.get(_NEED, ("a positive integer", _positive))
            if not (_is_int(value) and accept(int(value))):
                raise ValueError(f"{name}.{field.name} must be {need} (or None: the implementation's heuristic "
                                 f"value), got {value!r}")

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    @classmethod
    def from_dict(cls: type[C], values: Any) -> C:
        """The config a dict of its fields describes (a cache entry's "cfg"), checked: ValueError for anything
        else (not a dict, a field this config lacks, a value `validate` rejects)."""
        if not isinstance(values, dict):
            raise ValueError(f"{cls.__name__} needs a dict of its fields, got {type(values).__name__}")
        unknown = sorted(str(key) for key in set(values) - {f.name for f in dataclasses.fields(cls)})
        if unknown:
            raise ValueError(f"{cls.__name__} has no field {', '.join(unknown)}")
        return cls(**values)

    @property
    def is_resolved(self) -> bool:
        return self.platform != "auto" and self.backend != "auto"
