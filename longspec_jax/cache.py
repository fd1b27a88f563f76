"""Static-shape KV cache of the target model.

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

from longspec_jax.config import TargetConfig


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
  k: jax.Array  # [L, B, S, K, D]
  v: jax.Array  # [L, B, S, K, D]
  lengths: jax.Array  # [B] int32: committed slots per sequence

  @classmethod
  def create(cls, config: TargetConfig, batch: int, max_len: int, dtype) -> "KVCache":
    shape = (config.num_layers, batch, max_len, config.num_kv_heads, config.head_dim)
    return cls(
        k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype), lengths=jnp.zeros((batch,), jnp.int32)
    )

  @property
  def max_len(self) -> int:
    return self.k.shape[2]

  def advance(self, counts: jax.Array) -> "KVCache":
    """Commits `counts [B]` (or a scalar) more slots per sequence."""
    return dataclasses.replace(self, lengths=self.lengths + counts)

  def commit_path(self, path: jax.Array, count: jax.Array) -> "KVCache":
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
