"""Context parallelism: one long sequence split along time over the devices of a mesh axis, each device holding
consecutive tokens (shard i holds tokens i * T_local ... (i + 1) * T_local - 1). Call these inside
`jax.shard_map` with the time axis (axis 1) of the token inputs split over `axis_name`.

Both recurrences are affine in the state entering a shard, and so is every output. Each device runs one pass
over its own tokens from a zero state that also yields the shard's map S_out = map(S_in) + L; the maps are
gathered (B·H·K·(K + V) fp32 numbers per device for KDA, B·H·(K + V) for gated linear attention), every device
runs the short chain S_in(0) = initial state, S_in(i + 1) = map_i(S_in(i)) + L_i, and adds its outputs' terms in
S_in. Gradients flow through the same ops (the passes' custom VJPs, the gather, the chain).

KDA: map(S) = P S with P [K, K] the product of the shard's decay-then-delta steps (I - beta k k^T) Diag(exp g),
and o_t = S_in^T (P_t^T q_t) + o_local_t. One chunked pass gives all of it: values widened by K zero columns and
an initial state widened by the identity (zeros under the values' columns) carry P_t in the extra columns, so the
final state's extra columns are P and the extra outputs P_t^T q_t: a pass of width V + K. Packed sequences
(cu_seqlens) may cross shards: only the sequence holding a shard's first token receives the carried state
(the identity goes into its columns alone), the state leaving a shard is its last sequence's, and each
sequence's final state comes from the shard holding its last token.
Gated linear attention: map(S) = Diag(a) S Diag(b) with a, b the shard's products of key- and value-axis
decays, from cumulative sums of the log gates; the pass is the ordinary one.

Softmax attention has no state to pass: each device gathers the whole sequence's keys and values
(`attention_context_parallel`); causal calls trade half-shards of queries so that every device does the same work.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from hybrax.core import vary_like
from hybrax.core.packing import reversed_cu_seqlens, token_sequence
from hybrax.core.validate import check_integer, check_rank, check_shape, describe
from hybrax.ops.attention.api import attention
from hybrax.ops.attention.mask import MaskInfo
from hybrax.ops.kda.api import kernel_delta_attention
from hybrax.ops.recurrent.api import RecurrentAttention, recurrent_attention
from hybrax.ops.recurrent.engine import key_log_decay


def _check_shard(query: Any, value: Any, initial_state: Any, cu_seqlens: Any) -> None:
    """What the widened call cannot name well: value's own shape, and the whole sequence's initial state."""
    check_rank("query", query, 4, "[batch, seq_shard, num_heads, head_dim]")
    check_rank("value", value, 4, "[batch, seq_shard, num_value_heads, v_head_dim]")
    batch, length = query.shape[:2]
    check_shape("value", value, (batch, length, None, None), "[batch, seq_shard, num_value_heads, v_head_dim]")
    states = batch
    if cu_seqlens is not None:
        check_integer("cu_seqlens", cu_seqlens)
        check_rank("cu_seqlens", cu_seqlens, 1, "[num_sequences + 1] (the whole sequence's)")
        states = jnp.shape(cu_seqlens)[0] - 1
    if initial_state is not None:
        what = "[batch" if cu_seqlens is None else "[num_sequences"
        check_shape("initial_state", initial_state, (states, value.shape[2], query.shape[3], value.shape[3]),
                    f"{what}, num_value_heads, head_dim, v_head_dim]")


def _widened(value: jax.Array, initial: jax.Array, carried_in: jax.Array) -> tuple[jax.Array, jax.Array]:
    """value with K zero columns, and the initial states [N, HV, K, V + K] widened by K columns: where
    `carried_in`, zeros then the identity (the state arrives from the shards before, unknown yet), elsewhere the
    known initial state then zeros."""
    batch, length, value_heads, _ = value.shape
    dk = initial.shape[2]
    wide_value = jnp.concatenate([value, jnp.zeros((batch, length, value_heads, dk), value.dtype)], axis=-1)
    identity = jnp.broadcast_to(jnp.eye(dk, dtype=jnp.float32), initial.shape[:2] + (dk, dk))
    wide_initial = jnp.concatenate([jnp.where(carried_in, 0.0, initial), jnp.where(carried_in, identity, 0.0)], -1)
    return wide_value, wide_initial


def _entering_states(transition: Any, local_state: jax.Array, initial_state: jax.Array | None, axis_name: str,
                     apply: Callable[[Any, jax.Array], jax.Array], reverse: bool = False
                     ) -> tuple[jax.Array, jax.Array]:
    """(the state entering this shard, the state after the last shard), from every shard's affine map
    S_out = apply(transition, S_in) + local_state; with `reverse` the sequence runs from the last shard down."""
    # Gathered as invarying: every device then holds, and runs, the same chain.
    transitions, local_states = jax.lax.all_gather((transition, local_state), axis_name, to="invarying")
    start = jnp.zeros_like(local_states[0]) if initial_state is None else initial_state.astype(jnp.float32)
    start = vary_like(start, local_states)  # the chain's carry varies wherever the gathered states do

    def shard_step(state: jax.Array, shard: tuple[Any, jax.Array]) -> tuple[jax.Array, jax.Array]:
        shard_transition, shard_local = shard
        return apply(shard_transition, state) + shard_local, state

    final, entering = jax.lax.scan(shard_step, start, (transitions, local_states), reverse=reverse)
    return entering[jax.lax.axis_index(axis_name)], final


def _matmul(a: jax.Array, b: jax.Array, spec: str) -> jax.Array:
    return jnp.einsum(spec, a, b, precision=jax.lax.Precision.HIGHEST)


class _PackedShard(NamedTuple):
    """This shard's view of packed sequences (the whole sequence's cu_seqlens). With `reverse`, the view of the
    time-flipped sequence, where the recurrence runs forward: boundaries S·T_local - cu_seqlens[::-1], sequence n
    is N - 1 - n, and device i holds shard S - 1 - i, its tokens flipped."""

    cu_seqlens: jax.Array  # [N + 1] the sequences' boundaries within the shard (empty where a sequence is not)
    first: jax.Array  # the sequence holding the shard's first token
    continues: jax.Array  # whether it began on an earlier shard: its state arrives from there
    last: jax.Array  # the sequence holding the shard's last token
    ends_here: jax.Array  # [N] whether a sequence's last token is on this shard
    empty: jax.Array  # [N] whether a sequence has no tokens


def _packed_shard(cu_seqlens: jax.Array, shard_len: int, axis_name: str, reverse: bool = False) -> _PackedShard:
    index = jax.lax.axis_index(axis_name)
    if reverse:
        shards = jax.lax.axis_size(axis_name)
        cu_seqlens, index = reversed_cu_seqlens(cu_seqlens, shards * shard_len), shards - 1 - index
    start = index * shard_len
    end = start + shard_len  # past the shard's last token
    count = cu_seqlens.shape[0] - 1
    local = jnp.clip(cu_seqlens - start, 0, shard_len).astype(jnp.int32)
    # The sequences of the shard's tokens under the clipped boundaries are those under the whole sequence's (a
    # sequence that ends before the shard ends at its token 0, one that starts after it at shard_len); tokens past
    # the last sequence count as its.
    holding = jnp.minimum(token_sequence(local, shard_len), count - 1)
    first = holding[0]
    lengths = cu_seqlens[1:] - cu_seqlens[:-1]
    return _PackedShard(
        cu_seqlens=local,
        first=first,
        continues=(cu_seqlens[first] < start) & (start < cu_seqlens[first + 1]),
        last=holding[-1],
        ends_here=(lengths > 0) & (start < cu_seqlens[1:]) & (cu_seqlens[1:] <= end),
        empty=lengths == 0,
    )


def kda_context_parallel(
    query: Float[Array, "batch seq_shard num_heads qk_head_dim"],
    key: Float[Array, "batch seq_shard num_heads qk_head_dim"],
    value: Float[Array, "batch seq_shard num_value_heads v_head_dim"],
    beta: Float[Array, "batch seq_shard num_value_heads"],
    decay: Float[Array, "batch seq_shard num_value_heads *qk_head_dim"] | None = None,
    initial_state: Float[Array, "batch num_value_heads qk_head_dim v_head_dim"] | None = None,
    /,
    *,
    axis_name: str,
    return_state: bool = False,
    cu_seqlens: Int[Array, " num_sequences_plus_1"] | None = None,
    **options: Any,
) -> Any:
    """`kernel_delta_attention` over a sequence split along time over mesh axis `axis_name` (inside shard_map).

    Token inputs are this device's shard [batch, seq_len / shards, ...]; `initial_state` (the whole sequence's,
    the same on every device) and the final state returned with `return_state` (the same on every device) are
    [batch, num_value_heads, qk_head_dim, v_head_dim] fp32. With `cu_seqlens` (the whole sequence's boundaries
    [N + 1], the same on every device; batch of one) the sequence packs N sequences, which may cross shards, and
    the states are [N, ...]. `options` are `kernel_delta_attention`'s other keywords (softmax_scale,
    use_qk_l2norm, the fused gate's a_log / dt_bias / lower_bound, beta_is_logits, platform, cfg, ...).
    """
    _check_shard(query, value, initial_state, cu_seqlens)
    dk, dv = query.shape[-1], value.shape[-1]
    matmul = functools.partial(_matmul, spec="bhkj,bhjv->bhkv")
    if cu_seqlens is None:
        wide_value, wide_initial = _widened(value, jnp.zeros(query.shape[:1] + (value.shape[2], dk, dv)), True)
        wide_out, wide_state = _wide_pass(query, key, wide_value, beta, decay, wide_initial, options)
        entering, final = _entering_states(wide_state[..., dv:], wide_state[..., :dv], initial_state, axis_name,
                                           matmul)
    else:
        shard = _packed_shard(jnp.asarray(cu_seqlens, jnp.int32), query.shape[1], axis_name)
        sequences = cu_seqlens.shape[0] - 1
        initial = jnp.zeros((sequences, value.shape[2], dk, dv)) if initial_state is None else initial_state
        carried_in = (jnp.arange(sequences) == shard.first) & shard.continues  # the one sequence S_in reaches
        wide_value, wide_initial = _widened(value, initial.astype(jnp.float32), carried_in[:, None, None, None])
        wide_out, wide_state = _wide_pass(query, key, wide_value, beta, decay, wide_initial,
                                          dict(options, cu_seqlens=shard.cu_seqlens))
        last = wide_state[shard.last][None]  # the state leaving the shard is its last sequence's
        entering, _ = _entering_states(last[..., dv:], last[..., :dv], None, axis_name, matmul)
        ends = wide_state[..., :dv] + _matmul(wide_state[..., dv:], entering[0], "nhkj,hjv->nhkv")
        final = _gather_final_states(ends, initial, shard, axis_name)
    carried = _matmul(wide_out[..., dv:].astype(jnp.float32), entering, "bthk,bhkv->bthv")
    out = (wide_out[..., :dv].astype(jnp.float32) + carried).astype(wide_out.dtype)
    return (out, final) if return_state else out


def _wide_pass(query, key, wide_value, beta, decay, wide_initial, options) -> tuple[jax.Array, jax.Array]:
    wide_initial = vary_like(wide_initial, query, key, wide_value, beta, decay)  # its cotangent will vary so
    return kernel_delta_attention(query, key, wide_value, beta, decay, wide_initial, return_state=True, **options)


def _scale_state(factors: tuple[jax.Array, jax.Array | None], state: jax.Array) -> jax.Array:
    """Diag(key factors) S Diag(value factors): gated linear attention's map of the state through a shard."""
    key_factor, value_factor = factors
    state = key_factor[..., :, None] * state
    return state if value_factor is None else state * value_factor[..., None, :]


