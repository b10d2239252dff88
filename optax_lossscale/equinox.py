"""Equinox integration: differentiate modules with loss scaling (needs `equinox`).

The optimizer side needs nothing from here: give `loss_scale_optimizer` (or
`skip_bad_steps`) the module's floating-point arrays as params,
`eqx.filter(model, eqx.is_inexact_array)`, and apply its updates with
`eqx.apply_updates(model, updates)`. The core package `optax_lossscale` never
imports Equinox.
"""

from optax_lossscale._src.integrations.equinox_grad import filter_value_and_grad

__all__ = ("filter_value_and_grad",)
