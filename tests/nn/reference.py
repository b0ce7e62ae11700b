"""flash-linear-attention's layers in float64, straight from the math, on fla-format weights (names and PyTorch
layouts): the oracle of the hybrax.nn tests. One sequence at a time ([T, hidden]); `xp` is numpy (float64 arrays) or
jax.numpy (float64 inside jax.enable_x64, differentiable)."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

L2_EPS = 1e-6


def sigmoid(x, xp):
    return 1.0 / (1.0 + xp.exp(-x))


def linear(weights: dict, name: str, x, xp=np):
    """PyTorch's nn.Linear: x weight^T + bias."""
    y = x @ weights[name + ".weight"].T
    return y + weights[name + ".bias"] if name + ".bias" in weights else y


def short_conv(x, weight, bias, xp=np):
    """Depthwise causal conv then SiLU: y_t = silu(bias + sum_j weight[:, 0, j] x_{t - (W - 1) + j}), x [T, D]."""
    width, length = weight.shape[-1], x.shape[0]
    padded = xp.concatenate([xp.zeros((width - 1, x.shape[1])), x], axis=0)
    y = sum(padded[j:j + length] * weight[:, 0, j] for j in range(width))
    if bias is not None:
        y = y + bias
    return y * sigmoid(y, xp)


def rms_norm(x, weight, eps, xp=np):
    return x / xp.sqrt(xp.mean(x * x, axis=-1, keepdims=True) + eps) * weight


def kda_recurrence(q, k, v, beta, decay, xp=np):
    """fla's naive_recurrent_kda: q, k [T, H, K] (normalized), v [T, HV, V], beta [T, HV], decay [T, HV, K]. With
    jax.numpy the loop is a lax.scan (an unrolled loop takes long to differentiate and compile)."""
    group = v.shape[1] // q.shape[1]
    q, k = xp.repeat(q, group, axis=1) * q.shape[-1] ** -0.5, xp.repeat(k, group, axis=1)

    def step(state, token):
        q_t, k_t, v_t, beta_t, decay_t = token
        state = state * xp.exp(decay_t)[..., None]
        error = v_t - xp.einsum("hk,hkv->hv", k_t, state)
        state = state + xp.einsum("hk,hv->hkv", k_t * beta_t[:, None], error)
        return state, xp.einsum("hk,hkv->hv", q_t, state)

    state = xp.zeros((v.shape[1], q.shape[2], v.shape[2]))
    if xp is np:
        outputs = []
        for token in zip(q, k, v, beta, decay):
            state, o_t = step(state, token)
            outputs.append(o_t)
        return np.stack(outputs)
    return jax.lax.scan(step, state, (q, k, v, beta, decay))[1]


def kda_layer(w: dict, x, cfg: dict, xp=np):
    """fla.layers.KimiDeltaAttention on one sequence x [T, hidden]. cfg: num_heads, num_v_heads, head_dim,
    head_v_dim, use_short_conv, allow_neg_eigval, lower_bound, norm_eps."""
    length, heads, v_heads = x.shape[0], cfg["num_heads"], cfg["num_v_heads"]
    dk, dv = cfg["head_dim"], cfg["head_v_dim"]
    projected = [linear(w, name, x, xp) for name in ("q_proj", "k_proj", "v_proj")]
    if cfg["use_short_conv"]:
        projected = [short_conv(t, w[name + ".weight"], w.get(name + ".bias"), xp)
                     for t, name in zip(projected, ("q_conv1d", "k_conv1d", "v_conv1d"))]
    else:
        projected = [t * sigmoid(t, xp) for t in projected]
    q, k = (t.reshape(length, heads, dk) for t in projected[:2])
    q, k = (t / xp.sqrt(xp.sum(t * t, axis=-1, keepdims=True) + L2_EPS) for t in (q, k))
    v = projected[2].reshape(length, v_heads, dv)
    raw = linear(w, "f_proj.1", linear(w, "f_proj.0", x, xp), xp).reshape(length, v_heads, dk)
    raw = raw + w["dt_bias"].reshape(v_heads, dk)
    rate = xp.exp(w["A_log"])[:, None]
    if cfg["lower_bound"] is None:
        decay = -rate * xp.logaddexp(0.0, raw)
    else:
        decay = cfg["lower_bound"] * sigmoid(rate * raw, xp)
    beta = sigmoid(linear(w, "b_proj", x, xp), xp) * (2.0 if cfg["allow_neg_eigval"] else 1.0)
    o = kda_recurrence(q, k, v, beta, decay, xp)
    gate = linear(w, "g_proj.1", linear(w, "g_proj.0", x, xp), xp).reshape(length, v_heads, dv)
    o = rms_norm(o, w["o_norm.weight"], cfg["norm_eps"], xp) * sigmoid(gate, xp)
    return linear(w, "o_proj", o.reshape(length, v_heads * dv), xp)


