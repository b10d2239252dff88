"""Implementation modules; the public API is `optax_lossscale`."""
