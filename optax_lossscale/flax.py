"""Flax integration: `TrainState`, NNX helpers and checkpoints (needs `flax`).

Importing this module also registers every loss scale with
`flax.serialization`, so `flax.serialization.to_bytes(state)` and
`from_bytes(target, data)` save and restore loss-scaled states with readable
keys. The core package `optax_lossscale` never imports Flax.
"""

from optax_lossscale._src.integrations.flax_checkpoint import (
  check_loss_scale_kind,
  register_loss_scale_serialization,
  restore_checkpoint,
  save_checkpoint,
)
from optax_lossscale._src.integrations.flax_nnx import (
  nnx_convert_optimizer,
  nnx_retry_on_overflow,
  nnx_value_and_grad,
)
from optax_lossscale._src.integrations.flax_train_state import TrainState, convert_train_state

__all__ = (
  "TrainState",
  "check_loss_scale_kind",
  "convert_train_state",
  "nnx_convert_optimizer",
  "nnx_retry_on_overflow",
  "nnx_value_and_grad",
  "register_loss_scale_serialization",
  "restore_checkpoint",
  "save_checkpoint",
)
