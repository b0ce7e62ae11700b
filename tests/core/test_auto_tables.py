"""Each op's `auto` table (AUTO: per device platform, what `auto` tries in order; OPT_IN: what it never takes, and
why) names exactly the registered implementations, and the registry walks it as it reads."""

from __future__ import annotations

import dataclasses
import importlib

import jax.numpy as jnp
import pytest

from hybrax.core import auto_order, implementations, registry
from hybrax.ops.kda.api import KernelDeltaAttention

TABLES = ["hybrax.ops.kda.api", "hybrax.ops.recurrent.api", "hybrax.ops.attention.api", "hybrax.serving.kda_pool",
          "hybrax.serving.attention_pool"]


@pytest.mark.parametrize("module_name", TABLES)
def test_every_name_is_registered_and_every_implementation_is_in_a_row_or_opt_in(module_name):
    module = importlib.import_module(module_name)
    table, opt_in = module.AUTO, getattr(module, "OPT_IN", {})
    registered = {impl.name for impl in implementations(module.OP_ID)}
    in_rows = {name for row in table.values() for name in row}
    assert set(table) == {"cpu", "gpu", "tpu"}
    assert all(len(set(row)) == len(row) for row in table.values()), "a name twice in one row"
    assert in_rows <= registered, f"not registered: {in_rows - registered}"
    assert set(opt_in) <= registered, f"opt-in but not registered: {set(opt_in) - registered}"
    assert not in_rows & set(opt_in), "both in a row and opt-in"
    assert registered == in_rows | set(opt_in), f"in no row and not opt-in: {registered - in_rows - set(opt_in)}"
    assert all(isinstance(why, str) and why for why in opt_in.values()), "an opt-in without its reason"
    assert auto_order(module.OP_ID).rows == table and dict(auto_order(module.OP_ID).opt_in) == opt_in


def test_every_registered_op_has_a_table():
    ops = {op for op, _, _ in registry._REGISTRY}
    assert {importlib.import_module(name).OP_ID for name in TABLES} <= ops
    for op in ops:
        auto_order(op)  # raises for an op without one


def _kda_invocation(device: str, tokens: int = 1, platform: str | None = None):
    kernel = KernelDeltaAttention()
    q = jnp.ones((1, tokens, 1, 16), jnp.float32)
    problem = kernel.prepare(q, q, q, jnp.full((1, tokens, 1), 0.5), -jnp.ones((1, tokens, 1)))
    return dataclasses.replace(kernel.invocation(problem, platform), device=device)


@pytest.mark.parametrize("device", ["cpu", "gpu", "tpu"])
def test_auto_walks_the_devices_row(device):
    """A single token: everything in the row that takes it, in the row's order."""
    module = importlib.import_module("hybrax.ops.kda.api")
    inv = _kda_invocation(device)
    runnable = [impl.name for impl in registry.supported(module.OP_ID, inv)]
    assert runnable == [name for name in module.AUTO[device] if registry.lookup(
        module.OP_ID, *name.split(":")).supports(inv) is None]


def test_a_device_the_table_does_not_name_reads_the_cpu_row():
    module = importlib.import_module("hybrax.ops.kda.api")
    names = [impl.name for impl in registry.supported(module.OP_ID, _kda_invocation("metal", tokens=3))]
    assert names == [name for name in module.AUTO["cpu"] if name != "xla:single_step"]


def test_an_explicit_platform_takes_its_opt_in_implementations_first():
    module = importlib.import_module("hybrax.ops.kda.api")
    names = [impl.name for impl in registry.supported(module.OP_ID, _kda_invocation("tpu", platform="pallas_tpu"))]
    assert names == ["pallas_tpu:decode", "pallas_tpu:chunked"]


def test_a_bad_table_is_refused():
    with pytest.raises(ValueError, match="needs a 'cpu' row"):
        registry.set_auto_order("not_an_op", {"gpu": ("xla:x",)})
    with pytest.raises(ValueError, match="both in an auto row and opt-in"):
        registry.set_auto_order("not_an_op", {"cpu": ("xla:x",)}, {"xla:x": "why"})
    with pytest.raises(ValueError, match="not_an_op: no auto table"):
        auto_order("not_an_op")

