"""optax_lossscale: mixed-precision loss scaling for JAX, the optax way."""

from optax_lossscale._src.autocast.api import autocast
from optax_lossscale._src.autocast.interpreter import UnknownPrimitiveError
from optax_lossscale._src.autocast.report import autocast_report
from optax_lossscale._src.diagnostics.gradient_report import (
  GradientReport,
  LeafStats,
  format_gradient_report,
  gradient_report,
)
from optax_lossscale._src.diagnostics.overflow_guard import OverflowGuardError
from optax_lossscale._src.diagnostics.scale_advisor import ScaleAdvice, suggest_loss_scale
from optax_lossscale._src.loss_scales.dynamic_loss_scale import DynamicLossScale
from optax_lossscale._src.loss_scales.loss_scale import FixedLossScale, LossScale, NoOpLossScale
from optax_lossscale._src.loss_scales.scaling_record import UnscaledGradientsWarning, mark_scaled
from optax_lossscale._src.loss_scales.serialization import deserialize, get, serialize
from optax_lossscale._src.loss_scales.skipping_fixed_loss_scale import SkippingFixedLossScale
from optax_lossscale._src.step.apply_gradients import apply_gradients
from optax_lossscale._src.storage.master_weights import MasterWeightsState, master_weights
from optax_lossscale._src.storage.quantize import QuantizedArray
from optax_lossscale._src.storage.rounding import stochastic_round
from optax_lossscale._src.storage.state_dtypes import state_dtypes
from optax_lossscale._src.storage.stochastic_rounding import (
  StochasticRoundingState,
  stochastic_rounding,
)
from optax_lossscale._src.utils.policy import (
  Policy,
  cast_to_full,
  cast_to_half,
  dtype_to_names,
  get_policy,
  half_dtype,
)
from optax_lossscale._src.utils.tree_utils import all_finite, select_tree
from optax_lossscale._src.wrappers.grad import value_and_grad
from optax_lossscale._src.wrappers.optimizer import (
  LossScaleOptimizer,
  LossScaleOptimizerState,
  loss_scale_optimizer,
)
from optax_lossscale._src.wrappers.retry import retry_on_overflow
from optax_lossscale._src.wrappers.skip_bad_steps import (
  SkipBadSteps,
  SkipBadStepsState,
  skip_bad_steps,
)
from optax_lossscale._src.wrappers.state_access import (
  check_composition,
  get_loss_scale,
  get_scaled_loss,
  get_unscaled_gradients,
  inner_state,
  metrics,
)
from optax_lossscale._src.wrappers.state_conversion import convert_state

__version__ = "0.1.0"

__all__ = (
  "DynamicLossScale",
  "FixedLossScale",
  "GradientReport",
  "LeafStats",
  "LossScale",
  "LossScaleOptimizer",
  "LossScaleOptimizerState",
  "MasterWeightsState",
  "NoOpLossScale",
  "OverflowGuardError",
  "Policy",
  "QuantizedArray",
  "ScaleAdvice",
  "SkipBadSteps",
  "SkipBadStepsState",
  "SkippingFixedLossScale",
  "StochasticRoundingState",
  "UnknownPrimitiveError",
  "UnscaledGradientsWarning",
  "all_finite",
  "apply_gradients",
  "autocast",
  "autocast_report",
  "cast_to_full",
  "cast_to_half",
  "check_composition",
  "convert_state",
  "deserialize",
  "dtype_to_names",
  "format_gradient_report",
  "get",
  "get_loss_scale",
  "get_policy",
  "get_scaled_loss",
  "get_unscaled_gradients",
  "gradient_report",
  "half_dtype",
  "inner_state",
  "loss_scale_optimizer",
  "mark_scaled",
  "master_weights",
  "metrics",
  "retry_on_overflow",
  "select_tree",
  "serialize",
  "skip_bad_steps",
  "state_dtypes",
  "stochastic_round",
  "stochastic_rounding",
  "suggest_loss_scale",
  "value_and_grad",
)
