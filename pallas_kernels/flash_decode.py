"""Flash decoding: a few queries (one AR token, or a tree's nodes) over a long cached prefix.

The cache may be the stacked [L, B, S, K, D] of every layer, with the layer chosen by an
index the kernel reads at run time: inside the target's layer scan, a per-layer slice
handed to a custom call is a copy XLA makes of the whole slice (every allocated slot, twice
the bytes the pass needs), so the kernel reads the layer in place instead.

The key axis is split into `splits` contiguous ranges processed by separate programs
(split-K), so that even one sequence with a few KV heads fills the GPU; each program runs
an online softmax over its range in blocks and writes a normalized partial (out, lse);
`merge.merge` merges the partials exactly. Each query row r sees the cached slots
lo[r] <= slot < hi[r]: hi is the committed length (or the draft's delayed limit), lo
the start of a sliding window.

Reference twin: `longspec_jax.ops.attention.prefix_attention_reference`.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import blocks
from pallas_kernels.merge import merge
from pallas_kernels.tuning import KernelParams, Pass, params_for


def attend_prefix(layer, q, k_ref, v_ref, lo, hi, split, *, block_keys, split_len, seq_len, scale):
  """Rows q [R, D] over split `split`'s cached keys of layer `layer` of k_ref, v_ref [L, S, D],
  row r seeing slots lo[r] <= slot < hi[r]. Returns its partial (out f32 [R, D], lse [R])."""
  start = split * split_len
  split_end = jnp.minimum(start + split_len, seq_len)
  # Blocks start at whole multiples of block_keys from the split's start whatever the rows'
  # windows are, so a row's keys fall in the same blocks and lanes in every call.
  begin = start + jnp.maximum(jnp.min(lo) - start, 0) // block_keys * block_keys
  num_blocks = pl.cdiv(jnp.maximum(jnp.minimum(split_end, jnp.max(hi)) - begin, 0), block_keys)
  # Blocks inside every row's range need no mask: all of them but the edges, usually.
  full_begin = pl.cdiv(jnp.maximum(jnp.max(lo) - begin, 0), block_keys)
  full_end = jnp.maximum(jnp.minimum(split_end, jnp.min(hi)) - begin, 0) // block_keys
  visible = lambda slots, i: (
    (slots[None, :] >= lo[:, None]) & (slots[None, :] < hi[:, None]) & (slots[None, :] < split_end)
  )
  return blocks.attend_blocks(
    q,
    k_ref,
    v_ref,
    begin,
    num_blocks,
    block_keys,
    seq_len,
    visible,
    scale,
    full=(full_begin, full_end),
    lead=(layer,),
  )


def _kernel(layer_ref, q_ref, k_ref, v_ref, lo_ref, hi_ref, out_ref, lse_ref, **static):
  out, lse = attend_prefix(layer_ref[0], q_ref[...], k_ref, v_ref, lo_ref[...], hi_ref[...], pl.program_id(2), **static)
  out_ref[...] = out
  lse_ref[...] = lse


@dataclasses.dataclass(frozen=True)
class SplitK:
  """The launch both prefix kernels share (this one and `sparse_decode`'s): a grid of
  (B * K heads, row blocks, splits) programs over rows [B, K, R, D] and a stacked cache
  [L, B, S, K, D], each writing one normalized partial (out, lse) of its split."""

  batch: int
  kv_heads: int
  rows: int  # R, a multiple of block_rows
  head_dim: int
  num_layers: int
  seq_len: int
  block_rows: int
  splits: int  # the partials: programs along the key axis

  @property
  def grid(self) -> tuple[int, int, int]:
    return self.batch * self.kv_heads, self.rows // self.block_rows, self.splits

  def head(self, bh):
    """A program's (sequence, KV head)."""
    return bh // self.kv_heads, bh % self.kv_heads

  @property
  def inputs(self) -> list:
    """The layer index [1], the program's row block and its KV head's stacked K and V."""
    cache = pl.BlockSpec(
      (self.num_layers, None, self.seq_len, None, self.head_dim),
      lambda bh, i, s: (0, self.head(bh)[0], 0, self.head(bh)[1], 0),
    )
    return [
      pl.BlockSpec((1,), lambda bh, i, s: (0,)),
      pl.BlockSpec((None, None, self.block_rows, self.head_dim), lambda bh, i, s: (*self.head(bh), i, 0)),
      cache,
      cache,
    ]

  @property
  def per_row(self) -> pl.BlockSpec:
    """A per-row array [B, R] (a row's visible bound), this program's row block of it."""
    return pl.BlockSpec((None, self.block_rows), lambda bh, i, s: (self.head(bh)[0], i))

  @property
  def outputs(self) -> list:
    return [
      pl.BlockSpec((None, None, None, self.block_rows, self.head_dim), lambda bh, i, s: (s, *self.head(bh), i, 0)),
      pl.BlockSpec((None, None, None, self.block_rows), lambda bh, i, s: (s, *self.head(bh), i)),
    ]

  @property
  def out_shape(self) -> list:
    """Per-split partials out [P, B, K, R, D] f32 and lse [P, B, K, R]."""
    lead = (self.splits, self.batch, self.kv_heads, self.rows)
    return [jax.ShapeDtypeStruct((*lead, self.head_dim), jnp.float32), jax.ShapeDtypeStruct(lead, jnp.float32)]


def prefix_partials(rows, k, v, lo, hi, params: KernelParams, interpret: bool, layer=None):
  """rows [B, K, R, D] (R a multiple of block_rows); k, v [B, S, K, D], or [L, B, S, K, D]
  with `layer` (an int or int32 scalar) naming the one to read; lo, hi [B, R] int32.
  Returns per-split partials out [P, B, K, R, D] f32 and lse [P, B, K, R]."""
  k, v, layer = stacked(k, v, layer)
  grid, static = split_k(rows, k, params)
  return pl.pallas_call(
    functools.partial(_kernel, **static),
    grid=grid.grid,
    in_specs=[*grid.inputs, grid.per_row, grid.per_row],
    out_specs=grid.outputs,
    out_shape=grid.out_shape,
    compiler_params=plgpu.CompilerParams(num_warps=params.num_warps, num_stages=params.num_stages),
    interpret=interpret,
    name="flash_decode",
  )(layer, rows, k, v, lo, hi)


def stacked(k, v, layer):
  """k, v as a stacked cache [L, B, S, K, D] and the layer to read as an int32 [1]: a
  single cache [B, S, K, D] becomes layer 0 of one; an int layer may count from the end."""
  if layer is None:
    k, v, layer = k[None], v[None], 0
  if isinstance(layer, int):
    layer %= k.shape[0]  # (-1: the last layer)
  return k, v, jnp.asarray(layer, jnp.int32).reshape(1)


def split_k(rows, k, params: KernelParams, extra_parts: int = 0) -> tuple[SplitK, dict]:
  """The split-K launch of rows [B, K, R, D] over the stacked cache k [L, B, S, K, D], with
  `extra_parts` more partials after the splits, and `attend_prefix`'s static arguments."""
  b, kv_heads, r, d = rows.shape
  num_layers, _, seq_len = k.shape[:3]
  split_len = split_length(seq_len, params)
  splits = pl.cdiv(seq_len, split_len)
  grid = SplitK(b, kv_heads, r, d, num_layers, seq_len, params.block_rows, splits + extra_parts)
  return grid, dict(block_keys=params.block_keys, split_len=split_len, seq_len=seq_len, scale=d**-0.5)


def split_length(seq_len: int, params: KernelParams) -> int:
  """Keys per split-K program: `params.split_keys` when fixed, else `params.splits` ranges
  rounded up to whole key blocks."""
  if params.split_keys:
    return params.split_keys
  return pl.cdiv(pl.cdiv(seq_len, params.splits), params.block_keys) * params.block_keys


def bounds(lengths, q_positions, window, t: int):
  """Per-query visible slot range [lo, hi) as [B, T] arrays."""
  hi = jnp.broadcast_to(lengths[:, None] if lengths.ndim == 1 else lengths, (lengths.shape[0], t))
  lo = jnp.zeros_like(hi) if window is None else jnp.maximum(q_positions - window + 1, 0)
  return lo.astype(jnp.int32), hi.astype(jnp.int32)


def flash_decode(
  q,
  k,
  v,
  lengths,
  q_positions=None,
  window=None,
  *,
  layer=None,
  params: KernelParams | None = None,
  interpret: bool | None = None,
):
  """q [B, T, K, G, D] over k, v [B, S, K, D] (or layer `layer` of [L, B, S, K, D]) at
  slots < lengths ([B], or [B, T] per query) and, with `window`, > q_positions - window.
  Returns (out f32 [B, T, K, G, D], lse [B, T, K, G])."""
  b, t, kv_heads, g, d = q.shape
  params = params or params_for(Pass.PREFIX, t * g, d, k.shape[-3], b * kv_heads)
  interpret = blocks.interpret_off_gpu(interpret)
  rows = blocks.to_rows(q, params.block_rows)
  lo, hi = (blocks.per_row(x, g, rows.shape[2]) for x in bounds(lengths, q_positions, window, t))
  return merge(*prefix_partials(rows, k, v, lo, hi, params, interpret, layer=layer), t, g, interpret=interpret)
