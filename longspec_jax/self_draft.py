"""TokenSwift's drafting pass (tokenswift.md, section 3.1 and Algorithm 1, lines 5-8).

The target is its own draft: it runs the newest token over its partial cache
(`cache.PartialCache`, a fixed budget of its most important K/V), so the pass reads the
weights and the budget's keys per layer, not the whole context, and its final state
feeds the multi-token heads (`heads.py`). Where the cache's positions are due to be
ranked again, each layer ranks them with this token's queries before attending
(`cache.select_layer`): only then is a layer's whole cache read, once per budget - sink
committed tokens. Verification runs over the full cache, so the partial cache changes
what is proposed, never what is accepted.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from longspec_jax import attention
from longspec_jax.cache import KVCache, PartialCache, select_layer
from longspec_jax.layers import rms_norm
from longspec_jax.rope import inverse_frequencies, rope_tables
from longspec_jax.target import Transformer


def draft_pass(target: Transformer, partial: PartialCache, full: KVCache, root: jax.Array,
               most: int) -> tuple[jax.Array, PartialCache]:
  """root [B]: the newest token, at position `full.lengths`, not in the cache yet. Returns
  the target's final state there over its partial cache [B, E] and the partial cache
  holding the positions committed since the last pass: appended (at most `most`), or,
  where due, all of them ranked again."""
  c = target.config
  batch = root.shape[0]
  due = partial.needs_selection(full.lengths)  # [B]
  partial = partial.append(full, most, where=~due)
  positions = full.lengths[:, None]  # [B, 1]
  x = jnp.take(target.embed[...], root[:, None], axis=0)  # [B, 1, E]
  inv_freq, scale = inverse_frequencies(c.rope, c.head_dim)
  cos, sin = rope_tables(positions, inv_freq, scale)
  layer_def, layer_state = nnx.split(target.layers)
  any_due = jnp.any(due)
  itself = jnp.ones((batch, 1), bool)

  def block(x, xs):
    state, index, slot_k, slot_v = xs  # this layer's params and partial slots [B, P, K, D]
    layer = nnx.merge(layer_def, state)
    q, k, v = layer.project_qkv(x, cos, sin)  # q [B, 1, K, G, D]
    def rank():  # the due sequences' slots selected again, the others' as they are
      new_k, new_v, new_filled = select_layer(q[:, 0], full.k[index], full.v[index], full.lengths, partial.budget,
                                              partial.sink)
      pick = lambda new, old: jnp.where(due[:, None, None, None], new.astype(old.dtype), old)
      return pick(new_k, slot_k), pick(new_v, slot_v), jnp.where(due[:, None], new_filled, partial.filled)

    # (a round with nothing due reads its slots as they are: no select over them)
    slot_k, slot_v, filled = jax.lax.cond(any_due, rank, lambda: (slot_k, slot_v, partial.filled))
    keys = jnp.concatenate([slot_k, k.astype(slot_k.dtype)], axis=1)  # [B, P + 1, K, D]: the slots, then itself
    values = jnp.concatenate([slot_v, v.astype(slot_v.dtype)], axis=1)
    visible = jnp.concatenate([filled, itself], axis=1)[:, None, :]  # [B, 1, P + 1]
    out, _ = attention.masked_attention(q, keys, values, visible, impl=target.attention)
    return layer.add_mlp(layer.add_attention(x, out)), (slot_k, slot_v, filled)

  x, (k, v, filled) = jax.lax.scan(block, x, (layer_state, jnp.arange(c.num_layers), partial.k, partial.v))
  partial = partial.reselected(k, v, filled[0], full.lengths, due)
  return rms_norm(x, target.final_norm[...], c.rms_norm_eps)[:, 0], partial
