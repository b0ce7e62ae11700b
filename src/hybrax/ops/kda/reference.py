"""Kimi Delta Attention in float64 NumPy, straight from the math: the tests' oracle.

Per value head, with the state S of shape [K, V]:
    S' = Diag(exp(g_t)) S_{t-1}                       decay first (Kimi Linear, fla's naive_kda)
    S_t = S' + k_t (beta_t (v_t - S'^T k_t))^T         then the delta rule on the decayed state
    o_t = S_t^T (scale q_t)
q and k are L2-normalized over K (x / sqrt(sum x^2 + 1e-6)) when asked; value head h reads query/key
head h // (HV / H) (grouped value attention). Nothing here is fast; everything is float64.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from hybrax.ops.kda.base import L2_EPS


def _f64(x: Any) -> np.ndarray | None:
    return None if x is None else np.asarray(x, np.float64)


def l2_normalize(x: np.ndarray) -> np.ndarray:
    return x / np.sqrt(np.sum(x * x, axis=-1, keepdims=True) + L2_EPS)


def sigmoid(x: np.ndarray, xp: Any = np) -> np.ndarray:
    return 1.0 / (1.0 + xp.exp(-x))


def softplus(x: np.ndarray, xp: Any = np) -> np.ndarray:
    return xp.logaddexp(0.0, x)


def activate_gate(raw: Any, a_log: Any, dt_bias: Any = None, lower_bound: Any = None, xp: Any = np) -> np.ndarray:
    """The fused gate on raw [B, T, HV, K] (or [B, T, HV]) inputs; a_log [HV], dt_bias [HV, K] or [HV*K].

    lower_bound None: -exp(a_log) * softplus(raw + dt_bias)              (Kimi Linear's released gate)
    lower_bound set:  lower_bound * sigmoid(exp(a_log) * (raw + dt_bias))  (the NKI `kda_tkg`'s bounded gate)
    `xp` is numpy (float64 here) or jax.numpy (the tests' differentiable oracle, on float64 arrays).
    """
    if xp is np:
        raw, a_log, dt_bias = _f64(raw), _f64(a_log), _f64(dt_bias)
    if dt_bias is not None:
        raw = (raw[..., None] if raw.ndim == 3 else raw) + xp.reshape(dt_bias, (a_log.shape[0], -1))
    scale = xp.exp(a_log).reshape((-1, 1) if raw.ndim == 4 else (-1,))
    if lower_bound is None:
        return -scale * softplus(raw, xp)
    return float(np.asarray(lower_bound).reshape(())) * sigmoid(scale * raw, xp)


def recurrence(
    q: np.ndarray, k: np.ndarray, v: np.ndarray, beta: np.ndarray, decay: np.ndarray,
    state: np.ndarray, scale: float,
) -> tuple[np.ndarray, np.ndarray]:
    """One sequence, token by token: q, k [T, H, K] (already normalized), v [T, HV, V], beta [T, HV],
    decay [T, HV, K] (log decay), state [HV, K, V]. Returns o [T, HV, V] and the final state."""
    group = v.shape[1] // q.shape[1]
    q, k = np.repeat(q, group, axis=1), np.repeat(k, group, axis=1)
    state = state.copy()
    out = np.zeros(v.shape)
    for t in range(q.shape[0]):
        state = state * np.exp(decay[t])[:, :, None]
        error = v[t] - np.einsum("hkv,hk->hv", state, k[t])
        state = state + np.einsum("hk,hv->hkv", k[t], beta[t][:, None] * error)
        out[t] = np.einsum("hkv,hk->hv", state, scale * q[t])
    return out, state


def kda_canonical(
    q: Any, k: Any, v: Any, beta: Any, decay: Any, initial_state: Any = None, cu_seqlens: Any = None,
    *, scale: float, use_qk_l2norm: bool = True,
) -> tuple[np.ndarray, np.ndarray]:
    """The canonical problem (see `api.KdaProblem`): q, k [B, T, H, K]; v [B, T, HV, V]; beta [B, T, HV]
    (activated); decay [B, T, HV, K] or [B, T, HV, 1] (log decay, activated); initial_state
    [B or N, HV, K, V] or None; cu_seqlens [N + 1] or None (then B == 1). Returns o [B, T, HV, V] and
    the final state [B or N, HV, K, V]. Tokens past cu_seqlens[-1] belong to no sequence: output 0."""
    q, k, v, beta, decay = (_f64(x) for x in (q, k, v, beta, decay))
    if use_qk_l2norm:
        q, k = l2_normalize(q), l2_normalize(k)
    decay = np.broadcast_to(decay, (*beta.shape, q.shape[-1]))
    if cu_seqlens is None:
        segments = [(b, 0, q.shape[1]) for b in range(q.shape[0])]
    else:
        bounds = np.asarray(cu_seqlens).tolist()
        segments = [(0, start, end) for start, end in zip(bounds[:-1], bounds[1:])]
    heads, dk, dv = v.shape[2], q.shape[-1], v.shape[-1]
    states = np.zeros((len(segments), heads, dk, dv)) if initial_state is None else _f64(initial_state).copy()
    out = np.zeros(v.shape)
    for index, (b, start, end) in enumerate(segments):
        piece = slice(start, end)
        out[b, piece], states[index] = recurrence(
            q[b, piece], k[b, piece], v[b, piece], beta[b, piece], decay[b, piece], states[index], scale
        )
    return out, states


def kda_reference(
    query: Any, key: Any, value: Any, beta: Any, decay: Any = None, initial_state: Any = None, *,
    softmax_scale: float | None = None, use_qk_l2norm: bool = True, cu_seqlens: Any = None,
    a_log: Any = None, dt_bias: Any = None, lower_bound: Any = None, beta_is_logits: bool = False,
) -> tuple[np.ndarray, np.ndarray]:
    """`kernel_delta_attention`'s public semantics: decay None / [B, T, HV] / [B, T, HV, K], the
    fused gates when a_log is given, beta logits when beta_is_logits. Returns (o, final state)."""
    query, value, beta = _f64(query), _f64(value), _f64(beta)
    batch, length, _, dk = query.shape
    heads = value.shape[2]
    if a_log is not None:
        decay = activate_gate(decay, a_log, dt_bias, lower_bound)
    elif decay is None:
        decay = np.zeros((batch, length, heads))
    decay = _f64(decay)
    if decay.ndim == 3:
        decay = decay[..., None]
    if beta_is_logits:
        beta = sigmoid(beta)
    scale = dk**-0.5 if softmax_scale is None else softmax_scale
    return kda_canonical(
        query, key, value, beta, decay, initial_state, cu_seqlens, scale=scale, use_qk_l2norm=use_qk_l2norm
    )


def kda_tkg_reference(
    q: Any, k: Any, v: Any, g: Any, beta: Any, a_log: Any, dt_bias: Any, S: Any, scale: Any, lower_bound: Any,
) -> tuple[np.ndarray, np.ndarray]:
    """The NKI `kda_tkg` decode step in its own layout: q, k, g [B, dk, H] raw; v [B, H, dv]; beta [B, 1, H]
    logits; a_log [1, H]; dt_bias [dk, H]; S [B, H, dk, dv]; scale, lower_bound [1, 1].
    Returns (out [B, H, dv], new S [B, H, dk, dv])."""
    q, k, g, v, beta, S = (_f64(x) for x in (q, k, g, v, beta, S))
    heads_last = (0, 2, 1)  # [B, dk, H] -> [B, H, dk]
    q, k, g = (np.transpose(x, heads_last) for x in (q, k, g))
    decay = activate_gate(g[:, None], _f64(a_log).reshape(-1), _f64(dt_bias).T, lower_bound)[:, 0]
    q, k = l2_normalize(q), l2_normalize(k)
    beta = sigmoid(beta[:, 0, :])
    scale = float(np.asarray(scale).reshape(()))
    out, state = np.zeros(v.shape), S.copy()
    for b in range(q.shape[0]):  # each request is a sequence of one token
        step, state[b] = recurrence(q[b, None], k[b, None], v[b, None], beta[b, None], decay[b, None], S[b], scale)
        out[b] = step[0]
    return out, state
