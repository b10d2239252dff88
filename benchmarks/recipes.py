"""The loss-scaling recipes compared by the benchmark, each as `(init, step)`.

Every recipe trains the same `loss_fn(params, batch)` (or, in the
optimizer-only workload, takes the gradients from the batch) with the same inner
optimizer and returns `step(params, state, batch) -> (params, state)`, to be
jitted with `params` and `state` donated. Each is written the way its library
documents it, so the comparison measures the recipe, not our rewrite of it:

* `bare`: plain optax, no loss scaling; the baseline of every ratio.
* `bare_plus_one_read`: plain optax that also sums the gradients, one more
  read of them and nothing else: the yardstick of the target "within one
  extra read of the gradients of bare Adam".
* `bare_plus_finiteness_read`: plain optax that also computes
  `optax_lossscale.all_finite` of the gradients and keeps it, skipping
  nothing: the floor of any recipe that checks the gradients (run on the GPU
  only, `GPU_VARIANTS`).
* `ols_*`: `optax_lossscale.loss_scale_optimizer` with a given `skip_mode`,
  stepped as optax documents (`update`, then `optax.apply_updates`) or with
  `optax_lossscale.apply_gradients`, which applies inside the skip branch.
* `ols_retry`: `ols.apply_gradients` fed by `ols.retry_on_overflow`, which
  retries an overflow on the same batch inside the step (full train steps
  only: it recomputes the backward pass); on finite steps its cost over
  `ols apply_gradients` is the loop's finiteness check.
* `jmp_recipe`: jmp's README recipe: scale the loss, unscale the gradients,
  `jmp.all_finite`, `adjust`, then `jmp.select_tree` over params and state,
  with the loss scale carried through `jit` as its two arrays and
  `jmp.DynamicLossScale` rebuilt inside the step: the generous variant, which
  spares jmp the Python its object costs per call.
* `jmp_object_recipe`: the same step carrying the `jmp.DynamicLossScale`
  object itself through `jit`, as jmp's README does; jmp 0.0.4 runs
  `jax.eval_shape` twice in its `__post_init__` at every unflatten, i.e. at
  every call, for the output loss scale.
* `flax`: `flax.training.dynamic_scale.DynamicScale.value_and_grad`, then
  `jnp.where(is_fin, new, old)` over params and optimizer state, as in Flax's
  examples; the `DynamicScale` (a `flax.struct` dataclass, flattened by JAX's
  C++ `register_dataclass`) is carried through `jit` in the state, as Flax's
  examples carry it in their `TrainState`.
* `apply_if_finite`: `optax.apply_if_finite` around the inner optimizer, fed
  gradients of the loss scaled by a fixed 2**15 (kept in the state) and
  divided back; it skips non-finite steps but cannot adjust a scale.
"""

from __future__ import annotations

from collections.abc import Callable
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from benchmarks import workloads
import optax_lossscale as ols

LossFn = Callable[[Any, Any], jax.Array] | None


def _grads(loss_fn: LossFn | None, params: Any, batch: Any) -> Any:
  """Gradients of the unscaled loss (given in the optimizer-only workload)."""
  if loss_fn is workloads.GIVEN_GRADIENTS:
    return batch["grads"]
  return jax.grad(loss_fn)(params, batch)


def _scaled_grads(
  loss_fn: LossFn | None, params: Any, batch: Any, scale_loss: Callable[[jax.Array], jax.Array]
) -> Any:
  """Gradients of the scaled loss (given in the optimizer-only workload)."""
  if loss_fn is workloads.GIVEN_GRADIENTS:
    return ols.mark_scaled(batch["scaled"])  # scaled when the workload was made
  return jax.grad(lambda p: scale_loss(loss_fn(p, batch)))(params)


class NotApplicable(Exception):
  """The recipe does not apply to the workload (the runner skips it)."""


class Recipe(NamedTuple):
  """`init(params) -> state` and `step(params, state, batch) -> (params, state)`.

  `lowers_flat`: the state holds a Python object that `jit(...).lower` cannot
  rebuild from its placeholder leaves (jmp's `DynamicLossScale`); the runner
  then inspects the step lowered over the state's leaves (the same
  computation) and times the jitted step called the way users call it.
  """

  init: Callable[[Any], Any]
  step: Callable[[Any, Any, Any], tuple[Any, Any]]
  lowers_flat: bool = False