def recurrent_context_parallel(
    query: Float[Array, "batch seq_shard num_heads head_dim"],
    key: Float[Array, "batch seq_shard num_kv_heads head_dim"],
    value: Float[Array, "batch seq_shard num_kv_heads v_head_dim"],
    g: Float[Array, "batch seq_shard num_heads *head_dim"] | None = None,
    g_gamma: Float[Array, "*batch num_heads"] | None = None,
    gk: Float[Array, "batch seq_shard num_heads head_dim"] | None = None,
    gv: Float[Array, "batch seq_shard num_heads v_head_dim"] | None = None,
    initial_state: Float[Array, "batch num_heads head_dim v_head_dim"] | None = None,
    /,
    *,
    axis_name: str,
    softmax_scale: float | None = None,
    reverse: bool = False,
    return_state: bool = False,
    cu_seqlens: Int[Array, " num_sequences_plus_1"] | None = None,
    platform: str | None = None,
    cfg: Any = None,
) -> Any:
    """`recurrent_attention` over a sequence split along time over mesh axis `axis_name` (inside shard_map),
    shapes as in `kda_context_parallel`; `reverse` runs the whole sequence from its last token (the last shard)
    down. The state's map through a shard is diagonal on both sides: S_out = Diag(a) S_in Diag(b) + L with a, b
    the shard's products of key- and value-axis decays, and an output's dependence on S_in is
    o_t += b_t * (S_in^T (scale q_t * a_t)) with the products up to t. So each device runs one ordinary pass from
    a zero state and adds that term, the decays' products from cumulative sums of the log gates. `cu_seqlens`
    (the whole sequence's) packs sequences that may cross shards, as in `kda_context_parallel`; with `reverse`,
    the packed algebra runs on the time-flipped sequence (see `_PackedShard`), forward from the last shard."""
    shard_len = jnp.shape(query)[1]
    packed = None if cu_seqlens is None else _packed_shard(jnp.asarray(cu_seqlens), shard_len, axis_name, reverse)
    local_cu = None  # the pass's boundaries, in the call's own time (the pass flips them itself when reverse)
    if packed is not None:
        local_cu = reversed_cu_seqlens(packed.cu_seqlens, shard_len) if reverse else packed.cu_seqlens
    problem = RecurrentAttention().prepare(  # checks the call; gates folded, time flipped when reverse
        query, key, value, g, g_gamma, gk, gv, initial_state, local_cu, softmax_scale=softmax_scale, reverse=reverse
    )
    batch, _, heads, dk = problem.query.shape

    def reorder(states: jax.Array) -> jax.Array:  # per-sequence states, the call's order <-> the packed view's
        return jnp.flip(states, 0) if reverse else states

    local_initial = None  # the pass's initial states: zeros, or in packed shards the sequences' own
    if packed is not None:  # ... but zeros for the one sequence the carried state reaches
        initial = jnp.zeros((local_cu.shape[0] - 1, heads, dk, value.shape[3])) if initial_state is None else (
            reorder(initial_state.astype(jnp.float32)))
        carried_in = ((jnp.arange(initial.shape[0]) == packed.first) & packed.continues)[:, None, None, None]
        local_initial = reorder(jnp.where(carried_in, 0.0, initial))
        local_initial = vary_like(local_initial, query, key, value)  # as its cotangent will
    local_out, local_state = recurrent_attention(
        query, key, value, g, g_gamma, gk, gv, local_initial, local_cu,
        softmax_scale=softmax_scale, reverse=reverse, return_state=True, platform=platform, cfg=cfg,
    )
    log_key = key_log_decay(problem, jnp.float32)
    log_key = jnp.zeros((batch, shard_len, heads, 1), jnp.float32) if log_key is None else log_key
    key_products = jnp.exp(jnp.cumsum(log_key, axis=1))  # [B, T, H, K | 1], in the problem's (flipped) time
    value_products = None if problem.g_value is None else jnp.exp(jnp.cumsum(problem.g_value.astype(jnp.float32), 1))

    def products_at(token: Any) -> tuple[jax.Array, jax.Array | None]:  # the map from the shard's start to a token
        return (jnp.broadcast_to(key_products[:, token], (batch, heads, dk)),
                None if value_products is None else value_products[:, token])

    if packed is None:
        entering, final = _entering_states(products_at(-1), local_state, initial_state, axis_name, _scale_state,
                                           reverse)
        reached = jnp.ones((shard_len,), bool)
    else:
        first_end = packed.cu_seqlens[packed.first + 1]  # past the carried sequence's last token on this shard
        through = packed.continues & (packed.last == packed.first)  # the carried state leaves the shard too
        transition = jax.tree.map(lambda x: jnp.where(through, x, 0.0), products_at(first_end - 1))
        local_state = reorder(local_state)
        entering, _ = _entering_states(transition, local_state[packed.last][None], None, axis_name, _scale_state,
                                       reverse)
        ends = local_state + jnp.where(carried_in, _scale_state(products_at(first_end - 1), entering), 0.0)
        final = reorder(_gather_final_states(ends, initial, packed, axis_name))
        reached = (jnp.arange(shard_len) < first_end) & packed.continues
    carried = _matmul(problem.query.astype(jnp.float32) * problem.scale * key_products, entering, "bthk,bhkv->bthv")
    carried = carried if value_products is None else carried * value_products
    carried = jnp.where(reached[None, :, None, None], carried, 0.0)
    out = local_out.astype(jnp.float32) + (jnp.flip(carried, 1) if reverse else carried)
    out = out.astype(local_out.dtype)
    return (out, final) if return_state else out


