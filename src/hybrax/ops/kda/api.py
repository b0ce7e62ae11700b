"""`kernel_delta_attention` (alias `kda_attention`; ejkernel's signature): Kimi Delta Attention, the public function.
The problem, config and kernel live in `base.py` (fla's argument convention: `kimi.py`); each implementation lives
in its own module, imported here so that it registers.
"""

from __future__ import annotations

from typing import Any

from jaxtyping import Array, Float, Int

from hybrax.core import default_executor, set_auto_order
from hybrax.core.packing import segment_packing, unflatten_output
from hybrax.ops.kda.base import OP_ID, KdaProblem, KernelDeltaAttention, KernelDeltaAttentionConfig

# Each implementation registers itself when imported; one subpackage per backend family.
from hybrax.ops.kda.decode import cuda as _decode_cuda, pallas_gpu as _decode_pallas_gpu  # noqa: F401
from hybrax.ops.kda.pallas_gpu import chunked as _pallas_gpu_chunked  # noqa: F401
from hybrax.ops.kda.pallas_tpu import decode as _pallas_tpu_decode, register as _pallas_tpu_chunked  # noqa: F401
from hybrax.ops.kda.xla import chunked as _xla_chunked, scan as _xla_scan  # noqa: F401

# What `auto` tries, in order, per device platform; the first whose supports() accepts the call runs (a device
# not named here reads the "cpu" row). The single-token kernels come first: they decline T > 1.
AUTO = {
    "gpu": ("cuda:decode", "pallas:decode", "xla:single_step", "pallas:chunked", "xla:chunked", "xla:scan"),
    "tpu": ("xla:single_step", "pallas_tpu:chunked", "xla:chunked", "xla:scan"),
    "cpu": ("xla:single_step", "xla:chunked", "xla:scan"),
}
# Run only when asked for by platform (there before the platform's other implementations).
OPT_IN = {
    "pallas_tpu:decode": "not yet run and timed on a TPU",
}
set_auto_order(OP_ID, AUTO, OPT_IN)

__all__ = ["OP_ID", "KdaProblem", "KernelDeltaAttention", "KernelDeltaAttentionConfig", "kda_attention",
           "kernel_delta_attention"]


def kernel_delta_attention(
    query: Float[Array, "batch seq_len num_heads qk_head_dim"],
    key: Float[Array, "batch seq_len num_heads qk_head_dim"],
    value: Float[Array, "batch seq_len num_value_heads v_head_dim"],
    beta: Float[Array, "batch seq_len num_value_heads"],
    decay: Float[Array, "batch seq_len num_value_heads *qk_head_dim"] | None = None,
    initial_state: Float[Array, "batch num_value_heads qk_head_dim v_head_dim"] | None = None,
    /,
    *,
    softmax_scale: float | None = None,
    chunk_size: int = 64,
    use_qk_l2norm: bool = True,
    use_chunked: bool = True,
    return_state: bool = False,
    platform: str | None = None,
    cfg: KernelDeltaAttentionConfig | None = None,
    cu_seqlens: Int[Array, " num_sequences_plus_1"] | None = None,
    a_log: Float[Array, " num_value_heads"] | None = None,
    dt_bias: Float[Array, "num_value_heads qk_head_dim"] | None = None,
    lower_bound: Any = None,
    beta_is_logits: bool = False,
    segment_ids: Int[Array, "batch seq_len"] | None = None,
    max_segments: int | None = None,
) -> Any:
    """Kimi Delta Attention. Returns the output [batch, seq_len, num_value_heads, v_head_dim] in the
    input dtype, or (output, final_state [batch | num_sequences, num_value_heads, qk_head_dim,
    v_head_dim] fp32) when return_state.

    decay: log decay per head [B, T, HV] or per key channel [B, T, HV, K], <= 0; None: no decay.
    With a_log [HV] (and dt_bias [HV, K] or [HV*K]) decay is the raw gate input, activated as
    -exp(a_log) * softplus(decay + dt_bias), or lower_bound * sigmoid(exp(a_log) * (decay + dt_bias))
    when lower_bound is set. beta_is_logits: beta goes through a sigmoid. cu_seqlens [N + 1] int32:
    packed sequences in a batch of one, initial and final state [N, HV, K, V]; it rises from 0 to at most
    seq_len, and tokens from cu_seqlens[-1] on belong to no sequence (zero output). Pad cu_seqlens to a
    fixed length with its last value to avoid a retrace when N varies (the empty sequences at the end keep
    their initial states). segment_ids [B, T] int instead: each run of equal ids in a row is a sequence, ids
    < 0 padding (zero output); the rows run as one packed row of B * T tokens with one sequence, and state,
    per run in row-major order (padding runs included), counted when the ids are concrete, else
    `max_segments` of them (states past the runs keep their initial values). Value heads may be a
    multiple of the query/key heads. chunk_size and use_chunked choose the default config only.
    """
    pack = segment_packing("query", query, cu_seqlens, segment_ids, max_segments)
    if pack is not None:
        query, key, value, beta, decay = (pack.flatten(name, array) for name, array in (
            ("query", query), ("key", key), ("value", value), ("beta", beta), ("decay", decay)))
        cu_seqlens = pack.cu_seqlens
    result = default_executor()(
        KernelDeltaAttention(), query, key, value, beta, decay, initial_state,
        softmax_scale=softmax_scale, chunk_size=chunk_size, use_qk_l2norm=use_qk_l2norm, use_chunked=use_chunked,
        return_state=return_state, platform=platform, cfg=cfg, cu_seqlens=cu_seqlens, a_log=a_log,
        dt_bias=dt_bias, lower_bound=lower_bound, beta_is_logits=beta_is_logits,
    )
    return unflatten_output(pack, result)


kda_attention = kernel_delta_attention
