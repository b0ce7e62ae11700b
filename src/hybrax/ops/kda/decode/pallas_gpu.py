"""KDA decode on the GPU with Pallas (Triton lowering): the fused recurrent step, state in place.

Decode is memory-bound: each step reads and writes the fp32 state, B*HV*K*V*4 bytes each way, and
everything else (q, k, v, gate, beta) is 1/V of that. So one program per (value block, value head,
request) reads its [K, BV] state tile once, keeps it in registers for all of the request's tokens,
and writes it once (per token when speculative decoding keeps every token's state):

    q, k  <- L2-normalized (x / sqrt(sum x^2 + 1e-6)), q scaled
    g     <- the fused gate, from the raw input:  activated (g is already the log decay)
             softplus:  -exp(a_log) * softplus(g + dt_bias)          (Kimi Linear's released gate)
             bounded:   lower_bound * sigmoid(exp(a_log) * (g + dt_bias))   (the NKI `kda_tkg`'s, fla's safe gate)
    beta  <- sigmoid(beta) when it holds logits
    S' = Diag(exp g) S;  S = S' + k (beta (v - S'^T k))^T;  o = S^T q

The state is a whole-array ref aliased to the output (input_output_aliases), so rows no program
names are never touched. With `slots` [B] int32 the state is a serving pool [num_slots, HV, K, V]
(or V-first [num_slots, HV, V, K]) and request b works on row slots[b]; slot -1 (or any other row
the pool lacks, as in the CUDA kernel) marks a padded request, which reads nothing, writes nothing and
outputs zeros. `token_slots` [B, T] (speculative decoding) names where the state after each token goes
(-1, or a row the pool lacks: nowhere); the final state then goes nowhere else.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton
from jaxtyping import Array, Float, Int

from hybrax.core import Invocation, register
from hybrax.ops.kda.base import OP_ID, KdaProblem, KernelDeltaAttentionConfig
from hybrax.ops.kda.common.delta import inverse_l2_norm, single_step
from hybrax.ops.kda.decode.operands import GATES, step_scalars
from hybrax.ops.pallas_shared import interpret_here, pallas_call

MAX_UNROLLED_TOKENS = 8


def _log_decay(raw, a_log, dt_bias, lower_bound, gate: str):
    """The in-kernel copy of `gate.fused_gate` for one (token, value head): raw [K] or [1] -> [K] or [1];
    a_log and dt_bias that value head's (or None)."""
    if gate == "activated":
        return raw
    if dt_bias is not None:
        raw = raw + dt_bias
    rate = 1.0 if a_log is None else jnp.exp(a_log)
    if gate == "softplus":
        return -rate * jax.nn.softplus(raw)
    return lower_bound * jax.nn.sigmoid(rate * raw)


