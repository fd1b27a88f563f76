"""Random inputs for the attention kernel tests (fresh normal values, never zeros)."""

import jax.numpy as jnp
import numpy as np

TOLERANCE = {jnp.float32: 2e-5, jnp.bfloat16: 2e-2}


def random_attention_inputs(rng, batch, steps, seq_len, kv_heads, group, head_dim, dtype):
  """q [B, T, K, G, D] and k, v [B, S, K, D] in `dtype`, as jnp arrays."""
  q = rng.standard_normal((batch, steps, kv_heads, group, head_dim))
  k, v = (rng.standard_normal((batch, seq_len, kv_heads, head_dim)) for _ in "kv")
  return tuple(jnp.asarray(x, dtype) for x in (q, k, v))


def random_tree_masks(rng, batch, steps):
  """Ancestor masks [B, T, T] of random trees (node i's parent is a random earlier node)."""
  masks = np.zeros((batch, steps, steps), bool)
  for b in range(batch):
    for i in range(steps):
      masks[b, i, i] = True
      if i:
        masks[b, i] |= masks[b, rng.integers(0, i)]
  return jnp.asarray(masks)