def random_kda_weights(rng: np.random.Generator, hidden: int, cfg: dict, conv_size: int = 4,
                       conv_bias: bool = False) -> dict[str, np.ndarray]:
    """fla-format weights of a KimiDeltaAttention layer, float32, at scales that keep activations O(1)."""
    key_dim = cfg["num_heads"] * cfg["head_dim"]
    value_dim = cfg["num_v_heads"] * cfg["head_v_dim"]
    shapes = {
        "q_proj.weight": (key_dim, hidden), "k_proj.weight": (key_dim, hidden), "v_proj.weight": (value_dim, hidden),
        "f_proj.0.weight": (cfg["head_v_dim"], hidden), "f_proj.1.weight": (cfg["num_v_heads"] * cfg["head_dim"],
                                                                            cfg["head_v_dim"]),
        "b_proj.weight": (cfg["num_v_heads"], hidden), "g_proj.0.weight": (cfg["head_v_dim"], hidden),
        "g_proj.1.weight": (value_dim, cfg["head_v_dim"]), "o_proj.weight": (hidden, value_dim),
    }
    weights = {name: rng.normal(size=shape) / np.sqrt(shape[1]) for name, shape in shapes.items()}
    if cfg["use_short_conv"]:
        for name, dim in (("q_conv1d", key_dim), ("k_conv1d", key_dim), ("v_conv1d", value_dim)):
            weights[name + ".weight"] = rng.normal(size=(dim, 1, conv_size)) * 0.6
            if conv_bias:
                weights[name + ".bias"] = rng.normal(size=(dim,)) * 0.2
    weights["g_proj.1.bias"] = rng.normal(size=(value_dim,)) * 0.3
    weights["A_log"] = np.log(rng.uniform(0.5, 4.0, size=(cfg["num_v_heads"],)))
    weights["dt_bias"] = rng.normal(size=(cfg["num_v_heads"] * cfg["head_dim"],))
    weights["o_norm.weight"] = 1.0 + 0.2 * rng.normal(size=(cfg["head_v_dim"],))
    return {name: value.astype(np.float32) for name, value in weights.items()}


def per_sequence(fn, x: np.ndarray, pieces: list[tuple[int, slice]]) -> np.ndarray:
    """fn on each piece (row, token slice) of x [B, T, hidden] in float64; zeros elsewhere."""
    out = np.zeros(x.shape, np.float64)
    for row, tokens in pieces:
        if tokens.stop > tokens.start:
            out[row, tokens] = fn(np.asarray(x[row, tokens], np.float64))
    return out


def f64(weights: dict[str, Any]) -> dict[str, np.ndarray]:
    return {name: np.asarray(value, np.float64) for name, value in weights.items()}


def rope(x, positions, theta, xp=np):
    """Rotate-half rotary embedding: x [T, heads, D], pairs (i, i + D/2) turned by p * theta^(-2i/D)."""
    half = x.shape[-1] // 2
    angle = np.asarray(positions, np.float64)[:, None, None] * theta ** (-2.0 * np.arange(half) / x.shape[-1])
    x1, x2 = x[..., :half], x[..., half:]
    return xp.concatenate([x1 * np.cos(angle) - x2 * np.sin(angle), x2 * np.cos(angle) + x1 * np.sin(angle)], -1)


