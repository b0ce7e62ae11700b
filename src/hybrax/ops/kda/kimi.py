"""`kimi_delta_attention`: Kimi Delta Attention with flash-linear-attention's arguments (`chunk_kda`).

Per value head, with the state S [K, V] in fp32 (decay first, then the delta rule on the decayed state):
    S' = Diag(exp(g_t)) S_{t-1};  S_t = S' + k_t (beta_t (v_t - S'^T k_t))^T;  o_t = S_t^T (scale q_t)
The names, defaults and layouts are fla's: g before beta, `scale`, `output_final_state`,
`use_qk_l2norm_in_kernel=False`, the gate computed from the raw g when `use_gate_in_kernel`
(-exp(A_log) * softplus(g + dt_bias), or lower_bound * sigmoid(exp(A_log) * (g + dt_bias))), beta logits
with `use_beta_sigmoid_in_kernel` (2 sigmoid(beta) with `allow_neg_eigval`), V-first states with
`state_v_first`; it returns (o, final_state or None). The call is mapped onto `KernelDeltaAttention`'s
problem and run by the executor, so every implementation of `kernel_delta_attention` serves it.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from hybrax.core import checks, default_executor
from hybrax.core.packing import segment_packing, unflatten_output
from hybrax.core.validate import (
    check_cu_seqlens, check_divides, check_floating, check_number, check_rank, check_shape, describe,
)
from hybrax.ops.fla_states import fla_result, k_first_initial_state
from hybrax.ops.kda.api import KernelDeltaAttention, KernelDeltaAttentionConfig

ORDER_HINT = ("kimi_delta_attention takes (q, k, v, g, beta) in flash-linear-attention's order; "
              "kernel_delta_attention takes (query, key, value, beta, decay)")
# fla's range for the bounded gate's lower_bound with safe_gate.
SAFE_GATE_BOUNDS = (-5.0, 0.0)


def _check_qkv(q: Any, k: Any, v: Any) -> tuple[int, int, int, int, int]:
    """(B, T, HV, K, V) of q, k [B, T, H, K] and v [B, T, HV, V]."""
    check_rank("q", q, 4, "[batch, seq_len, num_heads, head_dim]")
    check_shape("k", k, jnp.shape(q), "[batch, seq_len, num_heads, head_dim] (q's shape)")
    check_rank("v", v, 4, "[batch, seq_len, num_value_heads, v_head_dim]")
    batch, length, heads, dk = jnp.shape(q)
    check_shape("v", v, (batch, length, None, None), "[batch, seq_len, num_value_heads, v_head_dim]")
    value_heads, dv = jnp.shape(v)[2:]
    check_divides("num_heads of q", heads, "num_value_heads of v", value_heads)
    return batch, length, value_heads, dk, dv


def _check_g_and_beta(g: Any, beta: Any, dims: tuple[int, int, int, int, int]) -> None:
    """g [B, T, HV, K], [B, T, HV] or [B, T, HV, 1]; beta [B, T, HV]. A gate-shaped beta next to a beta-shaped
    g is the other argument order: say so."""
    batch, length, heads, dk, _ = dims
    gate_shapes = ((batch, length, heads, dk), (batch, length, heads), (batch, length, heads, 1))
    beta_shape = (batch, length, heads)
    if jnp.shape(beta) != beta_shape:
        swapped = jnp.shape(beta) in gate_shapes and jnp.shape(g) == beta_shape
        raise ValueError(
            f"beta must have shape [batch, seq_len, num_value_heads] = {describe(beta_shape)}, got "
            f"{describe(jnp.shape(beta))}" + (f": g and beta look swapped; {ORDER_HINT}" if swapped else "")
        )
    check_floating("beta", beta)
    check_floating("g", g)
    if jnp.shape(g) not in gate_shapes:
        raise ValueError(
            f"g must have shape [batch, seq_len, num_value_heads, head_dim] = {describe(gate_shapes[0])}, or per "
            f"head {describe(gate_shapes[1])} or {describe(gate_shapes[2])}, got {describe(jnp.shape(g))}"
        )


def _gate_arguments(g: Any, use_gate_in_kernel: bool, A_log: Any, dt_bias: Any, lower_bound: Any,
                    safe_gate: bool, heads: int) -> tuple[Any, dict[str, Any]]:
    """KernelDeltaAttention's decay and fused-gate keywords (a_log, dt_bias, lower_bound) for fla's gate options."""
    decay = g[..., 0] if jnp.ndim(g) == 4 and jnp.shape(g)[3] == 1 else g  # per head: [B, T, HV]
    if not use_gate_in_kernel:
        for name, value in (("A_log", A_log), ("dt_bias", dt_bias), ("lower_bound", lower_bound)):
            if value is not None:
                raise ValueError(f"{name} belongs to the gate computed from the raw g: pass use_gate_in_kernel=True "
                                 f"(with a precomputed g it would change nothing), or leave {name} None")
        checks.check_log_decay("g", g, f"a precomputed g is a log decay (use_gate_in_kernel=True takes the raw "
                                       f"gate input); if g holds betas, {ORDER_HINT}")
        return decay, {}
    if A_log is None and lower_bound is None:
        raise ValueError("use_gate_in_kernel=True needs A_log [num_value_heads] (or lower_bound for the bounded "
                         "gate lower_bound * sigmoid(g + dt_bias)), got neither")
    if safe_gate:
        low, high = SAFE_GATE_BOUNDS
        check_number("lower_bound", lower_bound, f"a number in [{low:g}, {high:g}) with safe_gate=True",
                     lambda bound: low <= bound < high)
    if A_log is None:
        A_log = jnp.zeros((heads,), jnp.float32)  # exp(0) = 1: fla's bounded gate without A_log
    else:
        check_shape("A_log", A_log, (heads,), "[num_value_heads]")
        check_floating("A_log", A_log)
    checks.check_not_nan("g", g)
    checks.check_finite("A_log", A_log)
    checks.check_finite("dt_bias", dt_bias)
    return decay, {"a_log": A_log, "dt_bias": dt_bias, "lower_bound": lower_bound}


def _beta_arguments(beta: Any, use_beta_sigmoid_in_kernel: bool, allow_neg_eigval: bool) -> tuple[Any, bool]:
    """KernelDeltaAttention's (beta, beta_is_logits); 2 sigmoid(beta) is activated here (its range is [0, 2))."""
    if allow_neg_eigval and not use_beta_sigmoid_in_kernel:
        raise ValueError("allow_neg_eigval=True scales the sigmoid of beta logits to [0, 2): it needs "
                         "use_beta_sigmoid_in_kernel=True")
    if not use_beta_sigmoid_in_kernel:
        checks.check_unit_interval("beta", beta, "pass use_beta_sigmoid_in_kernel=True if beta holds logits; "
                                                 f"if beta holds the gate, {ORDER_HINT}")
        return beta, False
    checks.check_not_nan("beta", beta)
    if allow_neg_eigval:
        return 2.0 * jax.nn.sigmoid(jnp.asarray(beta, jnp.float32)), False
    return beta, True


