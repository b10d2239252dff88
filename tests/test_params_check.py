"""`check_params_are_arrays`: a params tree holding a non-array is named, with the fix."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from optax_lossscale._src.utils.params_check import check_params_are_arrays


def test_arrays_scalars_none_tracers_and_shape_structs_pass():
  params = {"w": jnp.ones(2), "n": np.ones(3), "s": 1.0, "i": np.int32(2), "none": None}
  check_params_are_arrays(params, "tx.init")
  jax.jit(lambda p: check_params_are_arrays(p, "tx.init"))(params)
  jax.eval_shape(lambda p: check_params_are_arrays(p, "tx.init"), params)
  check_params_are_arrays(jax.eval_shape(lambda: params), "tx.init")


def test_a_function_leaf_is_named_by_its_path():
  params = {"layers": [{"w": jnp.ones(2)}, {"w": jnp.ones(2), "act": jax.nn.relu}]}
  with pytest.raises(TypeError) as e:
    check_params_are_arrays(params, "loss_scale_optimizer.init")
  message = str(e.value)
  assert message.startswith("loss_scale_optimizer.init got params with a leaf that is not an array")
  assert "['layers'][1]['act']" in message
  assert "eqx.filter(model, eqx.is_inexact_array)" in message


def test_a_string_leaf_is_refused():
  with pytest.raises(TypeError, match=r"at \['name'\] \(a str\)"):
    check_params_are_arrays({"name": "dense"}, "tx.update")


def test_a_whole_equinox_module_names_its_first_non_array_field():
  eqx = pytest.importorskip("equinox")
  model = eqx.nn.MLP(2, 1, width_size=4, depth=1, key=jax.random.PRNGKey(0))
  with pytest.raises(TypeError, match=r"at \.activation ") as e:
    check_params_are_arrays(model, "loss_scale_optimizer.update")
  assert "eqx.filter(model, eqx.is_inexact_array)" in str(e.value)
  check_params_are_arrays(eqx.filter(model, eqx.is_inexact_array), "loss_scale_optimizer.update")
