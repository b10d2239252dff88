"""Keras's `LossScaleOptimizer` arguments and configs, read into ours.

Keras builds the wrapper from `loss_scale=` or from the keyword form
(`dynamic`, `initial_scale`, `dynamic_growth_steps`); `resolve_loss_scale`
turns either into a `LossScale`.

Keras 2 (`tf.keras.mixed_precision.LossScaleOptimizer`) and Keras 3
(`keras.optimizers.LossScaleOptimizer`) configs differ from ours and from
each other, and so do their rules: Keras 2 follows TensorFlow (the scale
never backs off below 1), Keras 3 halves the scale on every overflow with no
floor. `config_to_kwargs` accepts all three and keeps each one's rule. Keras 3's constructor also
takes the base optimizer's options (`weight_decay`, `clipnorm`, ...) and
refuses them unless they keep their defaults, because they belong to the
inner optimizer; here they belong to the inner optax transformation, and the
error names it.
"""

from __future__ import annotations

from collections.abc import Iterator
import contextlib
from typing import Any

import numpy as np

from optax_lossscale._src.loss_scales import dynamic_loss_scale, serialization
from optax_lossscale._src.loss_scales import loss_scale as loss_scale_lib
from optax_lossscale._src.utils import validation

# Keras 3's base-optimizer options: their defaults, and what does the job in optax.
_INNER_OPTIONS: dict[str, tuple[Any, str]] = {
  "weight_decay": (
    None,
    "optax.add_decayed_weights(weight_decay) inside the chain (or optax.adamw)",
  ),
  "clipnorm": (
    None,
    "a per-leaf clip inside the chain: optax.clip_by_block_rms(c) (it clips each"
    " leaf's RMS, its norm / sqrt(size))",
  ),
  "global_clipnorm": (None, "optax.clip_by_global_norm(c) inside the chain"),
  "clipvalue": (None, "optax.clip(c) inside the chain"),
  "use_ema": (False, "an exponential moving average of the params kept beside them"),
  "ema_momentum": (0.99, "an exponential moving average of the params kept beside them"),
  "ema_overwrite_frequency": (None, "an exponential moving average of the params"),
  "loss_scale_factor": (None, "loss_scale=factor (a FixedLossScale) on this wrapper"),
  "gradient_accumulation_steps": (
    None,
    "optax.MultiSteps(inner, k).gradient_transformation() as the wrapped transformation",
  ),
}


def check_keras_options(options: dict[str, Any]) -> None:
  """Refuses Keras 3 base-optimizer options (at non-default values) and unknown keywords."""
  for name, value in options.items():
    if name not in _INNER_OPTIONS:
      raise TypeError(f"loss_scale_optimizer() got an unexpected keyword argument {name!r}.")
    default, instead = _INNER_OPTIONS[name]
    if value != default:
      raise ValueError(
        f"loss_scale_optimizer does not take {name}={value!r}: like Keras 3's"
        " LossScaleOptimizer, it leaves that to the inner optimizer. In optax, use"
        f" {instead}, e.g. loss_scale_optimizer(optax.chain(..., optax.adam(1e-3)))."
      )


# Keras 3 halves without a floor; the scale is a float32, whose smallest normal
# number is where halving stops being exact (below it, Keras 3 goes on through
# the subnormals to 0, where every gradient is 0 or NaN).
KERAS3_MIN_LOSS_SCALE = float(np.finfo(np.float32).tiny)
_KERAS_NAMES = {
  "initial_loss_scale": "initial_scale",
  "loss_scale_value": "initial_scale",
  "increment_period": "dynamic_growth_steps",
}


@contextlib.contextmanager
def _keras_names() -> Iterator[None]:
  """Errors of the loss scales' constructors, with Keras's keyword names."""
  try:
    yield
  except ValueError as e:
    message = str(e)
    for internal, keyword in _KERAS_NAMES.items():
      if message.startswith(internal):
        raise ValueError(keyword + message[len(internal) :]) from None
    raise


def keras3_loss_scale(
  initial_scale: float = 2**15, dynamic_growth_steps: int = 2000
) -> dynamic_loss_scale.DynamicLossScale:
  """Keras 3's rule: double after `dynamic_growth_steps` finite steps, halve on overflow, no floor.

  A `DynamicLossScale` whose floor is float32's smallest normal number
  (`KERAS3_MIN_LOSS_SCALE`, 2**-126): Keras 3's trajectory until then.
  """
  with _keras_names():
    return dynamic_loss_scale.DynamicLossScale(
      initial_scale,
      increment_period=dynamic_growth_steps,
      min_loss_scale=KERAS3_MIN_LOSS_SCALE,
    )


