"""The KimiDeltaAttention layer's benchmarks on the CPU: the smoke run appends rows for training and decode, the
parts chained compute the layer's output, and the counted work follows the layer's parameters."""

import json

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from hybrax.bench import __main__ as bench_cli
from hybrax.bench import shapes
from hybrax.bench.timer import Timing
from hybrax.bench.workloads import kda_layer
from hybrax.nn import KimiDeltaAttention
from tests.helpers import assert_close

TINY = shapes.parse("kda_layer-1x32x24x2x8")


def _rows(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_smoke_runs_append_layer_and_decode_rows(tmp_path):
    assert bench_cli.main(["--op", "kda_layer", "--smoke", "--mode", "fwd+bwd", "--out", str(tmp_path)]) == 0
    assert bench_cli.main(["--op", "kda_layer_decode", "--smoke", "--out", str(tmp_path)]) == 0
    (trained,) = _rows(tmp_path / "cpu" / "kda_layer.jsonl")
    assert trained["shape"] == shapes.SMOKE_SHAPES["kda_layer"] and trained["mode"] == "fwd+bwd"
    assert trained["tflops"] > 0
    (decoded,) = _rows(tmp_path / "cpu" / "kda_layer_decode.jsonl")
    assert decoded["shape"] == shapes.SMOKE_SHAPES["kda_layer_decode"] and decoded["gbps"] > 0


def test_parts_are_timed_on_request_and_chained_are_the_layer(monkeypatch):
    # The token-by-token KDA compiles faster on the CPU; the parts follow the layer's mode.
    layer = KimiDeltaAttention(TINY.hidden, TINY.heads, TINY.head_dim, mode="fused_recurrent", rngs=nnx.Rngs(0))
    inputs = {"layer": layer, "x": jax.random.normal(jax.random.key(1), (TINY.batch, TINY.seq_len, TINY.hidden))}
    calls = []
    measure = lambda call: calls.append(call) or Timing(1.0, 0.0, 1, 1, "jax")  # noqa: E731
    assert kda_layer.extras(TINY, inputs, "fwd", measure) == {} and not calls
    monkeypatch.setenv(kda_layer.PARTS_VARIABLE, "1")
    assert kda_layer.extras(TINY, inputs, "fwd", measure) == {f"{name}_ms": 1.0 for name in kda_layer.PARTS}
    # The last part (the output) runs on the activations the parts before it made: the layer's output.
    assert_close(calls[-1].run(), nnx.jit(lambda layer, x: layer(x))(layer, inputs["x"]), 1e-5)


def test_a_parts_gradient_covers_its_inputs_and_its_parameters():
    layer = kda_layer.make_layer(TINY, jnp.float32)
    x = jax.random.normal(jax.random.key(1), (1, 32, 24))
    o = jax.random.normal(jax.random.key(2), (1, 32, 2, 8))
    d_params, d_args = kda_layer.part_call(layer, kda_layer.PARTS["output"], (x, o), "fwd+bwd").run()
    assert sorted(d_params) == ["g_a_proj", "g_b_proj", "o_norm", "o_proj"]
    assert [d.shape for d in d_args] == [x.shape, o.shape]
    assert all(np.isfinite(leaf).all() for leaf in jax.tree.leaves((d_params, d_args)))


def test_decode_counts_every_byte_a_step_moves():
    shape = shapes.parse("kda_layer_decode-4x24x2x8")
    layer = nnx.eval_shape(lambda: kda_layer.make_layer(shape, jnp.bfloat16))
    weights = sum(leaf.size * leaf.dtype.itemsize for leaf in jax.tree.leaves(nnx.state(layer, nnx.Param)))
    cache = jax.eval_shape(lambda: layer.empty_cache(shape.batch))
    state, conv = (2 * leaf.size * leaf.dtype.itemsize for leaf in (cache.state, cache.conv))
    assert state == 2 * 4 * 2 * 8 * 8 * 4 and conv == 2 * 4 * (3 * 2 * 8) * 3 * 4
    tokens = 2 * 4 * 24 * 2
    assert kda_layer.decode_work(shape, "fwd", jnp.bfloat16).bytes == weights + state + conv + tokens