def _gather_final_states(ends: jax.Array, initial: jax.Array, packed: _PackedShard, axis_name: str) -> jax.Array:
    """Each sequence's final state from the shard holding its last token (`ends`: this shard's candidates), the
    same on every device; a sequence without tokens ends where it began."""
    final = jax.lax.psum(jnp.where(packed.ends_here[:, None, None, None], ends, 0.0), axis_name)
    return final + jnp.where(packed.empty[:, None, None, None], initial, 0.0)


def attention_context_parallel(
    query: Float[Array, "batch q_shard num_heads head_dim"],
    key: Float[Array, "batch kv_shard num_kv_heads head_dim"],
    value: Float[Array, "batch kv_shard num_kv_heads v_head_dim"],
    /,
    *,
    axis_name: str,
    causal: bool = False,
    sliding_window: int | tuple[int, int] | None = None,
    mask_info: MaskInfo | None = None,
    softmax_aux: Float[Array, "num_heads num_sinks"] | Float[Array, " num_sinks"] | None = None,
    balance: bool = True,
    **options: Any,
) -> Float[Array, "batch q_shard num_heads v_head_dim"]:
    """`attention` (self-attention) over a sequence split along time over mesh axis `axis_name` (inside
    shard_map): every device gathers the keys and values (and kv segment ids) of the whole sequence and attends
    its own queries to them. Causal calls (with a left window or none) read only the keys before their queries'
    last token, a prefix whose length is static per shard: one branch per shard (`lax.switch`), each made of
    ordinary bottom-right-aligned causal calls.

    Causal without a window, shard i's queries see (i + 1) shards of keys, so with `balance` (and an even shard
    length) the shards even out the work as zigzag layouts do, while the tokens stay in order (as the linear
    layers of a hybrid model need them): shard i keeps its first half of queries and trades its second half with
    shard n - 1 - i (one `ppermute` of half the queries and, back, of their outputs), so that device i attends
    half-shards 2i and 2n - 1 - 2i: half-shard j's causal work is j + 1/2 squares of a half-shard, so every
    device does 2n of them, 1/n of the whole call, where the last shard alone did 4n - 2. On a GPU the call
    whose keys are as many as its queries (shard 0's first half) takes cuDNN; the others (more keys than
    queries, which cuDNN's top-left causal mask cannot express) take `auto`'s next choice.
    `mask_info` may hold segment ids (packed sequences, shards of [batch, q_shard]); softmax_aux (sinks) as
    `attention`'s; `options` are its other keywords (softmax_scale, logits_soft_cap, dtype, softmax_dtype,
    platform, cfg): no bias, dense mask or dropout.
    """
    _check_attention_shard(query, key, sliding_window, causal, mask_info, options)
    keys, values = jax.lax.all_gather((key, value), axis_name, axis=1, tiled=True)
    q_ids = kv_ids = None
    if mask_info is not None:
        q_ids = mask_info.q_segment_ids
        kv_ids = jax.lax.all_gather(mask_info.kv_segment_ids, axis_name, axis=1, tiled=True)

    def attend(queries: jax.Array, ids: jax.Array | None, kv_len: int) -> jax.Array:
        """`queries` (ids their segment ids) against the first kv_len keys, causal aligned at the end."""
        segments = None if ids is None else MaskInfo.from_segments(ids, kv_ids[:, :kv_len])
        return attention(queries, keys[:, :kv_len], values[:, :kv_len], None, None, softmax_aux, causal=causal,
                         sliding_window=sliding_window, mask_info=segments, **options)

    if not causal:
        return attend(query, q_ids, keys.shape[1])
    shard_len, shards = key.shape[1], jax.lax.axis_size(axis_name)
    if not balance or sliding_window is not None or shard_len % 2:
        branches = [functools.partial(attend, query, q_ids, (shard + 1) * shard_len) for shard in range(shards)]
        return jax.lax.switch(jax.lax.axis_index(axis_name), branches)
    return _balanced_causal(attend, query, q_ids, shard_len, shards, axis_name)


