"""Properties of the compiled train step that must hold on every run.

These read the optimized HLO and the executable of a jitted, donated step, so
they are deterministic (no timing): the wrapper adds no full-size copies over
bare optax, no host transfer, keeps donation working, and allocates no
temporary beyond the updates (never the unscaled gradients); stepping with
`apply_gradients` does not even allocate the updates. BENCHMARKS.md has the
timings.
"""

import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from benchmarks import hlo_stats
import optax_lossscale as ols

SHAPES = {"w": (64, 128), "v": (128, 96), "b": (96,)}
BIG = {s for s in SHAPES.values() if np.prod(s) >= 4096}
PARAM_BYTES = sum(4 * int(np.prod(s)) for s in SHAPES.values())


def _params():
  rng = np.random.default_rng(0)
  return {k: jnp.asarray(rng.standard_normal(s), jnp.float32) for k, s in SHAPES.items()}


def _grads(poison=False):
  rng = np.random.default_rng(1)
  grads = {k: jnp.asarray(rng.standard_normal(s), jnp.float32) for k, s in SHAPES.items()}
  if poison:
    grads["v"] = grads["v"].at[3, 4].set(jnp.inf)
  return grads


def _step(tx, fused=False):
  def step(params, state, grads):
    if fused:
      return ols.apply_gradients(tx, grads, state, params)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  return jax.jit(step, donate_argnums=(0, 1))


def _compiled(tx, fused=False):
  params = _params()
  return _step(tx, fused).lower(params, tx.init(params), _grads()).compile()


def _data_copies(hlo):
  """Copies of full-size arrays, except copies of a broadcast constant (fills)."""
  return hlo_stats.count_copies(hlo, BIG)[0]


WRAPPED = {
  "cond": lambda: ols.loss_scale_optimizer(optax.adam(1e-3), skip_mode="cond"),
  "auto": lambda: ols.loss_scale_optimizer(optax.adam(1e-3), skip_mode="auto"),
}


FUSED = pytest.mark.parametrize("fused", [False, True], ids=["update", "apply_gradients"])


@FUSED
@pytest.mark.parametrize("mode", sorted(WRAPPED))
def test_no_extra_full_size_copies_over_bare_optax(mode, fused):
  bare = _data_copies(_compiled(optax.adam(1e-3)).as_text())
  wrapped = _data_copies(_compiled(WRAPPED[mode](), fused).as_text())
  assert wrapped <= bare, (wrapped, bare)


@FUSED
@pytest.mark.parametrize("mode", ["cond", "select", "auto"])
def test_no_host_transfer_in_the_step(mode, fused):
  tx = ols.loss_scale_optimizer(optax.adam(1e-3), skip_mode=mode)
  assert not hlo_stats.has_host_transfer(_compiled(tx, fused).as_text())


CPU_ONLY = pytest.mark.skipif(
  jax.default_backend() != "cpu",
  reason="a fact of XLA:CPU's compiled step (other backends fuse and rewrite differently)",
)


def test_auto_resolves_per_backend():
  expected = "select" if jax.default_backend() in ("gpu", "cuda", "rocm") else "cond"
  assert WRAPPED["auto"]().skip_mode == expected
  assert WRAPPED["auto"]().get_config()["skip_mode"] == "auto"


@CPU_ONLY
def test_auto_is_a_conditional_on_cpu():
  assert " conditional(" in _compiled(WRAPPED["auto"]()).as_text()


def test_temporaries_are_at_most_the_updates():
  # The cond's outputs (the updates) must exist as a buffer; the unscaled
  # gradients must not (the unscaling fuses into the check and the update),
  # and neither may a copy of the moments.
  bare = _compiled(optax.adam(1e-3)).memory_analysis().temp_size_in_bytes
  wrapped = _compiled(WRAPPED["cond"]()).memory_analysis().temp_size_in_bytes
  assert wrapped <= bare + PARAM_BYTES + 4096


def test_apply_gradients_allocates_no_full_size_temporary():
  # Inside the branch the updates fuse into the new params, and the check of
  # float32 gradients is a sum that writes nothing: only scalars remain.
  bare = _compiled(optax.adam(1e-3)).memory_analysis().temp_size_in_bytes
  fused = _compiled(WRAPPED["cond"](), fused=True).memory_analysis().temp_size_in_bytes
  assert fused <= bare + 4096, (fused, bare)


