"""The attention problem shared by the public function and every backend: `AttentionProblem`, `AttentionConfig`
and the `Attention` kernel, whose `prepare` validates a call once and resolves every option that changes the math:
heads split into (kv head, group), causal folded into the window bounds, bias / mask / sinks reshaped to broadcast
against [batch, kv_heads, group, Tq, Tk], the dropout key turned into two seed words. Backends import this module,
never `api.py`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int, UInt32

from hybrax.core import Invocation, Kernel, KernelConfig, problem_dataclass, static_field
from hybrax.core.validate import check_floating, check_integer, check_number, check_rank, describe
from hybrax.ops.attention.mask import MaskInfo

OP_ID = "attention"

# `auto` switches from the direct implementation (which materializes [B, H, Tq, Tk] scores) to the
# blockwise one when the score tensor would exceed LONG_SCORES_BYTES, and on the CPU also from this
# key length (blockwise was 2-4x faster there at T=2048; on an H200 direct stayed faster at T=2048).
LONG_KV_LEN = 1024
LONG_SCORES_BYTES = 256 * 2**20


@dataclasses.dataclass(frozen=True)
class AttentionConfig(KernelConfig):
    """Speed knobs only. block_q / block_k: tile sizes of the blockwise and flash implementations (None: the
    implementation's heuristic choice)."""

    block_q: int | None = None
    block_k: int | None = None


@problem_dataclass
class AttentionProblem:
    """The canonical problem. Shapes: B batch, Tq/Tk lengths, K kv heads, G query heads per kv head.

    query [B, Tq, K, G, D], key [B, Tk, K, D], value [B, Tk, K, Dv] in `dtype`;
    bias [B|1, K|1, G|1, Tq, Tk] and softmax_aux [K, G, S] in `softmax_dtype`;
    mask bool [B|1, K|1, G|1, Tq, Tk]; segment ids [B, Tq] / [B, Tk]; dropout_seed uint32 [2].
    Key j is visible to query i when window_left / window_right (None: unbounded) allow it around the
    aligned position i + Tk - Tq, the mask and segment ids allow it.
    """

    query: Float[Array, "B Tq K G D"]
    key: Float[Array, "B Tk K D"]
    value: Float[Array, "B Tk K Dv"]
    bias: Float[Array, "Bb Kb Gb Tq Tk"] | None
    softmax_aux: Float[Array, "K G S"] | None
    mask: Bool[Array, "Bm Km Gm Tq Tk"] | None
    q_segment_ids: Int[Array, "B Tq"] | None
    kv_segment_ids: Int[Array, "B Tk"] | None
    dropout_seed: UInt32[Array, "2"] | None
    softmax_scale: float = static_field()
    logits_soft_cap: float | None = static_field()
    window_left: int | None = static_field()
    window_right: int | None = static_field()
    dropout_prob: float = static_field()
    dtype: Any = static_field()
    softmax_dtype: Any = static_field()


def _check_same(what: str, names: Sequence[str], sizes: Sequence[int], shapes: Sequence[Any]) -> None:
    if len(set(sizes)) > 1:
        listing = ", ".join(f"{n} {describe(jnp.shape(s))}" for n, s in zip(names, shapes))
        raise ValueError(f"{what} must agree: {listing}")


def _check_qkv(query: Any, key: Any, value: Any) -> None:
    check_rank("query", query, 4, "[batch, q_len, num_heads, head_dim]")
    check_rank("key", key, 4, "[batch, kv_len, num_kv_heads, head_dim]")
    check_rank("value", value, 4, "[batch, kv_len, num_kv_heads, v_head_dim]")
    for name, array in (("query", query), ("key", key), ("value", value)):
        check_floating(name, array)
    q, k, v = jnp.shape(query), jnp.shape(key), jnp.shape(value)
    shapes = (query, key, value)
    _check_same("batch sizes (dim 0) of query, key and value", ("query", "key", "value"), (q[0], k[0], v[0]), shapes)
    _check_same("kv lengths (dim 1) of key and value", ("key", "value"), (k[1], v[1]), (key, value))
    _check_same("kv heads (dim 2) of key and value", ("key", "value"), (k[2], v[2]), (key, value))
    _check_same("head dims (dim 3) of query and key", ("query", "key"), (q[3], k[3]), (query, key))
    if q[1] < 1 or k[1] < 1:
        raise ValueError(f"query {describe(q)} and key {describe(k)} need at least one position each")
    if q[3] < 1 or jnp.shape(value)[3] < 1:
        raise ValueError(f"query {describe(q)} and value {describe(jnp.shape(value))} need head dims of at least 1")
    if k[2] < 1 or q[2] % k[2]:
        raise ValueError(
            f"num_heads of query {describe(q)} must be a multiple of num_kv_heads of key {describe(k)}"
        )


def _check_pairwise(name: str, array: Any, q_shape: Sequence[int], k_shape: Sequence[int], layout: str) -> None:
    """A [batch | 1, heads, Tq, Tk] array: bias or mask; `heads` may be num_heads, num_kv_heads or 1."""
    batch, tq, heads = q_shape[:3]
    tk, kv_heads = k_shape[1:3]
    shape = tuple(jnp.shape(array))
    ok = (
        len(shape) == 4 and shape[0] in (batch, 1) and shape[1] in (heads, kv_heads, 1) and shape[2:] == (tq, tk)
    )
    if not ok:
        raise ValueError(
            f"{name} must have shape {layout} = [{batch} | 1, {heads} | {kv_heads} | 1, {tq}, {tk}] "
            f"for query {describe(q_shape)} and key {describe(k_shape)}, got {describe(shape)}"
        )


def _check_softmax_aux(softmax_aux: Any, num_heads: int) -> None:
    shape = tuple(jnp.shape(softmax_aux))
    if len(shape) not in (1, 2) or (len(shape) == 2 and shape[0] != num_heads) or shape[-1] < 1:
        raise ValueError(
            f"softmax_aux must have shape [num_heads, num_sinks] = [{num_heads}, *] or [num_sinks], "
            f"got {describe(shape)}"
        )
    check_floating("softmax_aux", softmax_aux)


def _check_segments(mask_info: MaskInfo, batch: int, tq: int, tk: int) -> None:
    for name, ids, length, layout in (("q_segment_ids", mask_info.q_segment_ids, tq, "[batch, q_len]"),
                                      ("kv_segment_ids", mask_info.kv_segment_ids, tk, "[batch, kv_len]")):
        if tuple(jnp.shape(ids)) != (batch, length):
            raise ValueError(
                f"mask_info.{name} must have shape {layout} = [{batch}, {length}], got {describe(jnp.shape(ids))}"
            )
        check_integer(f"mask_info.{name}", ids)  # a MaskInfo built directly skipped from_segments' checks


def _check_mask_info(mask_info: Any, q_shape: Sequence[int], k_shape: Sequence[int]) -> None:
    if not isinstance(mask_info, MaskInfo):
        raise ValueError(f"mask_info must be a MaskInfo, got {type(mask_info).__name__}")
    if (mask_info.q_segment_ids is None) != (mask_info.kv_segment_ids is None):
        raise ValueError("mask_info needs both q_segment_ids and kv_segment_ids, or neither")
    if mask_info.q_segment_ids is not None:
        _check_segments(mask_info, q_shape[0], q_shape[1], k_shape[1])
    if mask_info.attention_mask is not None:
        _check_pairwise("mask_info.attention_mask", mask_info.attention_mask, q_shape, k_shape,
                        "[batch | 1, num_heads | num_kv_heads | 1, q_len, kv_len]")
        if jnp.result_type(mask_info.attention_mask) != jnp.bool_:
            raise ValueError(f"mask_info.attention_mask must be a boolean array (True keeps), got dtype "
                             f"{jnp.result_type(mask_info.attention_mask)}")


def _window_bounds(sliding_window: Any, causal: bool) -> tuple[int | None, int | None]:
    """(left, right) reach around the aligned position; None is unbounded. Causal caps right at 0."""
    if not isinstance(causal, bool):
        raise ValueError(f"causal must be a bool, got {causal!r}")
    if sliding_window is None:
        left, right = None, None
    else:
        pair = (sliding_window, sliding_window) if isinstance(sliding_window, int) else sliding_window
        valid = (
            isinstance(pair, (tuple, list)) and len(pair) == 2
            and all(isinstance(w, int) and not isinstance(w, bool) and w >= 0 for w in pair)
        )
        if not valid:
            raise ValueError(
                f"sliding_window must be an int >= 0 or a pair (left, right) of ints >= 0, got {sliding_window!r}"
            )
        left, right = int(pair[0]), int(pair[1])
    if causal:
        right = 0 if right is None else min(right, 0)
    return left, right


def _check_scalars(softmax_scale: Any, logits_soft_cap: Any, dropout_prob: Any) -> None:
    if softmax_scale is not None:
        check_number("softmax_scale", softmax_scale, "a finite number or None", lambda scale: True)
    if logits_soft_cap is not None:
        check_number("logits_soft_cap", logits_soft_cap, "a number > 0 or None", lambda cap: cap > 0)
    check_number("dropout_prob", dropout_prob, "a number in [0, 1)", lambda prob: 0.0 <= prob < 1.0)


def _check_dtype(name: str, dtype: Any) -> Any:
    try:
        dtype = jnp.dtype(dtype)
    except TypeError:
        raise ValueError(f"{name} must be a floating dtype, got {dtype!r}") from None
    if not jnp.issubdtype(dtype, jnp.floating):
        raise ValueError(f"{name} must be a floating dtype, got {dtype}")
    return dtype


def _split_heads(array: Any, num_kv_heads: int, group: int) -> jax.Array:
    """[b, heads, Tq, Tk] with heads in (K * G, K, 1) -> [b, K | 1, G | 1, Tq, Tk]."""
    b, heads, tq, tk = jnp.shape(array)
    if heads == num_kv_heads * group:
        return jnp.reshape(array, (b, num_kv_heads, group, tq, tk))
    if heads == num_kv_heads:
        return jnp.reshape(array, (b, num_kv_heads, 1, tq, tk))
    return jnp.reshape(array, (b, 1, 1, tq, tk))


def _dropout_seed(dropout_rng: Any) -> jax.Array:
    """Two uint32 words drawn from the key: the seed of the counter-based dropout hash."""
    if not jnp.issubdtype(jnp.result_type(dropout_rng), jax.dtypes.prng_key):
        if jnp.shape(dropout_rng) != (2,):
            raise ValueError(f"dropout_rng must be a key (jax.random.key) or raw key data of shape [2], got shape "
                             f"{describe(jnp.shape(dropout_rng))}")
        dropout_rng = jax.random.wrap_key_data(jnp.asarray(dropout_rng, jnp.uint32))
    elif jnp.shape(dropout_rng) != ():
        raise ValueError(f"dropout_rng must be a single key, got keys of shape {describe(jnp.shape(dropout_rng))}")
    return jax.random.bits(dropout_rng, (2,), jnp.uint32)


class Attention(Kernel[AttentionConfig, jax.Array]):
    """The attention operation for an `Executor`: `executor(Attention(), q, k, v, ...)` takes `attention`'s
    arguments (its `prepare` checks them once) and runs the implementation the config names or `auto` picks
    (the AUTO table in `ops/attention/api.py`)."""

    op_id = OP_ID
    config_type = AttentionConfig

    def prepare(
        self,
        query: Any,
        key: Any,
        value: Any,
        bias: Any = None,
        dropout_rng: Any = None,
        softmax_aux: Any = None,
        /,
        *,
        mask_info: MaskInfo | None = None,
        init_bias: Callable[[], Any] | None = None,
        deterministic: bool = True,
        softmax_scale: float | None = None,
        logits_soft_cap: float | None = None,
        dtype: Any = None,
        softmax_dtype: Any = None,
        dropout_prob: float = 0.0,
        causal: bool = False,
        sliding_window: int | tuple[int, int] | None = None,
    ) -> AttentionProblem:
        _check_qkv(query, key, value)
        q_shape, k_shape = tuple(jnp.shape(query)), tuple(jnp.shape(key))
        batch, _, num_heads, head_dim = q_shape
        num_kv_heads = k_shape[2]
        if bias is not None:
            _check_pairwise("bias", bias, q_shape, k_shape, "[batch | 1, num_heads | num_kv_heads | 1, q_len, kv_len]")
            check_floating("bias", bias)
        if softmax_aux is not None:
            _check_softmax_aux(softmax_aux, num_heads)
        if mask_info is not None:
            _check_mask_info(mask_info, q_shape, k_shape)
        if init_bias is not None and not callable(init_bias):
            raise ValueError(f"init_bias must be a callable returning the bias, got {type(init_bias).__name__}")
        _check_scalars(softmax_scale, logits_soft_cap, dropout_prob)
        window_left, window_right = _window_bounds(sliding_window, causal)
        dtype = _check_dtype("dtype", jnp.result_type(query, key, value) if dtype is None else dtype)
        softmax_dtype = _check_dtype(
            "softmax_dtype", jnp.promote_types(dtype, jnp.float32) if softmax_dtype is None else softmax_dtype
        )
        dropout_prob = float(dropout_prob) if not deterministic else 0.0
        if dropout_prob > 0 and dropout_rng is None:
            raise ValueError("dropout_prob > 0 with deterministic=False needs a dropout_rng key")

        if bias is None and mask_info is None and init_bias is not None:
            bias = init_bias()
            _check_pairwise("init_bias()", bias, q_shape, k_shape,
                            "[batch | 1, num_heads | num_kv_heads | 1, q_len, kv_len]")
            check_floating("init_bias()", bias)

        group = num_heads // num_kv_heads
        mask_info = mask_info or MaskInfo()
        return AttentionProblem(
            query=jnp.reshape(query, (*q_shape[:2], num_kv_heads, group, head_dim)).astype(dtype),
            key=jnp.asarray(key, dtype),
            value=jnp.asarray(value, dtype),
            bias=None if bias is None else _split_heads(bias, num_kv_heads, group).astype(softmax_dtype),
            softmax_aux=None if softmax_aux is None else jnp.broadcast_to(
                softmax_aux, (num_heads, jnp.shape(softmax_aux)[-1])
            ).reshape(num_kv_heads, group, -1).astype(softmax_dtype),
            mask=None if mask_info.attention_mask is None else _split_heads(
                mask_info.attention_mask, num_kv_heads, group),
            q_segment_ids=mask_info.q_segment_ids,
            kv_segment_ids=mask_info.kv_segment_ids,
            dropout_seed=_dropout_seed(dropout_rng) if dropout_prob > 0 else None,
            softmax_scale=float(head_dim**-0.5 if softmax_scale is None else softmax_scale),
            logits_soft_cap=None if logits_soft_cap is None else float(logits_soft_cap),
            window_left=window_left,
            window_right=window_right,
            dropout_prob=dropout_prob,
            dtype=dtype,
            softmax_dtype=softmax_dtype,
        )

    def finalize(self, problem: AttentionProblem, result: jax.Array) -> jax.Array:
        batch, q_len, num_kv_heads, group, v_dim = result.shape
        return jnp.reshape(result, (batch, q_len, num_kv_heads * group, v_dim))

    def run(
        self, query: Any, key: Any, value: Any, attention_mask: Any = None, bias: Any = None,
        init_bias: Callable[[], Any] | None = None, deterministic: bool = True, dropout_rng: Any = None,
        softmax_aux: Any = None, softmax_scale: float | None = None, logits_soft_cap: float | None = None,
        dtype: Any = None, softmax_dtype: Any = None, dropout_prob: float = 0.0, causal: bool = False,
        sliding_window: int | tuple[int, int] | None = None, *, mask_info: MaskInfo | None = None,
        platform: str | None = None, cfg: AttentionConfig | None = None,
    ) -> jax.Array:
        """ejkernel's `Attention.run` argument order (attention_mask: bool [B, 1 | H, Tq, Tk], True
        keeps), so code written for it binds the same arguments. Returns the output only: the seed's
        second result, the full attention weights, would cost [B, H, Tq, Tk] memory."""
        if attention_mask is not None:
            if mask_info is not None:
                raise ValueError("give attention_mask or mask_info, not both")
            mask_info = MaskInfo.from_attention_mask(attention_mask)
        return super().run(
            query, key, value, bias, dropout_rng, softmax_aux, mask_info=mask_info, init_bias=init_bias,
            deterministic=deterministic, softmax_scale=softmax_scale, logits_soft_cap=logits_soft_cap, dtype=dtype,
            softmax_dtype=softmax_dtype, dropout_prob=dropout_prob, causal=causal, sliding_window=sliding_window,
            platform=platform, cfg=cfg,
        )

    def implementations(self, inv: Invocation) -> list:
        """Registry order, except that a long call moves the direct XLA implementation last."""
        impls = super().implementations(inv)
        if not is_long(inv):
            return impls
        return sorted(impls, key=lambda impl: impl.name == "xla:direct")


def is_long(inv: Invocation) -> bool:
    """Whether materializing the [B, H, Tq, Tk] scores would be too costly for the direct implementation."""
    batch, q_len, num_kv_heads, group, _ = inv.arrays["query"].shape
    kv_len = inv.arrays["key"].shape[1]
    scores_bytes = 4 * batch * num_kv_heads * group * q_len * kv_len
    return scores_bytes > LONG_SCORES_BYTES or (inv.device == "cpu" and kv_len >= LONG_KV_LEN)
