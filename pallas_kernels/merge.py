"""The exact merge of partial attention passes in one launch.

The split-K prefix pass (and the tree pass beside it) writes one normalized partial
(out, lse) per split; the query's output is their log-sum-exp weighted sum. As XLA
fusions the merge is two or three kernels a layer (the log-sum-exp's reductions, the
weighted sum with its transpose back to [B, T, K, G, D], the rounding to the model's
dtype), each at a launch's fixed cost for a few kilobytes: at Llama-3.1-8B's shape about
4 us a layer of an AR step. Here one program per (sequence, position, KV head) reads its
G rows of every partial, and writes the merged rows where the model reads them, in its
dtype.

Not batch-invariant (the sum over partials is a tree of the padded partial count): the
batch-invariant pass keeps `blocks.merge_in_order`.

Reference twin: `pallas_kernels.blocks.merge`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import blocks

# Elements of the [P, G, D] partial tile one program holds: 64 float32 values a thread
# with 4 warps; a larger tile is split along D over more programs.
_TILE = 8192


def _kernel(out_ref, lse_ref, merged_ref, merged_lse_ref, *, parts: int, g: int, block_d: int, positions: int):
  # out_ref [P, R, D] and lse_ref [P, R]: this (sequence, KV head)'s partials; merged_ref [N, G, D] and
  # merged_lse_ref [N, G]: this program's N = `positions` positions' rows (N squeezed when 1), merged
  # one position after another. Tiles are powers of two, the lanes past P and G masked.
  block, j = pl.program_id(1), pl.program_id(2)
  p_lanes, g_lanes = pl.next_power_of_2(parts), pl.next_power_of_2(g)
  part_ok = jnp.arange(p_lanes) < parts
  row_ok = jnp.arange(g_lanes) < g
  ok = part_ok[:, None] & row_ok[None, :]  # [P, G]
  cols = pl.ds(j * block_d, block_d)

  def position(n, carry):
    rows = pl.ds((block * positions + n) * g, g_lanes)
    lse = plgpu.load(lse_ref.at[pl.ds(0, p_lanes), rows], mask=ok, other=blocks.NEG_INF)  # [P, G]
    peak = jnp.max(lse, axis=0)
    peak = jnp.where(peak == blocks.NEG_INF, 0.0, peak)  # rows no partial saw
    weight = jnp.exp(lse - peak[None, :])  # [P, G]; a partial that saw nothing weighs 0
    total = jnp.sum(weight, axis=0)  # [G]
    seen = total > 0
    weight = weight / jnp.where(seen, total, 1.0)[None, :]
    tile_ok = jnp.broadcast_to(ok[:, :, None], (p_lanes, g_lanes, block_d))
    parts_out = plgpu.load(out_ref.at[pl.ds(0, p_lanes), rows, cols], mask=tile_ok, other=0.0)  # [P, G, Dj]
    merged = jnp.sum(parts_out * weight[:, :, None], axis=0)  # [G, Dj]
    store_ok = jnp.broadcast_to(row_ok[:, None], (g_lanes, block_d))
    at = () if positions == 1 else (n,)
    plgpu.store(merged_ref.at[*at, pl.ds(0, g_lanes), cols], merged.astype(merged_ref.dtype), mask=store_ok)

    @pl.when(j == 0)
    def _():
      merged_lse = jnp.where(seen, peak + jnp.log(jnp.where(seen, total, 1.0)), blocks.NEG_INF)
      plgpu.store(merged_lse_ref.at[*at, pl.ds(0, g_lanes)], merged_lse, mask=row_ok)

    return carry

  if positions == 1:
    position(0, 0)
  else:
    jax.lax.fori_loop(0, positions, position, 0)


@functools.partial(jax.jit, static_argnames=("t", "g", "dtype", "interpret", "positions"))
def merge(out, lse, t: int, g: int, dtype=jnp.float32, *, interpret: bool | None = None, positions: int | None = None):
  """Partials out [P, B, K, R_pad, D] f32 and lse [P, B, K, R_pad] over disjoint keys (row
  r = t * G + g, as `blocks.to_rows` lays them out; parts that saw nothing have lse -inf)
  -> (out [B, T, K, G, D] in `dtype`, lse [B, T, K, G] f32). `positions`: how many each
  program merges (a divisor of T). By default one on a GPU (parallel programs), every one
  off it: the interpreter runs programs one by one, each copying its blocks whole."""
  parts, b, kv_heads, r_pad, d = out.shape
  interpret = blocks.interpret_off_gpu(interpret)
  block_d = d
  while pl.next_power_of_2(parts) * pl.next_power_of_2(g) * block_d > _TILE and block_d > 16:
    block_d //= 2
  positions = positions or (t if interpret else 1)
  block_positions = None if positions == 1 else positions
  head = lambda i: (i // kv_heads, i % kv_heads)  # program axis 0: (sequence, KV head)
  return pl.pallas_call(
    functools.partial(_kernel, parts=parts, g=g, block_d=block_d, positions=positions),
    grid=(b * kv_heads, t // positions, d // block_d),
    in_specs=[
      pl.BlockSpec((parts, None, None, r_pad, d), lambda i, s, j: (0, *head(i), 0, 0)),
      pl.BlockSpec((parts, None, None, r_pad), lambda i, s, j: (0, *head(i), 0)),
    ],
    out_specs=[
      pl.BlockSpec((None, block_positions, None, g, d), lambda i, s, j: (head(i)[0], s, head(i)[1], 0, 0)),
      pl.BlockSpec((None, block_positions, None, g), lambda i, s, j: (head(i)[0], s, head(i)[1], 0)),
    ],
    out_shape=[
      jax.ShapeDtypeStruct((b, t, kv_heads, g, d), dtype),
      jax.ShapeDtypeStruct((b, t, kv_heads, g), jnp.float32),
    ],
    compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1),
    interpret=interpret,
    name="merge_partials",
  )(out, lse)
