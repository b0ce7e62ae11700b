"""float64 references written from flash-linear-attention's conventions, for the fla-style entry points.

KDA (naive_recurrent_kda): per value head, S <- S * exp(g_t)[:, None]; S <- S + k_t (beta_t (v_t - S^T k_t))^T;
o_t = S^T (scale q_t); q/k head h // (HV // H) serves value head h. GLA (naive_recurrent_gla):
S <- S * exp(gk_t)[:, None] * exp(gv_t)[None, :] + k_t v_t^T; o_t = S^T (scale q_t). Packed sequences
(cu_seqlens) run one by one from their own initial state; tokens past the last boundary output zeros.
Each function takes the array module `xp`: NumPy (the default), or jax.numpy on float64 arrays inside
`jax.enable_x64(True)`, where jax.grad gives float64 gradients.
"""

from __future__ import annotations

import numpy as np


def sigmoid(x, xp=np):
    return 1.0 / (1.0 + xp.exp(-x))


def softplus(x, xp=np):
    return xp.logaddexp(0.0, x)


def l2norm(x, xp=np):
    return x / xp.sqrt((x * x).sum(-1, keepdims=True) + 1e-6)


def kda_gate(raw, A_log, dt_bias, lower_bound, xp=np):
    """fla's gates on raw [B, T, HV, K]: -exp(A_log) softplus(raw + dt_bias), or with lower_bound
    lower_bound * sigmoid(exp(A_log) (raw + dt_bias)) (A_log None: a rate of 1)."""
    heads, dk = raw.shape[2:]
    x = raw if dt_bias is None else raw + dt_bias.reshape(heads, dk)
    rate = 1.0 if A_log is None else xp.exp(A_log).reshape(heads, 1)
    if lower_bound is None:
        return -rate * softplus(x, xp)
    return lower_bound * sigmoid(rate * x, xp)


def _kda_one(q, k, v, g, beta, scale, state, xp):
    """One sequence: q, k [T, H, K], v [T, HV, V], g [T, HV, K], beta [T, HV], state [HV, K, V]."""
    group = v.shape[1] // q.shape[1]
    q, k = xp.repeat(q, group, axis=1) * scale, xp.repeat(k, group, axis=1)
    out = []
    for t in range(q.shape[0]):
        state = state * xp.exp(g[t])[..., None]
        error = v[t] - xp.einsum("hk,hkv->hv", k[t], state)
        state = state + xp.einsum("hk,hv->hkv", k[t], beta[t][:, None] * error)
        out.append(xp.einsum("hk,hkv->hv", q[t], state))
    return xp.stack(out) if out else xp.zeros(v.shape), state


def _gla_one(q, k, v, gk, gv, scale, state, xp):
    """One sequence: q, k, gk [T, H, K], v, gv [T, H, V], state [H, K, V]."""
    out = []
    for t in range(q.shape[0]):
        state = state * xp.exp(gk[t])[..., None] * xp.exp(gv[t])[:, None, :] + xp.einsum("hk,hv->hkv", k[t], v[t])
        out.append(xp.einsum("hk,hkv->hv", q[t] * scale, state))
    return xp.stack(out) if out else xp.zeros(v.shape), state


def _run(step, arrays, state_shape, initial_state, cu_seqlens, xp):
    """step over each batch row, or each packed sequence of a batch of one; (output, final states)."""
    batch, length = arrays[0].shape[:2]
    bounds = [(b, 0, length) for b in range(batch)] if cu_seqlens is None else [
        (0, int(start), int(end)) for start, end in zip(cu_seqlens[:-1], cu_seqlens[1:])]
    rows = [[] for _ in range(batch)]
    finals = []
    for n, (b, start, end) in enumerate(bounds):
        state = xp.zeros(state_shape) if initial_state is None else initial_state[n]
        out, state = step(*(x[b, start:end] for x in arrays), state)
        rows[b].append(out)
        finals.append(state)
    ends = [length] * batch if cu_seqlens is None else [int(cu_seqlens[-1])]
    rows = [xp.concatenate(row + [xp.zeros((length - end, *row[0].shape[1:]))]) for row, end in zip(rows, ends)]
    return xp.stack(rows), xp.stack(finals)


def kda(q, k, v, g, beta, *, scale=None, initial_state=None, cu_seqlens=None, use_qk_l2norm=False, xp=np):
    """o [B, T, HV, V] and final states [N, HV, K, V]; g [B, T, HV, K] is the activated log decay, beta activated."""
    if use_qk_l2norm:
        q, k = l2norm(q, xp), l2norm(k, xp)
    dk, (heads, dv) = q.shape[3], v.shape[2:]
    scale = dk**-0.5 if scale is None else scale
    step = lambda q, k, v, g, beta, state: _kda_one(q, k, v, g, beta, scale, state, xp)  # noqa: E731
    return _run(step, (q, k, v, g, beta), (heads, dk, dv), initial_state, cu_seqlens, xp)


def gla(q, k, v, gk=None, gv=None, *, scale=None, initial_state=None, cu_seqlens=None, reverse=False, xp=np):
    """o [B, T, H, V] and final states [N, H, K, V]; gk [B, T, H, K], gv [B, T, H, V] log decays (None: 0).
    reverse: each sequence runs from its last token to its first."""
    gk = xp.zeros(q.shape) if gk is None else gk
    gv = xp.zeros(v.shape) if gv is None else gv
    dk, (heads, dv) = q.shape[3], v.shape[2:]
    scale = dk**-0.5 if scale is None else scale

    def step(q, k, v, gk, gv, state):
        if not reverse:
            return _gla_one(q, k, v, gk, gv, scale, state, xp)
        out, state = _gla_one(*(x[::-1] for x in (q, k, v, gk, gv)), scale, state, xp)
        return out[::-1], state

    return _run(step, (q, k, v, gk, gv), (heads, dk, dv), initial_state, cu_seqlens, xp)
