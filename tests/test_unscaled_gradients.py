"""Gradients of the plain loss given to `loss_scale_optimizer` are loud; every scaled path is quiet.

The wrapper divides its gradients by the loss scale. Given those of the plain
loss it trains 2**15 times too slowly without a word (as Keras's
`LossScaleOptimizer` and, after the first `scaler.scale`, torch's
`GradScaler` do). It now warns, `UnscaledGradientsWarning`, when its update
runs or is traced and no loss has been scaled since it was built
(`wrappers/scaled_check.py`). These tests give it the mistake (eager, under
`jit`, through `apply_gradients`, the Flax `TrainState`, NNX and Equinox) and
every documented way of computing scaled gradients, which must stay quiet:
`value_and_grad`, `get_scaled_loss` under `jax.grad`, the Flax, NNX and
Equinox helpers, `retry_on_overflow`, `pmean` under `shard_map`, sums over
micro-batches, `lax.scan`, `MultiSteps`, a `jit` boundary between the
gradients and the update, and a loss scaled by hand and marked.
"""

from __future__ import annotations

import contextlib
import pathlib
import re
import warnings

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P
import numpy as np
import optax
import pytest

import optax_lossscale as ols
from optax_lossscale._src.wrappers import scaled_check

X = jnp.linspace(-1.0, 1.0, 16)
Y = 3.0 * X
PARAMS = {"w": jnp.zeros(())}
ROOT = pathlib.Path(__file__).resolve().parents[1]


def loss_fn(params, x=X, y=Y):
  return jnp.mean((params["w"] * x - y) ** 2)


@pytest.fixture(autouse=True)
def _fresh_sites():
  # Each test builds its wrappers on lines of its own; this also forgets the
  # eager warnings given so far, so that a test may count them.
  scaled_check.reset_sites()


@contextlib.contextmanager
def quiet():
  """Fails the test on an UnscaledGradientsWarning (other warnings pass)."""
  with warnings.catch_warnings():
    warnings.simplefilter("error", ols.UnscaledGradientsWarning)
    yield


@contextlib.contextmanager
def caught():
  """Records every UnscaledGradientsWarning given inside, in a list."""
  with warnings.catch_warnings(record=True) as records:
    warnings.simplefilter("always")
    found: list[warnings.WarningMessage] = []
    yield found
  found.extend(r for r in records if issubclass(r.category, ols.UnscaledGradientsWarning))


def loud():
  return pytest.warns(ols.UnscaledGradientsWarning, match=re.escape("ols.value_and_grad(loss_fn)"))


# -- The example: SGD on the gradients of the plain loss.


def _sgd_run(grad_kind, jit, steps=30):
  """Final loss of SGD (lr 0.5) on a least-squares fit, from w=0 (loss 3.4) to w=3 (loss 0)."""
  tx = ols.loss_scale_optimizer(optax.sgd(0.5))

  def step(params, state):
    if grad_kind == "plain":
      grads = jax.grad(loss_fn)(params)
    else:
      _, grads = ols.value_and_grad(loss_fn)(state, params)
    return ols.apply_gradients(tx, grads, state, params)

  step = jax.jit(step) if jit else step
  params, state = PARAMS, tx.init(PARAMS)
  for _ in range(steps):
    params, state = step(params, state)
  return float(loss_fn(params))


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_plain_gradients_into_sgd_warn_and_barely_move(jit):
  start = float(loss_fn(PARAMS))
  with loud():
    stuck = _sgd_run("plain", jit)
  with quiet():
    trained = _sgd_run("scaled", jit)
  # Divided by 2**15, thirty steps of SGD leave the loss where it started.
  assert stuck > 0.99 * start
  assert trained < 1e-9


def test_the_warning_names_the_fix_and_points_at_the_users_line():
  tx = ols.loss_scale_optimizer(optax.sgd(0.5))
  state = tx.init(PARAMS)
  with caught() as found:
    tx.update(jax.grad(loss_fn)(PARAMS), state, PARAMS)
  (w,) = found
  text = str(w.message)
  for fix in ("ols.value_and_grad(loss_fn)", "ols.get_scaled_loss", "ols.mark_scaled", "32768"):
    assert fix in text
  assert w.filename == __file__


def test_a_jitted_step_warns_once_per_trace_and_never_per_call():
  tx = ols.loss_scale_optimizer(optax.sgd(0.5))
  step = jax.jit(lambda p, s, x: tx.update(jax.grad(loss_fn)(p, x, 3.0 * x), s, p))
  state = tx.init(PARAMS)
  with caught() as found:
    for _ in range(3):
      step(PARAMS, state, X)
  assert len(found) == 1
  with caught() as found:
    step(PARAMS, state, X[:8])  # a new shape: traced again
    step(PARAMS, state, X[:8])
  assert len(found) == 1


