"""Parameters and optimizer state held in fewer bits, and the updates that let them learn.

`master_weights` (a float32 copy, or its 16-bit remainder, beside 16-bit
params), `stochastic_rounding` (16-bit params alone, rounded without bias by
`rounding`), `state_dtypes` (an inner optimizer's state in 16 or 8 bits,
`quantize`), and the parameter write they share (`param_write`). Imports
`utils` and `step` (the fused parameter write).
"""
