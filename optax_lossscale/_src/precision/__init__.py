"""Mixed precision beyond loss scaling: policies, autocast and 16-bit parameters.

A precision policy (`Policy`, `get_policy`, jmp's names), `autocast`, which
rewrites any JAX function's jaxpr op by op, and the transformations that let
16-bit parameters learn (`master_weights`, `stochastic_rounding`, state
dtypes). Imports `utils` and `step` (the fused parameter write).
"""
