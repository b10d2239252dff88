"""Guards and diagnostics: which leaves overflowed, reports, a scale advisor.

Read-only looks at gradients and states (`gradient_report`,
`suggest_loss_scale`) and the guards that stop a run that skipping cannot
save (`OverflowGuardError`). A new guard goes here and is called by a wrapper
after it has decided. Imports `utils` and `loss_scales`.
"""
