"""Hybrid tree attention: the flash-decoding pass over the committed prefix and the masked
pass over the tree, merged by log-sum-exp.

One launch computes both: the prefix pass's split-K programs and, beside them on the same
grid axis, one program per row block for the tree, whose (out, lse) is one more partial.
The tree's program runs alongside the splits instead of in a launch after them: at
Llama-3.1-8B's shape a separate launch cost 2.5 us a layer for an AR step and 7.5 us for a
32-node tree (docs/results.md, "Hybrid attention in one launch"). The merge of the two
passes costs nothing beyond the merge of splits the prefix pass needs anyway.

`invariant_hybrid_attention` computes the same function so that a query's bits do not
depend on the call: the same token at the same position gets the same output whether it
is an AR step's one query or a node among a tree's, so verification computes exactly
what AR decoding computes (module docstring there).

Reference twin: `longspec_jax.ops.attention.hybrid_attention` with impl="reference".
"""

from __future__ import annotations

import dataclasses
import functools

import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import blocks
from pallas_kernels.flash_decode import attend_prefix, bounds, prefix_partials, split_k, stacked
from pallas_kernels.merge import merge
from pallas_kernels.tree_attention import attend_tree, tree_partial
from pallas_kernels.tuning import KernelParams, Pass, invariant_prefix_params, params_for

# Batch-invariant attention takes each query's last RECENT positions (itself included) from
# its own path, so trees may be at most RECENT - 1 deep.
RECENT = 32


def hybrid_attention(
  q,
  k_cache,
  v_cache,
  lengths,
  k_new,
  v_new,
  mask,
  q_positions,
  window=None,
  *,
  layer=None,
  split_keys: int = 0,
  dtype=jnp.float32,
  interpret: bool | None = None,
):
  """q [B, T, K, G, D] over the cache k/v [B, S, K, D] (or layer `layer` of the stacked
  [L, B, S, K, D], read in place; slots < lengths [B], within `window` of each query's
  position) and the step's own k_new/v_new [B, T, K, D] under mask [B, T, T]. Returns
  out [B, T, K, G, D] in `dtype`. `split_keys`: a fixed split-K range for the prefix pass,
  its partials merged in order (the bits then do not depend on S), else one from the
  shape, its partials merged in one launch (`merge.merge`)."""
  b, t, kv_heads, g, d = q.shape
  interpret = blocks.interpret_off_gpu(interpret)
  prefix = dataclasses.replace(
    params_for(Pass.PREFIX, t * g, d, k_cache.shape[-3], b * kv_heads, extra_parts=1), split_keys=split_keys
  )
  tree = params_for(Pass.TREE, t * g, d, t, b * kv_heads)
  block_rows = max(prefix.block_rows, tree.block_rows)  # one row layout for both passes
  rows = blocks.to_rows(q, block_rows)
  lo, hi = (blocks.per_row(x, g, rows.shape[2]) for x in bounds(lengths, q_positions, window, t))
  mask_rows = blocks.per_row(mask, g, rows.shape[2])
  parts = hybrid_partials(
    rows,
    k_cache,
    v_cache,
    lo,
    hi,
    k_new,
    v_new,
    mask_rows,
    dataclasses.replace(prefix, block_rows=block_rows),
    tree.block_keys,
    interpret,
    layer=layer,
  )
  if split_keys:  # as many as the cache allows, merged one by one (those past a query's keys add zeros)
    return blocks.merge_in_order([parts], t, g)[0].astype(dtype)
  return merge(*parts, t, g, dtype, interpret=interpret)[0]


def _kernel(
  layer_ref,
  q_ref,
  k_ref,
  v_ref,
  lo_ref,
  hi_ref,
  k_new_ref,
  v_new_ref,
  mask_ref,
  out_ref,
  lse_ref,
  *,
  prefix,
  tree,
  splits,
):
  # Programs 0 .. splits - 1 along the last grid axis: the prefix pass's splits; the last: the tree's.
  split = pl.program_id(2)

  def write(out, lse):
    out_ref[...] = out
    lse_ref[...] = lse

  @pl.when(split < splits)
  def _():
    write(*attend_prefix(layer_ref[0], q_ref[...], k_ref, v_ref, lo_ref[...], hi_ref[...], split, **prefix))

  @pl.when(split == splits)
  def _():
    write(*attend_tree(q_ref[...], k_new_ref, v_new_ref, mask_ref, **tree))