def bare(tx: optax.GradientTransformation, loss_fn: LossFn) -> Recipe:
  def step(params, state, batch):
    grads = _grads(loss_fn, params, batch)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  return Recipe(tx.init, step)


def bare_plus_one_read(tx: optax.GradientTransformation, loss_fn: LossFn) -> Recipe:
  def init(params):
    return tx.init(params), jnp.zeros((), jnp.float32)

  def step(params, state, batch):
    grads = _grads(loss_fn, params, batch)
    # Kept in the state, so XLA cannot drop the read.
    total = sum(jnp.sum(g, dtype=jnp.float32) for g in jax.tree.leaves(grads))
    updates, opt_state = tx.update(grads, state[0], params)
    return optax.apply_updates(params, updates), (opt_state, total)

  return Recipe(init, step)


def bare_plus_finiteness_read(tx: optax.GradientTransformation, loss_fn: LossFn) -> Recipe:
  def init(params):
    return tx.init(params), jnp.ones((), jnp.bool_)

  def step(params, state, batch):
    grads = _grads(loss_fn, params, batch)
    # Kept in the state, so XLA cannot drop the check; nothing is skipped.
    finite = ols.all_finite(grads)
    updates, opt_state = tx.update(grads, state[0], params)
    return optax.apply_updates(params, updates), (opt_state, finite)

  return Recipe(init, step)


def optax_lossscale(
  tx: optax.GradientTransformation,
  loss_fn: LossFn,
  skip_mode: str,
  fused: bool = False,
  **options: Any,
) -> Recipe:
  opt = ols.loss_scale_optimizer(tx, skip_mode=skip_mode, **options)

  def step(params, state, batch):
    grads = _scaled_grads(loss_fn, params, batch, lambda loss: ols.get_scaled_loss(loss, state))
    if fused:
      return ols.apply_gradients(opt, grads, state, params)
    updates, state = opt.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  return Recipe(opt.init, step)


def ols_retry(tx: optax.GradientTransformation, loss_fn: LossFn) -> Recipe:
  if loss_fn is workloads.GIVEN_GRADIENTS:
    raise NotApplicable("retry_on_overflow recomputes the backward pass: needs a loss function")
  opt = ols.loss_scale_optimizer(tx, skip_mode="auto")
  retrying = ols.retry_on_overflow(ols.value_and_grad(loss_fn), max_retries=8)

  def step(params, state, batch):
    _, grads, state = retrying(state, params, batch)
    return ols.apply_gradients(opt, grads, state, params)

  return Recipe(opt.init, step)


def jmp_recipe(tx: optax.GradientTransformation, loss_fn: LossFn) -> Recipe:
  import jmp  # an optional dependency of the benchmark only

  # jmp 0.0.4's DynamicLossScale validates its leaves in __post_init__, which
  # fails when `jit(...).lower` rebuilds it with placeholder leaves; so the
  # state carries its two arrays and the step rebuilds jmp's object from them.
  def init(params):
    return tx.init(params), (jnp.asarray(2.0**15, jnp.float32), jnp.zeros((), jnp.int32))

  def step(params, state, batch):
    opt_state, (scale, counter) = state
    loss_scale = jmp.DynamicLossScale(scale, counter)
    params, opt_state, loss_scale = _jmp_step(tx, loss_fn, params, opt_state, loss_scale, batch)
    return params, (opt_state, (loss_scale.loss_scale, loss_scale.counter))

  return Recipe(init, step)


def _jmp_step(
  tx: optax.GradientTransformation,
  loss_fn: LossFn,
  params: Any,
  opt_state: Any,
  loss_scale: Any,
  batch: Any,
) -> tuple[Any, Any, Any]:
  """jmp's README recipe: scale, unscale, check, adjust, select."""
  import jmp

  grads = _scaled_grads(loss_fn, params, batch, loss_scale.scale)
  grads = loss_scale.unscale(grads)
  grads_finite = jmp.all_finite(grads)
  loss_scale = loss_scale.adjust(grads_finite)
  updates, new_opt_state = tx.update(grads, opt_state, params)
  new_params = optax.apply_updates(params, updates)
  params, opt_state = jmp.select_tree(
    grads_finite, (new_params, new_opt_state), (params, opt_state)
  )
  return params, opt_state, loss_scale


