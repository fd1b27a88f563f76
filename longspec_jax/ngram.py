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
about the same for 97 nodes as for 11 (launch-bound): four of 24 ran 1.24-2.24x one of
10 on seven prompt sets (H100, docs/benchmarks.md, session 19); on a CPU a round's cost
grows with its nodes.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from longspec_jax.tree import Tree, copy_tree

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

  @property
  def tree_size(self) -> int:
    return 1 + self.matches * self.num_tokens

  @property
  def depth(self) -> int:
    return self.num_tokens

  def start(self, params, *, target, cache, history):
    return None

  def propose(self, params, state, *, target, cache, history, root) -> tuple[Tree, None]:
    """The root, then the continuations of the latest earlier matches."""
    drafted, valid = self.lookup(history, cache.lengths)
    return copy_tree(root, drafted, valid), state

  def lookup(self, history: jax.Array, end: jax.Array) -> tuple[jax.Array, jax.Array]:
    """history [B, S] holds each sequence's tokens up to and including index `end [B]`
    (the root). Returns drafted tokens [B, M, gamma] and which of them are real [B, M,
    gamma], M = `matches` continuations, most recent first (those not found: none real)."""
    drafted, valid, _ = self.match(history, end)
    return drafted, valid

  def match(self, history: jax.Array, end: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """`lookup`, and the length of the n-gram the first continuation matched [B] int32
    (0: none): how much evidence it has (`adaptive.Adaptive` predicts its gain by it)."""
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
    kept = real[:, :, 0]  # [B, C]
    if self.matches > 1:  # a continuation that an earlier one already holds adds nothing
      holds = jnp.all(
        ~real[:, :, None, :] | (real[:, None, :, :] & (tokens[:, :, None, :] == tokens[:, None, :, :])), axis=-1
      )  # [B, C, C']: C's tokens are a prefix of C''s
      earlier = jnp.arange(kept.shape[1])[:, None] > jnp.arange(kept.shape[1])[None, :]
      kept &= ~jnp.any(holds & earlier[None], axis=-1)
    rank = jnp.cumsum(kept, axis=1) - 1  # [B, C]
    chosen = kept[:, None, :] & (rank[:, None, :] == jnp.arange(self.matches)[None, :, None])  # [B, M, C]
    pick = jnp.argmax(chosen, axis=-1)  # [B, M]
    found = jnp.any(chosen, axis=-1)  # [B, M]
    drafted = jnp.take_along_axis(tokens, pick[:, :, None], axis=1)  # [B, M, gamma]
    valid = jnp.take_along_axis(real, pick[:, :, None], axis=1) & found[:, :, None]
    return drafted, valid, jnp.where(found[:, 0], jnp.take_along_axis(ngram, pick[:, :1], axis=1)[:, 0], 0)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class NGramTable:
  """TokenSwift's token reutilization (tokenswift.md, section 3.2): the n-grams of the
  text so far, by first token, with how often each occurred; a round proposes the most
  frequent n-grams that begin with the token the model predicts next (`top`).

  Static shapes: each first token holds at most `slots` distinct continuations (the n - 1
  tokens after it), most frequent first where the table was built (`build`). The paper
  keeps every n-gram (a Python dictionary); here a first token with more distinct
  continuations than slots keeps the most frequent ones of the text it was built from,
  and a continuation added later (`add`) takes the slot of the least frequent one (its
  count starting at 1): the table's bytes are fixed by vocabulary x slots, whatever the
  length of the text."""

  continuations: jax.Array  # [B, V, K, n - 1] int32: each first token's continuations
  counts: jax.Array  # [B, V, K] int32: how often each occurred (0: an empty slot)

  @property
  def n(self) -> int:
    return self.continuations.shape[-1] + 1

  @property
  def slots(self) -> int:
    return self.counts.shape[-1]

  @classmethod
  def build(cls, history: jax.Array, count: jax.Array, vocab: int, slots: int, n: int = 4) -> NGramTable:
    """The table of the n-grams wholly inside history[b, :count[b]] ([B, S] int32, count
    [B]): for each first token its `slots` most frequent continuations (of equally
    frequent ones, the one that occurred first), in that order."""
    if n < 2 or slots < 1:
      raise ValueError(f"an n-gram table needs n >= 2 and slots >= 1, got n={n} and slots={slots}.")
    continuations, counts = jax.vmap(functools.partial(_build_one, vocab=vocab, slots=slots, n=n))(history, count)
    return cls(continuations=continuations, counts=counts)

  def add(self, history: jax.Array, start: jax.Array, stop: jax.Array, most: int) -> NGramTable:
    """The table with the n-grams of history [B, S] that begin at positions start[b] ..
    stop[b] - 1 added in order (at most `most` of them per sequence: a static bound): a
    continuation already held counts once more, a new one takes the slot of the least
    frequent (the first such, empty slots first)."""
    n = self.n

    def one(continuations, counts, tokens, first, end):
      def insert(i, table):
        continuations, counts = table
        position = first + i
        gram = jax.lax.dynamic_slice(tokens, (jnp.clip(position, 0, tokens.shape[0] - n),), (n,))
        real = (position < end) & (position + n <= tokens.shape[0])
        token, tail = gram[0], gram[1:]
        held, times = continuations[token], counts[token]  # [K, n - 1], [K]
        same = jnp.all(held == tail, axis=-1) & (times > 0)
        hit = jnp.any(same)
        slot = jnp.where(hit, jnp.argmax(same), jnp.argmin(times))
        continuations = continuations.at[token, slot].set(jnp.where(real, tail, held[slot]))
        counts = counts.at[token, slot].set(jnp.where(real, jnp.where(hit, times[slot] + 1, 1), times[slot]))
        return continuations, counts

      return jax.lax.fori_loop(0, most, insert, (continuations, counts), unroll=True)  # (a few: no loop to launch)

    continuations, counts = jax.vmap(one)(self.continuations, self.counts, history, start, stop)
    return NGramTable(continuations=continuations, counts=counts)

  def top(self, first: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """The k most frequent n-grams that begin with first [B] (of equally frequent ones, the
    earlier slot): n-grams [B, k, n] and which are real [B, k]."""
    if not 1 <= k <= self.slots:
      raise ValueError(f"the table holds {self.slots} n-grams per first token; {k} were asked for.")
    rows = jnp.arange(first.shape[0])
    times, pick = jax.lax.top_k(self.counts[rows, first], k)  # [B, k]
    tails = jnp.take_along_axis(self.continuations[rows, first], pick[:, :, None], axis=1)  # [B, k, n - 1]
    heads = jnp.broadcast_to(first[:, None, None], (*pick.shape, 1))
    return jnp.concatenate([heads, tails], axis=-1), times > 0


def _build_one(tokens: jax.Array, count: jax.Array, *, vocab: int, slots: int, n: int):
  """`NGramTable.build` for one sequence: tokens [S], count []. Sorting gives each
  distinct n-gram's count and first position, a second sort each first token's ranking."""
  size = tokens.shape[0]
  continuations = jnp.zeros((vocab, slots, n - 1), jnp.int32)
  counts = jnp.zeros((vocab, slots), jnp.int32)
  starts = size - n + 1
  if starts <= 0:
    return continuations, counts
  grams = jnp.stack([tokens[i : i + starts] for i in range(n)], axis=-1)  # [G, n]
  positions = jnp.arange(starts)
  real = positions + n <= count
  order = jnp.lexsort((positions, *[grams[:, i] for i in range(n - 1, -1, -1)], ~real))  # (last key: primary)
  grams, real = grams[order], real[order]
  index = jnp.arange(starts)
  fresh = real & ((index == 0) | jnp.any(grams != jnp.roll(grams, 1, axis=0), axis=-1))  # a run's first
  run = jnp.cumsum(fresh) - 1  # [G]: which distinct n-gram
  times = jax.ops.segment_sum(real.astype(jnp.int32), jnp.where(real, run, starts), num_segments=starts)
  first_seen = jax.ops.segment_min(positions[order], jnp.where(real, run, starts), num_segments=starts)
  distinct = jnp.zeros((starts, n), jnp.int32).at[jnp.where(fresh, run, starts)].set(grams, mode="drop")
  held = index < jnp.sum(fresh)  # [G]: runs that exist
  rank_order = jnp.lexsort((first_seen, -times, distinct[:, 0], ~held))
  distinct, times, held = distinct[rank_order], times[rank_order], held[rank_order]
  leader = held & ((index == 0) | (distinct[:, 0] != jnp.roll(distinct[:, 0], 1)))  # a first token's first
  rank = index - jax.lax.cummax(jnp.where(leader, index, 0))
  token = jnp.where(held & (rank < slots), distinct[:, 0], vocab)  # (vocab: dropped)
  continuations = continuations.at[token, rank].set(distinct[:, 1:], mode="drop")
  counts = counts.at[token, rank].set(times, mode="drop")
  return continuations, counts
