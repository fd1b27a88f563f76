"""TokenSwift (tokenswift.md): the target drafts for itself.

Its drafting pass (section 3.1 and Algorithm 1, lines 5-8): the target runs the newest token
over its partial cache (`cache.PartialCache`, a fixed budget of its most important K/V), so
the pass reads the weights and the budget's keys per layer, not the whole context, and its
final state feeds the multi-token heads (`heads.py`). The pass is the target's own decode
step with the partial cache in place of the full one (`Transformer.hidden_and_kv`: the same
kernels, unrolled on a GPU as its rounds are). Where the cache's positions are due to be
ranked again (once per budget - sink committed tokens), a selection pass comes first: each
layer ranks the whole context with this token's queries there (`cache.select_layer`) and
attends to what it kept. Verification runs over the full cache, so the partial cache changes
what is proposed, never what is accepted.

Its n-gram table (`NGramTable`) holds each first token's most frequent continuations; the
proposer grafts those that begin with the target's own top token into the heads' tree.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import nnx

from longspec_jax.decoding.sampling import SamplingConfig, penalize, recent_tokens
from longspec_jax.decoding.tree import Tree, graft_chains, static_topology
from longspec_jax.models.cache import KVCache, PartialCache, select_layer
from longspec_jax.models.heads import Heads
from longspec_jax.models.layers import embed_tokens
from longspec_jax.models.rope import inverse_frequencies, rope_tables
from longspec_jax.models.target import Transformer
from longspec_jax.ops import attention


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SelfDraftState:
  """TokenSwift's per-sequence state: its partial cache and its n-gram table."""

  partial: PartialCache
  table: NGramTable | None  # (None: no n-gram branches)
  tabled: jax.Array  # [B] int32: the n-grams that begin below this position are in the table


@dataclasses.dataclass(frozen=True)
class TokenSwift:
  """TokenSwift (tokenswift.md, Algorithm 1): the target drafts for itself. Each round it
  runs its newest token over its partial cache (`draft_pass`); its own
  prediction there and its heads' (`heads.py`: `params` are theirs) give each depth's
  most likely tokens, set as a full tree with `tree_widths[d - 1]` children per node at
  depth d (the paper's ternary (1, 3, 3, 3), Medusa-style: a depth's candidates are the
  same under every parent); and the `ngrams` most frequent n-grams of the text so far
  that begin with the target's own top token (`NGramTable`, n-grams entered once
  they are `lag` tokens old, the contextual penalty's window: the paper's table lags
  as much) join it as branches (`tree.graft_chains`). Verification then runs over the
  full cache, so the draft's approximations cost acceptance, never exactness.

  Candidates are ranked by the logits under `sampling`'s contextual penalty (over the
  text up to the root; the only processor that reorders tokens), as the verification
  will weigh them. Deviation: of several fully accepted paths the walk keeps the first,
  not one at random (the paper's "random n-gram selection", exact only under greedy
  decoding)."""

  graphdef: nnx.GraphDef  # the heads'
  tree_widths: tuple[int, ...] = (1, 3, 3, 3)
  budget: int = 4096  # |B|: positions the partial cache holds (the authors' scripts: 4,096)
  sink: int = 16  # |S|: the first positions, always kept (the authors' code: 16)
  ngrams: int = 20  # k: n-gram branches a round (the paper's Table 11)
  ngram_slots: int = 32  # continuations the table holds per first token
  n: int = 4  # the paper's 4-grams: as deep as the heads' tree
  lag: int = 1024
  sampling: SamplingConfig = SamplingConfig()  # the generation's processors (the penalty ranks candidates)

  @property
  def tree_size(self) -> int:
    return len(static_topology(self.tree_widths)[0]) + self.ngrams * self.n

  @property
  def depth(self) -> int:
    return max(len(self.tree_widths), self.n if self.ngrams else 0)

  def describe(self) -> dict:
    return {
      "tree_widths": list(self.tree_widths),
      "ngrams": self.ngrams,
      "ngram_tokens": self.n,
      "partial_cache": self.budget,
    }

  def start(self, params, *, target, cache, history) -> SelfDraftState:
    """An empty partial cache (the first round selects its positions) and the table of the
    prompt's n-grams that are `lag` tokens old (none without n-gram branches)."""
    batch = history.shape[0]
    budget = min(self.budget, cache.max_len)
    partial = PartialCache.create(target.config, batch, budget, min(self.sink, budget - 1), cache.k.dtype)
    old = cache.lengths + 1 - self.lag  # the text so far (the root included), less the lag
    table = NGramTable.build(history, old, target.config.vocab_size, self.ngram_slots, self.n) if self.ngrams else None
    return SelfDraftState(partial=partial, table=table, tabled=jnp.maximum(old - self.n + 1, 0))

  def propose(self, params, state: SelfDraftState, *, target, cache, history, root):
    heads: Heads = nnx.merge(self.graphdef, params)
    hidden, partial = draft_pass(target, state.partial, cache, root, most=self.depth + 1)
    logits = target.logits(jnp.concatenate([hidden[:, None], heads(hidden)], axis=1))  # [B, G + 1, V]
    if self.sampling.penalized:  # (the window up to the root: the tree's own tokens are left out)
      none = jnp.full((root.shape[0], 1, 1), -1, jnp.int32)
      seen = recent_tokens(history, cache.lengths, none, self.sampling, logits.shape[-1])  # [B, 1, V]
      logits = penalize(logits, seen, self.sampling)
    _, top = jax.lax.top_k(logits, max(self.tree_widths))  # [B, G + 1, W]
    parents, depths, ranks = static_topology(self.tree_widths)
    tokens = jnp.concatenate([root[:, None], top[:, depths[1:] - 1, ranks[1:]]], axis=1)
    tree = Tree(
      tokens=tokens.astype(jnp.int32),
      parents=jnp.broadcast_to(parents, tokens.shape),
      depths=jnp.broadcast_to(depths, tokens.shape),
      valid=jnp.ones(tokens.shape, bool),
    )
    if not self.ngrams:
      return tree, dataclasses.replace(state, partial=partial)
    stop = jnp.maximum(cache.lengths + 1 - self.lag - self.n + 1, state.tabled)  # n-grams now `lag` old
    table = state.table.add(history, state.tabled, stop, most=self.depth + 1)
    grams, real = table.top(top[:, 0, 0], self.ngrams)  # [B, k, n]: those that begin with its own top token
    tree = graft_chains(tree, grams, jnp.broadcast_to(real[:, :, None], grams.shape))
    return tree, SelfDraftState(partial=partial, table=table, tabled=stop)


