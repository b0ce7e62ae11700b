"""The float64 gradient oracle of KDA's tests: `reference.kda_reference` in jax.numpy, differentiated.

The oracle (`kda64`) is `reference.kda_reference` written in jax.numpy and traced in float64 (inside
`jax.enable_x64`): the fused gate, the beta sigmoid, the L2 norm and the recurrence token by token
(one `lax.scan` over time; one per packed sequence). test_gradients.py checks it against the NumPy reference
(forward, ~1e-12) and against float64 central differences (gradient). The loss uses both outputs,
sum(o * w) + sum(S * ws), so the final state's cotangent reaches every gradient; gradients are taken w.r.t. q, k, v,
beta, decay (per channel or per head; the raw gate when fused), initial_state, a_log and dt_bias.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from hybrax.ops.kda import reference
from hybrax.ops.kda.api import kernel_delta_attention
from tests.helpers import to64


def kda64(q, k, v, beta, decay, initial_state=None, a_log=None, dt_bias=None, *, cu_seqlens=None,
          lower_bound=None, beta_is_logits=False, softmax_scale=None, use_qk_l2norm=True):
    """`reference.kda_reference` in jax.numpy: traceable, so differentiable. Call it on float64 arrays inside
    `jax.enable_x64`; cu_seqlens is a static sequence of ints. Returns (o [B, T, HV, V], final state)."""
    batch, length, heads, dk = q.shape
    value_heads = v.shape[2]
    if a_log is not None:
        decay = reference.activate_gate(decay, a_log, dt_bias, lower_bound, xp=jnp)
    if decay.ndim == 3:
        decay = decay[..., None]
    decay = jnp.broadcast_to(decay, (batch, length, value_heads, dk))
    if beta_is_logits:
        beta = jax.nn.sigmoid(beta)
    if use_qk_l2norm:
        q, k = (x / jnp.sqrt(jnp.sum(x * x, axis=-1, keepdims=True) + reference.L2_EPS) for x in (q, k))
    q, k = (jnp.repeat(x, value_heads // heads, axis=2) for x in (q, k))
    scale = dk**-0.5 if softmax_scale is None else softmax_scale

    def step(state, token):  # state [..., HV, K, V]: decay first, then the delta rule on the decayed state
        q_t, k_t, v_t, beta_t, decay_t = token
        state = state * jnp.exp(decay_t)[..., None]
        error = v_t - jnp.einsum("...kv,...k->...v", state, k_t)
        state = state + k_t[..., :, None] * (beta_t[..., None] * error)[..., None, :]
        return state, jnp.einsum("...kv,...k->...v", state, scale * q_t)

    tokens = (q, k, v, beta, decay)
    if cu_seqlens is None:  # B sequences side by side, time-major
        initial = jnp.zeros((batch, value_heads, dk, v.shape[-1]), v.dtype) if initial_state is None else initial_state
        final, o = lax.scan(step, initial, tuple(jnp.moveaxis(x, 1, 0) for x in tokens))
        return jnp.moveaxis(o, 0, 1), final
    if initial_state is None:
        initial_state = jnp.zeros((len(cu_seqlens) - 1, value_heads, dk, v.shape[-1]), v.dtype)
    outputs, finals = [], []
    for index, (start, end) in enumerate(zip(cu_seqlens[:-1], cu_seqlens[1:])):  # batch of one
        final, o = lax.scan(step, initial_state[index], tuple(x[0, start:end] for x in tokens))
        outputs.append(o)
        finals.append(final)
    o = jnp.concatenate(outputs, axis=0)  # tokens past cu_seqlens[-1] belong to no sequence: zeros
    return jnp.pad(o, ((0, length - o.shape[0]), (0, 0), (0, 0)))[None], jnp.stack(finals)


# ---------------------------------------------------------------------------------------------------
# Cases: differentiable arrays (positional order of kda64 / kernel_delta_attention, then a_log, dt_bias)
# and the static options.

B, T, H, HV, K, V = 2, 45, 2, 2, 16, 16
ARRAY_NAMES = ("q", "k", "v", "beta", "decay", "initial_state", "a_log", "dt_bias")


def make_case(seed=0, batch=B, length=T, heads=H, value_heads=HV, *, decay="channel", hard=False,
              cu_seqlens=None, gate=None, unnormalized=False, dtype=jnp.float32):
    """(arrays, options). decay: "channel" [B, T, HV, K] or "head" [B, T, HV] log decays; hard: a tenth of the
    tokens' gates -1000 (they forget everything); gate "softplus": decay is the raw gate input of the fused
    gate (a_log, dt_bias [HV, K]) and beta logits; unnormalized: no L2 norm (q and k drawn near unit length,
    so that the delta rule stays a contraction) and a softmax_scale of 0.3. Drawn with NumPy: eager jax.random
    would compile once per shape."""
    rng = np.random.default_rng(seed)
    normal = lambda *shape: rng.standard_normal(shape, np.float32)  # noqa: E731
    sigmoid = lambda x: 1 / (1 + np.exp(-x))  # noqa: E731
    qk_scale = K**-0.5 if unnormalized else 1.0
    arrays = dict(q=qk_scale * normal(batch, length, heads, K), k=qk_scale * normal(batch, length, heads, K),
                  v=normal(batch, length, value_heads, V))
    arrays = {n: jnp.asarray(x, dtype) for n, x in arrays.items()}
    shape = (batch, length, value_heads, K) if decay == "channel" else (batch, length, value_heads)
    options = {} if cu_seqlens is None else {"cu_seqlens": tuple(cu_seqlens)}
    if unnormalized:
        options.update(use_qk_l2norm=False, softmax_scale=0.3)
    if gate is None:
        beta, g = sigmoid(normal(batch, length, value_heads)), -np.logaddexp(0, normal(*shape))
        if hard:
            forget = rng.random((batch, length, value_heads)) < 0.1
            g[forget] = -1000.0
    else:
        beta, g = normal(batch, length, value_heads), normal(*shape)
        options["beta_is_logits"] = True
    states = batch if cu_seqlens is None else len(cu_seqlens) - 1
    extra = dict(beta=beta, decay=g, initial_state=0.5 * normal(states, value_heads, K, V))
    if gate is not None:
        extra.update(a_log=0.5 * normal(value_heads), dt_bias=normal(value_heads, K))
    arrays.update({n: jnp.asarray(x, jnp.float32) for n, x in extra.items()})
    return arrays, options


CASES = {
    "plain": dict(),  # T = 45: not a multiple of 16 or 64
    "gates_minus_1000": dict(hard=True),
    "packed_empty_segment": dict(batch=1, cu_seqlens=(0, 5, 5, 37)),  # and 8 tokens of no sequence
    "gqa_per_head_decay": dict(heads=1, value_heads=2, decay="head"),  # HV = 2 H
    "softplus_gate": dict(gate="softplus"),  # a_log and dt_bias through the fused gate, beta logits
    "no_l2_norm_scale": dict(unnormalized=True),  # use_qk_l2norm=False, softmax_scale=0.3
}


def loss_weights(arrays, seed=99):
    """The loss's weights on o and on the final state (fp32)."""
    rng = np.random.default_rng(seed)
    return tuple(jnp.asarray(rng.standard_normal(x.shape, np.float32)) for x in (arrays["v"], arrays["initial_state"]))


