"""Framework integrations: Flax (`TrainState`, NNX, checkpoints) and Equinox.

The only modules that import `flax` or `equinox`; the public modules
`optax_lossscale.flax` and `optax_lossscale.equinox` re-export them. They may
import every other subpackage; nothing imports them.
"""
