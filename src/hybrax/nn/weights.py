"""Loading flash-linear-attention (PyTorch) weights into the layers' parameters.

A layer lists its parameters by fla name as targets: (variable, the PyTorch shape, the map to our layout).
Everything is checked before anything is written, so a failed load leaves the layer as it was.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

import jax.numpy as jnp
import numpy as np
from flax import nnx

from hybrax.core.validate import describe

Target = tuple[nnx.Variable, tuple[int, ...], Callable[[np.ndarray], np.ndarray] | None]


def linear_targets(linear: nnx.Linear, prefix: str) -> dict[str, Target]:
    """An `nnx.Linear` (kernel [in, out]) from PyTorch's `weight` [out, in] and `bias` [out]."""
    targets = {prefix + "weight": (linear.kernel, (linear.out_features, linear.in_features), np.transpose)}
    if linear.bias is not None:
        targets[prefix + "bias"] = (linear.bias, (linear.out_features,), None)
    return targets


def _converted(name: str, value: Any, shape: tuple[int, ...], convert: Callable | None) -> np.ndarray:
    array = np.asarray(value)
    if array.shape != shape:
        raise ValueError(f"{name} must have shape {describe(shape)} (PyTorch layout), got {describe(array.shape)}")
    if not np.issubdtype(array.dtype, np.floating):
        raise ValueError(f"{name} must be a floating-point array, got dtype {array.dtype}")
    return array if convert is None else convert(array)


def load_parameters(owner: str, state_dict: Mapping[str, Any], targets: Mapping[str, Target]) -> None:
    """Write state_dict[name] into each target's variable (cast to its dtype; a variable may hold just a shape, as
    `nnx.eval_shape` builds it, so a layer can be made without initialising it); the names must match exactly."""
    missing, unexpected = sorted(set(targets) - set(state_dict)), sorted(set(state_dict) - set(targets))
    if missing or unexpected:
        raise ValueError(f"{owner}.load_fla_state_dict needs exactly the names {sorted(targets)}: "
                         f"missing {missing}, unexpected {unexpected}")
    values = {name: _converted(name, state_dict[name], shape, convert)
              for name, (_, shape, convert) in targets.items()}
    for name, (variable, _, _) in targets.items():
        variable.set_value(jnp.asarray(values[name], variable.get_value().dtype))