def test_eager_updates_warn_once_per_wrapper():
  tx = ols.loss_scale_optimizer(optax.adam(0.1))
  params, state = PARAMS, tx.init(PARAMS)
  with caught() as found:
    for _ in range(3):
      updates, state = tx.update(jax.grad(loss_fn)(params), state, params)
      params = optax.apply_updates(params, updates)
  assert len(found) == 1


def test_the_check_adds_nothing_to_the_compiled_step():
  tx = ols.loss_scale_optimizer(optax.sgd(0.5))
  state = tx.init(PARAMS)
  mistaken = lambda p, s: ols.apply_gradients(tx, jax.grad(loss_fn)(p), s, p)
  marked = lambda p, s: ols.apply_gradients(tx, ols.mark_scaled(jax.grad(loss_fn)(p)), s, p)
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", ols.UnscaledGradientsWarning)
    a = jax.make_jaxpr(mistaken)(PARAMS, state)
  b = jax.make_jaxpr(marked)(PARAMS, state)
  assert str(a) == str(b)


def test_a_warnings_filter_silences_it():
  tx = ols.loss_scale_optimizer(optax.sgd(0.5))
  state = tx.init(PARAMS)
  with warnings.catch_warnings(record=True) as records:
    warnings.simplefilter("always")
    warnings.filterwarnings("ignore", category=ols.UnscaledGradientsWarning)
    tx.update(jax.grad(loss_fn)(PARAMS), state, PARAMS)
  assert not [r for r in records if issubclass(r.category, ols.UnscaledGradientsWarning)]


# -- Scales that cannot make the mistake matter.


@pytest.mark.parametrize("scale", [ols.NoOpLossScale(), ols.FixedLossScale(1.0)], ids=str)
@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_a_scale_of_one_is_quiet(scale, jit):
  tx = ols.loss_scale_optimizer(optax.sgd(0.5), scale)
  update = jax.jit(tx.update) if jit else tx.update
  with quiet():
    update(jax.grad(loss_fn)(PARAMS), tx.init(PARAMS), PARAMS)


def test_a_dynamic_scale_now_one_is_quiet_eagerly_and_warned_under_jit():
  # Eagerly the scale is known to be 1 (nothing is divided yet); traced, it may have grown.
  tx = ols.loss_scale_optimizer(optax.sgd(0.5), ols.DynamicLossScale(1.0))
  grads, state = jax.grad(loss_fn)(PARAMS), tx.init(PARAMS)
  with quiet():
    tx.update(grads, state, PARAMS)
  with loud():
    jax.jit(tx.update)(grads, state, PARAMS)


# -- Each documented way of computing scaled gradients stays quiet.


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("how", ["value_and_grad", "get_scaled_loss", "callable", "ls.scale"])
def test_the_scaled_losses_are_quiet(how, jit):
  tx = ols.loss_scale_optimizer(optax.sgd(0.5))

  def step(params, state):
    if how == "value_and_grad":
      _, grads = ols.value_and_grad(loss_fn)(state, params)
    elif how == "get_scaled_loss":  # TensorFlow/Keras style
      grads = jax.grad(lambda p: ols.get_scaled_loss(loss_fn(p), state))(params)
    elif how == "callable":  # get_scaled_loss(loss_fn, state): scaled when called
      grads = jax.grad(ols.get_scaled_loss(loss_fn, state))(params)
    else:
      grads = jax.grad(lambda p: ols.get_loss_scale(state).scale(loss_fn(p)))(params)
    return ols.apply_gradients(tx, grads, state, params)

  step = jax.jit(step) if jit else step
  params, state = PARAMS, tx.init(PARAMS)
  with quiet():
    for _ in range(3):
      params, state = step(params, state)
  assert float(loss_fn(params)) < float(loss_fn(PARAMS))


def test_a_jit_boundary_between_the_gradients_and_the_update_is_quiet():
  tx = ols.loss_scale_optimizer(optax.sgd(0.5))
  grad_fn = jax.jit(ols.value_and_grad(loss_fn))
  update = jax.jit(tx.update)
  params, state = PARAMS, tx.init(PARAMS)
  with quiet():
    for _ in range(2):
      _, grads = grad_fn(state, params)
      updates, state = update(grads, state, params)  # a program of its own
      params = optax.apply_updates(params, updates)
      _, grads = grad_fn(state, params)
      params, state = ols.apply_gradients(tx, grads, state, params)  # eager
  assert float(loss_fn(params)) < 0.2 * float(loss_fn(PARAMS))