def hybrid_partials(
  rows, k, v, lo, hi, k_new, v_new, mask_rows, params: KernelParams, tree_block_keys: int, interpret: bool, layer=None
):
  """rows [B, K, R, D] over the cache k, v [B, S, K, D] (or layer `layer` of [L, B, S, K, D])
  at lo <= slot < hi ([B, R] int32), and over the tree's k_new, v_new [B, N, K, D] under
  mask_rows [B, R, N], in one launch. Returns partials out [P + 1, B, K, R, D] f32 and lse
  [P + 1, B, K, R]: the prefix pass's P splits, then the tree's."""
  k, v, layer = stacked(k, v, layer)
  grid, prefix = split_k(rows, k, params, extra_parts=1)
  n, d = k_new.shape[1], rows.shape[-1]
  head = grid.head
  new = pl.BlockSpec((None, n, None, d), lambda bh, i, s: (head(bh)[0], 0, head(bh)[1], 0))
  static = dict(
    prefix=prefix,
    tree=dict(
      block_keys=tree_block_keys,
      split_len=pl.cdiv(n, tree_block_keys) * tree_block_keys,
      num_keys=n,
      scale=prefix["scale"],
    ),
    splits=grid.splits - 1,
  )
  return pl.pallas_call(
    functools.partial(_kernel, **static),
    grid=grid.grid,
    in_specs=[
      *grid.inputs,
      grid.per_row,
      grid.per_row,
      new,
      new,
      pl.BlockSpec((None, params.block_rows, n), lambda bh, i, s: (head(bh)[0], i, 0)),
    ],
    out_specs=grid.outputs,
    out_shape=grid.out_shape,
    compiler_params=plgpu.CompilerParams(num_warps=params.num_warps, num_stages=params.num_stages),
    interpret=interpret,
    name="hybrid_attention",
  )(layer, rows, k, v, lo, hi, k_new, v_new, mask_rows)


def invariant_hybrid_attention(
  q,
  k_cache,
  v_cache,
  lengths,
  k_new,
  v_new,
  mask,
  q_positions,
  window=None,
  *,
  layer=None,
  interpret: bool | None = None,
):
  """`hybrid_attention` (same arguments; `mask` must be the tree's ancestor mask, node
  itself included, and the step's tokens sit at depths q_positions - lengths < RECENT),
  computed so that a query's output depends only on its position, its path and the
  cache's contents, bit for bit, never on the other queries of the call or on how many
  slots the cache has.

  Where a query's keys come from differs between calls: for AR at position p every earlier
  key is in the cache; for a tree node at p, those after the round's start are its
  ancestors. So a query at p splits its keys by position, not by where they lie: the far
  part, slots < p - RECENT + 1, all committed, by the split-K prefix pass with one launch
  for every call (fixed splits and blocks, aligned to absolute slots); the near part, positions
  p - RECENT + 1 .. p, gathered into RECENT lanes (lane i: position p - RECENT + 1 + i)
  from the cache or from the query's own ancestors, attended one query per program. The
  parts are merged one after another in a fixed order."""
  b, t, kv_heads, g, d = q.shape
  interpret = blocks.interpret_off_gpu(interpret)
  if layer is None:
    k_cache, v_cache, layer = k_cache[None], v_cache[None], 0
  seq_len = k_cache.shape[2]
  params = invariant_prefix_params()
  rows = blocks.to_rows(q, params.block_rows)
  lo, _ = bounds(lengths, q_positions, window, t)
  far_end = jnp.clip(q_positions - (RECENT - 1), 0, lengths[:, None]).astype(jnp.int32)  # [B, T]
  lo, hi = (blocks.per_row(x, g, rows.shape[2]) for x in (lo, far_end))
  far_out, far_lse = prefix_partials(rows, k_cache, v_cache, lo, hi, params, interpret, layer=layer)

  # The near lanes: from the cache before the round's start, else from the query's ancestor at that depth.
  lanes = q_positions[:, :, None] - (RECENT - 1) + jnp.arange(RECENT)  # [B, T, W] positions
  lane_depth = lanes - lengths[:, None, None]  # < 0: committed
  node_depth = q_positions - lengths[:, None]  # [B, T]
  at_depth = mask[:, :, :, None] & (node_depth[:, None, :, None] == jnp.arange(RECENT))  # [B, T, T, W]
  ancestor = jnp.take_along_axis(jnp.argmax(at_depth, axis=2), jnp.clip(lane_depth, 0, RECENT - 1), axis=2)
  batch = jnp.arange(b)[:, None, None]
  slot = jnp.clip(lanes, 0, seq_len - 1)
  committed = (lane_depth < 0)[..., None, None]

  def near(cache, new):  # [B * T, W, K, D]
    keys = jnp.where(committed, cache[layer, batch, slot], new[batch, ancestor])  # [B, T, W, K, D]
    return keys.reshape(b * t, RECENT, kv_heads, d)

  visible = lanes >= 0
  if window is not None:
    visible &= q_positions[:, :, None] - lanes < window
  tree = params_for(Pass.TREE, g, d, RECENT, b * t * kv_heads)  # one query's rows, whatever T is
  near_rows = blocks.to_rows(q.reshape(b * t, 1, kv_heads, g, d), tree.block_rows)
  near_mask = blocks.per_row(visible.reshape(b * t, 1, RECENT), g, near_rows.shape[2])
  near_out, near_lse = tree_partial(near_rows, near(k_cache, k_new), near(v_cache, v_new), near_mask, tree, interpret)
  near_out = blocks.to_rows(blocks.from_rows(near_out[0], 1, g).reshape(b, t, kv_heads, g, d), params.block_rows)
  near_lse = blocks.to_rows(
    blocks.from_rows(near_lse[0, ..., None], 1, g).reshape(b, t, kv_heads, g, 1), params.block_rows
  )[..., 0]
  return blocks.merge_in_order([(far_out, far_lse), (near_out[None], near_lse[None])], t, g)[0]
