"""Random inputs the kernel benchmarks and the kernel tests share."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def random_ancestor_mask(rng: np.random.Generator, batch: int, nodes: int) -> jax.Array:
  """[B, N, N] bool ancestor masks of random trees (each node's parent drawn uniformly
  among the earlier nodes): test and benchmark input for the tree attention kernels."""
  parents = [rng.integers(0, max(i, 1), size=batch) for i in range(nodes)]
  mask = np.zeros((batch, nodes, nodes), bool)
  for i in range(nodes):
    mask[:, i, i] = True
    if i:
      mask[np.arange(batch), i] |= mask[np.arange(batch), parents[i]]
  return jnp.asarray(mask)