def attention_layer(w: dict, x, cfg: dict, xp=np):
    """fla.layers.Attention on one sequence x [T, hidden]. cfg: num_heads, num_kv_heads, head_dim, rope_theta,
    sliding_window (w: keys i - w .. i), qk_norm, sinks, norm_eps."""
    length, heads, kv_heads, dim = x.shape[0], cfg["num_heads"], cfg["num_kv_heads"], cfg["head_dim"]
    q = linear(w, "q_proj", x, xp).reshape(length, heads, dim)
    k = linear(w, "k_proj", x, xp).reshape(length, kv_heads, dim)
    v = linear(w, "v_proj", x, xp).reshape(length, kv_heads, dim)
    if cfg["qk_norm"]:
        q = rms_norm(q, w["q_norm.weight"], cfg["norm_eps"], xp)
        k = rms_norm(k, w["k_norm.weight"], cfg["norm_eps"], xp)
    if cfg["rope_theta"] is not None:
        q, k = rope(q, np.arange(length), cfg["rope_theta"], xp), rope(k, np.arange(length), cfg["rope_theta"], xp)
    k, v = xp.repeat(k, heads // kv_heads, axis=1), xp.repeat(v, heads // kv_heads, axis=1)
    scores = xp.einsum("thd,shd->hts", q, k) / np.sqrt(dim)
    query, key = np.arange(length)[:, None], np.arange(length)[None, :]
    visible = key <= query
    if cfg["sliding_window"] is not None:
        visible &= query - key <= cfg["sliding_window"]
    scores = xp.where(visible, scores, -np.inf)
    sink = (w["sinks"] if cfg["sinks"] else xp.full((heads,), -np.inf))[:, None, None]
    top = xp.maximum(xp.max(scores, axis=-1, keepdims=True), sink)
    weights = xp.exp(scores - top)
    weights = weights / (xp.sum(weights, axis=-1, keepdims=True) + xp.exp(sink - top))
    o = xp.einsum("hts,shd->thd", weights, v)
    return linear(w, "o_proj", o.reshape(length, heads * dim), xp)


def random_attention_weights(rng: np.random.Generator, hidden: int, cfg: dict, qkv_bias: bool = False
                             ) -> dict[str, np.ndarray]:
    """fla-format weights of an Attention layer (plus `sinks`), float32."""
    heads, kv_heads, dim = cfg["num_heads"], cfg["num_kv_heads"], cfg["head_dim"]
    shapes = {"q_proj.weight": (heads * dim, hidden), "k_proj.weight": (kv_heads * dim, hidden),
              "v_proj.weight": (kv_heads * dim, hidden), "o_proj.weight": (hidden, heads * dim)}
    weights = {name: rng.normal(size=shape) / np.sqrt(shape[1]) for name, shape in shapes.items()}
    weights["q_proj.weight"] *= 2.0  # sharper attention than random projections give
    if qkv_bias:
        for name in ("q_proj", "k_proj", "v_proj"):
            weights[name + ".bias"] = rng.normal(size=(shapes[name + ".weight"][0],)) * 0.3
    if cfg["qk_norm"]:
        weights["q_norm.weight"] = 1.0 + 0.5 * rng.normal(size=(dim,))
        weights["k_norm.weight"] = 1.0 + 0.5 * rng.normal(size=(dim,))
    if cfg["sinks"]:
        weights["sinks"] = rng.normal(size=(heads,))
    return {name: value.astype(np.float32) for name, value in weights.items()}


def log_sigmoid(x, xp=np):
    return -xp.logaddexp(0.0, -x)


GLA_FEATURE_MAPS = {"relu": lambda x, xp: xp.maximum(x, 0.0), "sigmoid": sigmoid,
                    "silu": lambda x, xp: x * sigmoid(x, xp), "swish": lambda x, xp: x * sigmoid(x, xp)}


def gla_recurrence(q, k, v, gk, xp=np):
    """fla's naive_recurrent_gla: q, k, gk [T, H, K], v [T, H, V]; S_t = S_{t-1} exp(gk_t)[:, None] + k_t v_t^T,
    o_t = S_t^T q_t / sqrt(K). With jax.numpy the loop is a lax.scan."""
    q = q * q.shape[-1] ** -0.5

    def step(state, token):
        q_t, k_t, v_t, gk_t = token
        state = state * xp.exp(gk_t)[..., None] + xp.einsum("hk,hv->hkv", k_t, v_t)
        return state, xp.einsum("hk,hkv->hv", q_t, state)

    state = xp.zeros((q.shape[1], q.shape[2], v.shape[2]))
    if xp is np:
        outputs = []
        for token in zip(q, k, v, gk):
            state, o_t = step(state, token)
            outputs.append(o_t)
        return np.stack(outputs)
    return jax.lax.scan(step, state, (q, k, v, gk))[1]


def gla_layer(w: dict, x, cfg: dict, xp=np):
    """fla.layers.GatedLinearAttention on one sequence x [T, hidden]. cfg: num_heads, num_kv_heads, head_k_dim,
    head_v_dim, use_short_conv, feature_map, use_output_gate, gate_fn, norm_name, gate_logit_normalizer, clamp_min,
    norm_eps."""
    length, heads, kv_heads = x.shape[0], cfg["num_heads"], cfg["num_kv_heads"]
    dk, dv, group = cfg["head_k_dim"], cfg["head_v_dim"], cfg["num_heads"] // cfg["num_kv_heads"]
    projected = [linear(w, name, x, xp) for name in ("q_proj", "k_proj", "v_proj")]
    if cfg["use_short_conv"]:
        projected = [short_conv(t, w[name + ".weight"], w.get(name + ".bias"), xp)
                     for t, name in zip(projected, ("q_conv1d", "k_conv1d", "v_conv1d"))]
    q = projected[0].reshape(length, heads, dk)
    k = xp.repeat(projected[1].reshape(length, kv_heads, dk), group, axis=1)
    v = xp.repeat(projected[2].reshape(length, kv_heads, dv), group, axis=1)
    gk = log_sigmoid(linear(w, "gk_proj.1", linear(w, "gk_proj.0", x, xp), xp), xp) / cfg["gate_logit_normalizer"]
    if cfg["clamp_min"] is not None:
        gk = xp.maximum(gk, cfg["clamp_min"])
    gk = xp.repeat(gk.reshape(length, kv_heads, dk), group, axis=1)
    if cfg["feature_map"] is not None:
        q, k = GLA_FEATURE_MAPS[cfg["feature_map"]](q, xp), GLA_FEATURE_MAPS[cfg["feature_map"]](k, xp)
    o = rms_norm(gla_recurrence(q, k, v, gk, xp), w[cfg["norm_name"] + ".weight"], cfg["norm_eps"], xp)
    if cfg["use_output_gate"]:
        gate = linear(w, "g_proj", x, xp).reshape(length, heads, dv)
        o = o * (sigmoid(gate, xp) if cfg["gate_fn"] == "sigmoid" else gate * sigmoid(gate, xp))
    return linear(w, "o_proj", o.reshape(length, heads * dv), xp)


def random_gla_weights(rng: np.random.Generator, hidden: int, cfg: dict, gate_low_rank_dim: int, conv_size: int = 4,
                       conv_bias: bool = False) -> dict[str, np.ndarray]:
    """fla-format weights of a GatedLinearAttention layer, float32, at scales that keep activations O(1)."""
    key_dim, value_dim = cfg["num_heads"] * cfg["head_k_dim"], cfg["num_heads"] * cfg["head_v_dim"]
    kv_key_dim, kv_value_dim = cfg["num_kv_heads"] * cfg["head_k_dim"], cfg["num_kv_heads"] * cfg["head_v_dim"]
    shapes = {"q_proj.weight": (key_dim, hidden), "k_proj.weight": (kv_key_dim, hidden),
              "v_proj.weight": (kv_value_dim, hidden), "gk_proj.0.weight": (gate_low_rank_dim, hidden),
              "gk_proj.1.weight": (kv_key_dim, gate_low_rank_dim), "o_proj.weight": (hidden, value_dim)}
    if cfg["use_output_gate"]:
        shapes["g_proj.weight"] = (value_dim, hidden)
    weights = {name: rng.normal(size=shape) / np.sqrt(shape[1]) for name, shape in shapes.items()}
    weights["gk_proj.1.weight"] *= 3.0  # gates from near 0 to well below it
    weights["gk_proj.1.bias"] = rng.normal(size=(kv_key_dim,))
    if cfg["use_short_conv"]:
        for name, dim in (("q_conv1d", key_dim), ("k_conv1d", kv_key_dim), ("v_conv1d", kv_value_dim)):
            weights[name + ".weight"] = rng.normal(size=(dim, 1, conv_size)) * 0.6
            if conv_bias:
                weights[name + ".bias"] = rng.normal(size=(dim,)) * 0.2
    weights[cfg["norm_name"] + ".weight"] = 1.0 + 0.2 * rng.normal(size=(cfg["head_v_dim"],))
    return {name: value.astype(np.float32) for name, value in weights.items()}


def causal_attention(q, k, v, scale, sliding_window, xp=np):
    """softmax_{j <= i, i - j <= sliding_window} (scale q_i . k_j) v_j per head: q, k [T, H, D], v [T, H, Dv]."""
    length = q.shape[0]
    scores = scale * xp.einsum("thd,shd->hts", q, k)
    query, key = np.arange(length)[:, None], np.arange(length)[None, :]
    visible = key <= query
    if sliding_window is not None:
        visible &= query - key <= sliding_window
    scores = xp.where(visible, scores, -np.inf)
    weights = xp.exp(scores - xp.max(scores, axis=-1, keepdims=True))
    return xp.einsum("hts,shd->thd", weights / xp.sum(weights, axis=-1, keepdims=True), v)


def mla_layer(w: dict, x, cfg: dict, xp=np):
    """fla.layers.MultiheadLatentAttention on one sequence x [T, hidden] (rope_theta None: no rotation, as Kimi
    Linear's). cfg: num_heads, q_lora_rank, kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim, v_head_dim,
    rope_theta, sliding_window, softmax_scale (None: 1 / sqrt(nope + rope)), norm_eps."""
    length, heads, nope, rope_dim = x.shape[0], cfg["num_heads"], cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"]
    eps = cfg["norm_eps"]
    if cfg["q_lora_rank"] is None:
        q = linear(w, "q_proj", x, xp)
    else:
        q = linear(w, "q_proj.2", rms_norm(linear(w, "q_proj.0", x, xp), w["q_proj.1.weight"], eps, xp), xp)
    q = q.reshape(length, heads, nope + rope_dim)
    kv = linear(w, "kv_proj.2", rms_norm(linear(w, "kv_proj.0", x, xp), w["kv_proj.1.weight"], eps, xp), xp)
    kv = kv.reshape(length, heads, nope + cfg["v_head_dim"])
    k_rope = linear(w, "k_rope", x, xp)[:, None]
    q_nope, q_rope, k_nope, v = q[..., :nope], q[..., nope:], kv[..., :nope], kv[..., nope:]
    if cfg["rope_theta"] is not None:
        positions = np.arange(length)
        q_rope, k_rope = rope(q_rope, positions, cfg["rope_theta"], xp), rope(k_rope, positions, cfg["rope_theta"], xp)
    q = xp.concatenate([q_nope, q_rope], axis=-1)
    k = xp.concatenate([k_nope, xp.broadcast_to(k_rope, (length, heads, rope_dim))], axis=-1)
    scale = (nope + rope_dim) ** -0.5 if cfg["softmax_scale"] is None else cfg["softmax_scale"]
    o = causal_attention(q, k, v, scale, cfg["sliding_window"], xp)
    return linear(w, "o_proj", o.reshape(length, heads * cfg["v_head_dim"]), xp)


def random_mla_weights(rng: np.random.Generator, hidden: int, cfg: dict) -> dict[str, np.ndarray]:
    """fla-format weights of a MultiheadLatentAttention layer, float32."""
    heads, rank, q_rank = cfg["num_heads"], cfg["kv_lora_rank"], cfg["q_lora_rank"]
    qk_dim = cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"]
    shapes = {"k_rope.weight": (cfg["qk_rope_head_dim"], hidden), "kv_proj.0.weight": (rank, hidden),
              "kv_proj.2.weight": (heads * (cfg["qk_nope_head_dim"] + cfg["v_head_dim"]), rank),
              "o_proj.weight": (hidden, heads * cfg["v_head_dim"])}
    if q_rank is None:
        shapes["q_proj.weight"] = (heads * qk_dim, hidden)
    else:
        shapes.update({"q_proj.0.weight": (q_rank, hidden), "q_proj.2.weight": (heads * qk_dim, q_rank)})
    weights = {name: rng.normal(size=shape) / np.sqrt(shape[1]) for name, shape in shapes.items()}
    weights["k_rope.weight"] *= 2.0  # sharper attention than random projections give
    weights["kv_proj.1.weight"] = 1.0 + 0.3 * rng.normal(size=(rank,))
    if q_rank is not None:
        weights["q_proj.1.weight"] = 1.0 + 0.3 * rng.normal(size=(q_rank,))
    return {name: value.astype(np.float32) for name, value in weights.items()}
