"""`MaskInfo`: which keys each query may see, from segment ids or from a boolean mask.

Segment ids stay as ids ([batch, len] each) rather than being expanded to a [Tq, Tk] mask, so the
blockwise implementation can build each tile's mask on the fly with memory linear in length.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Int

from hybrax.core.validate import check_integer, check_rank, describe

PADDING_SEGMENT = -1


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class MaskInfo:
    """Visibility of keys to queries. Build it with `from_segments` or `from_attention_mask`.

    q_segment_ids / kv_segment_ids: [batch, Tq] / [batch, Tk] ints; a query sees the keys of its own
        segment; id -1 is padding and sees (and is seen by) nothing.
    attention_mask: bool [batch | 1, 1 | num_heads, Tq, Tk], True keeps.
    Both kinds may be present; a key is visible when every present part allows it.
    """

    q_segment_ids: Int[Array, "batch q_len"] | None = None
    kv_segment_ids: Int[Array, "batch kv_len"] | None = None
    attention_mask: Bool[Array, "batch heads q_len kv_len"] | None = None

    @classmethod
    def from_segments(
        cls,
        q_segment_ids: Int[Array, "batch q_len"],
        kv_segment_ids: Int[Array, "batch kv_len"] | None = None,
    ) -> "MaskInfo":
        """Equal ids attend; -1 is padding. `kv_segment_ids` defaults to `q_segment_ids` (self-attention)."""
        check_rank("q_segment_ids", q_segment_ids, 2, "[batch, q_len]")
        check_integer("q_segment_ids", q_segment_ids)
        if kv_segment_ids is None:
            kv_segment_ids = q_segment_ids
        check_rank("kv_segment_ids", kv_segment_ids, 2, "[batch, kv_len]")
        check_integer("kv_segment_ids", kv_segment_ids)
        if jnp.shape(q_segment_ids)[0] != jnp.shape(kv_segment_ids)[0]:
            raise ValueError(
                f"q_segment_ids {describe(jnp.shape(q_segment_ids))} and kv_segment_ids "
                f"{describe(jnp.shape(kv_segment_ids))} must have the same batch size"
            )
        return cls(q_segment_ids=jnp.asarray(q_segment_ids, jnp.int32),
                   kv_segment_ids=jnp.asarray(kv_segment_ids, jnp.int32))

    @classmethod
    def from_attention_mask(cls, mask: Bool[Array, "batch heads q_len kv_len"]) -> "MaskInfo":
        """A boolean mask [batch | 1, 1 | num_heads, Tq, Tk]; True keeps."""
        check_rank("mask", mask, 4, "[batch | 1, 1 | num_heads, q_len, kv_len]")
        if jnp.result_type(mask) != jnp.bool_:
            raise ValueError(f"mask must be a boolean array (True keeps), got dtype {jnp.result_type(mask)}")
        return cls(attention_mask=jnp.asarray(mask))
