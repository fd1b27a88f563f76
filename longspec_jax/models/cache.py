"""Static-shape KV caches: the target's full cache, the draft's sliding-window ring, and
TokenSwift's partial cache of the target's most important K/V.

Keys and values are preallocated `[L, B, S_max, K, D]`; `lengths [B]` says how many
slots of each sequence hold committed tokens (slot i holds position i). A forward pass
writes its new tokens at slots `lengths .. lengths + T` without moving `lengths`: the
caller commits what it keeps with `advance` (all of it for prefill and AR decode, the
accepted path for tree verification). Slots at or past `lengths` are dead and simply
overwritten later.

Under a mesh (tensor-parallel inference) every cache is split by KV head
(`sharding.CACHE_AXES`): each device holds its heads' K/V, which its share of the
attention reads.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from longspec_jax.models.config import DraftConfig, TargetConfig
from longspec_jax.ops import sharding


def _empty(shape: tuple[int, ...], dtype) -> jax.Array:
  """Zeroed K or V slots [L, B, S, K, D], split by KV head under a mesh."""
  return sharding.zeros(shape, dtype, sharding.CACHE_AXES)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
  k: jax.Array  # [L, B, S, K, D]
  v: jax.Array  # [L, B, S, K, D]
  lengths: jax.Array  # [B] int32: committed slots per sequence

  @classmethod
  def create(cls, config: TargetConfig, batch: int, max_len: int, dtype) -> KVCache:
    shape = (config.num_layers, batch, max_len, config.num_kv_heads, config.head_dim)
    return cls(k=_empty(shape, dtype), v=_empty(shape, dtype), lengths=sharding.zeros((batch,), jnp.int32, ()))

  @property
  def max_len(self) -> int:
    return self.k.shape[2]

  def advance(self, counts: jax.Array) -> KVCache:
    """Commits `counts [B]` (or a scalar) more slots per sequence."""
    return dataclasses.replace(self, lengths=self.lengths + counts)

  def commit_path(self, path: jax.Array, count: jax.Array) -> KVCache:
    """Keeps an accepted tree path: moves the K/V of nodes `path [B, N]` (written at slots
    lengths + path[d]) to slots lengths + d for d < count [B], then commits count slots.
    Rejected nodes stay where they are, past `lengths`, dead."""
    batch, n = path.shape
    if n == 1:  # a one-node tree (AR decoding): the root is already in its slot
      return self.advance(count)
    rows = jnp.arange(batch)[:, None]
    depth = jnp.arange(n)[None, :]
    src = self.lengths[:, None] + path  # [B, N]
    dst = jnp.where(depth < count[:, None], self.lengths[:, None] + depth, self.max_len)  # past the end: dropped

    def move(layers):  # [L, B, S, K, D]; the gather completes before the scatter
      return layers.at[:, rows, dst].set(layers.at[:, rows, src].get(mode="clip"), mode="drop")

    return KVCache(k=move(self.k), v=move(self.v), lengths=self.lengths + count)

  def nbytes(self) -> int:
    return self.k.nbytes + self.v.nbytes + self.lengths.nbytes


def write_block(layers: jax.Array, lengths: jax.Array, block: jax.Array) -> jax.Array:
  """Writes `block [L, B, T, K, D]` into `layers [L, B, S, K, D]` at slots
  lengths[b] .. lengths[b] + T of each sequence. The engine checks capacity before any write."""
  batch, steps = block.shape[1:3]
  rows = jnp.broadcast_to(jnp.arange(batch)[:, None], (batch, steps))  # [B, T]
  slots = lengths[:, None] + jnp.arange(steps)[None, :]  # [B, T]
  return layers.at[:, rows, slots].set(block.astype(layers.dtype), mode="drop")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class RingCache:
  """The draft's self-attention K/V for the latest `window` committed positions: position
  p lives in slot p % window, so memory is constant however long the context grows
  (LongSpec's); a ring as long as the target's cache never wraps (GLIDE's)."""

  k: jax.Array  # [L, B, W, K, D]
  v: jax.Array  # [L, B, W, K, D]
  positions: jax.Array  # [B, W] int32: position held in each slot, -1 if none yet
  length: jax.Array  # [B] int32: every position below this has been written

  @classmethod
  def create(cls, config: DraftConfig, batch: int, dtype, window: int) -> RingCache:
    shape = (config.num_layers, batch, window, config.num_kv_heads, config.head_dim)
    return cls(
      k=_empty(shape, dtype),
      v=_empty(shape, dtype),
      positions=jnp.full((batch, window), -1, jnp.int32),
      length=jnp.zeros((batch,), jnp.int32),
    )

  @property
  def window(self) -> int:
    return self.k.shape[2]

  def write(self, k: jax.Array, v: jax.Array, positions: jax.Array, valid: jax.Array) -> RingCache:
    """Stores k, v [L, B, T, K, D] of consecutive `positions [B, T]` where
    `valid [B, T]` (at most `window` of them), and moves `length` past the newest one."""
    batch = positions.shape[0]
    rows = jnp.arange(batch)[:, None]
    slots = jnp.where(valid, positions % self.window, self.window)  # past the end: dropped
    put = lambda ring, new: ring.at[:, rows, slots].set(new.astype(ring.dtype), mode="drop")
    newest = jnp.max(jnp.where(valid, positions + 1, 0), axis=1)
    return RingCache(
      k=put(self.k, k),
      v=put(self.v, v),
      positions=self.positions.at[rows, slots].set(positions, mode="drop"),
      length=jnp.maximum(self.length, newest),
    )

  def visible(self, q_positions: jax.Array, limit: jax.Array) -> jax.Array:
    """[B, T, W]: the slots a query at q_positions [B, T] sees: written positions below
    `limit [B]` and within the window (p - window < position <= p)."""
    held = self.positions[:, None, :]  # [B, 1, W]
    return (held >= 0) & (held < limit[:, None, None]) & (q_positions[:, :, None] - held < self.window)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PartialCache:
  """TokenSwift's drafting cache (tokenswift.md, section 3.3 and Algorithm 1): a fixed
  budget P of the target's committed K/V per layer, so its bytes stay the same however
  long the output grows; the target drafts on it, verification uses the full cache.

  The slots that hold a position are always a prefix, [0, `count`), so the drafting pass
  reads them as the target's decode step reads its cache (`as_cache`: the same attention
  kernel, lengths = count). A selection fills slots [0, sink) with the first positions
  (attention sinks) and [sink, `kept`) with the positions that ranked most important
  (Eq. 2: the current token's queries of each KV head's group, dotted with the key), in
  decreasing importance per KV head; `kept` = min(context, P). The tokens committed since
  are written once each (`append`, a few slots a round, never a copy of the whole cache):
  into the empty slots after `kept` while there are any, then over the least important
  selected ones, from slot P - 1 - j down (the j-th appended). When they would reach the
  sink, every position is ranked again (`select_layer`, layer by layer inside the
  drafting pass that has the queries)."""

  k: jax.Array  # [L, B, P, K, D]
  v: jax.Array  # [L, B, P, K, D]
  kept: jax.Array  # [B] int32: slots the last selection filled
  selected: jax.Array  # [B] int32: the target cache's length at the last selection
  copied: jax.Array  # [B] int32: the committed positions below this are in (selected, or appended)
  sink: int = dataclasses.field(metadata=dict(static=True))

  @classmethod
  def create(cls, config: TargetConfig, batch: int, budget: int, sink: int, dtype) -> PartialCache:
    if not 0 <= sink < budget:
      raise ValueError(f"a partial cache needs 0 <= sink < budget, got sink {sink} and budget {budget}.")
    shape = (config.num_layers, batch, budget, config.num_kv_heads, config.head_dim)
    zeros = jnp.zeros((batch,), jnp.int32)
    return cls(k=_empty(shape, dtype), v=_empty(shape, dtype), kept=zeros, selected=zeros, copied=zeros, sink=sink)

  @property
  def budget(self) -> int:
    return self.k.shape[2]

  @property
  def count(self) -> jax.Array:
    """[B]: slots [0, count) hold a position."""
    return jnp.minimum(self.kept + self.copied - self.selected, self.budget)

  def as_cache(self) -> KVCache:
    """The held slots as a target cache of `count` committed slots (their positions are
    not their slot numbers: a window over positions does not apply to them)."""
    return KVCache(k=self.k, v=self.v, lengths=self.count)

  def needs_selection(self, lengths: jax.Array) -> jax.Array:
    """[B] bool: the positions committed since the last selection (up to `lengths`) would
    reach the sink's slots, or nothing has been selected yet (Algorithm 1, line 5)."""
    return (self.copied == 0) | (lengths - self.selected > self.budget - self.sink)

  def append(self, full: KVCache, most: int, where: jax.Array | None = None) -> PartialCache:
    """Copies the target's K/V of the positions committed since the last call (at most
    `most` of them per sequence: a static bound, a round's accepted tokens) into the
    empty slots, then the least important ones, in the sequences `where [B]` (all by
    default): the others are due a selection (`needs_selection`), which takes every
    position."""
    batch = self.kept.shape[0]
    rows = jnp.arange(batch)[:, None]
    positions = self.copied[:, None] + jnp.arange(most)[None, :]  # [B, M]
    fresh = positions < full.lengths[:, None]
    if where is not None:
      fresh &= where[:, None]
    since = positions - self.selected[:, None]  # [B, M]: the j-th appended since the selection
    empty = self.kept[:, None] + since
    slots = jnp.where(empty < self.budget, empty, self.budget - 1 - since)
    slots = jnp.where(fresh, slots, self.budget)  # (past the end: dropped)
    take = lambda layers: layers.at[:, rows, positions].get(mode="clip")  # [L, B, M, K, D]
    put = lambda slots_kv, new: slots_kv.at[:, rows, slots].set(new.astype(slots_kv.dtype), mode="drop")
    return dataclasses.replace(
      self,
      k=put(self.k, take(full.k)),
      v=put(self.v, take(full.v)),
      copied=jnp.max(jnp.where(fresh, positions + 1, self.copied[:, None]), axis=1),
    )

  def reselected(self, k: jax.Array, v: jax.Array, lengths: jax.Array, where: jax.Array) -> PartialCache:
    """The cache with slots k, v [L, B, P, K, D] that hold, where `where [B]`, a selection
    (`select_layer`'s, stacked over the layers) of the positions below `lengths`, and
    elsewhere the slots as they were."""
    return dataclasses.replace(
      self,
      k=k.astype(self.k.dtype),
      v=v.astype(self.v.dtype),
      kept=jnp.where(where, jnp.minimum(lengths, self.budget), self.kept),
      selected=jnp.where(where, lengths, self.selected),
      copied=jnp.where(where, lengths, self.copied),
    )

  def nbytes(self) -> int:
    return sum(x.nbytes for x in (self.k, self.v, self.kept, self.selected, self.copied))


def select_layer(q: jax.Array, k: jax.Array, v: jax.Array, lengths: jax.Array, budget: int, sink: int):
  """One layer's slots after a selection (Algorithm 1, line 6): the first `sink`
  positions, then per KV head the budget - sink others with the largest importance (Eq. 2,
  `q [B, K, G, D]` the current token's queries grouped by KV head, each dotted with the
  key and summed over the group; ties: the earlier position), from the target's
  committed keys and values k, v [B, S, K, D] below `lengths [B]`. Returns slot keys and
  values [B, P, K, D], of which the first min(lengths, P) hold a position."""
  size = k.shape[1]
  rest = budget - sink
  scores = jnp.einsum("bkgd,bskd->bks", q.astype(jnp.float32), k.astype(jnp.float32))  # [B, K, S]
  position = jnp.arange(size)
  eligible = (position[None, :] >= sink) & (position[None, :] < lengths[:, None])  # [B, S]
  scores = jnp.where(eligible[:, None, :], scores, -jnp.inf)
  if rest > size:  # (fewer positions than slots: the rest of the slots stay empty)
    scores = jnp.pad(scores, ((0, 0), (0, 0), (0, rest - size)), constant_values=-jnp.inf)
  _, chosen = jax.lax.top_k(scores, rest)  # [B, K, R], most important first (the eligible ones)
  chosen = jnp.concatenate([jnp.broadcast_to(jnp.arange(sink), (*chosen.shape[:2], sink)), chosen], axis=-1)
  gather = lambda x: jnp.take_along_axis(x, jnp.clip(chosen, 0, size - 1).transpose(0, 2, 1)[..., None], axis=1)
  return gather(k), gather(v)