def test_a_sweep_rebuilding_the_wrapper_around_a_compiled_gradient_function_is_quiet():
  # The compiled gradient function scales its loss in Python only when it is
  # first traced; the later wrappers, built on the same line, count from the first.
  grad_fn = jax.jit(ols.value_and_grad(loss_fn))
  with quiet():
    for learning_rate in (0.1, 0.2, 0.3):
      tx = ols.loss_scale_optimizer(optax.sgd(learning_rate))
      state = tx.init(PARAMS)
      _, grads = grad_fn(state, PARAMS)
      jax.jit(tx.update)(grads, state, PARAMS)


def test_inject_hyperparams_around_the_wrapper_is_quiet():
  # inject_hyperparams builds the wrapper again on every update.
  tx = optax.inject_hyperparams(lambda lr: ols.loss_scale_optimizer(optax.sgd(lr)))(lr=0.5)

  @jax.jit
  def step(params, state):
    _, grads = ols.value_and_grad(loss_fn)(state, params)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  params, state = PARAMS, tx.init(PARAMS)
  with quiet():
    for _ in range(2):
      params, state = step(params, state)


def test_pmean_under_shard_map_is_quiet():
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("d",))
  tx = ols.loss_scale_optimizer(optax.sgd(0.5), axis_name="d")

  def step(params, state, x):
    _, grads = ols.value_and_grad(loss_fn)(state, params, x, 3.0 * x)
    grads = jax.lax.pmean(grads, "d")
    return ols.apply_gradients(tx, grads, state, params)

  sharded = jax.jit(
    jax.shard_map(step, mesh=mesh, in_specs=(P(), P(), P("d")), out_specs=(P(), P()))
  )
  with quiet():
    params, _ = sharded(PARAMS, tx.init(PARAMS), X)
  assert float(loss_fn(params)) < float(loss_fn(PARAMS))


def test_sums_over_micro_batches_are_quiet_eager_and_in_a_scan():
  tx = ols.loss_scale_optimizer(optax.sgd(0.5))
  micro = X.reshape(4, 4)
  state = tx.init(PARAMS)
  with quiet():
    total = None
    for x in micro:  # eager, a tree_map sum
      _, grads = ols.value_and_grad(loss_fn)(state, PARAMS, x, 3.0 * x)
      total = grads if total is None else jax.tree.map(jnp.add, total, grads)
    eager, _ = tx.update(jax.tree.map(lambda g: g / 4, total), state, PARAMS)

  @jax.jit
  def scanned(params, state):
    def body(acc, x):
      _, grads = ols.value_and_grad(loss_fn)(state, params, x, 3.0 * x)
      return jax.tree.map(jnp.add, acc, grads), None

    zeros = jax.tree.map(jnp.zeros_like, params)
    total, _ = jax.lax.scan(body, zeros, micro)
    return tx.update(jax.tree.map(lambda g: g / 4, total), state, params)

  with quiet():
    in_scan, _ = scanned(PARAMS, state)
  np.testing.assert_allclose(eager["w"], in_scan["w"], rtol=1e-6)


def test_multisteps_inside_the_wrapper_is_quiet():
  inner = optax.MultiSteps(optax.sgd(0.5), every_k_schedule=2).gradient_transformation()
  tx = ols.loss_scale_optimizer(inner)

  @jax.jit
  def step(params, state):
    _, grads = ols.value_and_grad(loss_fn)(state, params)
    return ols.apply_gradients(tx, grads, state, params)

  params, state = PARAMS, tx.init(PARAMS)
  with quiet():
    for _ in range(4):
      params, state = step(params, state)
  assert float(loss_fn(params)) < float(loss_fn(PARAMS))


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_retry_on_overflow_is_quiet(jit):
  tx = ols.loss_scale_optimizer(optax.sgd(0.1), ols.DynamicLossScale(2.0**20))
  f16_loss = lambda p: jnp.sum(p["w"].astype(jnp.float16) ** 2)  # overflows at 2**20
  retrying = ols.retry_on_overflow(ols.value_and_grad(f16_loss))

  def step(params, state):
    _, grads, state = retrying(state, params)
    return ols.apply_gradients(tx, grads, state, params)

  step = jax.jit(step) if jit else step
  params = {"w": jnp.array([1.0, 2.0])}
  with quiet():
    params, state = step(params, tx.init(params))
  assert int(ols.metrics(state)["retries"]) > 0
  np.testing.assert_allclose(params["w"], [0.8, 1.6], rtol=1e-6)


