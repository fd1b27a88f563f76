"""Counting XLA's compilations inside a block."""

import jax
import jax.numpy as jnp

from longspec_jax.decoding.compiles import Compiles


def test_compiles_counts_only_what_compiles_inside_its_block(compiling):
  add = jax.jit(lambda x: x + 1)
  three, five = jnp.ones(3), jnp.ones(5)
  add(three)  # compiled before
  with Compiles() as compiled:
    add(three)
  assert compiled.count == 0 and compiled.seconds == 0
  with Compiles() as compiled:
    add(five)  # a new shape
    jax.jit(lambda x: x * 2)(three)
  assert compiled.count == 2 and compiled.seconds > 0
  jax.jit(lambda x: x - 1)(three)  # after the block: not counted
  assert compiled.count == 2
