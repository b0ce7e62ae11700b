"""`kda_decode_pool`: KDA decode for a batch of requests over a serving state pool, by slot.

The way vLLM and SGLang serve KDA: every live request owns a row of a pool of fp32 states
[num_slots, HV, K, V] (or V-first [num_slots, HV, V, K]); a decode batch names its rows with int32
slot indices [B], and -1 marks a padded request (CUDA-graph batch padding), which reads nothing,
writes nothing and outputs zeros. Each request advances T tokens (T > 1: speculative decoding);
with `token_slots` [B, T] the state after token t is written to row token_slots[b, t] (-1: not
kept; no row named twice), so a verifier can resume from any accepted token; without it the final state goes back to
slots[b]. Rows no request names stay bit-for-bit unchanged, and the pool is updated in place when
the caller donates it. Concrete slots outside [-1, num_slots) raise; traced ones (under jit) cannot be
checked, so every slot outside [0, num_slots) is a padded request like -1 and a token_slots entry
outside it keeps nothing (`pool_rows`), on every implementation.

The gate stays raw into the implementations (the GPU kernels fuse it, where it costs nothing):
`gate="softplus"` -exp(a_log) * softplus(g + dt_bias), `gate="bounded"` lower_bound * sigmoid(
exp(a_log) * (g + dt_bias)), `gate="activated"` g is already the log decay.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jaxtyping import Array, Float, Int

from hybrax.core import (
    Invocation, Kernel, KernelConfig, default_executor, problem_dataclass, register, set_auto_order, static_field,
)
from hybrax.core.config import is_power_of_two
from hybrax.core.validate import (
    check_at_least_one, check_dtype, check_floating, check_integer, check_number, check_positive_number, check_rank, check_rows,
    check_shape, is_concrete,
)
from hybrax.ops.kda.common.delta import delta_step, l2_normalize
from hybrax.ops.kda.decode import cuda as cuda_decode
from hybrax.ops.kda.decode import pallas_gpu as pallas_decode
from hybrax.ops.kda.gate import activate_beta, fused_gate
from hybrax.ops.pallas_shared import interpret_here

OP_ID = "kda_decode_pool"
GATES = pallas_decode.GATES


@dataclasses.dataclass(frozen=True)
class KdaDecodePoolConfig(KernelConfig):
    """Speed knobs of the GPU kernels: value columns and warps per program (Pallas) or block (CUDA); see
    `pallas_decode.fused_recurrent_decode` and `cuda_decode.fused_recurrent_decode_cuda`."""

    block_v: int = 32
    num_warps: int = 4


@problem_dataclass
class KdaPoolProblem:
    """q, k [B, T, H, K]; v [B, T, HV, V]; g [B, T, HV, K] or [B, T, HV, 1] (raw, or the log decay when
    gate == "activated"); beta [B, T, HV] (logits when beta_is_logits); pool fp32 [S, HV, K, V]
    ([S, HV, V, K] when state_v_first); slots [B] int32; token_slots [B, T] int32 or None;
    a_log [HV] or None; dt_bias [HV, K] or None."""

    q: Float[Array, "B T H K"]
    k: Float[Array, "B T H K"]
    v: Float[Array, "B T HV V"]
    g: Float[Array, "B T HV Kg"]
    beta: Float[Array, "B T HV"]
    pool: Float[Array, "S HV K V"]
    slots: Int[Array, " B"]
    token_slots: Int[Array, "B T"] | None
    a_log: Float[Array, " HV"] | None
    dt_bias: Float[Array, "HV K"] | None
    scale: float = static_field()
    gate: str = static_field("activated")
    lower_bound: float | None = static_field(None)
    beta_is_logits: bool = static_field(False)
    use_qk_l2norm: bool = static_field(True)
    state_v_first: bool = static_field(False)


def check_gate(gate: str, g: Any, a_log: Any, dt_bias: Any, lower_bound: Any, heads: int, dk: int) -> None:
    check_rank("g", g, 4, "[batch, tokens, num_value_heads, head_dim or 1]")
    check_floating("g", g)
    if gate not in GATES:
        raise ValueError(f"gate must be one of {GATES}, got {gate!r}")
    if gate == "activated":
        if a_log is not None or dt_bias is not None or lower_bound is not None:
            raise ValueError(
                'a_log, dt_bias and lower_bound belong to the fused gates: use gate="softplus" or "bounded"'
            )
    else:
        if a_log is None:
            raise ValueError(f'gate="{gate}" needs a_log [num_value_heads] = [{heads}], got None')
        check_shape("a_log", a_log, (heads,), "[num_value_heads]")
        check_floating("a_log", a_log)
        if dt_bias is not None:
            check_shape("dt_bias", dt_bias, (heads, dk), "[num_value_heads, head_dim]")
            check_floating("dt_bias", dt_bias)
    if (gate == "bounded") != (lower_bound is not None):
        raise ValueError(f'lower_bound (a number <= 0) goes with gate="bounded" alone, got gate={gate!r} '
                         f"and lower_bound={lower_bound!r}")
    if lower_bound is not None:
        check_number("lower_bound", lower_bound, "a number <= 0", lambda bound: bound <= 0)
    batch, length, _, _ = jnp.shape(g)
    if jnp.shape(g) not in ((batch, length, heads, dk), (batch, length, heads, 1)):
        raise ValueError(f"g must have shape [batch, tokens, num_value_heads, head_dim or 1] = "
                         f"[{batch}, {length}, {heads}, {dk} or 1], got {list(jnp.shape(g))}")


def check_pool(pool: Any, value_heads: int, dk: int, dv: int, v_first: bool) -> None:
    """The fp32 state pool [num_slots, HV, K, V], or [num_slots, HV, V, K] when v_first."""
    row = (value_heads, dv, dk) if v_first else (value_heads, dk, dv)
    minor = "v_head_dim, head_dim]" if v_first else "head_dim, v_head_dim]"
    check_rank("pool", pool, 4, "[num_slots, num_value_heads, " + minor)
    check_shape("pool", pool, (None, *row), "[num_slots, num_value_heads, " + minor)
    check_dtype("pool", pool, jnp.float32, "the recurrent state")


def check_token_slots(token_slots: Any, slots: Any, num_slots: int) -> None:
    """The rows kept after each token (-1: none) of the requests with a valid slot, when concrete."""
    if is_concrete(slots) and is_concrete(token_slots):
        kept = np.where(np.asarray(slots)[:, None] >= 0, np.asarray(token_slots), -1)
        check_rows("token_slots", kept, num_slots)


class KdaDecodePool(Kernel[KdaDecodePoolConfig, Any]):
    """The slot-pool KDA decode step for an `Executor`: takes `kda_decode_pool`'s arguments and runs the
    implementation the config names or `auto` picks (this module's AUTO table)."""

    op_id = OP_ID
    config_type = KdaDecodePoolConfig

    def prepare(
        self, q: Any, k: Any, v: Any, g: Any, beta: Any, pool: Any, slots: Any, /, *, token_slots: Any = None,
        a_log: Any = None, dt_bias: Any = None, lower_bound: Any = None, gate: str = "activated",
        softmax_scale: float | None = None, beta_is_logits: bool = False, use_qk_l2norm: bool = True,
        state_v_first: bool = False,
    ) -> KdaPoolProblem:
        check_rank("q", q, 4, "[batch, tokens, num_heads, head_dim]")
        check_shape("k", k, jnp.shape(q), "[batch, tokens, num_heads, head_dim] (q's shape)")
        batch, length, heads, dk = jnp.shape(q)
        check_rank("v", v, 4, "[batch, tokens, num_value_heads, v_head_dim]")
        value_heads, dv = jnp.shape(v)[2:]
        check_shape("v", v, (batch, length, value_heads, dv), "[batch, tokens, num_value_heads, v_head_dim]")
        check_at_least_one("q", q, {2: "num_heads", 3: "head_dim"})
        check_at_least_one("v", v, {2: "num_value_heads", 3: "v_head_dim"})
        if value_heads % heads:
            raise ValueError(f"num_value_heads of v ({value_heads}) must be a multiple of num_heads of q ({heads})")
        check_shape("beta", beta, (batch, length, value_heads), "[batch, tokens, num_value_heads]")
        check_gate(gate, g, a_log, dt_bias, lower_bound, value_heads, dk)
        check_pool(pool, value_heads, dk, dv, state_v_first)
        num_slots = jnp.shape(pool)[0]
        check_shape("slots", slots, (batch,), "[batch]")
        check_integer("slots", slots)
        check_rows("slots", slots, num_slots)
        if token_slots is not None:
            check_shape("token_slots", token_slots, (batch, length), "[batch, tokens]")
            check_integer("token_slots", token_slots)
            check_token_slots(token_slots, slots, num_slots)
            token_slots = pool_rows(token_slots, num_slots)
        for name, array in (("q", q), ("k", k), ("v", v), ("beta", beta)):
            check_floating(name, array)
        scale = dk**-0.5 if softmax_scale is None else check_positive_number("softmax_scale", softmax_scale)
        return KdaPoolProblem(
            q=q, k=k, v=v, g=g, beta=beta, pool=pool, slots=pool_rows(slots, num_slots), token_slots=token_slots,
            a_log=a_log, dt_bias=dt_bias, scale=float(scale), gate=gate,
            lower_bound=None if lower_bound is None else float(lower_bound), beta_is_logits=bool(beta_is_logits),
            use_qk_l2norm=bool(use_qk_l2norm), state_v_first=bool(state_v_first),
        )

    def autotune_problem(self, inv: Invocation, rng: jax.Array) -> KdaPoolProblem:
        """Distinct slots (repeated ones would race) and a pool of small states."""
        problem = super().autotune_problem(inv, rng)
        batch, length = problem.v.shape[:2]
        num_slots = problem.pool.shape[0]
        rows = jnp.arange(batch, dtype=jnp.int32)
        slots = jnp.where(rows < num_slots, rows, -1)
        token_slots = None if problem.token_slots is None else jnp.broadcast_to(slots[:, None], (batch, length))
        return dataclasses.replace(problem, slots=slots, token_slots=token_slots, pool=0.1 * problem.pool)


def swap_layout(states: jax.Array, v_first: bool) -> jax.Array:
    """V-first rows [.., V, K] <-> K-first [.., K, V] (a swap, its own inverse); unchanged if not v_first."""
    return jnp.swapaxes(states, -1, -2) if v_first else states


def pool_rows(rows: Any, num_slots: int) -> jax.Array:
    """rows as int32 indices of a pool of num_slots rows, each outside [0, num_slots) made -1 (none). Concrete rows
    outside [-1, num_slots) were refused (`check_rows`); traced ones cannot be, and a gather would clamp a row past
    the pool onto another request's, so every implementation gets rows in the pool or -1. Compared before the
    cast, so a wide index cannot wrap into the pool."""
    rows = jnp.asarray(rows)
    return jnp.where((rows >= 0) & (rows < num_slots), rows, -1).astype(jnp.int32)


def scatter_rows(pool: jax.Array, rows: jax.Array, states: jax.Array, v_first: bool) -> jax.Array:
    """pool[rows[i]] = states[i] for rows >= 0; rows of -1 are dropped (written out of bounds)."""
    target = jnp.where(rows >= 0, rows, pool.shape[0])
    return pool.at[target].set(swap_layout(states, v_first).astype(pool.dtype), mode="drop")


def _xla_pool_decode(problem: KdaPoolProblem, cfg: KdaDecodePoolConfig) -> tuple[jax.Array, jax.Array]:
    """Gather the rows, step token by token with the XLA delta step, scatter the rows back."""
    valid = problem.slots >= 0
    states = swap_layout(problem.pool[jnp.maximum(problem.slots, 0)], problem.state_v_first)
    decay = problem.g.astype(jnp.float32)
    if problem.gate != "activated":
        decay = fused_gate(decay, problem.a_log, problem.dt_bias, problem.lower_bound)
    beta = activate_beta(problem.beta, problem.beta_is_logits)
    group = problem.v.shape[2] // problem.q.shape[2]
    q, k = (jnp.repeat(x.astype(jnp.float32), group, axis=2) for x in (problem.q, problem.k))
    if problem.use_qk_l2norm:
        q, k = l2_normalize(q), l2_normalize(k)
    tokens = tuple(jnp.moveaxis(x, 1, 0) for x in (q, k, problem.v.astype(jnp.float32), beta, decay))

    def body(state, token):
        o, state = delta_step(state, *token, problem.scale)
        return state, (o, state)

    final, (o, per_token) = lax.scan(body, states, tokens)
    o = jnp.where(valid[:, None, None, None], jnp.moveaxis(o, 0, 1), 0).astype(problem.q.dtype)
    if problem.token_slots is None:
        return o, scatter_rows(problem.pool, problem.slots, final, problem.state_v_first)
    keep = jnp.where(valid[:, None], problem.token_slots, -1)
    per_token = jnp.moveaxis(per_token, 0, 1).reshape(-1, *final.shape[1:])
    return o, scatter_rows(problem.pool, keep.reshape(-1), per_token, problem.state_v_first)


register(OP_ID, "xla", "gather_scatter", heuristic_cfg=lambda inv: KdaDecodePoolConfig())(
    _xla_pool_decode
)


def _pallas_supports(inv: Invocation, cfg: KdaDecodePoolConfig | None = None) -> str | None:
    dk, dv = inv.arrays["q"].shape[3], inv.arrays["v"].shape[3]
    if cfg is not None and not (is_power_of_two(cfg.block_v) and is_power_of_two(cfg.num_warps)):
        return f"needs block_v and num_warps powers of two, got {cfg.block_v} and {cfg.num_warps}"
    return pallas_decode.tile_reason(dk, dv)


def _pallas_heuristic(inv: Invocation) -> KdaDecodePoolConfig:
    batch, _, value_heads, dv = inv.arrays["v"].shape
    return KdaDecodePoolConfig(**pallas_decode.launch_params(batch * value_heads, dv, inv.static["state_v_first"]))


def _pallas_candidates(inv: Invocation) -> list[KdaDecodePoolConfig]:
    dv = inv.arrays["v"].shape[3]
    return [KdaDecodePoolConfig(block_v=bv, num_warps=w) for bv, w in pallas_decode.LAUNCH_CANDIDATES if bv <= dv]


@register(OP_ID, "pallas", "fused_recurrent", supports=_pallas_supports,
          heuristic_cfg=_pallas_heuristic, candidate_cfgs=_pallas_candidates, gradient_of=_xla_pool_decode)
def _pallas_pool_decode(problem: KdaPoolProblem, cfg: KdaDecodePoolConfig) -> tuple[jax.Array, jax.Array]:
    return pallas_decode.fused_recurrent_decode(
        problem.q, problem.k, problem.v, problem.g, problem.beta, problem.pool, problem.slots, problem.token_slots,
        problem.a_log, problem.dt_bias, scale=problem.scale, lower_bound=problem.lower_bound, gate=problem.gate,
        beta_is_logits=problem.beta_is_logits, use_qk_l2norm=problem.use_qk_l2norm,
        state_v_first=problem.state_v_first, block_v=cfg.block_v, num_warps=cfg.num_warps,
        interpret=interpret_here(),
    )


def _cuda_supports(inv: Invocation, cfg: KdaDecodePoolConfig | None = None) -> str | None:
    if inv.arrays["token_slots"] is not None or inv.static["state_v_first"]:
        return "takes neither token_slots nor the V-first pool (the Pallas kernel does)"
    dv = inv.arrays["v"].shape[3]
    if cfg is not None and ((cfg.block_v, cfg.num_warps) not in cuda_decode.LAUNCHES or dv % cfg.block_v):
        return (f"needs (block_v, num_warps) in {cuda_decode.LAUNCHES} with block_v dividing V = {dv}, "
                f"got ({cfg.block_v}, {cfg.num_warps})")
    return cuda_decode.decline_reason(inv.arrays["q"].shape, inv.arrays["v"].shape, inv.platform, inv.device)


def _cuda_candidates(inv: Invocation) -> list[KdaDecodePoolConfig]:
    dv = inv.arrays["v"].shape[3]
    return [KdaDecodePoolConfig(block_v=bv, num_warps=w) for bv, w in cuda_decode.LAUNCHES if dv % bv == 0]


@register(OP_ID, "cuda", "fused_recurrent", supports=_cuda_supports,
          heuristic_cfg=lambda inv: KdaDecodePoolConfig(**cuda_decode.launch_params(
              inv.arrays["v"].shape[0] * inv.arrays["v"].shape[2], inv.arrays["v"].shape[3])),
          candidate_cfgs=_cuda_candidates, gradient_of=_xla_pool_decode)
def _cuda_pool_decode(problem: KdaPoolProblem, cfg: KdaDecodePoolConfig) -> tuple[jax.Array, jax.Array]:
    return cuda_decode.fused_recurrent_decode_cuda(
        problem.q, problem.k, problem.v, problem.g, problem.beta, problem.pool, problem.slots, problem.a_log,
        problem.dt_bias, scale=problem.scale, lower_bound=problem.lower_bound, gate=problem.gate,
        beta_is_logits=problem.beta_is_logits, use_qk_l2norm=problem.use_qk_l2norm, block_v=cfg.block_v,
        num_warps=cfg.num_warps,
    )


# What `auto` tries, in order, per device platform; the first whose supports() accepts the call runs (a device
# not named here reads the "cpu" row).
AUTO = {
    "gpu": ("cuda:fused_recurrent", "pallas:fused_recurrent", "xla:gather_scatter"),
    "tpu": ("xla:gather_scatter",),
    "cpu": ("xla:gather_scatter",),
}
# Run only when asked for by platform (registered in ops/kda/pallas_tpu/pool_register.py).
OPT_IN = {
    "pallas_tpu:fused_recurrent": "not yet timed on a TPU",
}
set_auto_order(OP_ID, AUTO, OPT_IN)


def kda_decode_pool(
    q: Float[Array, "batch tokens num_heads head_dim"],
    k: Float[Array, "batch tokens num_heads head_dim"],
    v: Float[Array, "batch tokens num_value_heads v_head_dim"],
    g: Float[Array, "batch tokens num_value_heads gate_dim"],
    beta: Float[Array, "batch tokens num_value_heads"],
    pool: Float[Array, "num_slots num_value_heads d1 d2"],
    slots: Int[Array, " batch"],
    /,
    *,
    token_slots: Int[Array, "batch tokens"] | None = None,
    a_log: Float[Array, " num_value_heads"] | None = None,
    dt_bias: Float[Array, "num_value_heads head_dim"] | None = None,
    lower_bound: float | None = None,
    gate: str = "activated",
    softmax_scale: float | None = None,
    beta_is_logits: bool = False,
    use_qk_l2norm: bool = True,
    state_v_first: bool = False,
    platform: str | None = None,
    cfg: KdaDecodePoolConfig | None = None,
) -> tuple[Float[Array, "batch tokens num_value_heads v_head_dim"], Float[Array, "num_slots num_value_heads d1 d2"]]:
    """Advance B requests by T tokens each from their pool rows; returns (output [B, T, HV, V] in q's
    dtype, the updated pool). Donate the pool (jax.jit(..., donate_argnums=...)) to update it in place.

    slots [B] int32: the row each request reads (and, without token_slots, writes); -1: padded, and so is
    any slot outside [0, num_slots) under jit (eager calls refuse it). Valid slots must be distinct.
    gate: "activated" (g is the log decay), "softplus" or "bounded" (g raw; a_log [HV], dt_bias [HV, K]
    or None, lower_bound <= 0 for "bounded"). See the module doc.
    """
    return default_executor()(
        KdaDecodePool(), q, k, v, g, beta, pool, slots, token_slots=token_slots, a_log=a_log, dt_bias=dt_bias,
        lower_bound=lower_bound, gate=gate, softmax_scale=softmax_scale, beta_is_logits=beta_is_logits,
        use_qk_l2norm=use_qk_l2norm, state_v_first=state_v_first, platform=platform, cfg=cfg,
    )