def jmp_object_recipe(tx: optax.GradientTransformation, loss_fn: LossFn) -> Recipe:
  import jmp

  def init(params):
    return tx.init(params), jmp.DynamicLossScale(jnp.asarray(2.0**15, jnp.float32))

  def step(params, state, batch):
    opt_state, loss_scale = state
    params, opt_state, loss_scale = _jmp_step(tx, loss_fn, params, opt_state, loss_scale, batch)
    return params, (opt_state, loss_scale)

  return Recipe(init, step, lowers_flat=True)


def flax_recipe(tx: optax.GradientTransformation, loss_fn: LossFn) -> Recipe:
  from flax.training.dynamic_scale import DynamicScale

  def init(params):
    return tx.init(params), DynamicScale()

  def step(params, state, batch):
    opt_state, dynamic_scale = state
    if loss_fn is workloads.GIVEN_GRADIENTS:
      value_and_grad = dynamic_scale.value_and_grad(workloads.linear_loss)
      dynamic_scale, is_fin, _, grads = value_and_grad(params, batch["grads"])
    else:
      value_and_grad = dynamic_scale.value_and_grad(loss_fn)
      dynamic_scale, is_fin, _, grads = value_and_grad(params, batch)
    updates, new_opt_state = tx.update(grads, opt_state, params)
    new_params = optax.apply_updates(params, updates)
    keep = functools.partial(jnp.where, is_fin)
    params = jax.tree.map(keep, new_params, params)
    opt_state = jax.tree.map(keep, new_opt_state, opt_state)
    return params, (opt_state, dynamic_scale)

  return Recipe(init, step)


def apply_if_finite(tx: optax.GradientTransformation, loss_fn: LossFn) -> Recipe:
  # A huge limit: the benchmark's skipped steps must stay skipped.
  opt = optax.apply_if_finite(tx, max_consecutive_errors=2**30)

  # The fixed scale lives in the state, as a loss scale would: a Python
  # constant would let XLA cancel `(x * s) / s` in the optimizer-only workload.
  def init(params):
    return opt.init(params), jnp.asarray(2.0**15, jnp.float32)

  def step(params, state, batch):
    opt_state, scale = state
    grads = _scaled_grads(loss_fn, params, batch, lambda loss: loss * scale)
    grads = jax.tree.map(lambda g: g / scale, grads)
    updates, opt_state = opt.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), (opt_state, scale)

  return Recipe(init, step)


VARIANTS: dict[str, Callable[[optax.GradientTransformation, LossFn], Recipe]] = {
  "bare optax": bare,
  "bare + one read of grads": bare_plus_one_read,
  "ols cond": functools.partial(optax_lossscale, skip_mode="cond"),
  "ols select": functools.partial(optax_lossscale, skip_mode="select"),
  "ols auto": functools.partial(optax_lossscale, skip_mode="auto"),
  "ols apply_gradients": functools.partial(optax_lossscale, skip_mode="auto", fused=True),
  "ols apply_gradients (select)": functools.partial(
    optax_lossscale, skip_mode="select", fused=True
  ),
  "ols apply_gradients + retry": ols_retry,
  "jmp (arrays carried through jit)": jmp_recipe,
  "jmp (object carried through jit)": jmp_object_recipe,
  "flax DynamicScale": flax_recipe,
  "optax.apply_if_finite": apply_if_finite,
  # The diagnostics' costs (issue: guard against a scale that cannot recover).
  # The guard is armed but never fires: a streak this long never happens here.
  "ols cond + guard": functools.partial(
    optax_lossscale, skip_mode="cond", max_consecutive_skips=10**9
  ),
  "ols cond + record leaves": functools.partial(
    optax_lossscale, skip_mode="cond", record_nonfinite_leaves=True
  ),
}
# Run on the GPU only (`run.py --gpu-size`), where a step is device-bound.
GPU_VARIANTS: dict[str, Callable[[optax.GradientTransformation, LossFn], Recipe]] = {
  "bare + one finiteness read": bare_plus_finiteness_read,
}
BASELINE = "bare optax"
ONE_READ = "bare + one read of grads"
# Recipes whose library is an optional dependency of the benchmark.
OPTIONAL = {
  "jmp (arrays carried through jit)": "jmp",
  "jmp (object carried through jit)": "jmp",
  "flax DynamicScale": "flax",
}
