"""Turning logits into the next token.

`SamplingConfig` is static under jit (a new temperature compiles a new step); at
temperature 0 the choice is the argmax, so greedy decoding is exactly reproducible.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from longspec_jax.errors import UserError


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
  temperature: float = 0.0

  def __post_init__(self):
    if not self.temperature >= 0.0:
      raise UserError(f"--temperature must be >= 0, got {self.temperature}.")

  @property
  def greedy(self) -> bool:
    return self.temperature == 0.0


def sample(logits: jax.Array, key: jax.Array, config: SamplingConfig) -> jax.Array:
  """logits [B, V] float32 -> token ids [B] int32."""
  if config.greedy:
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)
  return jax.random.categorical(key, logits / config.temperature, axis=-1).astype(jnp.int32)
