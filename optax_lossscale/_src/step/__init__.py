"""The optax step both wrappers share, once they know whether to apply it.

`conditional_step` runs the inner transformation (and, fused, the parameter
write) under `lax.cond` or a select; `skip_branch` types a skipped step's
outputs; `overwrite` writes fp8 metadata leaves; `composition` refuses the
optimizer compositions that cannot work; `apply_gradients` is the public fused
step. Imports `utils`.
"""