def kimi_delta_attention(
    q: Float[Array, "batch seq_len num_heads head_dim"],
    k: Float[Array, "batch seq_len num_heads head_dim"],
    v: Float[Array, "batch seq_len num_value_heads v_head_dim"],
    g: Float[Array, "batch seq_len num_value_heads *head_dim"],
    beta: Float[Array, "batch seq_len num_value_heads"],
    *,
    scale: float | None = None,
    initial_state: Float[Array, "num_states num_value_heads d1 d2"] | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    use_gate_in_kernel: bool = False,
    A_log: Float[Array, " num_value_heads"] | None = None,
    dt_bias: Float[Array, "num_value_heads head_dim"] | Float[Array, " num_value_heads_x_head_dim"] | None = None,
    lower_bound: float | None = None,
    safe_gate: bool = False,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    state_v_first: bool = False,
    cu_seqlens: Int[Array, " num_sequences_plus_1"] | None = None,
    segment_ids: Int[Array, "batch seq_len"] | None = None,
    max_segments: int | None = None,
    platform: str | None = None,
    cfg: KernelDeltaAttentionConfig | None = None,
) -> tuple[Float[Array, "batch seq_len num_value_heads v_head_dim"], Float[Array, "num_states num_value_heads d1 d2"]
           | None]:
    """Kimi Delta Attention as flash-linear-attention's `chunk_kda` takes it (see the module docstring).

    Args:
        q, k: [B, T, H, K]. v: [B, T, HV, V], HV a multiple of H (value head h reads q/k head h // (HV // H)).
        g: the log decay (<= 0) per key channel [B, T, HV, K] or per head [B, T, HV] / [B, T, HV, 1]; with
            use_gate_in_kernel, the raw gate input of the same shapes.
        beta: [B, T, HV] in [0, 1], or logits with use_beta_sigmoid_in_kernel.
        scale: of the queries; None: K ** -0.5.
        initial_state: fp32 [N, HV, K, V] ([N, HV, V, K] with state_v_first); N = B, or the number of packed
            sequences with cu_seqlens or segment_ids. None: zeros.
        output_final_state: also return the final state, in initial_state's layout.
        use_qk_l2norm_in_kernel: L2-normalize q and k (x / sqrt(sum x^2 + 1e-6)) per head.
        use_gate_in_kernel: g is the raw gate input: -exp(A_log) * softplus(g + dt_bias), or with lower_bound
            lower_bound * sigmoid(exp(A_log) * (g + dt_bias)) (A_log None: exp(A_log) = 1).
        A_log: [HV]. dt_bias: [HV, K] or flat [HV * K], or None. lower_bound: a number <= 0, or None.
        safe_gate: fla's faster kernels for the bounded gate; here it checks lower_bound in [-5, 0) as fla does.
        use_beta_sigmoid_in_kernel: beta holds logits; beta = sigmoid(beta), or 2 sigmoid(beta) in [0, 2)
            with allow_neg_eigval (negative eigenvalues of the transition).
        state_v_first: states are [.., V, K] (initial_state and the final state).
        cu_seqlens: [N + 1] int32: N sequences packed into a batch of one. Pad it to a fixed length with its
            last value to avoid a retrace when N varies (empty sequences at the end: final state = initial state).
        segment_ids: [B, T] int, instead of cu_seqlens: each run of equal ids in a row is a sequence, ids < 0
            padding (zero output). The rows run as one packed row of B * T tokens, one sequence (and state) per run
            in row-major order, padding runs included: N runs, counted when the ids are concrete.
        max_segments: N with segment_ids under jit, a static bound on the runs; the states past the runs are
            empty sequences' (final state = initial state).
        platform, cfg: which implementation and knobs (default: the executor's choice; see hybrax.explain).

    Returns:
        (o [B, T, HV, V] in q's dtype, final_state fp32 or None when output_final_state is False).

    Values are checked on concrete inputs (g <= 0, beta in [0, 1], no NaN or inf): ValueError naming the
    argument; under jit, through `hybrax.checked`.
    """
    dims = _check_qkv(q, k, v)
    _check_g_and_beta(g, beta, dims)
    for name, array in (("q", q), ("k", k), ("v", v)):
        checks.check_finite(name, array)
    if scale is not None:
        check_number("scale", scale, "a number > 0 or None", lambda value: value > 0)
    pack = segment_packing("q", q, cu_seqlens, segment_ids, max_segments)
    if pack is not None:
        q, k, v, g, beta = (pack.flatten(name, array) for name, array in
                            (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)))
        dims, cu_seqlens = (1, dims[0] * dims[1], *dims[2:]), pack.cu_seqlens
    num_states = dims[0]
    if cu_seqlens is not None:
        check_cu_seqlens(cu_seqlens, dims[0], dims[1], "q")
        num_states = jnp.shape(cu_seqlens)[0] - 1
    h0 = k_first_initial_state(initial_state, num_states, ("num_value_heads", dims[2]), *dims[3:],
                               v_first=state_v_first, packed=cu_seqlens is not None)
    decay, fused_gate = _gate_arguments(g, use_gate_in_kernel, A_log, dt_bias, lower_bound, safe_gate, dims[2])
    beta, beta_is_logits = _beta_arguments(beta, use_beta_sigmoid_in_kernel, allow_neg_eigval)
    result = default_executor()(
        KernelDeltaAttention(), q, k, v, beta, decay, h0,
        softmax_scale=scale, use_qk_l2norm=use_qk_l2norm_in_kernel, return_state=output_final_state,
        cu_seqlens=cu_seqlens, beta_is_logits=beta_is_logits, platform=platform, cfg=cfg, **fused_gate,
    )
    return unflatten_output(pack, fla_result(result, output_final_state, state_v_first))