def loss(run, weights, arrays):
    o, final = run(arrays)
    o = o.astype(jnp.float32) if o.dtype == jnp.bfloat16 else o
    return jnp.sum(o * weights[0]) + jnp.sum(final * weights[1])


def ours(cfg, options):
    """(arrays) -> (o, final state) of kernel_delta_attention with cfg."""
    cu = options.get("cu_seqlens")
    rest = {n: x for n, x in options.items() if n != "cu_seqlens"}

    def run(arrays):
        fused = {n: arrays[n] for n in ("a_log", "dt_bias") if n in arrays}
        return kernel_delta_attention(
            *(arrays[n] for n in ARRAY_NAMES[:6]), return_state=True, cfg=cfg, **fused, **rest,
            cu_seqlens=None if cu is None else jnp.array(cu, jnp.int32),
        )

    return run


def oracle(options):
    """(float64 arrays) -> (o, final state) of the oracle."""
    return lambda arrays: kda64(*(arrays.get(n) for n in ARRAY_NAMES), **options)


def as64(tree):
    return jax.tree.map(lambda x: jnp.asarray(to64(x)), tree)


def oracle_outputs_and_gradients(arrays, options, weights):
    """(o, final state) and the loss's gradients by float64 autodiff of the oracle, on the (possibly
    bf16-rounded) inputs: NumPy float64 arrays."""
    with jax.enable_x64(True):
        weights64 = as64(weights)

        def run(arrays):
            outputs, pullback = jax.vjp(oracle(options), arrays)
            return outputs, pullback(weights64)[0]  # the loss is linear in the outputs, with the weights as slopes

        return jax.tree.map(np.asarray, jax.jit(run)(as64(arrays)))


def oracle_vjp(primals, cotangents, **options):
    """float64 autodiff of the oracle in kda_chunk's argument order: primals (q, k, v, g, beta, initial_state or
    None), activated g and beta, cotangents (d_out, d_final); options are kda64's. Returns the six gradients as
    NumPy float64 arrays (None for a None primal)."""
    with jax.enable_x64(True):
        primals, cotangents = (tuple(None if x is None else jnp.asarray(to64(x)) for x in xs)
                               for xs in (primals, cotangents))

        def run(primals, cotangents):
            _, pullback = jax.vjp(lambda q, k, v, g, beta, h0: kda64(q, k, v, beta, g, h0, **options), *primals)
            return pullback(cotangents)

        return [None if x is None else np.asarray(x) for x in jax.jit(run)(primals, cotangents)]


@functools.lru_cache
def reference_case(case, dtype=jnp.float32):
    """(arrays, options, weights, float64 outputs, float64 gradients), shared by every implementation."""
    arrays, options = make_case(**CASES[case], dtype=dtype)
    weights = loss_weights(arrays)
    return arrays, options, weights, *oracle_outputs_and_gradients(arrays, options, weights)


def our_gradients(cfg, arrays, options, weights):
    return jax.jit(jax.grad(functools.partial(loss, ours(cfg, options), weights)))(arrays)
