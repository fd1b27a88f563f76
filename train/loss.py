"""Per-token cross-entropy through the LM head, a chunk of positions at a time.

The [T, V] logits of a long sequence never all exist: each chunk's logits are computed,
reduced to per-token losses and dropped, and the backward pass recomputes them per chunk
(`jax.checkpoint`), which is what the paper gets from a fused linear + cross-entropy
kernel. The labels are either token ids (the data) or a teacher's hidden states, whose
softmax through the same head is the soft target (distillation from the frozen target).
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp


def chunked_token_losses(
  hidden: jax.Array,
  logits_fn: Callable[[jax.Array], jax.Array],
  labels: jax.Array,
  chunk: int,
  teacher: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
  """hidden [B, T, E]; logits_fn: [B, C, E] -> float32 logits [B, C, V]; labels [B, T];
  teacher: None, or hidden states [B, T, E] whose distribution replaces the labels.
  Returns (loss [B, T] float32, hit [B, T] bool: the argmax is the label, or the
  teacher's argmax)."""
  batch, length, _ = hidden.shape
  chunks = -(-length // chunk)
  pad = lambda x: jnp.pad(x, ((0, 0), (0, chunks * chunk - length)) + ((0, 0),) * (x.ndim - 2))
  split = lambda x: jnp.moveaxis(pad(x).reshape(batch, chunks, chunk, *x.shape[2:]), 1, 0)

  @jax.checkpoint
  def chunk_loss(h, y, t):  # [B, C, E], [B, C], [B, C, E] or None
    logits = logits_fn(h)  # [B, C, V]
    lse = jax.nn.logsumexp(logits, axis=-1)
    if t is None:
      expected = jnp.take_along_axis(logits, y[..., None], axis=-1)[..., 0]
    else:
      teacher_logits = jax.lax.stop_gradient(logits_fn(t))
      y = jnp.argmax(teacher_logits, axis=-1)
      expected = jnp.einsum("bcv,bcv->bc", jax.nn.softmax(teacher_logits, axis=-1), logits)
    return lse - expected, jnp.argmax(logits, axis=-1) == y

  def body(_, xs):
    return None, chunk_loss(*xs)

  teachers = None if teacher is None else split(teacher)
  _, (loss, hit) = jax.lax.scan(body, None, (split(hidden), split(labels), teachers))
  unsplit = lambda x: jnp.moveaxis(x, 0, 1).reshape(batch, chunks * chunk)[:, :length]
  return unsplit(loss), unsplit(hit)
