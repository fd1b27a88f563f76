"""Next-token cross-entropy through the LM head, a chunk of positions at a time.

The [T, V] logits of a long sequence never all exist: each chunk's logits are computed,
reduced to per-token losses and dropped, and the backward pass recomputes them per chunk
(`jax.checkpoint`), which is what the paper gets from a fused linear + cross-entropy
kernel.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp


def chunked_cross_entropy(
    hidden: jax.Array,
    logits_fn: Callable[[jax.Array], jax.Array],
    labels: jax.Array,
    weights: jax.Array,
    chunk: int,
) -> tuple[jax.Array, jax.Array]:
  """hidden [B, T, E]; logits_fn: [B, C, E] -> float32 logits [B, C, V]; labels, weights
  [B, T]. Returns (sum of weighted token losses, sum of weights)."""
  batch, length, width = hidden.shape
  chunks = -(-length // chunk)
  pad = chunks * chunk - length
  hidden = jnp.pad(hidden, ((0, 0), (0, pad), (0, 0)))
  labels = jnp.pad(labels, ((0, 0), (0, pad)))
  weights = jnp.pad(weights.astype(jnp.float32), ((0, 0), (0, pad)))  # padding weighs 0
  split = lambda x: jnp.moveaxis(x.reshape(batch, chunks, chunk, *x.shape[2:]), 1, 0)  # noqa: E731

  @jax.checkpoint
  def chunk_loss(h, y, w):  # [B, C, E], [B, C], [B, C]
    logits = logits_fn(h)  # [B, C, V]
    picked = jnp.take_along_axis(logits, y[..., None], axis=-1)[..., 0]
    return jnp.sum((jax.nn.logsumexp(logits, axis=-1) - picked) * w)

  def body(total, xs):
    return total + chunk_loss(*xs), None

  total, _ = jax.lax.scan(body, jnp.float32(0), (split(hidden), split(labels), split(weights)))
  return total, jnp.sum(weights)
