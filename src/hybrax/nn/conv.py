"""`ShortConvolution`: the causal depthwise convolution of Kimi-style layers, then SiLU.

    y_t = silu(bias + sum_{s=0}^{W-1} weight[:, W-1-s] * x_{t-s})      per channel, x_{t-s} = 0 before the sequence

Training runs it as W shifted multiply-adds in fp32, each shift masked where the shifted token belongs to another
sequence (packed sequences never see each other). Serving keeps each request's last W - 1 inputs in a pool row by
slot (`hybrax.serving.short_conv_prefill` / `short_conv_decode`). Parameters follow flash-linear-attention's
`ShortConvolution` (a depthwise `nn.Conv1d`): weight [D, W] here ([D, 1, W] in PyTorch), optional bias [D], both
initialised as PyTorch does, uniform in +-1/sqrt(W).
"""

from __future__ import annotations

from typing import Any, Mapping

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Float, Int

from hybrax.core.validate import check_rank, check_shape
from hybrax.core.packing import packing
from hybrax.nn.weights import load_parameters
from hybrax.serving.short_conv import ACTIVATIONS, short_conv_decode, short_conv_prefill


def causal_conv(
    x: Float[Array, "batch seq_len dim"],
    weight: Float[Array, "dim width"],
    bias: Float[Array, " dim"] | None,
    segments: Int[Array, "batch seq_len"] | None,
    activation: str | None,
) -> Float[Array, "batch seq_len dim"]:
    """The convolution over B rows, in fp32, returned in x's dtype; segments (None: one sequence per row) keep each
    token to the earlier tokens of its own segment."""
    length, width = x.shape[1], weight.shape[1]
    x32, weight = x.astype(jnp.float32), weight.astype(jnp.float32)
    y = x32 * weight[:, width - 1]
    for back in range(1, min(width, length + 1)):
        shifted = jnp.pad(x32, ((0, 0), (back, 0), (0, 0)))[:, :length]
        if segments is not None:
            same = jnp.pad(segments, ((0, 0), (back, 0)), constant_values=-2)[:, :length] == segments
            shifted = jnp.where(same[..., None], shifted, 0.0)
        y = y + shifted * weight[:, width - 1 - back]
    if bias is not None:
        y = y + bias.astype(jnp.float32)
    return (jax.nn.silu(y) if activation == "silu" else y).astype(x.dtype)


