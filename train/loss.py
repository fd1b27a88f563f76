"""Per-token cross-entropy through the LM head, a chunk of positions at a time.

The [T, V] logits of a long sequence never all exist: each chunk's logits are computed,
reduced to per-token losses and dropped, and the backward pass recomputes them per chunk
(`jax.checkpoint`), which is what the paper gets from a fused linear + cross-entropy
kernel. The labels are either token ids (the data) or a teacher's hidden states, whose
softmax through the same head is the soft target (distillation from the frozen target).
Several passes over the same tokens (the training-time test's) are scored together: the
teacher's logits are computed once a chunk for all of them.
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
  """hidden [B, T, E], or [P, B, T, E] for P passes scored against the same labels (in
  chunks P times shorter, so that as many logits exist at once); logits_fn: [..., E] ->
  float32 logits [..., V]; labels [B, T]; teacher: None, or hidden states [B, T, E] whose
  distribution replaces the labels. Returns (loss float32, hit bool: the argmax is the
  label, or the teacher's argmax), each [B, T] (or [P, B, T])."""
  passes = hidden.ndim == 4
  hidden = hidden if passes else hidden[None]
  count, batch, length, _ = hidden.shape
  chunk = max(chunk // count, 1)
  chunks = -(-length // chunk)

  def split(x, axis):  # [..., T, ...] at `axis` -> [chunks, ..., chunk, ...]
    x = jnp.pad(x, [(0, chunks * chunk - length) if a == axis else (0, 0) for a in range(x.ndim)])
    return jnp.moveaxis(x.reshape(*x.shape[:axis], chunks, chunk, *x.shape[axis + 1 :]), axis, 0)

  @jax.checkpoint
  def chunk_loss(h, y, t):  # [P, B, C, E], [B, C], [B, C, E] or None
    logits = logits_fn(h)  # [P, B, C, V]
    lse = jax.nn.logsumexp(logits, axis=-1)
    if t is None:
      expected = jnp.take_along_axis(logits, jnp.broadcast_to(y, logits.shape[:-1])[..., None], axis=-1)[..., 0]
    else:
      teacher_logits = jax.lax.stop_gradient(logits_fn(t))  # [B, C, V], once for every pass
      y = jnp.argmax(teacher_logits, axis=-1)
      expected = jnp.einsum("bcv,pbcv->pbc", jax.nn.softmax(teacher_logits, axis=-1), logits)
    return lse - expected, jnp.argmax(logits, axis=-1) == y

  def body(_, xs):
    return None, chunk_loss(*xs)

  teachers = None if teacher is None else split(teacher, 1)
  _, (loss, hit) = jax.lax.scan(body, None, (split(hidden, 2), split(labels, 1), teachers))
  unsplit = lambda x: jnp.moveaxis(x, 0, 2).reshape(count, batch, chunks * chunk)[..., :length]  # [P, B, T]
  loss, hit = unsplit(loss), unsplit(hit)
  return (loss, hit) if passes else (loss[0], hit[0])
