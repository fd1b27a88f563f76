"""Masked attention of the tree queries over the tree keys (the speculative tokens).

Blocked like FlashAttention-2: each program holds one block of query rows and walks the
tree's keys in blocks, loading the matching block of the ancestor mask alongside.
The tree is small (tens to a few hundred nodes), so one program covers all its keys.

Reference twin: `longspec_jax.ops.attention.masked_attention_reference`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import blocks
from pallas_kernels.flash_decode import split_length
from pallas_kernels.merge import merge
from pallas_kernels.tuning import KernelParams, Pass, params_for


def attend_tree(q, k_ref, v_ref, mask_ref, split=0, *, block_keys, split_len, num_keys, scale):
  """Rows q [R, D] over split `split`'s keys (`split_len` of them, a multiple of block_keys)
  of k_ref, v_ref [N, D] under mask_ref [R, N] (row r sees key j where set). Returns
  (out f32 [R, D], lse [R])."""
  begin = split * split_len

  def visible(slots, i):
    cols = pl.ds(begin + i * block_keys, block_keys)
    return plgpu.load(mask_ref.at[:, cols], mask=(slots < num_keys)[None, :], other=False)

  num_blocks = pl.cdiv(jnp.minimum(split_len, num_keys - begin), block_keys)
  return blocks.attend_blocks(q, k_ref, v_ref, begin, num_blocks, block_keys, num_keys, visible, scale)


def _kernel(q_ref, k_ref, v_ref, mask_ref, out_ref, lse_ref, **static):
  out, lse = attend_tree(q_ref[...], k_ref, v_ref, mask_ref, pl.program_id(2), **static)
  out_ref[...] = out
  lse_ref[...] = lse


def tree_partial(rows, k, v, mask_rows, params: KernelParams, interpret: bool):
  """rows [B, K, R, D]; k, v [B, N, K, D]; mask_rows [B, R, N] bool (row r: query r // G).
  The keys are split into `params.splits` ranges, one program each (a ring of hundreds of
  keys walked by one program a head left most of the GPU idle). Returns partials out [P,
  B, K, R, D] f32 and lse [P, B, K, R], one per range."""
  b, kv_heads, r, d = rows.shape
  n = k.shape[1]
  split_len = split_length(n, params)
  splits = pl.cdiv(n, split_len)
  kernel = functools.partial(_kernel, block_keys=params.block_keys, split_len=split_len, num_keys=n, scale=d**-0.5)
  head = lambda bh: (bh // kv_heads, bh % kv_heads)
  return pl.pallas_call(
    kernel,
    grid=(b * kv_heads, r // params.block_rows, splits),
    in_specs=[
      pl.BlockSpec((None, None, params.block_rows, d), lambda bh, i, s: (*head(bh), i, 0)),
      pl.BlockSpec((None, n, None, d), lambda bh, i, s: (head(bh)[0], 0, head(bh)[1], 0)),
      pl.BlockSpec((None, n, None, d), lambda bh, i, s: (head(bh)[0], 0, head(bh)[1], 0)),
      pl.BlockSpec((None, params.block_rows, n), lambda bh, i, s: (head(bh)[0], i, 0)),
    ],
    out_specs=[
      pl.BlockSpec((None, None, None, params.block_rows, d), lambda bh, i, s: (s, *head(bh), i, 0)),
      pl.BlockSpec((None, None, None, params.block_rows), lambda bh, i, s: (s, *head(bh), i)),
    ],
    out_shape=[
      jax.ShapeDtypeStruct((splits, b, kv_heads, r, d), jnp.float32),
      jax.ShapeDtypeStruct((splits, b, kv_heads, r), jnp.float32),
    ],
    compiler_params=plgpu.CompilerParams(num_warps=params.num_warps, num_stages=params.num_stages),
    interpret=interpret,
    name="tree_attention",
  )(rows, k, v, mask_rows)


def tree_attention(q, k, v, mask, *, params: KernelParams | None = None, interpret: bool | None = None):
  """q [B, T, K, G, D] over k, v [B, N, K, D] under mask [B, T, N] (query i sees key j).
  Returns (out f32 [B, T, K, G, D], lse [B, T, K, G])."""
  b, t, kv_heads, g, d = q.shape
  params = params or params_for(Pass.TREE, t * g, d, k.shape[1], b * kv_heads)
  interpret = blocks.interpret_off_gpu(interpret)
  rows = blocks.to_rows(q, params.block_rows)
  return merge(
    *tree_partial(rows, k, v, blocks.per_row(mask, g, rows.shape[2]), params, interpret), t, g, interpret=interpret
  )
