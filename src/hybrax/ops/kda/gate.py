"""KDA's gate activations in JAX (fp32), applied once in `prepare` so every implementation sees an
activated log decay and an activated beta; gradients reach a_log and dt_bias through autodiff.

    softplus gate (Kimi Linear's released form): g = -exp(a_log) * softplus(raw + dt_bias)
    bounded gate (the NKI `kda_tkg`'s, fla's "safe gate"):  g = lower_bound * sigmoid(exp(a_log) * (raw + dt_bias))
Both are <= 0 (lower_bound <= 0), so exp(g) is in (0, 1] and a decay never amplifies the state.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float


def fused_gate(
    raw: Float[Array, "B T HV *K"],
    a_log: Float[Array, " HV"],
    dt_bias: Float[Array, "HV K"] | None = None,
    lower_bound: Any = None,
) -> Float[Array, "B T HV *K"]:
    """The log decay from the raw gate input. raw [B, T, HV, K] or [B, T, HV]; a_log [HV];
    dt_bias [HV, K] (then the result is per channel, [B, T, HV, K]) or None; lower_bound None
    (softplus gate) or a scalar <= 0 (bounded gate)."""
    raw = raw.astype(jnp.float32)
    if dt_bias is not None:
        raw = (raw[..., None] if raw.ndim == 3 else raw) + dt_bias.astype(jnp.float32)
    rate = jnp.exp(a_log.astype(jnp.float32))
    rate = rate[:, None] if raw.ndim == 4 else rate
    if lower_bound is None:
        return -rate * jax.nn.softplus(raw)
    return jnp.asarray(lower_bound, jnp.float32).reshape(()) * jax.nn.sigmoid(rate * raw)


def activate_beta(beta: Float[Array, "B T HV"], is_logits: bool) -> Float[Array, "B T HV"]:
    """beta in fp32, through a sigmoid when it holds logits."""
    beta = beta.astype(jnp.float32)
    return jax.nn.sigmoid(beta) if is_logits else beta
