"""KDA decode on the TPU: one Pallas Mosaic kernel stepping rows of a state pool, for `kda_decode_pool`
(`pool_register`, the pool updated in place) and for `kernel_delta_attention` at T = 1 (registered here: the
batch's initial states as the pool, slot b for request b, the new states a fresh output). Both opt-in
(platform="pallas_tpu") until the kernel has run and been timed on a TPU (`benchmarks/kda_tpu.py`).

Decode is memory-bound: a step reads and writes each request's fp32 states [HV, K, V], and every other input
is 1/V of that. The kernel walks the grid (request b, block of value heads) in order. Each step copies its
block of row slots[b] of the states from HBM into one of three VMEM buffers, advances it by the request's
T tokens

    S' = Diag(exp g) S;  S = S' + k (beta (v - S'^T k))^T;  o = S^T q       (fp32, VPU)

and copies it to the same row of the output; the copy in of the next step is started before this step's
arithmetic and the copy out is waited for only when its buffer comes round again, so both overlap the
arithmetic. In place, the output is the input (input_output_aliases) and is touched only by these copies:
rows no request names, and the row of a padded request (slot -1), are never read or written; a padded
request outputs zeros.

The per-token vectors come prepared by XLA, a few small fusions (1/V of the state's bytes): q and k
L2-normalized, q scaled and both repeated to the value heads; q, k and the log decay as [K, 1] columns (the
state's rows are key channels), v as a [1, V] row. The gate and beta come activated.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from jaxtyping import Array, Float, Int

from hybrax.core import Invocation, lookup, register
from hybrax.ops.kda.base import OP_ID, KdaProblem, KernelDeltaAttentionConfig
from hybrax.ops.kda.pallas_tpu.chunk_fwd import head_dims_reason, interpret_mode
from hybrax.ops.kda.common.delta import l2_normalize

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
    blocks = pl.num_programs(1)
    step = pl.program_id(0) * blocks + pl.program_id(1)
    steps = pl.num_programs(0) * blocks
    heads = buffers.shape[1]

    def rows(ref, s):  # step s's block of its row of `ref`
        slot = jnp.maximum(slots_ref[lax.div(s, blocks)], 0)
        return ref.at[slot, pl.ds(lax.rem(s, blocks) * heads, heads)]

    def copy_in(s):
        buffer = lax.rem(s, BUFFERS)
        return pltpu.make_async_copy(rows(pool_in_ref, s), buffers.at[buffer], read_sems.at[buffer])

    def copy_out(s):
        buffer = lax.rem(s, BUFFERS)
        return pltpu.make_async_copy(buffers.at[buffer], rows(pool_ref, s), write_sems.at[buffer])

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


def _prepared(q, k, v, decay, beta, scale: float, use_qk_l2norm: bool) -> tuple[jax.Array, ...]:
    """q, k, log decay [B, T, HV, K, 1] and v [B, T, HV, 1, V], beta [B, T, HV, 1, 1], fp32 (module doc)."""
    batch, length, value_heads, _ = v.shape
    group = value_heads // q.shape[2]
    q, k = (jnp.repeat(x.astype(jnp.float32), group, axis=2) for x in (q, k))
    if use_qk_l2norm:
        q, k = l2_normalize(q), l2_normalize(k)
    decay = jnp.broadcast_to(decay.astype(jnp.float32), k.shape)
    return (
        (q * scale)[..., None], k[..., None], decay[..., None], v.astype(jnp.float32)[..., None, :],
        beta.astype(jnp.float32)[..., None, None],
    )


def fused_recurrent_decode(
    q: Float[Array, "B T H K"],
    k: Float[Array, "B T H K"],
    v: Float[Array, "B T HV V"],
    decay: Float[Array, "B T HV Kd"],
    beta: Float[Array, "B T HV"],
    states: Float[Array, "S HV K V"],
    slots: Int[Array, " B"],
    *,
    scale: float,
    use_qk_l2norm: bool = True,
    in_place: bool = True,
    interpret=None,
) -> tuple[Float[Array, "B T HV V"], Float[Array, "S HV K V"]]:
    """B requests advanced by T tokens each from rows `slots` of `states` (fp32); decay the log decay per
    channel (Kd = K) or per head (Kd = 1), beta activated. Returns (o in q's dtype, the states with those rows
    advanced). `in_place`: the states are aliased to the output (donate them to avoid XLA's copy), rows no
    request names keep their values; otherwise they are read from the input and written to a fresh output,
    whose other rows are undefined (every row should be named). Slots outside [0, S) are padded requests:
    nothing read or written, zeros out. `interpret` None: compiled on a TPU, interpret mode elsewhere."""
    batch, length, value_heads, dv = v.shape
    dk = q.shape[3]
    heads = block_heads(value_heads, length, dk)
    columns = pl.BlockSpec((None, length, heads, dk, 1), lambda b, j, slots: (b, 0, j, 0, 0))
    vectors = pl.BlockSpec((None, length, heads, 1, dv), lambda b, j, slots: (b, 0, j, 0, 0))
    scalars = pl.BlockSpec((None, length, heads, 1, 1), lambda b, j, slots: (b, 0, j, 0, 0))
    anywhere = pl.BlockSpec(memory_space=pl.ANY)
    slots = jnp.where((slots >= 0) & (slots < states.shape[0]), slots, -1).astype(jnp.int32)
    o, states = pl.pallas_call(
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
            jax.ShapeDtypeStruct(states.shape, jnp.float32),
        ],
        input_output_aliases={6: 1} if in_place else {},  # the states (after slots and the five token inputs)
        compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary", "arbitrary")),
        interpret=interpret_mode() if interpret is None else interpret,
        name="kda_decode_tpu",
    )(slots, *_prepared(q, k, v, decay, beta, scale, use_qk_l2norm), states.astype(jnp.float32))
    return o[..., 0, :].astype(q.dtype), states


def _supports_step(inv: Invocation) -> str | None:
    if inv.arrays["q"].shape[1] != 1:
        return "needs seq_len == 1 (a decode step)"
    if inv.arrays["cu_seqlens"] is not None:
        return "needs no cu_seqlens"
    return head_dims_reason(inv.arrays["q"].shape, inv.arrays["v"].shape)


def _xla_single_step(problem: KdaProblem, cfg: KernelDeltaAttentionConfig) -> tuple[jax.Array, jax.Array]:
    """XLA's T = 1 step: what the gradient differentiates."""
    return lookup(OP_ID, "xla", "single_step")(problem, cfg)


# Opt-in (platform="pallas_tpu": `OPT_IN` in ops/kda/api.py) until it has run and been timed on a TPU; then into
# the "tpu" row of `AUTO` there, before XLA's single step.
@register(OP_ID, "pallas_tpu", "decode", supports=_supports_step,
          heuristic_cfg=lambda inv: KernelDeltaAttentionConfig(), gradient_of=_xla_single_step)
def pallas_tpu_step(problem: KdaProblem, cfg: KernelDeltaAttentionConfig) -> tuple[jax.Array, jax.Array]:
    batch = problem.q.shape[0]
    return fused_recurrent_decode(
        problem.q, problem.k, problem.v, problem.decay, problem.beta, problem.initial_states(),
        jnp.arange(batch, dtype=jnp.int32), scale=problem.scale, use_qk_l2norm=problem.use_qk_l2norm,
        in_place=False,
    )