def _decode_kernel(
    scalars_ref, slots_ref, token_slots_ref, q_ref, k_ref, v_ref, g_ref, beta_ref, a_log_ref, dt_bias_ref,
    state_in_ref, o_ref, state_ref, *, gate: str, beta_is_logits: bool, use_qk_l2norm: bool, v_first: bool,
    block_v: int, group: int,
):
    del state_in_ref  # aliased to state_ref: read and written through it
    j, head, b = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    tokens = v_ref.shape[1]
    cols = pl.ds(j * block_v, block_v)
    scale, lower_bound = scalars_ref[0], scalars_ref[1]
    slot = b if slots_ref is None else slots_ref[b]

    def in_pool(row):  # a row the pool lacks (-1 for padding) is never read or written
        return (row >= 0) & (row < state_ref.shape[0])

    key_axis = 1 if v_first else 0

    def along_keys(x):  # [K] (or [K, 2]) -> broadcastable over the tile's key axis
        return x[None] if v_first else x[:, None]

    def along_values(x):  # [BV] -> broadcastable over the tile's value axis
        return x[:, None] if v_first else x[None, :]

    def tile(row):  # the program's view of a state row: [BV, K] V-first, else [K, BV]
        return state_ref.at[row, head, cols, :] if v_first else state_ref.at[row, head, :, cols]

    def token_inputs(t):
        """Token t's q, k, v, raw gate and beta in fp32. Loaded before any arithmetic: ptxas moves no load
        across the barriers of the reductions over K, so each load issued after one waited out a whole memory
        round trip of its own (four of them per step)."""
        f32 = lambda x: x.astype(jnp.float32)  # noqa: E731
        return (
            f32(q_ref[b, t, head // group, :]), f32(k_ref[b, t, head // group, :]), f32(v_ref[b, t, head, cols]),
            f32(g_ref[b, t, head, :]), f32(beta_ref[b, t, head]),
        )

    a_log = None if a_log_ref is None else a_log_ref[head].astype(jnp.float32)
    dt_bias = None if dt_bias_ref is None else dt_bias_ref[head, :].astype(jnp.float32)

    def token_step(t, state, inputs=None):
        """Token t from the state: (the new state, the output [BV] in fp32)."""
        q, k, v, raw_gate, beta = token_inputs(t) if inputs is None else inputs
        q, k, k_dot_q = _normalized_with_dot(q, k, scale, use_qk_l2norm)
        beta = jax.nn.sigmoid(beta) if beta_is_logits else beta
        state = state * along_keys(jnp.exp(_log_decay(raw_gate, a_log, dt_bias, lower_bound, gate)))
        # Both reductions over K from the decayed state: o = S_new^T q = S'^T q + (k . q) beta e, so the
        # output's reduction does not wait for the update. Kept as two sums: stacked into one [K, BV, 2]
        # reduction they doubled the registers (230 at bv64 w4, 2 programs per SM) and ran 10-25% slower
        # on the H200 (H200 measurements).
        decayed_k = jnp.sum(state * along_keys(k), axis=key_axis)
        decayed_q = jnp.sum(state * along_keys(q), axis=key_axis)
        update = beta * (v - decayed_k)
        state = state + along_keys(k) * along_values(update)
        return state, decayed_q + k_dot_q * update

    def store_output(t, out):
        o_ref[b, t, head, cols] = out.astype(o_ref.dtype)

    def store_token_state(t, state):
        if token_slots_ref is None:
            return
        target = token_slots_ref[b, t]

        @pl.when(in_pool(target))
        def _():
            tile(target)[...] = state

    def advance():
        state = tile(slot)[...]
        if tokens <= MAX_UNROLLED_TOKENS:  # straight-line code for decode and short speculation
            inputs = [token_inputs(t) for t in range(tokens)]
            outputs = []
            for t in range(tokens):
                state, out = token_step(t, state, inputs[t])
                store_token_state(t, state)
                outputs.append(out)
        else:
            def loop_step(t, state):
                state, out = token_step(t, state)
                store_token_state(t, state)
                store_output(t, out)
                return state

            state, outputs = lax.fori_loop(0, tokens, loop_step, state), []
        # The state first: its stores are the step's long tail, the outputs' few bytes go out behind them.
        if token_slots_ref is None:
            tile(slot)[...] = state
        for t, out in enumerate(outputs):
            store_output(t, out)

    if slots_ref is None:  # every request owns its row: nothing to skip
        advance()
        return

    pl.when(in_pool(slot))(advance)

    @pl.when(jnp.logical_not(in_pool(slot)))
    def _():
        for t in range(tokens):
            store_output(t, jnp.zeros((block_v,), jnp.float32))


def _normalized_with_dot(q, k, scale, use_qk_l2norm: bool):
    """(q scaled, k, k . q), q and k L2-normalized first when asked. The squared norms and k . q come from
    the raw vectors in one stacked reduction (its barriers paid once), then rescale. The sums stay [1]
    vectors: Triton's split of a [2] gives 0-d tensors that its scalar arithmetic does not take."""
    if not use_qk_l2norm:
        q = q * scale
        return q, k, jnp.sum(k * q, keepdims=True)
    squares = lax.stack([q * q, k * k], axis=1)  # [K, 2]
    products = lax.stack([squares, lax.stack([k * q, k * q], axis=1)], axis=2)  # [K, 2, 2]
    squares, dots = lax.unstack(jnp.sum(products, axis=0, keepdims=True), axis=2)  # [1, 2] each
    (q_square, k_square), (k_dot_q, _) = lax.unstack(squares, axis=1), lax.unstack(dots, axis=1)  # [1] each
    inverse_q, inverse_k = inverse_l2_norm(q_square) * scale, inverse_l2_norm(k_square)
    return q * inverse_q, k * inverse_k, k_dot_q * inverse_q * inverse_k


@functools.partial(
    jax.jit,
    static_argnames=(
        "gate", "beta_is_logits", "use_qk_l2norm", "state_v_first", "block_v", "num_warps", "num_stages",
        "interpret",
    ),
)
def fused_recurrent_decode(
    q: Float[Array, "B T H K"],
    k: Float[Array, "B T H K"],
    v: Float[Array, "B T HV V"],
    g: Float[Array, "B T HV Kg"],
    beta: Float[Array, "B T HV"],
    state: Float[Array, "S HV K V"],
    slots: Int[Array, " B"] | None = None,
    token_slots: Int[Array, "B T"] | None = None,
    a_log: Float[Array, " HV"] | None = None,
    dt_bias: Float[Array, "HV K"] | None = None,
    *,
    scale: Any,
    lower_bound: Any = None,
    gate: str = "activated",
    beta_is_logits: bool = False,
    use_qk_l2norm: bool = True,
    state_v_first: bool = False,
    block_v: int = 32,
    num_warps: int = 4,
    num_stages: int = 1,
    interpret: bool = False,
) -> tuple[Float[Array, "B T HV V"], Float[Array, "S HV K V"]]:
    """T tokens for each of B requests from the fp32 state; returns (o in q's dtype, the new state).

    g [B, T, HV, K] (or [B, T, HV, 1]: one decay per head) is raw for the fused gates, the log decay
    for `gate="activated"`; scale and lower_bound are numbers or one-element arrays. Without `slots`
    the state is [B, HV, K, V] (request b owns row b); with them it is a pool (see the module doc).
    K, V and block_v must be powers of two. Slots must be distinct among valid rows.
    The state is updated in place when the caller donates it (or carries it through a loop).
    """
    if gate not in GATES:
        raise ValueError(f"gate must be one of {GATES}, got {gate!r}")
    batch, tokens, value_heads, dv = v.shape
    reason = tile_reason(q.shape[-1], dv)
    if reason:
        raise ValueError(f"fused_recurrent_decode {reason}")
    block_v = min(block_v, dv)
    if block_v < 1 or block_v & (block_v - 1):  # with the head sizes powers of two, a power of two divides them
        raise ValueError(f"block_v must be a power of two, got {block_v}")
    scalars = step_scalars(scale, lower_bound)
    kernel = functools.partial(
        _decode_kernel, gate=gate, beta_is_logits=beta_is_logits, use_qk_l2norm=use_qk_l2norm,
        v_first=state_v_first, block_v=block_v, group=value_heads // q.shape[2],
    )
    arrays = (scalars, slots, token_slots, q, k, v, g, beta, a_log, dt_bias, state)
    state_index = len(jax.tree.leaves(arrays)) - 1  # aliases count array leaves; the None slots hold none
    return pallas_call(
        kernel,
        grid=(dv // block_v, value_heads, batch),
        out_shape=(jax.ShapeDtypeStruct(v.shape, q.dtype), jax.ShapeDtypeStruct(state.shape, jnp.float32)),
        input_output_aliases={state_index: 1},
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="kda_fused_recurrent_decode",
    )(*arrays)


def _is_tile_size(n: int) -> bool:
    return n >= 16 and n & (n - 1) == 0


def tile_reason(dk: int, dv: int) -> str | None:
    """Why the kernel cannot take these head sizes (Triton tiles are powers of two), or None."""
    if not (_is_tile_size(dk) and _is_tile_size(dv)) or dk > 256:
        return f"needs K a power of two in [16, 256] and V one of at least 16 (Triton tiles), got K={dk}, V={dv}"
    return None


# (block_v, num_warps) launches worth timing; the autotuner of `kda_decode_pool` tries those that fit the head
# sizes. (Splitting the key axis into blocks held apart, fewer registers and barriers in the offline PTX, lost at
# every batch on the H200.)
LAUNCH_CANDIDATES = ((32, 2), (32, 4), (32, 8), (64, 2), (64, 4), (64, 8))
# From this many programs of 64 value columns up, 64 columns stream the state faster; below, 32 columns
# fill the GPU better (H200, 132 SMs, H = 32, K = V = 128, µs per step with 32 / 64 columns: B = 1
# 11.2 / 16.0, B = 8 8.40 / 9.27, B = 64 81.8 / 81.5-82.4, B = 256 318 / 316, B = 1024 at
# H = 16 644 / 624-632).
MIN_PROGRAMS = 4096


def launch_params(rows: int, dv: int, state_v_first: bool = False) -> dict[str, int]:
    """block_v and num_warps for `rows` = requests x value heads (measured on the H200).

    K-first: 4 warps, 32 columns up to B = 8 at H = 32, 64 columns from B = 64 (Triton lays the warps along K,
    so the reductions over K cross warps; more warps lose). V-first: 32 columns and 8 warps at every B (each
    warp holds whole key rows, its reductions stay in the warp): 1-13% faster there than the K-first launches
    though still 1-2% behind the K-first state at B >= 64."""
    if state_v_first:
        return {"block_v": min(32, dv), "num_warps": 8}
    block_v = 64 if dv >= 64 and rows * (dv // 64) >= MIN_PROGRAMS else min(32, dv)
    return {"block_v": block_v, "num_warps": 4}


def _supports_single_token(inv: Invocation) -> str | None:
    if inv.arrays["q"].shape[1] != 1:
        return "needs seq_len == 1 (decode)"
    if inv.arrays["cu_seqlens"] is not None:
        return "needs no cu_seqlens"
    return tile_reason(inv.arrays["q"].shape[3], inv.arrays["v"].shape[3])


def _single_token(problem: KdaProblem, cfg: KernelDeltaAttentionConfig) -> tuple[jax.Array, jax.Array]:
    batch, _, value_heads, dv = problem.v.shape
    return fused_recurrent_decode(
        problem.q, problem.k, problem.v, problem.decay, problem.beta, problem.initial_states(), scale=problem.scale,
        use_qk_l2norm=problem.use_qk_l2norm, interpret=interpret_here(), **launch_params(batch * value_heads, dv),
    )


# kernel_delta_attention's T == 1 path: before xla:single_step in the "gpu" row (ops/kda/api.py).
register(
    OP_ID, "pallas", "decode", supports=_supports_single_token,
    heuristic_cfg=lambda inv: KernelDeltaAttentionConfig(),
    gradient_of=single_step,  # decode needs no fast backward: training never lands here
)(_single_token)
