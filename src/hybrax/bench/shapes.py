"""Named problem shapes: one string names a whole benchmark problem size, for the runner, the tests and the autotuner.

A name is a family, its dimensions joined by "x", and optional variants:

    kda-BxTxHxD              chunked KDA: B sequences of T tokens, H heads, K = V = D
    kda-1xTxHxD-varN         the same T tokens as N packed sequences of random lengths (cu_seqlens)
    gla-BxTxHxD              gated linear attention, one log decay per key channel (gk)
    simple_gla-BxTxHxD       gated linear attention, one log decay per head (g)
    attn-BxTxHxKVxD          causal softmax attention, H query heads on KV key/value heads of D
    attn-BxTxHxKVxD-wW       the same with a left window of W tokens
    attn-BxTxHxKVxD-segN     the same over N packed sequences of equal length (segment ids)
    kda_decode-BxHxD         one KDA decode step for B requests, H heads, a D x D state per head
    attn_decode-BxCxHxKVxD   one attention decode step for B requests over C cached tokens each
    kda_layer-BxTxNxHxD      the KimiDeltaAttention layer: B sequences of T tokens of hidden size N, H heads of D
    kda_layer_decode-BxNxHxD one decode step of that layer for B requests

`BENCHMARK_SHAPES[op]` lists the shapes each op is measured at by default; `SMOKE_SHAPES[op]` one that runs on a
CPU in seconds.
"""

from __future__ import annotations

import dataclasses
import re

import numpy as np

# family -> the names of its dimensions, in order
FAMILIES = {
    "kda": ("batch", "seq_len", "heads", "head_dim"),
    "gla": ("batch", "seq_len", "heads", "head_dim"),
    "simple_gla": ("batch", "seq_len", "heads", "head_dim"),
    "attn": ("batch", "seq_len", "heads", "kv_heads", "head_dim"),
    "kda_decode": ("batch", "heads", "head_dim"),
    "attn_decode": ("batch", "context", "heads", "kv_heads", "head_dim"),
    "kda_layer": ("batch", "seq_len", "hidden", "heads", "head_dim"),
    "kda_layer_decode": ("batch", "hidden", "heads", "head_dim"),
}
# family -> the variants it takes (prefix -> Shape field)
VARIANTS = {"kda": {"var": "sequences"}, "attn": {"w": "window", "seg": "segments"}}
_VARIANT = re.compile(r"([a-z]+)(\d+)")


