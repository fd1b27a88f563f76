"""Hybrid tree attention: the flash-decoding pass over the committed prefix and the masked
pass over the tree, merged by log-sum-exp.

The tree pass's (out, lse) joins the prefix pass's split-K partials as one more part, so
the merge of the two passes costs nothing beyond the merge of splits the prefix pass
needs anyway.

Reference twin: `longspec_jax.attention.hybrid_attention` with impl="reference".
"""

from __future__ import annotations

import dataclasses

import jax

from pallas_kernels import blocks
from pallas_kernels.flash_decode import bounds, prefix_partials
from pallas_kernels.tree_attention import tree_partial
from pallas_kernels.tuning import Pass, params_for


def hybrid_attention(q, k_cache, v_cache, lengths, k_new, v_new, mask, q_positions, window=None, *, layer=None,
                     interpret: bool | None = None):
  """q [B, T, K, G, D] over the cache k/v [B, S, K, D] (or layer `layer` of the stacked
  [L, B, S, K, D], read in place; slots < lengths [B], within `window` of each query's
  position) and the step's own k_new/v_new [B, T, K, D] under mask [B, T, T]. Returns
  out f32 [B, T, K, G, D]."""
  b, t, kv_heads, g, d = q.shape
  interpret = jax.default_backend() != "gpu" if interpret is None else interpret
  prefix = params_for(Pass.PREFIX, t * g, d, k_cache.shape[-3], b * kv_heads)
  tree = params_for(Pass.TREE, t * g, d, t, b * kv_heads)
  block_rows = max(prefix.block_rows, tree.block_rows)  # one row layout for both passes
  rows = blocks.to_rows(q, block_rows)
  lo, hi = (blocks.per_row(x, g, rows.shape[2]) for x in bounds(lengths, q_positions, window, t))
  prefix_part = prefix_partials(rows, k_cache, v_cache, lo, hi, dataclasses.replace(prefix, block_rows=block_rows),
                                interpret, layer=layer)
  mask_rows = blocks.per_row(mask, g, rows.shape[2])
  tree_part = tree_partial(rows, k_new, v_new, mask_rows, dataclasses.replace(tree, block_rows=block_rows), interpret)
  return blocks.merge([prefix_part, tree_part], t, g)[0]

