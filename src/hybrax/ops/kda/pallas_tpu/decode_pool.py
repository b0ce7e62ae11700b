"""KDA decode over a serving state pool on the TPU (`kda_decode_pool`): one Pallas Mosaic kernel, the pool
updated in place.

Decode is memory-bound: a step reads and writes each request's fp32 states [HV, K, V], and every other input
is 1/V of that. The kernel walks the grid (request b, block of value heads) in order. Each step copies its
block of pool row slots[b] from HBM into one of three VMEM buffers, advances it by the request's T tokens

    S' = Diag(exp g) S;  S = S' + k (beta (v - S'^T k))^T;  o = S^T q       (fp32, VPU)

and copies it back; the copy in of the next step is started before this step's arithmetic and the copy out
is waited for only when its buffer comes round again, so both overlap the arithmetic. The pool is aliased
to the output (input_output_aliases) and touched only by these copies: rows no request names, and the row
of a padded request (slot -1), are never read or written; a padded request outputs zeros.

The per-token vectors come prepared by XLA, a few small fusions (1/V of the state's bytes): the gate
activated, beta through its sigmoid, q and k L2-normalized, q scaled and both repeated to the value heads;
q, k and the log decay as [K, 1] columns (the state's rows are key channels), v as a [1, V] row.
Not covered yet (`supports` declines): token_slots (a state per token), the V-first pool, K or V above 128.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from hybrax.core import Invocation, lookup, register
from hybrax.ops.kda.gate import activate_beta, fused_gate
from hybrax.ops.kda.pallas_tpu.chunk_fwd import MAX_HEAD_DIM, interpret_mode
from hybrax.ops.kda.xla_scan import l2_normalize
from hybrax.serving.kda_pool import OP_ID, KdaDecodePoolConfig, KdaPoolProblem

BUFFERS = 3  # in flight at a step: the next step's copy in, this step's block, the last step's copy out
COLUMN_BYTES = 2 * 2**20  # VMEM for one input of [K, 1] columns (padded to 128 lanes there)


def block_heads(value_heads: int, tokens: int, dk: int) -> int:
    """Value heads per step: the most of 8, 4, 2, 1 dividing HV whose [T, heads, K, 1] column blocks fit
    COLUMN_BYTES."""
    fits = lambda n: tokens * n * dk * 128 * 4 <= COLUMN_BYTES  # noqa: E731
    return next(n for n in (8, 4, 2, 1) if value_heads % n == 0 and (n == 1 or fits(n)))


def _advance(state, q_ref, k_ref, decay_ref, v_ref, beta_ref, o_ref, head: int):
    """One head's state [K, V] through the request's tokens; writes their outputs."""
    for t in range(q_ref.shape[0]):
        k = k_ref[t, head]  # [K, 1]
        state = state * jnp.exp(decay_ref[t, head])
        error = v_ref[t, head] - jnp.sum(state * k, axis=0, keepdims=True)  # [1, V]
        state = state + k * (beta_ref[t, head] * error)
        o_ref[t, head] = jnp.sum(state * q_ref[t, head], axis=0, keepdims=True)
    return state


def _pool_kernel(slots_ref, q_ref, k_ref, decay_ref, v_ref, beta_ref, pool_in_ref, o_ref, pool_ref, buffers,
                 read_sems, write_sems):
    del pool_in_ref  # aliased to pool_ref: read and written through it
    blocks = pl.num_programs(1)
    step = pl.program_id(0) * blocks + pl.program_id(1)
    steps = pl.num_programs(0) * blocks
    heads = buffers.shape[1]

    def rows(s):  # step s's block of its pool row
        slot = jnp.maximum(slots_ref[lax.div(s, blocks)], 0)
        return pool_ref.at[slot, pl.ds(lax.rem(s, blocks) * heads, heads)]

    def copy_in(s):
        return pltpu.make_async_copy(rows(s), buffers.at[lax.rem(s, BUFFERS)], read_sems.at[lax.rem(s, BUFFERS)])

    def copy_out(s):
        return pltpu.make_async_copy(buffers.at[lax.rem(s, BUFFERS)], rows(s), write_sems.at[lax.rem(s, BUFFERS)])

    def valid(s):
        return slots_ref[lax.div(s, blocks)] >= 0

    @pl.when((step == 0) & valid(0))
    def _():
        copy_in(0).start()

    @pl.when((step >= 2) & valid(jnp.maximum(step - 2, 0)))
    def _():  # frees the buffer of step + 1
        copy_out(step - 2).wait()

    @pl.when((step + 1 < steps) & valid(jnp.minimum(step + 1, steps - 1)))
    def _():
        copy_in(step + 1).start()

    @pl.when(valid(step))
    def _():
        copy_in(step).wait()
        buffer = buffers.at[lax.rem(step, BUFFERS)]
        for head in range(heads):
            buffer[head] = _advance(buffer[head], q_ref, k_ref, decay_ref, v_ref, beta_ref, o_ref, head)
        copy_out(step).start()

    @pl.when(jnp.logical_not(valid(step)))
    def _():
        o_ref[...] = jnp.zeros(o_ref.shape, o_ref.dtype)

    @pl.when((step == steps - 1) & (steps >= 2) & valid(jnp.maximum(step - 1, 0)))
    def _():
        copy_out(step - 1).wait()

    @pl.when((step == steps - 1) & valid(step))
    def _():
        copy_out(step).wait()


def _prepared(problem: KdaPoolProblem) -> tuple[jax.Array, ...]:
    """q, k, log decay [B, T, HV, K, 1] and v [B, T, HV, 1, V], beta [B, T, HV, 1, 1], fp32 (module doc)."""
    batch, length, value_heads, dv = problem.v.shape
    dk = problem.q.shape[3]
    decay = problem.g.astype(jnp.float32)
    if problem.gate != "activated":
        decay = fused_gate(decay, problem.a_log, problem.dt_bias, problem.lower_bound)
    decay = jnp.broadcast_to(decay, (batch, length, value_heads, dk))
    group = value_heads // problem.q.shape[2]
    q, k = (jnp.repeat(x.astype(jnp.float32), group, axis=2) for x in (problem.q, problem.k))
    if problem.use_qk_l2norm:
        q, k = l2_normalize(q), l2_normalize(k)
    beta = activate_beta(problem.beta, problem.beta_is_logits)
    return (
        (q * problem.scale)[..., None], k[..., None], decay[..., None], problem.v.astype(jnp.float32)[..., None, :],
        beta[..., None, None],
    )


def pool_decode(problem: KdaPoolProblem, interpret=None) -> tuple[jax.Array, jax.Array]:
    """(o [B, T, HV, V] in q's dtype, the updated pool) of `kda_decode_pool` on the TPU (interpret mode
    elsewhere, `interpret` None)."""
    batch, length, value_heads, dv = problem.v.shape
    dk = problem.q.shape[3]
    heads = block_heads(value_heads, length, dk)
    columns = pl.BlockSpec((None, length, heads, dk, 1), lambda b, j, slots: (b, 0, j, 0, 0))
    vectors = pl.BlockSpec((None, length, heads, 1, dv), lambda b, j, slots: (b, 0, j, 0, 0))
    scalars = pl.BlockSpec((None, length, heads, 1, 1), lambda b, j, slots: (b, 0, j, 0, 0))
    anywhere = pl.BlockSpec(memory_space=pl.ANY)
    o, pool = pl.pallas_call(
        _pool_kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1,
            grid=(batch, value_heads // heads),
            in_specs=[columns, columns, columns, vectors, scalars, anywhere],
            out_specs=[vectors, anywhere],
            scratch_shapes=[
                pltpu.VMEM((BUFFERS, heads, dk, dv), jnp.float32),
                pltpu.SemaphoreType.DMA((BUFFERS,)),
                pltpu.SemaphoreType.DMA((BUFFERS,)),
            ],
        ),
        out_shape=[
            jax.ShapeDtypeStruct((batch, length, value_heads, 1, dv), jnp.float32),
            jax.ShapeDtypeStruct(problem.pool.shape, jnp.float32),
        ],
        input_output_aliases={6: 1},  # the pool (after slots and the five token inputs)
        compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary", "arbitrary")),
        interpret=interpret_mode() if interpret is None else interpret,
        name="kda_decode_pool_tpu",
    )(problem.slots, *_prepared(problem), problem.pool)
    return o[..., 0, :].astype(problem.q.dtype), pool


def _supports(inv: Invocation, cfg: KdaDecodePoolConfig | None = None) -> str | None:
    if inv.arrays["token_slots"] is not None:
        return "token_slots (a state per token) are not covered yet"
    if inv.static["state_v_first"]:
        return "the V-first pool is not covered yet"
    dk, dv = inv.arrays["q"].shape[3], inv.arrays["v"].shape[3]
    if max(dk, dv) > MAX_HEAD_DIM:
        return f"needs K and V <= {MAX_HEAD_DIM}, got K={dk}, V={dv}"
    return None


def _xla_pool_decode(problem: KdaPoolProblem, cfg: KdaDecodePoolConfig) -> tuple[jax.Array, jax.Array]:
    """The XLA implementation: what the gradient differentiates."""
    return lookup(OP_ID, "xla", "gather_scatter")(problem, cfg)


@register(OP_ID, "pallas_tpu", "fused_recurrent", priority=25, devices=("tpu",), supports=_supports,
          heuristic_cfg=lambda inv: KdaDecodePoolConfig(), gradient_of=_xla_pool_decode)
def pallas_tpu_pool_decode(problem: KdaPoolProblem, cfg: KdaDecodePoolConfig) -> tuple[jax.Array, jax.Array]:
    return pool_decode(problem)
