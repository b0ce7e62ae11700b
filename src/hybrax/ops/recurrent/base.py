"""The recurrent attention problem shared by the public function and every backend (the `RecurrentProblem`,
its config and the `RecurrentAttention` kernel); backends import this module, never `api.py`.

Per head, with the state S of shape [K, V] in fp32:
    S_t = S_{t-1} * exp(g_t) * exp(g_gamma) * exp(gk_t)[:, None] * exp(gv_t)[None, :] + k_t v_t^T
    o_t = S_t^T (softmax_scale * q_t)
`prepare` resolves everything that changes the math once: the gate forms are folded into a per-head
scalar gate (g [B,T,H] plus g_gamma) and a key-axis gate (g [B,T,H,K] plus gk), `reverse` becomes a
flip of the time axis (and of the sequence order for packed batches), undone in `finalize`.
Implementations (xla_scan.py, xla_chunked.py) see a forward-time problem only.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from hybrax.core import Kernel, KernelConfig, problem_dataclass, static_field
from hybrax.core.config import is_power_of_two, knob
from hybrax.core.kernel import Invocation
from hybrax.core.packing import reversed_cu_seqlens
from hybrax.core.validate import (
    check_at_least_one,
    check_cu_seqlens,
    check_divides,
    check_number,
    check_floating,
    check_rank,
    check_shape,
    describe,
)

OP_ID = "recurrent_attention"
# Off the CPU, below this length the per-step scan beats the chunked algorithm's setup (and decoding
# is T=1). On the CPU the scan wins at every length measured (its state stays in cache): the CPU's auto row
# takes it first.
CHUNKED_MIN_SEQ_LEN = 64


@dataclasses.dataclass(frozen=True)
class RecurrentAttentionConfig(KernelConfig):
    """`chunk_size`: tokens per chunk of the chunked backends, a power of two (XLA takes any; the Pallas kernels
    16, 32, 64 or 128). The scan has no knob."""

    chunk_size: int = knob(64, need="a power of two", accept=is_power_of_two)


@problem_dataclass
class RecurrentProblem:
    """Forward-time canonical problem; key/value keep their num_kv_heads (GQA)."""

    query: jax.Array  # [B,T,H,K]
    key: jax.Array  # [B,T,HKV,K]
    value: jax.Array  # [B,T,HKV,V]
    g_scalar: jax.Array | None  # [B,T,H]: g given per head, plus g_gamma
    g_key: jax.Array | None  # [B,T,H,K]: g given per key channel, plus gk
    g_value: jax.Array | None  # [B,T,H,V]
    initial_state: jax.Array | None  # [B,H,K,V], or [N+1,H,K,V] with cu_seqlens
    cu_seqlens: jax.Array | None  # [N+2]: the caller's N sequences and one of the tokens past them, from 0 to T
    scale: float = static_field()
    reverse: bool = static_field(False)
    return_state: bool = static_field(False)


def _add(a: jax.Array | None, b: jax.Array | None) -> jax.Array | None:
    if a is None or b is None:
        return b if a is None else a
    return a + b


def _cover_every_token(cu_seqlens: jax.Array, initial_state: jax.Array | None, seq_len: int):
    """(cu_seqlens [N + 2] with one more sequence, the tokens from cu_seqlens[-1] on (none when it is seq_len),
    the initial states with zeros for it): the implementations see sequences that cover every token, forward
    and reversed, and `finalize` drops that sequence's output and state."""
    cu_seqlens = jnp.pad(jnp.asarray(cu_seqlens, jnp.int32), (0, 1), constant_values=seq_len)
    if initial_state is not None:
        initial_state = jnp.pad(initial_state, ((0, 1), (0, 0), (0, 0), (0, 0)))
    return cu_seqlens, initial_state


def _packed_end(problem: RecurrentProblem) -> jax.Array:
    """Where the caller's packed sequences end, in the call's time (the added sequence starts there)."""
    if problem.reverse:  # the reversed boundaries are seq_len - cu_seqlens[::-1]
        return problem.query.shape[1] - problem.cu_seqlens[1]
    return problem.cu_seqlens[-2]


