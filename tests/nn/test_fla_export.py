"""KimiDeltaAttention.fla_state_dict, the inverse of load_fla_state_dict: fla's names and PyTorch layouts out, and
loading what was exported restores every parameter exactly (fp32 and bf16 parameters, with and without the
convolutions and their biases)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from hybrax.nn import KimiDeltaAttention
from tests.nn import reference

HIDDEN = 24
CFG = dict(num_heads=2, num_v_heads=4, head_dim=8, head_v_dim=16, use_short_conv=True)


def make_layer(seed, *, use_short_conv=True, conv_bias=False, param_dtype=jnp.float32):
    return KimiDeltaAttention(HIDDEN, CFG["num_heads"], CFG["head_dim"], num_v_heads=CFG["num_v_heads"],
                              expand_v=CFG["head_v_dim"] / CFG["head_dim"], use_short_conv=use_short_conv,
                              conv_bias=conv_bias, param_dtype=param_dtype, rngs=nnx.Rngs(seed))


def parameters(layer):
    return {path: np.asarray(value.get_value()) for path, value in nnx.to_flat_state(nnx.state(layer, nnx.Param))}


@pytest.mark.parametrize("use_short_conv, conv_bias, param_dtype", [
    (True, False, jnp.float32), (True, True, jnp.bfloat16), (False, False, jnp.float32)],
    ids=["fp32", "bf16-conv-bias", "no-conv"])
def test_loading_the_export_restores_every_parameter(use_short_conv, conv_bias, param_dtype):
    options = dict(use_short_conv=use_short_conv, conv_bias=conv_bias, param_dtype=param_dtype)
    source, target = make_layer(0, **options), make_layer(1, **options)
    exported = source.fla_state_dict()
    assert all(value.dtype in (np.float32, np.dtype(param_dtype)) for value in exported.values())
    target.load_fla_state_dict(exported)
    want, got = parameters(source), parameters(target)
    assert want.keys() == got.keys()
    for path in want:
        assert got[path].dtype == want[path].dtype, path
        np.testing.assert_array_equal(got[path], want[path], err_msg=str(path))


def test_the_export_of_loaded_fla_weights_is_those_weights():
    cfg = dict(CFG, use_short_conv=True)
    weights = reference.random_kda_weights(np.random.default_rng(0), HIDDEN, cfg, conv_bias=True)
    layer = make_layer(0, conv_bias=True)
    layer.load_fla_state_dict(weights)
    exported = layer.fla_state_dict()
    assert exported.keys() == weights.keys()
    for name, value in weights.items():
        assert exported[name].shape == value.shape, name
        np.testing.assert_array_equal(exported[name], value, err_msg=name)
