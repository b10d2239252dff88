"""The two wrappers and what reads their states.

`loss_scale_optimizer` decides by a loss scale's overflow check and
`skip_bad_steps` by a NaN check and a spike statistic; both hand the decision
to `step`. Beside them: `retry_on_overflow`, `value_and_grad`, reading a
wrapper's state from any optax state (`state_access`) and switching guards
mid-run (`state_conversion`). Imports `utils`, `loss_scales`, `diagnostics`
and `step`.
"""