def draft_pass(
  target: Transformer, partial: PartialCache, full: KVCache, root: jax.Array, most: int
) -> tuple[jax.Array, PartialCache]:
  """root [B]: the newest token, at position `full.lengths`, not in the cache yet. Returns
  the target's final state there over its partial cache [B, E] and the partial cache
  holding the positions committed since the last pass: appended (at most `most`), or,
  where due, all of them ranked again."""
  due = partial.needs_selection(full.lengths)  # [B]
  partial = partial.append(full, most, where=~due)
  # A loop of zero or one selection passes rather than a cond: its carry, the partial
  # cache, stays in place in the rounds where nothing is due (a cond's identity branch
  # would copy it).
  partial = jax.lax.fori_loop(
    0, jnp.any(due).astype(jnp.int32), lambda _, partial: _select(target, partial, full, root, due), partial
  )
  tokens, positions = root[:, None], full.lengths[:, None]  # [B, 1]
  itself = jnp.ones((root.shape[0], 1, 1), bool)
  hidden, _, _ = target.hidden_and_kv(
    tokens, positions, itself, partial.as_cache(), unroll=target.unrolled_rounds, any_slot=True
  )
  return hidden[:, 0], partial


def _select(target: Transformer, partial: PartialCache, full: KVCache, root: jax.Array, due: jax.Array) -> PartialCache:
  """The partial cache with every position below `full.lengths` ranked again in the
  sequences `due [B]` (Algorithm 1, line 6): layer by layer, with the queries of `root`
  at that layer, which attends to the slots it kept before the next layer ranks."""
  c = target.config
  positions = full.lengths[:, None]  # [B, 1]
  x = embed_tokens(target.embed[...], root[:, None])  # [B, 1, E]
  inv_freq, scale = inverse_frequencies(c.rope, c.head_dim)
  cos, sin = rope_tables(positions, inv_freq, scale)
  layer_def, layer_state = nnx.split(target.layers)
  count = jnp.where(due, jnp.minimum(full.lengths, partial.budget), partial.count)  # [B]
  itself = jnp.ones((root.shape[0], 1, 1), bool)

  def block(x, xs):
    state, index, slot_k, slot_v = xs  # this layer's params and partial slots [B, P, K, D]
    layer = nnx.merge(layer_def, state)
    q, k, v = layer.project_qkv(x, cos, sin)  # q [B, 1, K, G, D]
    new_k, new_v = select_layer(q[:, 0], full.k[index], full.v[index], full.lengths, partial.budget, partial.sink)
    pick = lambda new, old: jnp.where(due[:, None, None, None], new.astype(old.dtype), old)
    slot_k, slot_v = pick(new_k, slot_k), pick(new_v, slot_v)
    out = attention.hybrid_attention(q, slot_k, slot_v, count, k, v, itself, positions, impl=target.attention)
    return layer.add_mlp(layer.add_attention(x, out)), (slot_k, slot_v)

  _, (k, v) = jax.lax.scan(block, x, (layer_state, jnp.arange(c.num_layers), partial.k, partial.v))
  return partial.reselected(k, v, full.lengths, due)


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
