"""Drafting from n-grams already in the context: prompt lookup decoding (PLD), and
TokenSwift's table of frequent n-grams (`NGramTable`).

The training-free baseline: find the most recent earlier occurrence of the context's last
n tokens (n from `max_ngram` down to 1) and propose the tokens that followed it.

With `matches` > 1, the most recent distinct continuations (the longest n-gram's matches
first, then the shorter ones') are proposed together, merged as a trie
(`tree.copy_tree`): where one earlier occurrence goes on differently from the output,
another often does not. On the held-out C headers and C++ sources at 4k (SmolLM2's
greedy output, an offline count), 4 continuations of 16 tokens gave 11.0 and 6.8 tokens
a round against one of 10's 5.5 and 4.4. On a GPU a round of this small target costs
about the same for 97 nodes as for 11 (launch-bound): four of 24 ran 0.74-1.92x one of
10 on seven prompt sets, median 1.35x (H100, docs/results.md, "End-to-end decoding"); on
a CPU a round's cost grows with its nodes.

With `past_tokens`, the outputs of earlier generations in the process are searched too
(`past.match_past`): their continuations, ranked by how often they followed, take the
slots the context's matches leave empty, in order, so that they add proposals where the
request's own text has none and never take one's place. (Put first wherever its n-gram
was the longer, a past 4-gram displaced the context's 3-gram: on code edits it cut prompt
lookup's tokens a round from 2.87 to 2.21, docs/results.md, "Many prompts at once".)
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from longspec_jax.decoding.tree import Tree, copy_tree, distinct_continuations
from longspec_jax.methods.past import PAST_NGRAMS, PastTokens, match_past

# Earlier occurrences of each n-gram length looked at per continuation sought: repeated
# text makes many of them continue alike, and only distinct continuations are kept.
CANDIDATES_PER_MATCH = 4
# Positions per block of `latest`'s counts from the end.
COUNT_BLOCK = 128


def latest(mask: jax.Array, k: int) -> jax.Array:
  """The positions of the last k True entries of mask [..., L], latest first [..., k]
  int32 (-1 where there are fewer). Each True entry's rank from the end (the True
  entries at or after it) comes from block sums, two small matmuls, and the k latest are
  scattered into their slots: `jax.lax.top_k` over the positions is a sort of the whole
  context on a GPU (three of them, one per n-gram length, took 93 us of a 1.7 ms round of
  four continuations on an H200: 5%)."""
  *lead, size = mask.shape
  positions = jnp.arange(size, dtype=jnp.int32)
  if k == 1:
    return jnp.max(jnp.where(mask, positions, -1), axis=-1, keepdims=True)
  blocks = -(-size // COUNT_BLOCK)
  flat = mask.reshape(-1, size)
  counts = jnp.pad(flat, ((0, 0), (0, blocks * COUNT_BLOCK - size))).reshape(-1, blocks, COUNT_BLOCK)
  counts = counts.astype(jnp.float32)  # (sums of 0/1 up to the context's length: exact in float32)
  i, j = jnp.arange(COUNT_BLOCK), jnp.arange(blocks)
  exact = jax.lax.Precision.HIGHEST
  within = jnp.einsum(
    "rjp,pq->rjq", counts, (i[:, None] >= i[None, :]).astype(jnp.float32), precision=exact
  )  # [R, J, P]: True entries at or after each in its block
  after = jnp.einsum(
    "rj,jh->rh", counts.sum(axis=-1), (j[:, None] > j[None, :]).astype(jnp.float32), precision=exact
  )  # [R, J]: True entries in the blocks after each
  rank = (within + after[:, :, None]).reshape(flat.shape[0], -1)[:, :size].astype(jnp.int32)  # [R, L]: 1 = latest
  slot = jnp.where(flat & (rank <= k), rank - 1, k)  # k: not kept (dropped)
  rows = jnp.arange(flat.shape[0])[:, None]
  found = (
    jnp.full((flat.shape[0], k), -1, jnp.int32).at[rows, slot].set(jnp.broadcast_to(positions, flat.shape), mode="drop")
  )
  return found.reshape(*lead, k)


@dataclasses.dataclass(frozen=True)
class PromptLookup:
  max_ngram: int = 3
  num_tokens: int = 10  # gamma: tokens per continuation
  matches: int = 1  # continuations proposed together (a trie)
  past_tokens: int = 0  # the ring of earlier generations' outputs searched too (0: none)

  @property
  def tree_size(self) -> int:
    return 1 + self.matches * self.num_tokens

  @property
  def depth(self) -> int:
    return self.num_tokens

  @property
  def levels(self) -> int:
    """The kinds of evidence a first continuation has (`match`'s third value, 1-based):
    the context's n-gram lengths, then the past's."""
    return self.max_ngram + (len(PAST_NGRAMS) if self.past_tokens else 0)

  def describe(self) -> dict:
    return {"copy_tokens": self.num_tokens, "copy_matches": self.matches, "past_tokens": self.past_tokens}

  def start(self, params, *, target, cache, history, past: PastTokens | None = None) -> PastTokens | None:
    """The state: the ring of past outputs (`engine.Memory`'s), with `past_tokens`."""
    return past

  def with_past(self, state: PastTokens | None, past: PastTokens) -> PastTokens:
    """The state reading `past` (the ring after more outputs were written)."""
    return past

  def propose(self, params, state, *, target, cache, history, root) -> tuple[Tree, PastTokens | None]:
    """The root, then the continuations of the latest earlier matches."""
    drafted, valid, _ = self.match(history, cache.lengths, state)
    return copy_tree(root, drafted, valid), state

  def lookup(self, history: jax.Array, end: jax.Array) -> tuple[jax.Array, jax.Array]:
    """history [B, S] holds each sequence's tokens up to and including index `end [B]`
    (the root). Returns drafted tokens [B, M, gamma] and which of them are real [B, M,
    gamma], M = `matches` continuations, most recent first (those not found: none real)."""
    drafted, valid, _ = self.match(history, end)
    return drafted, valid

  def match(
    self, history: jax.Array, end: jax.Array, past: PastTokens | None = None
  ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """`lookup` (with `past`, its continuations in the slots the context leaves empty),
    and the evidence of the first continuation [B] int32: the length of the n-gram it
    matched in the context, or `max_ngram` + the rank of the past's n-gram length among
    `PAST_NGRAMS` (shortest 1) where the context has none; 0: none (`auto.Adaptive`
    predicts its gain by it)."""
    drafted, valid, ngram = self._match_context(history, end)
    if past is None:
      return drafted, valid, ngram
    tokens, real, matched = match_past(past, history, end, self.num_tokens, self.matches)  # [B, M, G] x2, [B]
    empty = ~valid[:, :, 0]  # [B, M]: slots without a continuation of the context's
    # [B, M, 1]: the past's n-th best continuation goes into the n-th empty slot
    nth = jnp.maximum(jnp.cumsum(empty, axis=1) - 1, 0)[:, :, None]
    into = empty[:, :, None] & jnp.take_along_axis(real[:, :, :1], nth, axis=1)  # [B, M, 1]
    drafted = jnp.where(into, jnp.take_along_axis(tokens, nth, axis=1), drafted)
    valid = jnp.where(into, jnp.take_along_axis(real, nth, axis=1), valid)
    rank = jnp.searchsorted(jnp.asarray(sorted(PAST_NGRAMS)), matched) + 1  # [B]: 1 = the shortest
    return drafted, valid, jnp.where(into[:, 0, 0], self.max_ngram + rank, ngram)

  def _match_context(self, history: jax.Array, end: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """`match` within each sequence's own context."""
    batch, size = history.shape
    count = end + 1  # tokens in the context, root included
    per_ngram = 1 if self.matches == 1 else CANDIDATES_PER_MATCH * self.matches
    occurrences = []  # [B, S] per n-gram length: where an earlier occurrence of the tail begins
    for n in range(self.max_ngram, 0, -1):
      tail = jax.vmap(lambda h, c: jax.lax.dynamic_slice(h, (c - n,), (n,)))(history, jnp.maximum(count, n))
      windows = jnp.stack([history[:, i : size - n + 1 + i] for i in range(n)], axis=-1)  # [B, S-n+1, n]
      match = jnp.all(windows == tail[:, None, :], axis=-1)
      s = jnp.arange(size - n + 1)[None, :]
      match &= (s + n < count[:, None]) & (count[:, None] > n)  # an earlier occurrence, not the tail itself
      occurrences.append(jnp.pad(match, ((0, 0), (0, n - 1))))
    latest_first = latest(jnp.stack(occurrences, axis=1), min(per_ngram, size))  # [B, n-grams, C]
    lengths = jnp.arange(self.max_ngram, 0, -1, dtype=jnp.int32)[None, :, None]
    start = jnp.where(latest_first >= 0, latest_first + lengths, -1).reshape(batch, -1)  # [B, C]: longest n first
    ngram = jnp.broadcast_to(lengths, latest_first.shape).reshape(batch, -1)
    offsets = start[:, :, None] + jnp.arange(self.num_tokens)[None, None, :]  # [B, C, gamma]
    tokens = jnp.take_along_axis(history[:, None, :], jnp.clip(offsets, 0, size - 1), axis=2)
    real = (start >= 0)[:, :, None] & (offsets < count[:, None, None])
    pick, found = distinct_continuations(tokens, real, self.matches)  # [B, M] x2
    drafted = jnp.take_along_axis(tokens, pick[:, :, None], axis=1)  # [B, M, gamma]
    valid = jnp.take_along_axis(real, pick[:, :, None], axis=1) & found[:, :, None]
    return drafted, valid, jnp.where(found[:, 0], jnp.take_along_axis(ngram, pick[:, :1], axis=1)[:, 0], 0)
