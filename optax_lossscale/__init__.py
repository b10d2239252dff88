"""optax_lossscale: mixed-precision loss scaling for JAX, the optax way."""

from optax_lossscale._src.grad import value_and_grad
from optax_lossscale._src.loss_scale import (
  DynamicLossScale,
  FixedLossScale,
  LossScale,
  NoOpLossScale,
  deserialize,
  get,
  serialize,
)
from optax_lossscale._src.optimizer import (
  LossScaleOptimizer,
  LossScaleOptimizerState,
  loss_scale_optimizer,
)
from optax_lossscale._src.state_access import (
  get_loss_scale,
  get_scaled_loss,
  get_unscaled_gradients,
  metrics,
)
from optax_lossscale._src.tree_utils import all_finite, select_tree

__version__ = "0.1.0"

__all__ = (
  "DynamicLossScale",
  "FixedLossScale",
  "LossScale",
  "LossScaleOptimizer",
  "LossScaleOptimizerState",
  "NoOpLossScale",
  "all_finite",
  "deserialize",
  "get",
  "get_loss_scale",
  "get_scaled_loss",
  "get_unscaled_gradients",
  "loss_scale_optimizer",
  "metrics",
  "select_tree",
  "serialize",
  "value_and_grad",
)
