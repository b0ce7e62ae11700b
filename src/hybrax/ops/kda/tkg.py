"""`kda_tkg`: the NKI `kda_tkg` KDA token-generation step, in its own layouts.

One decode token for each of B requests: q, k and the raw gate g come head-last ([B, dk, H]), the
bounded gate lower_bound * sigmoid(exp(a_log) * (g + dt_bias)) and the beta sigmoid are applied
inside, q and k are L2-normalized and q scaled, and the state S [B, H, dk, dv] (fp32) advances by
one delta-rule step (decay first). It equals one step of `kernel_delta_attention` with the bounded
fused gate and beta logits. `scale` and `lower_bound` are [1, 1] arrays (they may be traced).

JAX arrays are immutable: the step returns the new state. Under `jax.jit(kda_tkg,
donate_argnums=8)` the new state takes S's buffer (in place). `out` is the seed's caller-allocated
destination: its shape is checked and its dtype is the output's.

On a GPU the step is the fused CUDA decode kernel (`decode.cuda`, where nvcc can build it) or the fused Pallas
one (`decode.pallas_gpu`); elsewhere the XLA step.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float

from hybrax.core.validate import check_floating, check_rank, check_shape, is_concrete
from hybrax.ops.kda.common.delta import delta_step, l2_normalize
from hybrax.ops.kda.decode import cuda as cuda_decode
from hybrax.ops.kda.decode import pallas_gpu as pallas_decode
from hybrax.ops.kda.gate import fused_gate
from hybrax.ops.pallas_shared import interpret_here


def _check(q, k, v, g, beta, a_log, dt_bias, out, S, scale, lower_bound) -> None:
    check_rank("q", q, 3, "[B, dk, num_head]")
    batch, dk, heads = jnp.shape(q)
    check_shape("k", k, (batch, dk, heads), "[B, dk, num_head] (q's shape)")
    check_shape("g", g, (batch, dk, heads), "[B, dk, num_head] (q's shape)")
    check_rank("v", v, 3, "[B, num_head, dv]")
    dv = jnp.shape(v)[2]
    check_shape("v", v, (batch, heads, dv), "[B, num_head, dv]")
    check_shape("beta", beta, (batch, 1, heads), "[B, 1, num_head]")
    check_shape("a_log", a_log, (1, heads), "[1, num_head]")
    check_shape("dt_bias", dt_bias, (dk, heads), "[dk, num_head]")
    check_shape("out", out, (batch, heads, dv), "[B, num_head, dv]")
    check_shape("S", S, (batch, heads, dk, dv), "[B, num_head, dk, dv]")
    check_shape("scale", scale, (1, 1), "[1, 1]")
    check_shape("lower_bound", lower_bound, (1, 1), "[1, 1]")
    for name, array in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta), ("a_log", a_log),
                        ("dt_bias", dt_bias), ("out", out), ("scale", scale), ("lower_bound", lower_bound)):
        check_floating(name, array)
    if jnp.result_type(S) != jnp.float32:
        raise ValueError(f"S must be float32 (the recurrent state), got {jnp.result_type(S)}")
    if is_concrete(lower_bound) and not float(np.asarray(lower_bound).reshape(())) <= 0:
        raise ValueError(f"lower_bound must be <= 0 (the gate is lower_bound * sigmoid(...)), got "
                         f"{np.asarray(lower_bound).tolist()}")


def _xla_step(q, k, v, g, beta, a_log, dt_bias, S, scale, lower_bound) -> tuple[jax.Array, jax.Array]:
    """q, k, g [B, 1, H, dk]; v [B, 1, H, dv]; beta [B, 1, H] logits: one XLA delta step."""
    decay = fused_gate(g, a_log, dt_bias, lower_bound)[:, 0]
    q, k = (l2_normalize(x.astype(jnp.float32))[:, 0] for x in (q, k))
    scale = jnp.asarray(scale, jnp.float32).reshape(())
    return delta_step(S, q, k, v[:, 0].astype(jnp.float32), jax.nn.sigmoid(beta[:, 0]), decay, scale)


@functools.partial(jax.custom_vjp, nondiff_argnums=(10, 11))
def _fused_step(q, k, v, g, beta, a_log, dt_bias, S, scale, lower_bound, kernel: str, interpret: bool = False):
    """The same step through a fused decode kernel, "cuda" or "pallas" (gate, beta, L2 norm and scale inside)."""
    batch, _, heads, dv = v.shape
    fused = {"gate": "bounded", "beta_is_logits": True, "scale": scale, "lower_bound": lower_bound}
    if kernel == "cuda":
        o, state = cuda_decode.fused_recurrent_decode_cuda(
            q, k, v, g, beta, S, a_log=a_log, dt_bias=dt_bias, **fused, **cuda_decode.launch_params(batch * heads, dv),
        )
    else:
        o, state = pallas_decode.fused_recurrent_decode(
            q, k, v, g, beta, S, a_log=a_log, dt_bias=dt_bias, interpret=interpret, **fused,
            **pallas_decode.launch_params(batch * heads, dv),
        )
    return o[:, 0], state


def _fused_step_fwd(*args):
    return _fused_step(*args), args[:10]


def _fused_step_bwd(kernel: str, interpret: bool, args: tuple, cotangent: tuple) -> tuple:
    """The XLA step's gradient: the kernel updates the state in place and has no backward; decode never trains,
    but `jax.grad` through a step still works."""
    return jax.vjp(_xla_step, *args)[1](cotangent)


_fused_step.defvjp(_fused_step_fwd, _fused_step_bwd)


def kda_tkg(
    q: Float[Array, "B dk num_head"],
    k: Float[Array, "B dk num_head"],
    v: Float[Array, "B num_head dv"],
    g: Float[Array, "B dk num_head"],
    beta: Float[Array, "B 1 num_head"],
    a_log: Float[Array, "1 num_head"],
    dt_bias: Float[Array, "dk num_head"],
    out: Float[Array, "B num_head dv"],
    S: Float[Array, "B num_head dk dv"],
    scale: Float[Array, "1 1"],
    lower_bound: Float[Array, "1 1"],
) -> tuple[Float[Array, "B num_head dv"], Float[Array, "B num_head dk dv"]]:
    """One KDA decode step for B requests (the NKI `kda_tkg`). Returns (out [B, H, dv] in out's dtype, new S)."""
    _check(q, k, v, g, beta, a_log, dt_bias, out, S, scale, lower_bound)
    batch, dk, heads = jnp.shape(q)
    dv = jnp.shape(v)[2]
    q, k, g = (jnp.swapaxes(x, 1, 2)[:, None] for x in (q, k, g))  # [B, 1, H, dk]
    v, a_log, dt_bias = v[:, None], jnp.reshape(a_log, (heads,)), jnp.transpose(dt_bias)
    args = (q, k, v, g, beta, a_log, dt_bias, S, scale, lower_bound)
    if cuda_decode.decline_reason(q.shape, v.shape, "auto", jax.default_backend()) is None:
        o, state = _fused_step(*args, "cuda")
    elif interpret_here() or pallas_decode.tile_reason(dk, dv):
        o, state = _xla_step(*args)
    else:
        o, state = _fused_step(*args, "pallas")
    return o.astype(jnp.result_type(out)), state
