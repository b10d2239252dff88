"""Foundations every other subpackage may use: pytree helpers, argument checks, version shims.

Imports nothing from the rest of `optax_lossscale._src`.
"""
