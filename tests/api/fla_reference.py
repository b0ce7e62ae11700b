"""float64 NumPy references written from flash-linear-attention's conventions, for the fla-style entry points.

KDA (naive_recurrent_kda): per value head, S <- S * exp(g_t)[:, None]; S <- S + k_t (beta_t (v_t - S^T k_t))^T;
o_t = S^T (scale q_t); q/k head h // (HV // H) serves value head h. GLA (naive_recurrent_gla):
S <- S * exp(gk_t)[:, None] * exp(gv_t)[None, :] + k_t v_t^T; o_t = S^T (scale q_t). Packed sequences
(cu_seqlens) run one by one from their own initial state; tokens past the last boundary output zeros.
"""

from __future__ import annotations

import numpy as np


def sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-x))


def softplus(x: np.ndarray) -> np.ndarray:
    return np.logaddexp(0.0, x)


def l2norm(x: np.ndarray) -> np.ndarray:
    return x / np.sqrt((x * x).sum(-1, keepdims=True) + 1e-6)


def kda_gate(raw: np.ndarray, A_log: np.ndarray | None, dt_bias: np.ndarray | None,
             lower_bound: float | None) -> np.ndarray:
    """fla's gates on raw [B, T, HV, K]: -exp(A_log) softplus(raw + dt_bias), or with lower_bound
    lower_bound * sigmoid(exp(A_log) (raw + dt_bias)) (A_log None: a rate of 1)."""
    heads, dk = raw.shape[2:]
    x = raw if dt_bias is None else raw + dt_bias.reshape(heads, dk)
    rate = np.ones((heads, 1)) if A_log is None else np.exp(A_log).reshape(heads, 1)
    if lower_bound is None:
        return -rate * softplus(x)
    return lower_bound * sigmoid(rate * x)


def _kda_one(q, k, v, g, beta, scale, state):
    """One sequence: q, k [T, H, K], v [T, HV, V], g [T, HV, K], beta [T, HV], state [HV, K, V]."""
    group = v.shape[1] // q.shape[1]
    q, k = np.repeat(q, group, axis=1) * scale, np.repeat(k, group, axis=1)
    out = np.zeros(v.shape)
    for t in range(q.shape[0]):
        state = state * np.exp(g[t])[..., None]
        error = v[t] - np.einsum("hk,hkv->hv", k[t], state)
        state = state + np.einsum("hk,hv->hkv", k[t], beta[t][:, None] * error)
        out[t] = np.einsum("hk,hkv->hv", q[t], state)
    return out, state


def _gla_one(q, k, v, gk, gv, scale, state):
    """One sequence: q, k, gk [T, H, K], v, gv [T, H, V], state [H, K, V]."""
    out = np.zeros(v.shape)
    for t in range(q.shape[0]):
        state = state * np.exp(gk[t])[..., None] * np.exp(gv[t])[:, None, :] + np.einsum("hk,hv->hkv", k[t], v[t])
        out[t] = np.einsum("hk,hkv->hv", q[t] * scale, state)
    return out, state


def _run(step, arrays, state_shape, initial_state, cu_seqlens):
    """step over each batch row, or each packed sequence of a batch of one; (output, final states)."""
    batch, length = arrays[0].shape[:2]
    bounds = [(b, 0, length) for b in range(batch)] if cu_seqlens is None else [
        (0, int(start), int(end)) for start, end in zip(cu_seqlens[:-1], cu_seqlens[1:])]
    out = np.zeros((batch, length, *state_shape[:1], state_shape[2]))
    finals = []
    for n, (b, start, end) in enumerate(bounds):
        state = np.zeros(state_shape) if initial_state is None else np.array(initial_state[n], np.float64)
        out[b, start:end], state = step(*(x[b, start:end] for x in arrays), state)
        finals.append(state)
    return out, np.stack(finals)


def kda(q, k, v, g, beta, *, scale=None, initial_state=None, cu_seqlens=None, use_qk_l2norm=False):
    """o [B, T, HV, V] and final states [N, HV, K, V]; g [B, T, HV, K] is the activated log decay, beta activated."""
    q, k, v, g, beta = (np.asarray(x, np.float64) for x in (q, k, v, g, beta))
    if use_qk_l2norm:
        q, k = l2norm(q), l2norm(k)
    dk, (heads, dv) = q.shape[3], v.shape[2:]
    scale = dk**-0.5 if scale is None else scale
    step = lambda q, k, v, g, beta, state: _kda_one(q, k, v, g, beta, scale, state)  # noqa: E731
    return _run(step, (q, k, v, g, beta), (heads, dk, dv), initial_state, cu_seqlens)


def gla(q, k, v, gk=None, gv=None, *, scale=None, initial_state=None, cu_seqlens=None):
    """o [B, T, H, V] and final states [N, H, K, V]; gk [B, T, H, K], gv [B, T, H, V] log decays (None: 0)."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    gk = np.zeros(q.shape) if gk is None else np.asarray(gk, np.float64)
    gv = np.zeros(v.shape) if gv is None else np.asarray(gv, np.float64)
    dk, (heads, dv) = q.shape[3], v.shape[2:]
    scale = dk**-0.5 if scale is None else scale
    step = lambda q, k, v, gk, gv, state: _gla_one(q, k, v, gk, gv, scale, state)  # noqa: E731
    return _run(step, (q, k, v, gk, gv), (heads, dk, dv), initial_state, cu_seqlens)
