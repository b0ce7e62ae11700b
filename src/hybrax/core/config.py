"""Kernel configurations: which implementation runs, and the knobs that change only its speed."""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Literal, TypeVar

Platform = Literal["xla", "pallas", "triton", "cuda", "auto"]
PLATFORMS: tuple[str, ...] = ("xla", "pallas", "triton", "cuda", "auto")

C = TypeVar("C", bound="KernelConfig")


@dataclasses.dataclass(frozen=True)
class KernelConfig:
    """Base of every op's config.

    `platform` and `backend` name the implementation ("auto" lets the executor choose); subclasses
    add tuning fields (chunk sizes, block sizes) that never change the math. In an explicit config, a
    field left None takes the chosen implementation's heuristic value.
    """

    platform: Platform = "auto"
    backend: str = "auto"

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    @classmethod
    def from_dict(cls: type[C], values: dict[str, Any]) -> C:
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in values.items() if k in known})

    @property
    def is_resolved(self) -> bool:
        return self.platform != "auto" and self.backend != "auto"
