"""What the scan and the chunked algorithm share: their inputs, and a VJP built from the algorithm itself.

An engine computes one forward-time recurrence on compute-dtype arrays with every head expanded:
    engine(q, k, v, log_k, log_v, h0, cu_seqlens, cfg) -> (o [B,T,H,V], final_state [B or N,H,K,V])
with q already scaled, `log_k` the log decay on the key axis ([B,T,H,K], or [B,T,H,1] for a per-head
scalar, or None) and `log_v` on the value axis ([B,T,H,V] or None).

The backward needs no stored states: each gradient is itself a recurrence of the same form,
    dq_t = S_t do_t                      forward in time, state S^T  (keys v, values k, gates swapped)
    dk_t = L_t v_t,  dv_t = L_t^T k_t    backward in time, L_t = q_t do_t^T + decay_{t+1} * L_{t+1}
so the engine runs three more times. Gate gradients follow from o and the gradients without any state:
with G the cumulative log decay, dL/dG_t = q_t*dq_t - k_t*dk_t on the key axis (o_t*do_t - v_t*dv_t
on the value axis), plus dS_final*S_final at each sequence's last token; the gate of step t is the
suffix sum of that within its sequence. (Where a decay is exactly zero, e.g. gates of -1000, the true
gate gradient is a cancellation of O(1) terms, so fp32 leaves an absolute error of ~eps * sqrt(T) of them.)
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp

from hybrax.core import KernelConfig, cotangent
from hybrax.core.packing import last_token_mask, reversed_cu_seqlens

Engine = Callable[..., tuple[jax.Array, jax.Array]]


class EngineInputs(NamedTuple):
    q: jax.Array  # scaled query [B,T,H,K]
    k: jax.Array  # keys repeated to H heads
    v: jax.Array
    log_k: jax.Array | None
    log_v: jax.Array | None
    h0: jax.Array | None
    cu_seqlens: jax.Array | None


def compute_dtype(dtype: Any) -> Any:
    """fp32 for fp32 and narrower inputs; float64 inputs (x64 tests) stay float64."""
    return jnp.promote_types(dtype, jnp.float32)


def expand_heads(x: jax.Array, num_heads: int) -> jax.Array:
    return jnp.repeat(x, num_heads // x.shape[2], axis=2)


def reduce_heads(x: jax.Array, num_kv_heads: int) -> jax.Array:
    batch, seq_len, num_heads, dim = x.shape
    return x.reshape(batch, seq_len, num_kv_heads, num_heads // num_kv_heads, dim).sum(3)


def key_log_decay(problem: Any, dtype: Any) -> jax.Array | None:
    """The log decay along the key axis, [B, T, H, K] or [B, T, H, 1] (per head only); None without one."""
    scalar, per_key = problem.g_scalar, problem.g_key
    if per_key is None:
        return None if scalar is None else scalar.astype(dtype)[..., None]
    return per_key.astype(dtype) + (0 if scalar is None else scalar.astype(dtype)[..., None])


def engine_inputs(problem: Any) -> EngineInputs:
    dtype = compute_dtype(problem.query.dtype)
    num_heads = problem.query.shape[2]
    cast = lambda x: None if x is None else x.astype(dtype)  # noqa: E731
    return EngineInputs(
        q=problem.query.astype(dtype) * problem.scale,
        k=expand_heads(problem.key.astype(dtype), num_heads),
        v=expand_heads(problem.value.astype(dtype), num_heads),
        log_k=key_log_decay(problem, dtype),
        log_v=cast(problem.g_value),
        h0=cast(problem.initial_state),
        cu_seqlens=problem.cu_seqlens,
    )


def forward(engine: Engine, problem: Any, cfg: KernelConfig) -> tuple[jax.Array, jax.Array]:
    """(output in the query's dtype, final state in the compute dtype)."""
    o, final = engine(*engine_inputs(problem), cfg)
    return o.astype(problem.query.dtype), final


def decay_state(state: jax.Array, decay_k: jax.Array | None, decay_v: jax.Array | None) -> jax.Array:
    """state [..., K, V] times the key-axis decay [..., K] (or [..., 1]) and the value-axis decay [..., V]."""
    if decay_k is not None:
        state = state * decay_k[..., :, None]
    if decay_v is not None:
        state = state * decay_v[..., None, :]
    return state


def _transpose(state: jax.Array | None) -> jax.Array | None:
    return None if state is None else jnp.swapaxes(state, -1, -2)


def _trailing(mask: jax.Array, ndim: int) -> jax.Array:
    return mask.reshape(mask.shape + (1,) * (ndim - mask.ndim))


def _shift_to_next_token(log: jax.Array | None, cu_seqlens: jax.Array | None) -> jax.Array | None:
    """log[t] <- log[t+1] inside each sequence, 0 at its last token: the decay from L_{t+1} to L_t."""
    if log is None:
        return None
    shifted = jnp.concatenate([log[:, 1:], jnp.zeros_like(log[:, :1])], axis=1)
    if cu_seqlens is None:
        return shifted
    last = last_token_mask(cu_seqlens, log.shape[1])
    return jnp.where(_trailing(last[None], shifted.ndim), 0, shifted)


def _at_first_tokens(x: jax.Array, cu_seqlens: jax.Array | None) -> jax.Array:
    """x at each sequence's first token ([B or N, ...]); zeros for empty sequences."""
    if cu_seqlens is None:
        return x[:, 0]
    nonempty = cu_seqlens[1:] > cu_seqlens[:-1]
    first = x[0, jnp.clip(cu_seqlens[:-1], 0, x.shape[1] - 1)]
    return jnp.where(_trailing(nonempty, first.ndim), first, 0)


def _add_at_last_tokens(x: jax.Array, term: jax.Array, cu_seqlens: jax.Array | None) -> jax.Array:
    """x with term[n] added at sequence n's last token (nothing for empty sequences)."""
    if cu_seqlens is None:
        return x.at[:, -1].add(term)
    nonempty = cu_seqlens[1:] > cu_seqlens[:-1]
    last = jnp.clip(cu_seqlens[1:] - 1, 0, x.shape[1] - 1)
    return x.at[0, last].add(jnp.where(_trailing(nonempty, term.ndim), term, 0))


def _segmented_suffix_sum(values: jax.Array, is_last: jax.Array) -> jax.Array:
    """sum_{s >= t, s in t's sequence} values[:, s] along axis 1 (a segmented scan, no cancellation)."""

    def combine(earlier, later):
        later_value, later_reset = later
        return jnp.where(later_reset, later_value, earlier[0] + later_value), earlier[1] | later_reset

    reset = jnp.broadcast_to(_trailing(is_last[None], values.ndim), values.shape)
    flipped = (jnp.flip(values, 1), jnp.flip(reset, 1))
    total, _ = jax.lax.associative_scan(combine, flipped, axis=1)
    return jnp.flip(total, 1)


def _suffix_sum(x: jax.Array, cu_seqlens: jax.Array | None) -> jax.Array:
    if cu_seqlens is None:
        return jax.lax.cumsum(x, axis=1, reverse=True)
    return _segmented_suffix_sum(x, last_token_mask(cu_seqlens, x.shape[1]))


def _backwards_in_time(engine: Engine, x: EngineInputs, do: jax.Array, d_final: jax.Array, cfg: KernelConfig):
    """(dk, dv, L at each sequence's first token) from the recurrence for L run backwards in time."""
    seq_len = x.q.shape[1]
    flip = lambda a: None if a is None else jnp.flip(a, 1)  # noqa: E731
    cu = x.cu_seqlens
    log_k = flip(_shift_to_next_token(x.log_k, cu))
    log_v = flip(_shift_to_next_token(x.log_v, cu))
    cu_back = None if cu is None else reversed_cu_seqlens(cu, seq_len)
    # Sequence n runs as sequence N-1-n when the packed batch is read backwards.
    d_final_back = d_final if cu is None else jnp.flip(d_final, 0)
    q, k, v, do = flip(x.q), flip(x.k), flip(x.v), flip(do)
    dk, _ = engine(v, do, q, log_v, log_k, _transpose(d_final_back), cu_back, cfg)
    dv, first_state = engine(k, q, do, log_k, log_v, d_final_back, cu_back, cfg)
    if cu is not None:
        first_state = jnp.flip(first_state, 0)
    return flip(dk), flip(dv), first_state


def _gate_gradient(x_side, dx_side, y_side, dy_side, cross: jax.Array, cu) -> jax.Array:
    """Gradient of one axis' log decays: suffix sums of x*dx - y*dy, plus the final-state term."""
    return _suffix_sum(_add_at_last_tokens(x_side * dx_side - y_side * dy_side, cross, cu), cu)


def vjp_rules(engine: Engine) -> tuple[Callable, Callable]:
    """(fwd, bwd) for `register`: residuals are the problem, the fp32 output (value gates only) and the final state."""

    def fwd(problem: Any, cfg: KernelConfig):
        x = engine_inputs(problem)
        o, final = engine(*x, cfg)
        residual_o = o if problem.g_value is not None else None
        return (o.astype(problem.query.dtype), final), (problem, residual_o, final)

    def bwd(cfg: KernelConfig, residuals: Any, ct: Any):
        problem, o, final = residuals
        x = engine_inputs(problem)
        do, d_final = (c.astype(x.q.dtype) for c in ct)
        cu = x.cu_seqlens
        dq, _ = engine(do, x.v, x.k, x.log_v, x.log_k, _transpose(x.h0), cu, cfg)
        dk, dv, first_state = _backwards_in_time(engine, x, do, d_final, cfg)
        grads = {}
        if problem.initial_state is not None:
            decay = jnp.ones_like(first_state)
            if x.log_k is not None:
                decay = decay * jnp.exp(_at_first_tokens(x.log_k, cu))[..., :, None]
            if x.log_v is not None:
                decay = decay * jnp.exp(_at_first_tokens(x.log_v, cu))[..., None, :]
            grads["initial_state"] = (decay * first_state).astype(problem.initial_state.dtype)
        final_cross = d_final * final
        if x.log_k is not None:
            d_log_k = _gate_gradient(x.q, dq, x.k, dk, final_cross.sum(-1), cu)
            if problem.g_key is not None:
                grads["g_key"] = d_log_k.astype(problem.g_key.dtype)
            if problem.g_scalar is not None:
                grads["g_scalar"] = d_log_k.sum(-1).astype(problem.g_scalar.dtype)
        if x.log_v is not None:
            d_log_v = _gate_gradient(o, do, x.v, dv, final_cross.sum(-2), cu)
            grads["g_value"] = d_log_v.astype(problem.g_value.dtype)
        num_kv_heads = problem.key.shape[2]
        return cotangent(
            problem,
            query=(dq * problem.scale).astype(problem.query.dtype),
            key=reduce_heads(dk, num_kv_heads).astype(problem.key.dtype),
            value=reduce_heads(dv, num_kv_heads).astype(problem.value.dtype),
            **grads,
        )

    return fwd, bwd
