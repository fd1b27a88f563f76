"""longspec-jax: lossless speculative decoding for long contexts in JAX."""

__version__ = "0.1.0"
