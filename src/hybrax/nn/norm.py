"""RMS norms over the last axis, in fp32, returned in the input's dtype (or `dtype`):

    RMSNorm:        y = x / sqrt(mean(x^2) + eps) * weight
    GatedRMSNorm:   y = x / sqrt(mean(x^2) + eps) * weight * act(gate),  act = sigmoid (KDA's output gate) or
                    swish / silu (gate * sigmoid(gate))
as flash-linear-attention's `RMSNorm` and `FusedRMSNormGated` (weight initialised to ones, fla name `weight`).
"""

from __future__ import annotations

from typing import Any, Mapping

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Float

from hybrax.core.validate import check_shape
from hybrax.nn.weights import load_parameters

GATE_ACTIVATIONS = ("sigmoid", "swish", "silu")


def _normalized(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    x = x.astype(jnp.float32)
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps) * weight.astype(jnp.float32)


class RMSNorm(nnx.Module):
    """RMS norm over the last axis of size `hidden_size`."""

    def __init__(self, hidden_size: int, *, eps: float = 1e-5, dtype: Any = None, param_dtype: Any = jnp.float32):
        self.hidden_size, self.eps, self.dtype = hidden_size, eps, dtype
        self.weight = nnx.Param(jnp.ones((hidden_size,), param_dtype))

    def __call__(self, x: Float[Array, "*batch hidden"]) -> Float[Array, "*batch hidden"]:
        check_shape("x", x, (*jnp.shape(x)[:-1], self.hidden_size), "[..., hidden_size]")
        return _normalized(x, self.weight[...], self.eps).astype(self.dtype or x.dtype)

    def load_fla_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """`weight` [hidden_size] as a NumPy array."""
        load_parameters(type(self).__name__, state_dict, {"weight": (self.weight, (self.hidden_size,), None)})


class GatedRMSNorm(nnx.Module):
    """RMS norm of x times act(gate), both [..., hidden_size]; `activation` "sigmoid", "swish" or "silu"."""

    def __init__(self, hidden_size: int, *, eps: float = 1e-5, activation: str = "sigmoid", dtype: Any = None,
                 param_dtype: Any = jnp.float32):
        if activation not in GATE_ACTIVATIONS:
            raise ValueError(f"activation must be one of {GATE_ACTIVATIONS}, got {activation!r}")
        self.hidden_size, self.eps, self.activation, self.dtype = hidden_size, eps, activation, dtype
        self.weight = nnx.Param(jnp.ones((hidden_size,), param_dtype))

    def __call__(self, x: Float[Array, "*batch hidden"], gate: Float[Array, "*batch hidden"]
                 ) -> Float[Array, "*batch hidden"]:
        check_shape("x", x, (*jnp.shape(x)[:-1], self.hidden_size), "[..., hidden_size]")
        check_shape("gate", gate, jnp.shape(x), "x's shape")
        gate = gate.astype(jnp.float32)
        act = jax.nn.sigmoid(gate) if self.activation == "sigmoid" else jax.nn.silu(gate)
        return (_normalized(x, self.weight[...], self.eps) * act).astype(self.dtype or x.dtype)

    def load_fla_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """`weight` [hidden_size] as a NumPy array."""
        load_parameters(type(self).__name__, state_dict, {"weight": (self.weight, (self.hidden_size,), None)})
