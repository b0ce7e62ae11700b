"""What both GPU decode kernels take besides the arrays: the gate's form and the scalar operand.

    GATES          the forms of the gate the kernels fuse, by name (the CUDA kernel reads the index):
                   activated (g is the log decay), softplus -exp(a_log) softplus(g + dt_bias),
                   bounded lower_bound sigmoid(exp(a_log) (g + dt_bias))
    step_scalars   [scale, lower_bound] in fp32, one operand, so that traced values need no recompile
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

GATES = ("activated", "softplus", "bounded")


def step_scalars(scale: Any, lower_bound: Any) -> jax.Array:
    """[scale, lower_bound (0 when None)] in fp32: the decode kernels' scalar operand (numbers or traced arrays)."""
    return jnp.stack([
        jnp.asarray(scale, jnp.float32).reshape(()),
        jnp.asarray(0.0 if lower_bound is None else lower_bound, jnp.float32).reshape(()),
    ])
