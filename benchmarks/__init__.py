"""Benchmarks of optax_lossscale against the other ways to loss-scale in JAX."""
