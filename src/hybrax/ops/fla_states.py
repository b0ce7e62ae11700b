"""Recurrent states as flash-linear-attention's functions take and return them, for the fla-style entry points.

States are [N, heads, K, V] fp32 (N: the batch, or the packed sequences with cu_seqlens), or V-first
[N, heads, V, K] with `state_v_first`; hybrax's kernels hold them K-first. The functions return
(o, final_state), final_state None unless asked for.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from hybrax.core import checks
from hybrax.core.validate import check_shape


def k_first_initial_state(initial_state: Any, num_states: int, heads: tuple[str, int], dk: int, dv: int, *,
                          v_first: bool, packed: bool) -> Any:
    """initial_state checked (shape in the caller's layout, finite values) and put K-first; None stays None.
    heads: (its name in the message, its count)."""
    if initial_state is None:
        return None
    rows = "[num_sequences" if packed else "[batch"
    layout = f"{rows}, {heads[0]}, " + ("v_head_dim, head_dim]" if v_first else "head_dim, v_head_dim]")
    minor = (dv, dk) if v_first else (dk, dv)
    check_shape("initial_state", initial_state, (num_states, heads[1], *minor), layout)
    checks.check_finite("initial_state", initial_state)
    return jnp.swapaxes(initial_state, -1, -2) if v_first else initial_state


def fla_result(result: Any, output_final_state: bool, v_first: bool) -> tuple[jax.Array, jax.Array | None]:
    """(o, final_state in the caller's layout) from a kernel's o, or its (o, K-first final state)."""
    if not output_final_state:
        return result, None
    output, final_state = result
    return output, jnp.swapaxes(final_state, -1, -2) if v_first else final_state