class ShortConvolution(nnx.Module):
    """Causal depthwise convolution over `hidden_size` channels, width `kernel_size`, then `activation` ("silu" or
    None). `dtype`: the output's dtype (None: x's); parameters in `param_dtype`."""

    def __init__(self, hidden_size: int, kernel_size: int = 4, *, bias: bool = False, activation: str | None = "silu",
                 dtype: Any = None, param_dtype: Any = jnp.float32, rngs: nnx.Rngs):
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
        if not (isinstance(kernel_size, int) and kernel_size >= 1):
            raise ValueError(f"kernel_size must be an int >= 1, got {kernel_size!r}")
        self.hidden_size, self.kernel_size, self.activation, self.dtype = hidden_size, kernel_size, activation, dtype
        bound = kernel_size**-0.5
        init = nnx.initializers.uniform(2 * bound)
        self.weight = nnx.Param(init(rngs.params(), (hidden_size, kernel_size), param_dtype) - bound)
        self.bias = nnx.Param(init(rngs.params(), (hidden_size,), param_dtype) - bound) if bias else None

    def _input(self, x: Any, layout: str) -> jax.Array:
        check_rank("x", x, 3, layout)
        check_shape("x", x, (None, None, self.hidden_size), layout)
        return x if self.dtype is None else x.astype(self.dtype)

    def _bias(self) -> jax.Array | None:
        return None if self.bias is None else self.bias[...]

    def __call__(self, x: Float[Array, "batch seq_len dim"], *, cu_seqlens: Int[Array, " n_plus_1"] | None = None,
                 segment_ids: Int[Array, "batch seq_len"] | None = None) -> Float[Array, "batch seq_len dim"]:
        """Training and full-sequence inference: x [B, T, D] (one sequence per row, packed ones by cu_seqlens with
        B = 1, or by segment_ids [B, T]: see `hybrax.core.packing`)."""
        x = self._input(x, "[batch, seq_len, hidden_size]")
        return self.convolve(x, packing(x, cu_seqlens, segment_ids).segments)

    def convolve(self, x: Float[Array, "batch seq_len dim"], segments: Int[Array, "batch seq_len"] | None
                 ) -> Float[Array, "batch seq_len dim"]:
        """The convolution of x [B, T, D] (unchecked), each token seeing only its own segment's tokens (None: one
        sequence per row); `hybrax.core.packing` makes the segments."""
        return causal_conv(x, self.weight[...], self._bias(), segments, self.activation)

    def empty_cache(self, num_slots: int) -> Float[Array, "num_slots dim width_minus_1"]:
        """The conv-state pool: each slot's last W - 1 inputs, fp32, zeros."""
        return jnp.zeros((num_slots, self.hidden_size, self.kernel_size - 1), jnp.float32)

    def prefill(self, x: Float[Array, "batch seq_len dim"], cache: Float[Array, "num_slots dim width_minus_1"],
                slots: Int[Array, " num_sequences"], *, cu_seqlens: Int[Array, " n_plus_1"] | None = None,
                ) -> tuple[Float[Array, "batch seq_len dim"], Float[Array, "num_slots dim width_minus_1"]]:
        """New prompts (rows of x, or packed by cu_seqlens) into the slots, one per sequence (-1: padded; reads and
        writes nothing, outputs zeros). Each starts from an empty history. Returns (y, the new pool)."""
        x = self._input(x, "[batch, seq_len, hidden_size]")
        fresh = jnp.zeros(jnp.shape(slots), bool)
        return short_conv_prefill(x, cache, self.weight[...], slots, bias=self._bias(), has_initial_state=fresh,
                                  cu_seqlens=cu_seqlens, activation=self.activation)

    def decode(self, x: Float[Array, "batch 1 dim"], cache: Float[Array, "num_slots dim width_minus_1"],
               slots: Int[Array, " batch"]) -> tuple[Float[Array, "batch 1 dim"], Float[Array, "num_slots dim w"]]:
        """One token per request (slot -1: padded row). Returns (y [B, 1, D], the new pool)."""
        x = self._input(x, "[batch, 1, hidden_size]")
        check_shape("x", x, (None, 1, self.hidden_size), "[batch, 1, hidden_size]")
        y, cache = short_conv_decode(x[:, 0], cache, self.weight[...], slots, bias=self._bias(),
                                     activation=self.activation)
        return y[:, None], cache

    def load_fla_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """flash-linear-attention's names and PyTorch layouts: `weight` [D, 1, W], `bias` [D] (when built with
        bias=True), as NumPy arrays."""
        load_parameters(type(self).__name__, state_dict, conv_targets(self, ""))


class QkvShortConvs:
    """The q, k, v projections (q_proj, k_proj, v_proj) of a recurrent layer and their short convolutions
    (q_conv1d, k_conv1d, v_conv1d, with use_short_conv), as the GLA and KDA layers both hold them, and the check
    of their serving cache (the layer's `cache_type`, holding the conv pool as `conv` with use_short_conv)."""

    cache_type: type

    def _check_cache(self, cache: Any) -> None:
        if not isinstance(cache, self.cache_type):
            raise ValueError(f"cache must be this layer's {self.cache_type.__name__} (from empty_cache), "
                             f"got {type(cache).__name__}")
        if (cache.conv is None) == self.use_short_conv:
            raise ValueError(f"cache.conv must be {'an array' if self.use_short_conv else 'None'} for a layer with "
                             f"use_short_conv={self.use_short_conv}")

    def _convs(self) -> tuple[ShortConvolution, ShortConvolution, ShortConvolution]:
        return self.q_conv1d, self.k_conv1d, self.v_conv1d

    def _projections(self, x: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        return self.q_proj(x), self.k_proj(x), self.v_proj(x)

    def _conv_weights(self) -> tuple[jax.Array, jax.Array | None]:
        """The three convolutions as one over the concatenated q, k, v channels: weight [D, W], bias [D] or None."""
        weight = jnp.concatenate([conv.weight[...] for conv in self._convs()])
        has_bias = self.q_conv1d.bias is not None
        return weight, jnp.concatenate([conv.bias[...] for conv in self._convs()]) if has_bias else None


def conv_targets(conv: ShortConvolution, prefix: str) -> dict:
    """The conv's parameters by fla name: (variable, PyTorch shape, to our layout)."""
    targets = {prefix + "weight": (conv.weight, (conv.hidden_size, 1, conv.kernel_size), lambda w: w[:, 0])}
    if conv.bias is not None:
        targets[prefix + "bias"] = (conv.bias, (conv.hidden_size,), None)
    return targets