@dataclasses.dataclass(frozen=True)
class Shape:
    """A parsed shape name. seq_len is 1 for decode steps; kv_heads equals heads outside attention; sequences > 0
    packs that many sequences of random lengths into the one row; segments > 1 packs equal ones; hidden is a
    layer's model width (0 for the ops)."""

    name: str
    family: str
    batch: int
    heads: int
    head_dim: int
    seq_len: int = 1
    kv_heads: int = 0
    context: int = 0
    sequences: int = 0
    window: int | None = None
    segments: int = 1
    hidden: int = 0

    def __post_init__(self) -> None:
        if not self.kv_heads:
            object.__setattr__(self, "kv_heads", self.heads)

    @property
    def tokens(self) -> int:
        """Tokens one call processes (new tokens for decode steps)."""
        return self.batch * self.seq_len

    def cu_seqlens(self) -> np.ndarray | None:
        """[sequences + 1] int32 bounds of the packed sequences (lengths >= 1, fixed by the name), or None."""
        if not self.sequences:
            return None
        cuts = np.random.default_rng(0).choice(np.arange(1, self.seq_len), self.sequences - 1, replace=False)
        return np.concatenate([[0], np.sort(cuts), [self.seq_len]]).astype(np.int32)

    def segment_ids(self) -> np.ndarray | None:
        """[batch, seq_len] int32 ids of `segments` equal packed sequences, or None."""
        if self.segments == 1:
            return None
        ids = np.repeat(np.arange(self.segments, dtype=np.int32), self.seq_len // self.segments)
        return np.broadcast_to(ids, (self.batch, self.seq_len)).copy()


def parse(name: str) -> Shape:
    """The Shape a name stands for (grammar in the module docstring); ValueError naming what is wrong."""
    family, _, rest = name.partition("-")
    if family not in FAMILIES:
        raise ValueError(f"shape {name!r}: family must be one of {sorted(FAMILIES)}, got {family!r}")
    dims_text, *variant_texts = rest.split("-") if rest else [""]
    fields = FAMILIES[family]
    dims = dims_text.split("x")
    if len(dims) != len(fields) or not all(d.isdigit() and int(d) > 0 for d in dims):
        raise ValueError(f"shape {name!r}: needs {len(fields)} positive integers "
                         f"{'x'.join(f.upper() for f in fields)} after {family!r}, got {dims_text!r}")
    values = dict(zip(fields, map(int, dims)))
    for text in variant_texts:
        values.update(_variant(name, family, text))
    shape = Shape(name=name, family=family, **values)
    _check(shape)
    return shape


def _variant(name: str, family: str, text: str) -> dict[str, int]:
    allowed = VARIANTS.get(family, {})
    match = _VARIANT.fullmatch(text)
    if not match or match.group(1) not in allowed:
        raise ValueError(f"shape {name!r}: family {family!r} takes variants {sorted(f'{p}N' for p in allowed)}, "
                         f"got {text!r}")
    return {allowed[match.group(1)]: int(match.group(2))}


def _check(shape: Shape) -> None:
    if shape.sequences and (shape.batch != 1 or not 1 < shape.sequences <= shape.seq_len):
        raise ValueError(f"shape {shape.name!r}: packed sequences need batch 1 and 2 <= N <= T, "
                         f"got batch {shape.batch} and N = {shape.sequences}")
    if shape.segments > 1 and shape.seq_len % shape.segments:
        raise ValueError(f"shape {shape.name!r}: {shape.segments} equal segments need T divisible by them, "
                         f"got T = {shape.seq_len}")
    if shape.heads % shape.kv_heads:
        raise ValueError(f"shape {shape.name!r}: query heads must be a multiple of kv heads, "
                         f"got {shape.heads} and {shape.kv_heads}")


KDA_SHAPES = ("kda-1x8192x32x128", "kda-8x2048x16x128", "kda-1x32768x16x128", "kda-2x16384x16x128")
BENCHMARK_SHAPES: dict[str, tuple[str, ...]] = {
    "kda": KDA_SHAPES + ("kda-1x32768x16x128-var16", "kda-1x32768x32x128-var64"),
    "gla": ("gla-1x8192x16x128", "gla-8x2048x16x128", "simple_gla-1x8192x16x128"),
    "attention": ("attn-1x2048x8x8x64", "attn-1x8192x8x8x64", "attn-1x8192x32x8x128",
                  "attn-1x8192x32x8x128-w1024", "attn-1x8192x32x8x128-seg4", "attn-1x2048x32x8x128-seg4"),
    "kda_decode": ("kda_decode-1x32x128", "kda_decode-8x32x128", "kda_decode-64x32x128", "kda_decode-256x32x128",
                   "kda_decode-1024x16x128"),
    "attention_decode": ("attn_decode-1x4096x32x8x128", "attn_decode-8x4096x32x8x128", "attn_decode-64x4096x32x8x128",
                         "attn_decode-8x32768x32x8x128", "attn_decode-64x32768x32x8x128"),
    "kda_cp": ("kda-1x32768x16x128",),
    "gla_cp": ("gla-1x32768x16x128",),
    "attention_cp": ("attn-1x32768x16x16x128",),
    "kda_layer": ("kda_layer-1x8192x2048x16x128", "kda_layer-8x2048x2048x16x128"),
    "kda_layer_decode": ("kda_layer_decode-1x2048x16x128", "kda_layer_decode-64x2048x16x128",
                         "kda_layer_decode-256x2048x16x128"),
}
SMOKE_SHAPES: dict[str, str] = {
    "kda": "kda-1x64x2x16",
    "gla": "gla-1x64x2x16",
    "attention": "attn-1x64x4x2x16",
    "kda_decode": "kda_decode-2x2x16",
    "attention_decode": "attn_decode-2x40x4x2x16",
    "kda_cp": "kda-1x64x2x16",
    "gla_cp": "gla-1x64x2x16",
    "attention_cp": "attn-1x64x2x2x16",
    "kda_layer": "kda_layer-1x64x32x2x16",
    "kda_layer_decode": "kda_layer_decode-2x32x2x16",
}
