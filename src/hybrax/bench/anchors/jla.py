"""jax-linear-attention's `linear_attention` on the benchmark's inputs: kind "kda" (with the L2 norm of q and k),
"gla" (per-key gate) or "simple_gla" (per-head gate); its Mosaic GPU kernels on a GPU (impl "mosaic_gpu"), its
chunked JAX path elsewhere. Packed shapes go in as segment ids.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from hybrax.bench.anchors import require
from hybrax.bench.shapes import Shape
from hybrax.bench.workloads.base import Call, Declined, Inputs, jax_call

PACKAGES = ("jax-linear-attention",)


def _segment_ids(cu_seqlens: jax.Array, length: int) -> jax.Array:
    """[1, T] int32 sequence index of each token of the packed row."""
    bounds = np.asarray(cu_seqlens)
    return jnp.asarray(np.searchsorted(bounds, np.arange(length), side="right") - 1, jnp.int32)[None]


def build(name: str, op: str, shape: Shape, inputs: Inputs, mode: str) -> Call:
    if op not in ("kda", "gla"):
        raise Declined(f"jla is an anchor of kda and gla, not {op}")
    ops = require("jla.ops", "jax-linear-attention")
    impl = "mosaic_gpu" if jax.default_backend() == "gpu" else "chunked"
    options = {"scale": shape.head_dim ** -0.5, "impl": impl}
    if op == "kda":
        kind, names = "kda", ("q", "k", "v", "g", "beta")
        options["use_qk_l2norm"] = True
        if inputs["cu_seqlens"] is not None:
            options["segment_ids"] = _segment_ids(inputs["cu_seqlens"], shape.seq_len)
    else:
        kind, names = shape.family, ("q", "k", "v", "log_decay")

    def forward(q, k, v, *gates):
        gate_names = ("g", "beta")[:len(gates)]
        return ops.linear_attention(kind, q, k, v, **dict(zip(gate_names, gates)), **options)

    return jax_call(forward, [inputs[name] for name in names], mode, inputs["d_out"])
