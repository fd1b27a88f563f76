"""Static-shape KV caches: the target's full cache and the draft's sliding-window ring.

Keys and values are preallocated `[L, B, S_max, K, D]`; `lengths [B]` says how many
slots of each sequence hold committed tokens (slot i holds position i). A forward pass
writes its new tokens at slots `lengths .. lengths + T` without moving `lengths`: the
caller commits what it keeps with `advance` (all of it for prefill and AR decode, the
accepted path for tree verification). Slots at or past `lengths` are dead and simply
overwritten later.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from longspec_jax.config import DraftConfig, TargetConfig


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
  k: jax.Array  # [L, B, S, K, D]
  v: jax.Array  # [L, B, S, K, D]
  lengths: jax.Array  # [B] int32: committed slots per sequence

  @classmethod
  def create(cls, config: TargetConfig, batch: int, max_len: int, dtype) -> KVCache:
    shape = (config.num_layers, batch, max_len, config.num_kv_heads, config.head_dim)
    return cls(
        k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype), lengths=jnp.zeros((batch,), jnp.int32)
    )

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
        k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype),
        positions=jnp.full((batch, window), -1, jnp.int32), length=jnp.zeros((batch,), jnp.int32),
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
        k=put(self.k, k), v=put(self.v, v),
        positions=self.positions.at[rows, slots].set(positions, mode="drop"),
        length=jnp.maximum(self.length, newest),
    )

  def visible(self, q_positions: jax.Array, limit: jax.Array) -> jax.Array:
    """[B, T, W]: the slots a query at q_positions [B, T] sees: written positions below
    `limit [B]` and within the window (p - window < position <= p)."""
    held = self.positions[:, None, :]  # [B, 1, W]
    return (held >= 0) & (held < limit[:, None, None]) & (q_positions[:, :, None] - held < self.window)