def check_gates(g, g_gamma, gk, gv, batch, seq_len, num_heads, key_dim, value_dim) -> None:
    """Each gate given has one of its shapes and a floating dtype."""
    if g is not None:
        check_floating("g", g)
        if tuple(jnp.shape(g)) not in ((batch, seq_len, num_heads), (batch, seq_len, num_heads, key_dim)):
            raise ValueError(
                f"g must have shape [batch, seq_len, num_heads] = {describe((batch, seq_len, num_heads))} or "
                f"[batch, seq_len, num_heads, head_dim] = {describe((batch, seq_len, num_heads, key_dim))}, "
                f"got {describe(jnp.shape(g))}"
            )
    if g_gamma is not None:
        check_floating("g_gamma", g_gamma)
        if tuple(jnp.shape(g_gamma)) not in ((num_heads,), (batch, num_heads)):
            raise ValueError(
                f"g_gamma must have shape [num_heads] = [{num_heads}] or [batch, num_heads] = "
                f"{describe((batch, num_heads))}, got {describe(jnp.shape(g_gamma))}"
            )
    if gk is not None:
        check_floating("gk", gk)
        check_shape("gk", gk, (batch, seq_len, num_heads, key_dim), "[batch, seq_len, num_heads, head_dim]")
    if gv is not None:
        check_floating("gv", gv)
        check_shape("gv", gv, (batch, seq_len, num_heads, value_dim), "[batch, seq_len, num_heads, v_head_dim]")


def _fold_gates(g, g_gamma, gk, tokens: tuple[int, int, int]) -> tuple[jax.Array | None, jax.Array | None]:
    """(per-head scalar gate [B,T,H] = g [B,T,H] + g_gamma, key-axis gate [B,T,H,K] = g [B,T,H,K] + gk)."""
    batch, _, num_heads = tokens
    g_scalar = g if g is not None and jnp.ndim(g) == 3 else None
    if g_gamma is not None:
        gamma = jnp.broadcast_to(g_gamma, (batch, num_heads))
        g_scalar = _add(g_scalar, jnp.broadcast_to(gamma[:, None, :], tokens))
    return g_scalar, _add(g if g is not None and jnp.ndim(g) == 4 else None, gk)


def _reverse_time(problem: RecurrentProblem) -> RecurrentProblem:
    """The same problem read from t = T-1 down to 0; sequence n of a packed batch becomes N-1-n."""
    flip = lambda x: None if x is None else jnp.flip(x, 1)  # noqa: E731
    cu, h0 = problem.cu_seqlens, problem.initial_state
    if cu is not None:
        h0 = None if h0 is None else jnp.flip(h0, 0)
        cu = reversed_cu_seqlens(cu, problem.query.shape[1])
    return dataclasses.replace(
        problem,
        query=flip(problem.query), key=flip(problem.key), value=flip(problem.value),
        g_scalar=flip(problem.g_scalar), g_key=flip(problem.g_key), g_value=flip(problem.g_value),
        initial_state=h0, cu_seqlens=cu,
    )


