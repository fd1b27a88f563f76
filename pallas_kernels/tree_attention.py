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
from pallas_kernels.tuning import KernelParams, Pass, params_for


def _kernel(q_ref, k_ref, v_ref, mask_ref, out_ref, lse_ref, *, block_keys, num_keys, scale):

  def visible(slots, i):
    cols = pl.ds(i * block_keys, block_keys)
    return plgpu.load(mask_ref.at[:, cols], mask=(slots < num_keys)[None, :], other=False)

  out, lse = blocks.attend_blocks(
    q_ref[...], k_ref, v_ref, 0, pl.cdiv(num_keys, block_keys), block_keys, num_keys, visible, scale
  )
  out_ref[...] = out
  lse_ref[...] = lse


def tree_partial(rows, k, v, mask_rows, params: KernelParams, interpret: bool):
  """rows [B, K, R, D]; k, v [B, N, K, D]; mask_rows [B, R, N] bool (row r: query r // G).
  Returns out [1, B, K, R, D] f32 and lse [1, B, K, R], shaped as one more partial."""
  b, kv_heads, r, d = rows.shape
  n = k.shape[1]
  kernel = functools.partial(_kernel, block_keys=params.block_keys, num_keys=n, scale=d**-0.5)
  head = lambda bh: (bh // kv_heads, bh % kv_heads)
  out_specs = [
    pl.BlockSpec((None, None, params.block_rows, d), lambda bh, i: (*head(bh), i, 0)),
    pl.BlockSpec((None, None, params.block_rows), lambda bh, i: (*head(bh), i)),
  ]
  out, lse = pl.pallas_call(
    kernel,
    grid=(b * kv_heads, r // params.block_rows),
    in_specs=[
      pl.BlockSpec((None, None, params.block_rows, d), lambda bh, i: (*head(bh), i, 0)),
      pl.BlockSpec((None, n, None, d), lambda bh, i: (head(bh)[0], 0, head(bh)[1], 0)),
      pl.BlockSpec((None, n, None, d), lambda bh, i: (head(bh)[0], 0, head(bh)[1], 0)),
      pl.BlockSpec((None, params.block_rows, n), lambda bh, i: (head(bh)[0], i, 0)),
    ],
    out_specs=out_specs,
    out_shape=[
      jax.ShapeDtypeStruct((b, kv_heads, r, d), jnp.float32),
      jax.ShapeDtypeStruct((b, kv_heads, r), jnp.float32),
    ],
    compiler_params=plgpu.CompilerParams(num_warps=params.num_warps, num_stages=params.num_stages),
    interpret=interpret,
    name="tree_attention",
  )(rows, k, v, mask_rows)
  return out[None], lse[None]


def tree_attention(q, k, v, mask, *, params: KernelParams | None = None, interpret: bool | None = None):
  """q [B, T, K, G, D] over k, v [B, N, K, D] under mask [B, T, N] (query i sees key j).
  Returns (out f32 [B, T, K, G, D], lse [B, T, K, G])."""
  b, t, kv_heads, g, d = q.shape
  params = params or params_for(Pass.TREE, t * g, d, k.shape[1], b * kv_heads)
  interpret = blocks.interpret_off_gpu(interpret)
  rows = blocks.to_rows(q, params.block_rows)
  return blocks.merge([tree_partial(rows, k, v, blocks.per_row(mask, g, rows.shape[2]), params, interpret)], t, g)