# -- A loss scaled by hand: quiet once marked.


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_a_loss_scaled_by_hand_warns_until_marked(jit):
  def step(tx, params, state, mark):
    scale = ols.get_loss_scale(state)()  # hand scaling with the scale's value
    if mark == "loss":
      grads = jax.grad(lambda p: ols.mark_scaled(loss_fn(p) * scale))(params)
    else:
      grads = jax.grad(lambda p: loss_fn(p) * scale)(params)
      grads = ols.mark_scaled(grads) if mark == "grads" else grads
    return ols.apply_gradients(tx, grads, state, params)

  runs = {}
  for mark in (None, "loss", "grads"):
    scaled_check.reset_sites()
    tx = ols.loss_scale_optimizer(optax.sgd(0.5))
    run = jax.jit(step, static_argnums=(0, 3)) if jit else step
    with caught() as found:
      runs[mark], _ = run(tx, PARAMS, tx.init(PARAMS), mark)
    assert len(found) == (1 if mark is None else 0), mark
  # Marking changes nothing but the warning: the same step, scaled by hand.
  np.testing.assert_array_equal(runs[None]["w"], runs["loss"]["w"])
  np.testing.assert_array_equal(runs[None]["w"], runs["grads"]["w"])


def test_mark_scaled_returns_its_argument_unchanged():
  tree = {"w": jnp.ones(2), "n": None}
  assert ols.mark_scaled(tree) is tree


# -- The integrations.


def test_flax_train_state():
  pytest.importorskip("flax")
  from optax_lossscale.flax import TrainState

  def train(grad_kind):
    tx = ols.loss_scale_optimizer(optax.sgd(0.5))
    state = TrainState.create(apply_fn=None, params=PARAMS, tx=tx)

    @jax.jit
    def step(s):
      if grad_kind == "plain":
        grads = jax.grad(loss_fn)(s.params)
      else:
        _, grads = ols.value_and_grad(loss_fn)(s, s.params)
      return s.apply_gradients(grads=grads)

    return step(step(state))

  with loud():
    train("plain")
  with quiet():
    state = train("scaled")
  assert int(state.step) == 2


def test_flax_nnx():
  pytest.importorskip("flax")
  from flax import nnx

  from optax_lossscale.flax import nnx_retry_on_overflow, nnx_value_and_grad

  nnx_loss = lambda model, x: jnp.mean((model(x) - 3.0 * x) ** 2)

  def train(grad_kind):
    model = nnx.Linear(1, 1, rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, ols.loss_scale_optimizer(optax.sgd(0.1)), wrt=nnx.Param)

    @nnx.jit
    def step(model, optimizer, x):
      if grad_kind == "plain":
        _, grads = nnx.value_and_grad(nnx_loss)(model, x)
      elif grad_kind == "retry":
        _, grads = nnx_retry_on_overflow(nnx_loss)(optimizer, model, x)
      else:
        _, grads = nnx_value_and_grad(nnx_loss)(optimizer, model, x)
      optimizer.update(model, grads)

    step(model, optimizer, X[:, None])
    return optimizer

  with loud():
    train("plain")
  with quiet():
    train("scaled")
    train("retry")


def test_equinox():
  eqx = pytest.importorskip("equinox")
  from optax_lossscale.equinox import filter_value_and_grad

  eqx_loss = lambda model, x: jnp.mean((jax.vmap(model)(x) - 3.0 * x) ** 2)

  def train(grad_kind):
    model = eqx.nn.Linear(1, 1, key=jax.random.PRNGKey(0))
    tx = ols.loss_scale_optimizer(optax.sgd(0.1))
    params = eqx.filter(model, eqx.is_inexact_array)
    opt_state = tx.init(params)

    @eqx.filter_jit
    def step(model, opt_state, x):
      if grad_kind == "plain":
        _, grads = eqx.filter_value_and_grad(eqx_loss)(model, x)
      else:
        _, grads = filter_value_and_grad(eqx_loss)(opt_state, model, x)
      params = eqx.filter(model, eqx.is_inexact_array)
      updates, opt_state = tx.update(grads, opt_state, params)
      return eqx.apply_updates(model, updates), opt_state

    return step(model, opt_state, X[:, None])

  with loud():
    train("plain")
  with quiet():
    train("scaled")


# -- Where users read first.


def test_the_readme_states_the_trap_next_to_its_first_example():
  readme = (ROOT / "README.md").read_text()
  first_example = readme.index("## Ten lines of optax")
  after = readme[first_example : readme.index("\n## ", first_example + 1)]
  assert "jax.value_and_grad" in after and "UnscaledGradientsWarning" in after
  assert "ols.mark_scaled" in after


def test_the_optax_guide_states_the_trap():
  guide = (ROOT / "docs" / "guides" / "optax.md").read_text()
  assert "UnscaledGradientsWarning" in guide and "ols.mark_scaled" in guide
  assert "GradScaler" in guide and "Keras" in guide
