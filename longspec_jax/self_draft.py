"""TokenSwift's drafting pass (tokenswift.md, section 3.1 and Algorithm 1, lines 5-8).

The target is its own draft: it runs the newest token over its partial cache
(`cache.PartialCache`, a fixed budget of its most important K/V), so the pass reads the
weights and the budget's keys per layer, not the whole context, and its final state
feeds the multi-token heads (`heads.py`). The pass is the target's own decode step with
the partial cache in place of the full one (`Transformer.hidden_and_kv`: the same
kernels, unrolled on a GPU as its rounds are). Where the cache's positions are due to be
ranked again (once per budget - sink committed tokens), a selection pass comes first:
each layer ranks the whole context with this token's queries there (`cache.select_layer`)
and attends to what it kept. Verification runs over the full cache, so the partial
cache changes what is proposed, never what is accepted.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from longspec_jax import attention
from longspec_jax.cache import KVCache, PartialCache, select_layer
from longspec_jax.layers import embed_tokens
from longspec_jax.rope import inverse_frequencies, rope_tables
from longspec_jax.target import Transformer


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
