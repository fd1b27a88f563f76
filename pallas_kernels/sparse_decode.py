"""Block-sparse flash decoding: a few queries over the chunks of a long cached prefix that
a selection kept (SpecAttn's sparse verification, specattn.md section 3.5).

Each KV head of each sequence reads its own list of chunks (`chunk` slots each, the
chunks `topp.select_chunks` kept for it): the list is compacted from the kept mask
without a sort (a prefix sum gives each kept chunk its place), so a program walks only
the chunks on it and K/V bytes read fall with the chunks dropped. As in `flash_decode`,
the cache may be the stacked [L, B, S, K, D] of every layer read in place at a layer
index, each list is shared evenly among programs (split-K over list entries, however
few the chunks kept) so one sequence fills the GPU, and each program writes a normalized
partial (out, lse) that `merge.merge` combines exactly; each query row still sees only slots < its length.

Reference twin: `longspec_jax.ops.attention.sparse_prefix_attention_reference`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import blocks
from pallas_kernels.flash_decode import SplitK, bounds
from pallas_kernels.merge import merge
from pallas_kernels.topp import CHUNK
from pallas_kernels.tuning import Pass, params_for, wave_programs


def compact(kept: jax.Array) -> tuple[jax.Array, jax.Array]:
  """kept [B, K, C] bool -> (the kept chunks' indices in increasing order [B, K, C] int32,
  the rest of each list 0; how many [B, K, 1] int32), by a prefix sum, not a sort."""
  place = jnp.cumsum(kept, axis=-1) - 1  # [B, K, C]: each kept chunk's place on its list
  chunks = kept.shape[-1]
  index = jnp.broadcast_to(jnp.arange(chunks, dtype=jnp.int32), kept.shape)
  b, k = jnp.indices(kept.shape[:2])
  lists = (
    jnp.zeros(kept.shape, jnp.int32)
    .at[b[..., None], k[..., None], jnp.where(kept, place, chunks)]
    .set(index, mode="drop")
  )
  return lists, jnp.sum(kept, axis=-1, keepdims=True, dtype=jnp.int32)


def _kernel(
  layer_ref, q_ref, k_ref, v_ref, hi_ref, list_ref, count_ref, out_ref, lse_ref, *, splits, chunk, seq_len, scale
):
  layer = layer_ref[0]  # k_ref, v_ref [L, S, D]; list_ref [C] this head's chunks; count_ref [2]
  hi = hi_ref[...]  # [block_rows]
  count, inside = count_ref[0], count_ref[1]  # entries on the list; the first `inside` need no mask
  # The head's entries are shared evenly among its splits whatever their number, so the
  # pass's time falls with the chunks dropped (a split sized for the whole context would
  # leave most programs idle and the rest as busy as in the dense pass).
  per_split = pl.cdiv(count, splits)
  first = pl.program_id(2) * per_split
  entries = jnp.clip(count - first, 0, per_split)
  visible = lambda slots, i: slots[None, :] < hi[:, None]
  out, lse = blocks.attend_blocks(
    q_ref[...],
    k_ref,
    v_ref,
    0,
    entries,
    chunk,
    seq_len,
    visible,
    scale,
    full=(0, inside - first),
    lead=(layer,),
    starts=lambda i: list_ref[first + i] * chunk,
  )
  out_ref[...] = out
  lse_ref[...] = lse


def sparse_flash_decode(q, k, v, lengths, kept, *, chunk: int = CHUNK, layer=None, interpret: bool | None = None):
  """q [B, T, K, G, D] over k, v [B, S, K, D] (or layer `layer` of [L, B, S, K, D]) at the
  slots < lengths [B] that lie in the chunks kept [B, K, ceil(S / chunk)] marks for each KV
  head. Returns (out f32 [B, T, K, G, D], lse [B, T, K, G]); a query that saw nothing: 0
  and -inf."""
  if chunk < 16 or chunk & (chunk - 1):
    raise ValueError(f"a chunk is a key block of the kernel: a power of two >= 16, got {chunk}.")
  if layer is None:
    k, v, layer = k[None], v[None], 0
  b, t, kv_heads, g, d = q.shape
  num_layers, _, seq_len = k.shape[:3]
  if kept.shape != (b, kv_heads, pl.cdiv(seq_len, chunk)):
    raise ValueError(
      f"kept must be [B, K, ceil(S / {chunk})] = {(b, kv_heads, pl.cdiv(seq_len, chunk))}, got {kept.shape}."
    )
  interpret = blocks.interpret_off_gpu(interpret)
  params = params_for(Pass.PREFIX, t * g, d, seq_len, b * kv_heads)
  rows = blocks.to_rows(q, params.block_rows)
  row_blocks = rows.shape[2] // params.block_rows
  _, hi = bounds(lengths, None, None, t)
  hi = blocks.per_row(hi, g, rows.shape[2])
  lists, counts = compact(kept)
  chunks = kept.shape[-1]
  # Kept chunks wholly below every row's length (a prefix of each increasing list) skip the mask.
  inside = jnp.arange(1, chunks + 1) * chunk <= jnp.minimum(jnp.min(hi, axis=1), seq_len)[:, None, None]  # [B, 1, C]
  counts = jnp.concatenate([counts, jnp.sum(kept & inside, axis=-1, keepdims=True, dtype=jnp.int32)], axis=-1)
  splits = max(1, min(chunks, wave_programs() // (b * kv_heads * row_blocks)))
  grid = SplitK(b, kv_heads, rows.shape[2], d, num_layers, seq_len, params.block_rows, splits)
  per_head = lambda size: pl.BlockSpec((None, None, size), lambda bh, i, s: (*grid.head(bh), 0))  # [B, K, size]
  out, lse = pl.pallas_call(
    functools.partial(_kernel, splits=splits, chunk=chunk, seq_len=seq_len, scale=d**-0.5),
    grid=grid.grid,
    in_specs=[*grid.inputs, grid.per_row, per_head(chunks), per_head(2)],
    out_specs=grid.outputs,
    out_shape=grid.out_shape,
    compiler_params=plgpu.CompilerParams(num_warps=params.num_warps, num_stages=params.num_stages),
    interpret=interpret,
    name="sparse_flash_decode",
  )(jnp.asarray(layer, jnp.int32).reshape(1), rows, k, v, hi, lists, counts)
  return merge(out, lse, t, g, interpret=interpret)