def is_keras3_config(config: dict[str, Any]) -> bool:
  """Whether a wrapper config is Keras 3's: Keras 2 always writes `dynamic`, ours `loss_scale`."""
  return "initial_scale" in config and not {"loss_scale", "dynamic"} & set(config)


def config_to_kwargs(config: dict[str, Any]) -> dict[str, Any]:
  """`loss_scale_optimizer` keyword arguments from our, Keras 2's or Keras 3's config.

  Ours holds `loss_scale` (a serialized `LossScale`) and restates it in the
  keyword form; Keras 2's holds the keyword form (`dynamic`, `initial_scale`,
  `dynamic_growth_steps`) or, in old configs, `loss_scale`, and gives
  TensorFlow's rule; Keras 3's holds `initial_scale` and
  `dynamic_growth_steps` (always dynamic, no `dynamic` key), `name` and the
  base optimizer's options, and gives Keras 3's rule (`keras3_loss_scale`:
  halving with no floor). The serialized `inner_optimizer` of Keras's
  configs is dropped: the optax transformation is passed again.
  """
  if not isinstance(config, dict) or not {"loss_scale", "initial_scale"} & set(config):
    got = type(config).__name__ if not isinstance(config, dict) else f"keys {sorted(config)}"
    raise ValueError(
      "config must be a dict from LossScaleOptimizer.get_config() or from Keras's"
      " LossScaleOptimizer.get_config() (with 'loss_scale' or 'initial_scale');"
      f" got {got}."
    )
  # Keras's serialized inner optimizer ('optimizer' in pre-2.4 configs) and name.
  kwargs = {k: v for k, v in config.items() if k not in ("name", "inner_optimizer", "optimizer")}
  if is_keras3_config(config):
    given = {k: kwargs.pop(k) for k in ("initial_scale", "dynamic_growth_steps") if k in kwargs}
    kwargs["loss_scale"] = keras3_loss_scale(**{k: v for k, v in given.items() if v is not None})
  elif "loss_scale" in kwargs:
    # Ours (or Keras 2's legacy form): the keyword form only restates it.
    for key in ("dynamic", "initial_scale", "dynamic_growth_steps"):
      kwargs.pop(key, None)
  return kwargs


def resolve_loss_scale(
  loss_scale: Any,
  dynamic: bool | None,
  initial_scale: float | None,
  dynamic_growth_steps: int | None,
) -> loss_scale_lib.LossScale:
  """Turns either of Keras's argument forms into a `LossScale`."""
  keyword_form = (dynamic, initial_scale, dynamic_growth_steps) != (None, None, None)
  if not keyword_form:
    return serialization.get(loss_scale)
  if not (isinstance(loss_scale, str) and loss_scale == "dynamic"):
    # `loss_scale_optimizer(inner, **tx.get_config())` passes both forms; accept
    # them when they describe the same scale.
    resolved = serialization.get(loss_scale)
    if keywords_agree(resolved, dynamic, initial_scale, dynamic_growth_steps):
      return resolved
    raise ValueError(
      "Pass either loss_scale= or the keyword form (dynamic=, initial_scale=,"
      f" dynamic_growth_steps=), not both; got loss_scale={loss_scale!r} with"
      f" dynamic={dynamic!r}, initial_scale={initial_scale!r},"
      f" dynamic_growth_steps={dynamic_growth_steps!r}, which describe another scale."
      " To rebuild a wrapper from get_config(), use"
      " LossScaleOptimizer.from_config(config, inner)."
    )
  if dynamic is None:
    dynamic = True
  validation.check_bool("dynamic", dynamic)
  # Keras's keyword names in the errors, not the loss scales' own.
  with _keras_names():
    if dynamic:
      given = {"initial_loss_scale": initial_scale, "increment_period": dynamic_growth_steps}
      return dynamic_loss_scale.DynamicLossScale(
        **{k: v for k, v in given.items() if v is not None}
      )
    if initial_scale is None:
      raise ValueError('"initial_scale" must be specified if "dynamic" is False.')
    if dynamic_growth_steps is not None:
      raise ValueError(
        f'"dynamic_growth_steps" must be None if "dynamic" is False; got {dynamic_growth_steps!r}.'
      )
    return loss_scale_lib.FixedLossScale(initial_scale)


def keywords_agree(
  ls: loss_scale_lib.LossScale,
  dynamic: bool | None,
  initial_scale: float | None,
  dynamic_growth_steps: int | None,
) -> bool:
  """Whether Keras's keyword form, where given, describes the `LossScale` `ls`."""
  growth = ls.increment_period if isinstance(ls, dynamic_loss_scale.DynamicLossScale) else None
  return (
    (dynamic is None or dynamic == ls.dynamic)
    and (initial_scale is None or float(initial_scale) == float(ls()))
    and (dynamic_growth_steps is None or dynamic_growth_steps == growth)
  )
