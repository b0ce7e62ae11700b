"""Float64 reference for recurrent attention, straight from the recurrence; the tests' oracle.

Per head, with S of shape [K, V]:
    S_t = S_{t-1} * exp(g_t) * exp(g_gamma) * exp(gk_t)[:, None] * exp(gv_t)[None, :] + k_t v_t^T
    o_t = S_t^T (scale * q_t)
Written without in-place updates so that `xp=jax.numpy` (under jax_enable_x64) gives a differentiable
float64 version of the same math for gradient tests; `xp=numpy` is the default.
"""

from __future__ import annotations

from typing import Any

import numpy as np


def _log_decays(query, g, g_gamma, gk, gv, value_dim, xp):
    """Per-step log decays on the key axis [B,T,H,K] and on the value axis [B,T,H,V]."""
    batch, seq_len, num_heads, key_dim = query.shape
    log_k = xp.zeros((batch, seq_len, num_heads, key_dim))
    log_v = xp.zeros((batch, seq_len, num_heads, value_dim))
    if g is not None:
        log_k = log_k + (g[..., None] if g.ndim == 3 else g)
    if g_gamma is not None:
        gamma = g_gamma if g_gamma.ndim == 2 else xp.broadcast_to(g_gamma, (batch, num_heads))
        log_k = log_k + gamma[:, None, :, None]
    if gk is not None:
        log_k = log_k + gk
    if gv is not None:
        log_v = log_v + gv
    return log_k, log_v


def _run_sequence(q, k, v, log_k, log_v, state, reverse, xp):
    """One sequence: q, k, log_k [L,H,K]; v, log_v [L,H,V]; state [H,K,V] -> (o [L,H,V], state)."""
    steps = range(q.shape[0] - 1, -1, -1) if reverse else range(q.shape[0])
    outputs = {}
    for t in steps:
        decay = xp.exp(log_k[t])[:, :, None] * xp.exp(log_v[t])[:, None, :]
        state = state * decay + k[t][:, :, None] * v[t][:, None, :]
        outputs[t] = xp.einsum("hk,hkv->hv", q[t], state)
    if not outputs:
        return xp.zeros((0,) + v.shape[1:]), state
    return xp.stack([outputs[t] for t in range(q.shape[0])]), state


def recurrent_reference(
    query: Any,
    key: Any,
    value: Any,
    g: Any = None,
    g_gamma: Any = None,
    gk: Any = None,
    gv: Any = None,
    initial_state: Any = None,
    cu_seqlens: Any = None,
    *,
    softmax_scale: float | None = None,
    reverse: bool = False,
    xp: Any = np,
) -> tuple[Any, Any]:
    """(output [B,T,H,V], final_state [B or N,H,K,V]) in float64; arguments as `recurrent_attention`."""
    as64 = (lambda x: None if x is None else np.asarray(x, np.float64)) if xp is np else (lambda x: x)
    query, key, value, g, g_gamma, gk, gv, initial_state = map(
        as64, (query, key, value, g, g_gamma, gk, gv, initial_state)
    )
    batch, seq_len, num_heads, key_dim = query.shape
    value_dim = value.shape[-1]
    group = num_heads // key.shape[2]
    key = xp.repeat(key, group, axis=2)
    value = xp.repeat(value, group, axis=2)
    scale = key_dim**-0.5 if softmax_scale is None else softmax_scale
    q = query * scale
    log_k, log_v = _log_decays(query, g, g_gamma, gk, gv, value_dim, xp)
    if cu_seqlens is None:
        spans = [(b, 0, seq_len) for b in range(batch)]
    else:
        bounds = [int(x) for x in np.asarray(cu_seqlens)]
        spans = [(0, bounds[n], bounds[n + 1]) for n in range(len(bounds) - 1)]
    outputs, finals = [], []
    for index, (b, start, end) in enumerate(spans):
        state = xp.zeros((num_heads, key_dim, value_dim)) if initial_state is None else initial_state[index]
        o, state = _run_sequence(
            q[b, start:end], key[b, start:end], value[b, start:end],
            log_k[b, start:end], log_v[b, start:end], state, reverse, xp,
        )
        outputs.append(o)
        finals.append(state)
    if cu_seqlens is None:
        output = xp.stack(outputs)
    else:
        output = xp.concatenate(outputs, axis=0)[None]
    return output, xp.stack(finals)
