"""What the attention kernels share: the query-row layout, the in-kernel online-softmax
loop over key blocks, and the exact log-sum-exp combine of partial results.

Rows: the queries of one KV head, all T positions times G grouped heads, as one matrix
[B, K, R = T * G, D] padded to whole row blocks, so that every K/V block loaded from HBM
serves all query heads of its group (GQA: K/V read once per row block).
"""

from __future__ import annotations

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
  """A per-query array [B, T, ...] repeated for its G heads and padded: [B, R_pad, ...]."""
  x = jnp.repeat(x, g, axis=1)
  pad = [(0, 0), (0, rows - x.shape[1])] + [(0, 0)] * (x.ndim - 2)
  return jnp.pad(x, pad)


def attend_blocks(q, k_ref, v_ref, begin, num_blocks, block_k: int, seq_len: int, visible, scale: float):
  """Online softmax of q [R, D] over key blocks begin, begin + block_k, ... (num_blocks of
  them) of k_ref/v_ref [S, D]; `visible(slots [block_k], i)` -> [R, block_k] bool.
  Returns (out f32 [R, D] normalized, lse f32 [R]; rows that saw nothing: 0 and -inf)."""
  rows, dim = q.shape
  exact = q.dtype == jnp.float32  # f32 inputs: full f32 products, not TF32

  def body(i, carry):
    acc, m, l = carry
    slots = begin + i * block_k + jnp.arange(block_k)
    in_range = (slots < seq_len)[:, None]
    k = plgpu.load(k_ref.at[pl.ds(begin + i * block_k, block_k), :], mask=in_range, other=0.0)
    s = plgpu.dot(q, k, trans_b=True, allow_tf32=not exact) * scale  # [R, block_k] f32
    s = jnp.where(visible(slots, i), s, NEG_INF)
    m_new = jnp.maximum(m, jnp.max(s, axis=1))
    m_safe = jnp.where(m_new == NEG_INF, 0.0, m_new)  # rows with nothing visible yet
    correction = jnp.exp(m - m_safe)
    p = jnp.exp(s - m_safe[:, None])
    v = plgpu.load(v_ref.at[pl.ds(begin + i * block_k, block_k), :], mask=in_range, other=0.0)
    acc = acc * correction[:, None] + plgpu.dot(p.astype(v.dtype), v, allow_tf32=not exact)
    return acc, m_new, l * correction + jnp.sum(p, axis=1)

  init = (jnp.zeros((rows, dim), jnp.float32), jnp.full((rows,), NEG_INF, jnp.float32),
          jnp.zeros((rows,), jnp.float32))
  acc, m, l = jax.lax.fori_loop(0, num_blocks, body, init)
  seen = l > 0
  out = acc / jnp.where(seen, l, 1.0)[:, None]
  return out, jnp.where(seen, m + jnp.log(jnp.where(seen, l, 1.0)), NEG_INF)


def combine(out_parts: jax.Array, lse_parts: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Exact merge of partial passes over disjoint keys: out_parts [P, ..., D], lse_parts
  [P, ...] -> (out [..., D], lse [...]); parts that saw nothing (lse -inf) vanish."""
  lse = jax.nn.logsumexp(lse_parts, axis=0)
  safe = jnp.where(jnp.isfinite(lse), lse, 0.0)
  weights = jnp.exp(lse_parts - safe)  # exp(-inf) = 0 for empty parts
  return jnp.sum(out_parts * weights[..., None], axis=0), lse
