"""Implementations called inside `jax.shard_map`: constants that start a loop's carry must vary over the mesh.

Under shard_map (check_vma, JAX's default) every value has the set of manual mesh axes it varies over, and a
scan, fori_loop or cond needs its carry's set to stay the same from step to step. A carry that starts as a
constant (zeros, -inf) varies over nothing, while the step mixes in the sharded inputs: JAX refuses the loop.
`vary_like` marks such constants as varying wherever the inputs do (a no-op cast; outside shard_map, nothing).
"""

from __future__ import annotations

from typing import Any, TypeVar

import jax

T = TypeVar("T")


def _varying_axes(leaf: Any) -> frozenset:
    mesh_axes = getattr(jax.typeof(leaf), "mat", None)  # jax 0.11 keeps the set on the aval's `mat`
    return frozenset(getattr(mesh_axes, "varying", ()))


def varying_axes(*sources: Any) -> frozenset:
    """The manual mesh axes that some array leaf of `sources` varies over (empty outside shard_map)."""
    return frozenset().union(*(_varying_axes(leaf) for leaf in jax.tree.leaves(sources) if isinstance(leaf, jax.Array)))


def vary_like(value: T, *sources: Any) -> T:
    """`value` (a pytree) cast to vary over every manual mesh axis that some array leaf of `sources` varies over."""
    axes = varying_axes(*sources)
    if not axes:
        return value

    def cast(leaf: jax.Array) -> jax.Array:
        missing = tuple(sorted(axes - _varying_axes(leaf), key=str))
        return jax.lax.pcast(leaf, missing, to="varying") if missing else leaf

    return jax.tree.map(cast, value)
