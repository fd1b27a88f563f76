"""What the attention kernels share: the query-row layout, the in-kernel online-softmax
loop over key blocks, and the exact log-sum-exp combine of partial results.

Rows: the queries of one KV head, all T positions times G grouped heads, as one matrix
[B, K, R = T * G, D] padded to whole row blocks, so that every K/V block loaded from HBM
serves all query heads of its group (GQA: K/V read once per row block).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

NEG_INF = float("-inf")


def to_rows(q: jax.Array, block_rows: int) -> jax.Array:
  """q [B, T, K, G, D] -> rows [B, K, R_pad, D], row r = t * G + g, zero-padded to a
  multiple of block_rows."""
  b, t, k, g, d = q.shape
  rows = q.transpose(0, 2, 1, 3, 4).reshape(b, k, t * g, d)
  return jnp.pad(rows, ((0, 0), (0, 0), (0, pl.cdiv(t * g, block_rows) * block_rows - t * g), (0, 0)))


def from_rows(rows: jax.Array, t: int, g: int) -> jax.Array:
  """rows [B, K, R_pad, ...] -> [B, T, K, G, ...] (padding dropped)."""
  b, k = rows.shape[:2]
  out = rows[:, :, : t * g].reshape(b, k, t, g, *rows.shape[3:])
  return jnp.moveaxis(out, 2, 1)


def per_row(x: jax.Array, g: int, rows: int) -> jax.Array:
  """A per-query array [B, T, ...] repeated for its G heads and padded with copies of the
  last row (so padding rows never narrow a block's common visible range): [B, R_pad, ...]."""
  x = jnp.repeat(x, g, axis=1)
  pad = [(0, 0), (0, rows - x.shape[1])] + [(0, 0)] * (x.ndim - 2)
  return jnp.pad(x, pad, mode="edge")


def attend_blocks(
  q,
  k_ref,
  v_ref,
  begin,
  num_blocks,
  block_k: int,
  seq_len: int,
  visible,
  scale: float,
  full=(0, 0),
  lead=(),
  starts=None,
):
  """Online softmax of q [R, D] over key blocks begin, begin + block_k, ... (num_blocks of
  them; with `starts`, block i starts at slot starts(i) instead: a list of blocks) of
  k_ref/v_ref [*lead, S, D] at the leading indices `lead` (e.g. a layer of a stacked
  cache); `visible(slots [block_k], i)` -> [R, block_k] bool.
  Blocks full[0] <= i < full[1] are known to lie inside the keys and to be visible to
  every row: they skip the bounds and the mask, which cost as much as the softmax.
  Returns (out f32 [R, D] normalized, lse f32 [R]; rows that saw nothing: 0 and -inf)."""
  rows, dim = q.shape
  exact = q.dtype == jnp.float32  # f32 inputs: full f32 products, not TF32

  def body(masked: bool):
    def step(i, carry):
      acc, m, denom = carry
      first = begin + i * block_k if starts is None else starts(i)
      keys = (*lead, pl.ds(first, block_k), slice(None))
      slots = first + jnp.arange(block_k)
      in_range = (slots < seq_len)[:, None]

      def load(ref):
        return plgpu.load(ref.at[keys], mask=in_range, other=0.0) if masked else ref[keys]

      # Scores stay unscaled until after the max is taken off: a product feeding a subtraction
      # could become one fused multiply-add in this loop and not in the other (the mask's
      # select sits between them there), and a row's bits would then depend on which of its
      # blocks the call's other rows leave whole.
      s = plgpu.dot(q, load(k_ref), trans_b=True, allow_tf32=not exact)  # [R, block_k] f32, unscaled
      if masked:
        s = jnp.where(visible(slots, i), s, NEG_INF)
      m_new = jnp.maximum(m, jnp.max(s, axis=1))
      m_safe = jnp.where(m_new == NEG_INF, 0.0, m_new)  # rows with nothing visible yet
      correction = jnp.exp((m - m_safe) * scale)
      p = jnp.exp((s - m_safe[:, None]) * scale)
      v = load(v_ref)
      acc = acc * correction[:, None] + plgpu.dot(p.astype(v.dtype), v, allow_tf32=not exact)
      return acc, m_new, denom * correction + jnp.sum(p, axis=1)

    return step

  first_full = jnp.clip(full[0], 0, num_blocks)
  end_full = jnp.clip(full[1], first_full, num_blocks) if seq_len >= block_k else first_full  # (no whole block fits)
  carry = (
    jnp.zeros((rows, dim), jnp.float32),
    jnp.full((rows,), NEG_INF, jnp.float32),
    jnp.zeros((rows,), jnp.float32),
  )
  carry = jax.lax.fori_loop(0, first_full, body(masked=True), carry)
  if seq_len >= block_k:
    carry = jax.lax.fori_loop(first_full, end_full, body(masked=False), carry)
  acc, m, denom = jax.lax.fori_loop(end_full, num_blocks, body(masked=True), carry)
  seen = denom > 0
  out = acc / jnp.where(seen, denom, 1.0)[:, None]
  return out, jnp.where(seen, m * scale + jnp.log(jnp.where(seen, denom, 1.0)), NEG_INF)


def merge(parts, t: int, g: int) -> tuple[jax.Array, jax.Array]:
  """Exact merge of partial passes over disjoint keys (the reference twin of the kernels'
  one-launch `merge.merge`). parts: (out [P, B, K, R_pad, D],
  lse [P, B, K, R_pad]) pairs, e.g. the prefix pass's splits and the tree pass. Returns
  (out f32 [B, T, K, G, D], lse [B, T, K, G]). Padding rows are dropped before anything is
  read, and the partial outputs are weighted where they lie, never concatenated; parts
  that saw nothing (lse -inf) vanish."""
  parts = [(out[..., : t * g, :], lse[..., : t * g]) for out, lse in parts]
  lse = jax.nn.logsumexp(jnp.concatenate([lse for _, lse in parts]), axis=0)  # [B, K, T * G]
  safe = jnp.where(jnp.isfinite(lse), lse, 0.0)
  out = sum(jnp.sum(out * jnp.exp(part_lse - safe)[..., None], axis=0) for out, part_lse in parts)
  return from_rows(out, t, g), from_rows(lse, t, g)


def merge_in_order(parts, t: int, g: int) -> tuple[jax.Array, jax.Array]:
  """`merge` (same arguments), with every sum over the partials taken one partial after
  another (each part's in order, the parts in list order) as elementwise operations: an
  element's result depends on its own inputs alone, never on how many rows the call has
  or how many partials there are (a reduction over a partials axis may be tiled by either;
  a partial that saw nothing adds exact zeros)."""
  partials = [(out[i, ..., : t * g, :], lse[i, ..., : t * g]) for out, lse in parts for i in range(out.shape[0])]
  peak = functools.reduce(jnp.maximum, [lse for _, lse in partials])
  peak = jnp.where(jnp.isfinite(peak), peak, 0.0)
  total = functools.reduce(jnp.add, [jnp.exp(lse - peak) for _, lse in partials])
  lse = peak + jnp.log(total)  # log(0) = -inf: rows that saw nothing
  safe = jnp.where(jnp.isfinite(lse), lse, 0.0)
  out = functools.reduce(jnp.add, [out * jnp.exp(part_lse - safe)[..., None] for out, part_lse in partials])
  return from_rows(out, t, g), from_rows(lse, t, g)


def interpret_off_gpu(interpret: bool | None) -> bool:
  """`interpret` as given, or by default whether the kernels must run in Pallas's
  interpreter: everywhere but a GPU."""
  return jax.default_backend() != "gpu" if interpret is None else interpret