@FUSED
def test_donation_aliases_every_param_and_moment(fused):
  tx = WRAPPED["cond"]()
  header = _compiled(tx, fused).as_text().split("\n", 1)[0]
  aliased = re.findall(r"\{[\d,\s]*\}: \((\d+), \{[\d,\s]*\}, (?:may|must)-alias\)", header)
  params = _params()
  flat_inputs = jax.tree.leaves((params, tx.init(params)))
  big_inputs = {i for i, x in enumerate(flat_inputs) if x.shape in BIG}
  # Params, mu and nu of both big leaves are updated in place.
  assert len(big_inputs) == 3 * len(BIG)
  assert big_inputs <= {int(i) for i in aliased}


@FUSED
@pytest.mark.parametrize("poison", [False, True], ids=["taken", "skipped"])
def test_donated_buffers_are_consumed_and_skip_keeps_values(poison, fused):
  tx = WRAPPED["cond"]()
  params = _params()
  state = tx.init(params)
  expected_params = jax.tree.map(np.array, params)
  expected_inner = jax.tree.map(np.array, state.inner_state)
  new_params, new_state = _step(tx, fused)(params, state, _grads(poison))
  assert all(x.is_deleted() for x in jax.tree.leaves(params))
  assert all(x.is_deleted() for x in jax.tree.leaves(state.inner_state))
  assert bool(new_state.last_step_applied) is not poison
  if poison:
    chex.assert_trees_all_equal(jax.tree.map(np.asarray, new_params), expected_params)
    chex.assert_trees_all_equal(jax.tree.map(np.asarray, new_state.inner_state), expected_inner)
  else:
    ref_updates, _ = optax.adam(1e-3).update(
      jax.tree.map(lambda g: g / 2.0**15, _grads()),
      optax.adam(1e-3).init(_params()),
      _params(),
    )
    chex.assert_trees_all_close(
      new_params, optax.apply_updates(_params(), ref_updates), rtol=1e-6, atol=1e-7
    )


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float16, jnp.bfloat16, jnp.complex64])
@pytest.mark.parametrize("bad", [None, np.nan, np.inf, -np.inf])
def test_all_finite_agrees_with_elementwise_check(dtype, bad):
  x = jnp.arange(3 * 5 * 7, dtype=jnp.float32).reshape(3, 5, 7).astype(dtype)
  if bad is not None:
    x = x.at[2, 4, 6].set(bad)
  tree = {"x": x, "empty": jnp.zeros((0, 4), dtype), "n": jnp.arange(3)}
  expected = bool(np.all(np.isfinite(np.asarray(x))))
  assert bool(ols.all_finite(tree)) is expected
  assert bool(jax.jit(ols.all_finite)(tree)) is expected


@CPU_ONLY
def test_copy_detector_sees_the_copies_of_a_select_over_the_state():
  # Guards the detector above against passing vacuously: selecting over
  # (params, opt_state), as the jmp and Flax recipes do, copies the moments.
  tx = optax.adam(1e-3)

  def step(params, state, grads):
    finite = ols.all_finite(grads)
    updates, new_state = tx.update(grads, state, params)
    new_params = optax.apply_updates(params, updates)
    return ols.select_tree(finite, (new_params, new_state), (params, state))

  params = _params()
  jitted = jax.jit(step, donate_argnums=(0, 1))
  hlo = jitted.lower(params, tx.init(params), _grads()).compile().as_text()
  assert _data_copies(hlo) >= len(BIG)


@pytest.mark.parametrize("platform, has_cond", [("cpu", True), ("gpu", False), ("tpu", True)])
def test_auto_traces_the_mode_of_the_platform(monkeypatch, platform, has_cond):
  # 'auto' is resolved when the update is traced, from the default backend.
  monkeypatch.setattr(jax, "default_backend", lambda: platform)
  tx = WRAPPED["auto"]()
  params = _params()
  jaxpr = jax.make_jaxpr(tx.update)(_grads(), tx.init(params), params)
  assert (" cond[" in str(jaxpr)) is has_cond
  assert tx.skip_mode == ("cond" if has_cond else "select")
