"""Kimi Delta Attention's problem, config and `Kernel`, shared by the public functions and every backend (backends
import this module, never `api.py`).

Per value head, with the state S of shape [K, V] in fp32 (decay first, then the delta rule on the
decayed state, as the Kimi Linear paper and flash-linear-attention's naive_kda):
    S' = Diag(exp(decay_t)) S_{t-1};  S_t = S' + k_t (beta_t (v_t - S'^T k_t))^T;  o_t = S_t^T (scale q_t)

`KernelDeltaAttention.prepare` validates a call once and resolves every option that changes the math
into a `KdaProblem`: the fused gate (a_log, dt_bias, lower_bound) and beta logits are activated,
decay None becomes zeros, the state becomes fp32. Implementations only compute; each returns
(output [B, T, HV, V] in q's dtype, final state [B or N, HV, K, V] in fp32).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from hybrax.core import Kernel, KernelConfig, problem_dataclass, static_field, vary_like
from hybrax.core.config import is_power_of_two, knob
from hybrax.core.kernel import Invocation
from hybrax.core.validate import (
    check_at_least_one, check_cu_seqlens, check_divides, check_floating, check_number, check_rank, check_shape, describe, is_concrete,
)
from hybrax.ops.kda.gate import activate_beta, fused_gate

OP_ID = "kernel_delta_attention"
CHUNK_SIZES = (16, 32, 64, 128)
L2_EPS = 1e-6  # q and k L2-normalized as x / sqrt(sum x^2 + L2_EPS), in every implementation and the reference
GATE_FLOOR = -1e30  # the chunked implementations clamp log decays here, exactly (`xla/chunked.py` says why)


@dataclasses.dataclass(frozen=True)
class KernelDeltaAttentionConfig(KernelConfig):
    """Speed knobs only. chunk_size: tokens per chunk of the chunked implementations, a power of two (XLA takes
    any; the Pallas kernels 16, 32, 64 or 128)."""

    chunk_size: int = knob(64, need="a power of two", accept=is_power_of_two)


@problem_dataclass
class KdaProblem:
    """The canonical problem. B batch, T tokens, H query/key heads, HV value heads (a multiple of H;
    value head h reads query/key head h // (HV // H)), K key dim, V value dim, N sequences.

    q, k [B, T, H, K] and v [B, T, HV, V]: one dtype (the output's), raw; normalized inside when
        `use_qk_l2norm` (x / sqrt(sum x^2 + 1e-6), fp32).
    beta [B, T, HV] fp32, activated (in [0, 1] for sigmoid betas).
    decay [B, T, HV, K] (per key channel) or [B, T, HV, 1] (per head, broadcast over K): fp32 log
        decay, activated, expected <= 0 (zeros: no decay).
    initial_state [B, HV, K, V] fp32, or [N, HV, K, V] with cu_seqlens, or None (zeros).
    cu_seqlens [N + 1] int32 or None: packed sequences in a batch of one; sequence n is tokens
        cu_seqlens[n]:cu_seqlens[n + 1]. Tokens past cu_seqlens[-1] belong to none: output 0
        (`hybrax.core.validate.check_cu_seqlens` states the rule).
    chunk_size and use_chunked are the caller's hints (the default config's chunk size, and whether
    the chunked algorithm is wanted); they never change the result.
    """

    q: Float[Array, "B T H K"]
    k: Float[Array, "B T H K"]
    v: Float[Array, "B T HV V"]
    beta: Float[Array, "B T HV"]
    decay: Float[Array, "B T HV Kd"]
    initial_state: Float[Array, "N HV K V"] | None
    cu_seqlens: Int[Array, " N1"] | None
    scale: float = static_field()
    use_qk_l2norm: bool = static_field(True)
    return_state: bool = static_field(False)
    chunk_size: int = static_field(64)
    use_chunked: bool = static_field(True)

    @property
    def num_sequences(self) -> int:
        return self.q.shape[0] if self.cu_seqlens is None else self.cu_seqlens.shape[0] - 1

    @property
    def state_shape(self) -> tuple[int, int, int, int]:
        return (self.num_sequences, self.v.shape[2], self.q.shape[3], self.v.shape[3])

    def initial_states(self) -> Float[Array, "N HV K V"]:
        """The initial state, or zeros of `state_shape` (inside shard_map, varying as the inputs do)."""
        if self.initial_state is not None:
            return self.initial_state
        return vary_like(jnp.zeros(self.state_shape, jnp.float32), self.q, self.k, self.v, self.beta, self.decay)


def _check_qkv(query: Any, key: Any, value: Any) -> None:
    check_rank("query", query, 4, "[batch, seq_len, num_heads, head_dim]")
    check_shape("key", key, jnp.shape(query), "[batch, seq_len, num_heads, head_dim] (query's shape)")
    check_rank("value", value, 4, "[batch, seq_len, num_value_heads, v_head_dim]")
    batch, length, heads, _ = jnp.shape(query)
    check_shape("value", value, (batch, length, None, None), "[batch, seq_len, num_value_heads, v_head_dim]")
    check_at_least_one("query", query, {0: "batch", 2: "num_heads", 3: "head_dim"})
    check_at_least_one("value", value, {2: "num_value_heads", 3: "v_head_dim"})
    check_divides("num_heads of query", heads, "num_value_heads of value", jnp.shape(value)[2])
    for name, array in (("query", query), ("key", key), ("value", value)):
        check_floating(name, array)
    dtypes = {jnp.result_type(x) for x in (query, key, value)}
    if len(dtypes) > 1:
        raise ValueError(
            f"query, key and value must share one dtype, got {jnp.result_type(query)}, "
            f"{jnp.result_type(key)}, {jnp.result_type(value)}"
        )


def _gate_parameters(a_log: Any, dt_bias: Any, heads: int, dk: int) -> tuple[Any, Any]:
    check_shape("a_log", a_log, (heads,), "[num_value_heads]")
    check_floating("a_log", a_log)
    if dt_bias is None:
        return a_log, None
    if jnp.shape(dt_bias) not in ((heads, dk), (heads * dk,)):
        raise ValueError(
            f"dt_bias must have shape [num_value_heads, head_dim] = [{heads}, {dk}] or "
            f"[num_value_heads * head_dim] = [{heads * dk}], got {describe(jnp.shape(dt_bias))}"
        )
    check_floating("dt_bias", dt_bias)
    return a_log, jnp.reshape(dt_bias, (heads, dk))


def _check_lower_bound(lower_bound: Any) -> None:
    """A number or one-element array <= 0 (its value is checked unless it is traced)."""
    if jnp.size(lower_bound) != 1:
        shape = describe(jnp.shape(lower_bound))
        raise ValueError(f"lower_bound must be a scalar or an array of one element, got {shape}")
    if is_concrete(lower_bound) and not float(np.asarray(lower_bound).reshape(())) <= 0:
        raise ValueError(f"lower_bound must be <= 0 (the gate is lower_bound * sigmoid(...)), got {lower_bound}")


def _log_decay(decay: Any, a_log: Any, dt_bias: Any, lower_bound: Any, batch: int, length: int, heads: int,
               dk: int) -> jax.Array:
    """The activated log decay [B, T, HV, K] or [B, T, HV, 1] in fp32."""
    layout = "[batch, seq_len, num_value_heads] or [batch, seq_len, num_value_heads, head_dim]"
    if a_log is None:
        for name, value in (("dt_bias", dt_bias), ("lower_bound", lower_bound)):
            if value is not None:
                raise ValueError(f"{name} belongs to the fused gate: give a_log too (or leave {name} None)")
        if decay is None:
            return jnp.zeros((batch, length, heads, 1), jnp.float32)
    elif decay is None:
        raise ValueError("decay must hold the raw gate input when a_log is given, got None")
    if jnp.shape(decay) not in ((batch, length, heads), (batch, length, heads, dk)):
        raise ValueError(
            f"decay must have shape {layout} = [{batch}, {length}, {heads}] or [{batch}, {length}, {heads}, {dk}], "
            f"got {describe(jnp.shape(decay))}"
        )
    check_floating("decay", decay)
    if a_log is not None:
        a_log, dt_bias = _gate_parameters(a_log, dt_bias, heads, dk)
        if lower_bound is not None:
            _check_lower_bound(lower_bound)
        decay = fused_gate(decay, a_log, dt_bias, lower_bound)
    decay = jnp.asarray(decay, jnp.float32)
    return decay[..., None] if decay.ndim == 3 else decay


class KernelDeltaAttention(Kernel[KernelDeltaAttentionConfig, Any]):
    """The KDA operation for an `Executor`: `executor(KernelDeltaAttention(), q, k, v, beta, decay, ...)` takes
    `kernel_delta_attention`'s arguments (its `prepare` checks them once) and runs the implementation the config
    names or `auto` picks (the AUTO table in `ops/kda/api.py`)."""

    op_id = OP_ID
    config_type = KernelDeltaAttentionConfig

    def prepare(
        self, query: Any, key: Any, value: Any, beta: Any, decay: Any = None, initial_state: Any = None, /, *,
        softmax_scale: float | None = None, chunk_size: int = 64, use_qk_l2norm: bool = True,
        use_chunked: bool = True, return_state: bool = False, cu_seqlens: Any = None, a_log: Any = None,
        dt_bias: Any = None, lower_bound: Any = None, beta_is_logits: bool = False,
    ) -> KdaProblem:
        _check_qkv(query, key, value)
        batch, length, _, dk = jnp.shape(query)
        heads, dv = jnp.shape(value)[2:]
        check_shape("beta", beta, (batch, length, heads), "[batch, seq_len, num_value_heads]")
        check_floating("beta", beta)
        if chunk_size not in CHUNK_SIZES:
            raise ValueError(f"chunk_size must be one of {CHUNK_SIZES}, got {chunk_size!r}")
        if cu_seqlens is not None:
            check_cu_seqlens(cu_seqlens, batch, length, "query")
            cu_seqlens = jnp.asarray(cu_seqlens, jnp.int32)
        num_sequences = batch if cu_seqlens is None else jnp.shape(cu_seqlens)[0] - 1
        if initial_state is not None:
            what = "[batch" if cu_seqlens is None else "[num_sequences"
            check_shape("initial_state", initial_state, (num_sequences, heads, dk, dv),
                        f"{what}, num_value_heads, head_dim, v_head_dim]")
            check_floating("initial_state", initial_state)
            initial_state = jnp.asarray(initial_state, jnp.float32)
        scale = dk**-0.5 if softmax_scale is None else check_number(
            "softmax_scale", softmax_scale, "a number > 0 or None", lambda scale: scale > 0)
        return KdaProblem(
            q=query, k=key, v=value,
            beta=activate_beta(beta, beta_is_logits),
            decay=_log_decay(decay, a_log, dt_bias, lower_bound, batch, length, heads, dk),
            initial_state=initial_state, cu_seqlens=cu_seqlens,
            scale=float(scale), use_qk_l2norm=bool(use_qk_l2norm), return_state=bool(return_state),
            chunk_size=chunk_size, use_chunked=bool(use_chunked),
        )

    def finalize(self, problem: KdaProblem, result: tuple[jax.Array, jax.Array]) -> Any:
        return result if problem.return_state else result[0]

    def autotune_problem(self, inv: Invocation, rng: jax.Array) -> KdaProblem:
        """Random inputs that respect the problem's ranges: beta in (0, 1), decay <= 0, valid cu_seqlens."""
        problem = super().autotune_problem(inv, rng)
        cu_seqlens = problem.cu_seqlens
        if cu_seqlens is not None:
            length = problem.q.shape[1]
            cu_seqlens = jnp.linspace(0, length, cu_seqlens.shape[0]).astype(jnp.int32)
        return dataclasses.replace(
            problem, beta=jax.nn.sigmoid(problem.beta), decay=-jax.nn.softplus(problem.decay), cu_seqlens=cu_seqlens
        )
