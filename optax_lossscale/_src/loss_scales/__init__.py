"""The loss scales: immutable pytrees with a pure `update`, and their configs.

`LossScale` (the base), `NoOpLossScale`, `FixedLossScale`, `SkippingFixedLossScale`
and `DynamicLossScale`; Keras-style identifiers (`get`, `serialize`,
`deserialize`) and the reading of Keras's `LossScaleOptimizer` arguments. A new
loss scale is a subclass of `LossScale` in a module here. Imports only `utils`.
"""
