"""Drafting from n-grams already in the context: prompt lookup decoding (PLD).

The training-free baseline: find the most recent earlier occurrence of the context's last
n tokens (n from `max_ngram` down to 1) and propose the tokens that followed it.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from longspec_jax.tree import Tree, chain


@dataclasses.dataclass(frozen=True)
class PromptLookup:
  max_ngram: int = 3
  num_tokens: int = 10  # gamma: drafted tokens per step

  @property
  def tree_size(self) -> int:
    return self.num_tokens + 1

  @property
  def depth(self) -> int:
    return self.num_tokens

  def start(self, params, *, target, cache, history):
    return None

  def propose(self, params, state, *, target, cache, history, root) -> tuple[Tree, None]:
    """A chain: the root, then the tokens that followed the latest earlier match."""
    drafted, valid = self.lookup(history, cache.lengths)
    return chain(root, drafted, valid), state

  def lookup(self, history: jax.Array, end: jax.Array) -> tuple[jax.Array, jax.Array]:
    """history [B, S] holds each sequence's tokens up to and including index `end [B]`
    (the root). Returns drafted tokens [B, gamma] and which of them are real [B, gamma]."""
    drafted, valid, _ = self.match(history, end)
    return drafted, valid

  def match(self, history: jax.Array, end: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """`lookup`, and the length of the n-gram matched [B] int32 (0: none): how much
    evidence the continuation has (`adaptive.Adaptive` predicts its gain by it)."""
    batch, size = history.shape
    count = end + 1  # tokens in the context, root included
    found = jnp.zeros((batch,), bool)
    start = jnp.zeros((batch,), jnp.int32)  # index where the continuation begins
    matched = jnp.zeros((batch,), jnp.int32)
    for n in range(self.max_ngram, 0, -1):
      tail = jax.vmap(lambda h, c: jax.lax.dynamic_slice(h, (c - n,), (n,)))(history, jnp.maximum(count, n))
      windows = jnp.stack([history[:, i : size - n + 1 + i] for i in range(n)], axis=-1)  # [B, S-n+1, n]
      match = jnp.all(windows == tail[:, None, :], axis=-1)
      s = jnp.arange(size - n + 1)[None, :]
      match &= (s + n < count[:, None]) & (count[:, None] > n)  # an earlier occurrence, not the tail itself
      last = jnp.max(jnp.where(match, s, -1), axis=1)
      take = ~found & (last >= 0)
      start = jnp.where(take, last + n, start)
      matched = jnp.where(take, n, matched)
      found |= take
    offsets = start[:, None] + jnp.arange(self.num_tokens)[None, :]
    drafted = jnp.take_along_axis(history, jnp.minimum(offsets, size - 1), axis=1)
    valid = found[:, None] & (offsets < count[:, None])
    return drafted, valid, jnp.where(valid[:, 0], matched, 0)