def _balanced_causal(attend: Callable, query: jax.Array, q_ids: jax.Array | None, shard_len: int, shards: int,
                     axis_name: str) -> jax.Array:
    """Causal attention with shard i's second half of queries computed by shard n - 1 - i (and its by i)."""
    half = shard_len // 2
    partners = [(shard, shards - 1 - shard) for shard in range(shards)]  # an involution: sent and returned alike
    trade = functools.partial(jax.lax.ppermute, axis_name=axis_name, perm=partners)
    kept = (query[:, :half], None if q_ids is None else q_ids[:, :half])
    received = trade((query[:, half:], None if q_ids is None else q_ids[:, half:]))

    def branch(shard: int) -> tuple[jax.Array, jax.Array]:
        # Half-shard 2i ends at (2i + 1) halves; the partner's second half, 2(n - 1 - i) + 1, at 2(n - i) halves.
        return attend(*kept, (2 * shard + 1) * half), attend(*received, 2 * (shards - shard) * half)

    own, traded = jax.lax.switch(jax.lax.axis_index(axis_name), [functools.partial(branch, s) for s in range(shards)])
    return jnp.concatenate([own, trade(traded)], axis=1)


def _check_attention_shard(query: Any, key: Any, sliding_window: Any, causal: bool, mask_info: MaskInfo | None,
                           options: dict) -> None:
    unsupported = [name for name in ("bias", "dropout_rng", "init_bias") if options.get(name) is not None]
    unsupported += ["dropout_prob"] if options.get("dropout_prob", 0.0) else []
    if mask_info is not None and mask_info.attention_mask is not None:
        unsupported.append("mask_info.attention_mask")
    if unsupported:
        raise ValueError(f"attention_context_parallel takes no {', '.join(unsupported)}: only segment ids split "
                         "over devices (a dense mask or bias would be [q_shard, whole kv_len] per device)")
    if sliding_window is not None and not causal:
        raise ValueError(f"attention_context_parallel takes a sliding_window only with causal=True (a right window "
                         f"would reach keys past the shard's prefix), got sliding_window={sliding_window!r}")
    if jnp.shape(query)[1] != jnp.shape(key)[1]:
        raise ValueError(f"attention_context_parallel is self-attention: query shard {describe(jnp.shape(query))} "
                         f"and key shard {describe(jnp.shape(key))} must have the same length (dim 1)")
