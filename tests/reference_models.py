"""Plain-Python models of the loss-scale algorithms, written from their specs.

They use numpy float32 scalars, as TensorFlow's float32 variables do, and share
no code with the library, so tests compare two independent implementations.
`jmp_recipe_step` is jmp's own recipe, run with jmp.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import optax


def tensorflow_trajectory(
  finite_flags: list[bool],
  initial_loss_scale: float = 2**15,
  increment_period: int = 2000,
  multiplier: float = 2.0,
) -> list[tuple[np.float32, int]]:
  """TensorFlow's DynamicLossScale.update, step by step: (scale, counter)."""
  scale = np.float32(initial_loss_scale)
  counter = 0
  out = []
  with np.errstate(over="ignore"):
    for finite in finite_flags:
      if finite:
        if counter + 1 >= increment_period:
          grown = scale * np.float32(multiplier)
          if np.isfinite(grown):
            scale = grown
          counter = 0
        else:
          counter += 1
      else:
        scale = np.maximum(scale / np.float32(multiplier), np.float32(1.0))
        counter = 0
      out.append((np.float32(scale), counter))
  return out


@dataclasses.dataclass
class GeneralModel:
  """The documented algorithm with every knob (Megatron/DeepSpeed hysteresis)."""

  initial_loss_scale: float = 2**15
  increment_period: int = 2000
  multiplier: float = 2.0
  min_loss_scale: float = 1.0
  max_loss_scale: float = float(np.finfo(np.float32).max)
  backoff_factor: float | None = None
  hysteresis: int = 1
  consecutive_hysteresis: bool = False

  def run(self, finite_flags: list[bool]) -> list[tuple[np.float32, int, int]]:
    """Returns (scale, counter, max(tracker, 0)) after each step."""
    scale = np.float32(self.initial_loss_scale)
    counter, tracker = 0, self.hysteresis
    out = []
    with np.errstate(over="ignore"):
      for finite in finite_flags:
        if finite:
          if counter + 1 >= self.increment_period:
            grown = scale * np.float32(self.multiplier)
            if np.isfinite(grown) and grown <= np.float32(self.max_loss_scale):
              scale = grown
            counter = 0
            tracker = self.hysteresis
          else:
            counter += 1
            if self.consecutive_hysteresis:
              tracker = self.hysteresis
        else:
          counter = 0
          tracker -= 1  # Megatron-LM lets it go negative; our tracker stops at 0.
          if tracker <= 0:
            # The documented backoff: a multiplication by 1/multiplier.
            backoff = self.backoff_factor
            if backoff is None:
              backoff = 1.0 / self.multiplier
            lowered = scale * np.float32(backoff)
            scale = np.maximum(lowered, np.float32(self.min_loss_scale))
        out.append((np.float32(scale), counter, max(tracker, 0)))
    return out


def keras3_trajectory(
  finite_flags: list[bool], initial_scale: float = 2**15, dynamic_growth_steps: int = 2000
) -> list[np.float32]:
  """Keras 3's LossScaleOptimizer, step by step, from its documented rule.

  A finite step counts; the `dynamic_growth_steps`-th in a row doubles the
  scale and restarts the count. A non-finite step halves the scale (no floor)
  and restarts the count.
  """
  scale, counter, out = np.float32(initial_scale), 0, []
  for finite in finite_flags:
    if finite and counter == dynamic_growth_steps - 1:
      scale, counter = scale * np.float32(2.0), 0
    elif finite:
      counter += 1
    else:
      scale, counter = scale * np.float32(0.5), 0
    out.append(np.float32(scale))
  return out


def jmp_recipe_step(jmp, inner, loss_scale, scaled_grads, params, opt_state):
  """One step of jmp's loss-scaling recipe, as docs/migration/jmp.md writes it.

  Runs jmp itself (passed in: it is a test-only dependency) around the optax
  transformation `inner`: unscale, check, adjust the scale, step, and keep the
  old params and state where the gradients are not finite. Returns
  `(finite, loss_scale, params, opt_state)`.
  """
  grads = loss_scale.unscale(scaled_grads)
  finite = jmp.all_finite(grads)
  loss_scale = loss_scale.adjust(finite)
  updates, new_opt_state = inner.update(grads, opt_state, params)
  new_params = optax.apply_updates(params, updates)
  params, opt_state = jmp.select_tree(finite, (new_params, new_opt_state), (params, opt_state))
  return finite, loss_scale, params, opt_state