class RecurrentAttention(Kernel[RecurrentAttentionConfig, Any]):
    """The gated linear recurrent attention operation for an `Executor`: `executor(RecurrentAttention(), q, k, v,
    ...)` takes `recurrent_attention`'s arguments (its `prepare` checks them once) and runs the implementation the
    config names or `auto` picks (the AUTO table in `ops/recurrent/api.py`)."""

    op_id = OP_ID
    config_type = RecurrentAttentionConfig

    def prepare(
        self, query, key, value, g=None, g_gamma=None, gk=None, gv=None, initial_state=None, cu_seqlens=None,
        *, softmax_scale=None, reverse=False, return_state=False,
    ) -> RecurrentProblem:
        for name, array in (("query", query), ("key", key), ("value", value)):
            check_floating(name, array)
            check_rank(name, array, 4, "[batch, seq_len, heads, head_dim]")
        batch, seq_len, num_heads, key_dim = jnp.shape(query)
        check_at_least_one("query", query, {1: "seq_len", 2: "num_heads", 3: "head_dim"})
        check_shape("key", key, (batch, seq_len, None, key_dim), "[batch, seq_len, num_kv_heads, head_dim]")
        check_at_least_one("key", key, {2: "num_kv_heads"})
        num_kv_heads = jnp.shape(key)[2]
        check_divides("num_kv_heads of key", num_kv_heads, "num_heads of query", num_heads)
        check_shape("value", value, (batch, seq_len, num_kv_heads, None), "[batch, seq_len, num_kv_heads, v_head_dim]")
        check_at_least_one("value", value, {3: "v_head_dim"})
        value_dim = jnp.shape(value)[3]
        check_gates(g, g_gamma, gk, gv, batch, seq_len, num_heads, key_dim, value_dim)
        num_states = batch
        if cu_seqlens is not None:
            check_cu_seqlens(cu_seqlens, batch, seq_len, "query")
            num_states = jnp.shape(cu_seqlens)[0] - 1
        if initial_state is not None:
            check_floating("initial_state", initial_state)
            layout = "[num_seqs, num_heads, head_dim, v_head_dim]" if cu_seqlens is not None else (
                "[batch, num_heads, head_dim, v_head_dim]")
            check_shape("initial_state", initial_state, (num_states, num_heads, key_dim, value_dim), layout)
        g_scalar, g_key = _fold_gates(g, g_gamma, gk, (batch, seq_len, num_heads))
        if cu_seqlens is not None:
            cu_seqlens, initial_state = _cover_every_token(cu_seqlens, initial_state, seq_len)
        problem = RecurrentProblem(
            query=query, key=key, value=value,
            g_scalar=g_scalar,
            g_key=g_key,
            g_value=gv,
            initial_state=initial_state,
            cu_seqlens=cu_seqlens,
            scale=key_dim**-0.5 if softmax_scale is None else check_number(
                "softmax_scale", softmax_scale, "a finite number or None", lambda scale: True),
            reverse=bool(reverse),
            return_state=bool(return_state),
        )
        return _reverse_time(problem) if reverse else problem

    def finalize(self, problem: RecurrentProblem, result: tuple[jax.Array, jax.Array]) -> Any:
        output, final_state = result
        if problem.reverse:
            output = jnp.flip(output, 1)
            if problem.cu_seqlens is not None:
                final_state = jnp.flip(final_state, 0)
        if problem.cu_seqlens is not None:  # drop the sequence `_cover_every_token` added
            inside = jnp.arange(output.shape[1]) < _packed_end(problem)
            output = jnp.where(inside[None, :, None, None], output, jnp.zeros((), output.dtype))
            final_state = final_state[:-1]
        return (output, final_state) if problem.return_state else output

    def run(
        self, query: Any, key: Any, value: Any, g: Any = None, g_gamma: Any = None, gk: Any = None, gv: Any = None,
        softmax_scale: float | None = None, initial_state: Any = None, reverse: bool = False, cu_seqlens: Any = None,
        return_state: bool = False, platform: str | None = None, *, cfg: RecurrentAttentionConfig | None = None,
    ) -> Any:
        """ejkernel's `RecurrentAttention.run` argument order (softmax_scale before initial_state,
        reverse before cu_seqlens), so code written for it binds the same arguments."""
        return super().run(
            query, key, value, g, g_gamma, gk, gv, initial_state, cu_seqlens, softmax_scale=softmax_scale,
            reverse=reverse, return_state=return_state, platform=platform, cfg=cfg,
        )

    def implementations(self, inv: Invocation) -> list:
        """The auto table's order (ops/recurrent/api.py), except that a call shorter than CHUNKED_MIN_SEQ_LEN tries
        the scan first. The default config and an all-auto one both take the first of these."""
        impls = super().implementations(inv)
        if inv.arrays["query"].shape[1] >= CHUNKED_MIN_SEQ_LEN:
            return impls
        return sorted(impls, key=lambda impl: impl.backend != "scan")

    def autotune_problem(self, inv: Invocation, rng: jax.Array) -> RecurrentProblem:
        """Random inputs with decaying gates (log-sigmoid) and equal-length packed sequences."""
        problem = super().autotune_problem(inv, rng)
        decaying = {
            name: jax.nn.log_sigmoid(getattr(problem, name) + 3.0)
            for name in ("g_scalar", "g_key", "g_value")
            if getattr(problem, name) is not None
        }
        if problem.cu_seqlens is not None:
            num_seqs = problem.cu_seqlens.shape[0] - 1
            seq_len = problem.query.shape[1]
            decaying["cu_seqlens"] = (jnp.arange(num_seqs + 1) * seq_len // num_seqs).astype(jnp.int32)
        return dataclasses.replace(problem, **decaying)
