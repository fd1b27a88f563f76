"""The LM head fused with a top-k: the k most likely next tokens of a few rows, and the
log-normalizer, without the [rows, V] logits ever landing in HBM.

The draft's beam search reads the whole [V, E] head once per depth for a handful of
frontier rows and keeps only the best few tokens of each. Unfused, that is a product
writing rows x V float32 logits, a log-softmax over them and a top-k reading them again
(several kernels of the round's idle-bound tail). Here each program takes one chunk of
the vocabulary: it streams its [chunk, E] slice of the head, forms the chunk's logits in
registers (rounded to the model's dtype as the unfused product returns them), and keeps
the chunk's max, its sum of exp(logit - max) and its k best (value, token), found by k
argmax passes (lowest token first among equals). A small XLA epilogue merges the chunks:
the log-normalizer from the (max, sum) pairs, and the top k of the chunks' candidates,
which is `jax.lax.top_k` of the full logits, order and ties included.

Reference twin: `head_top_k_reference`.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

BLOCK_ROWS = 16
NEG_INF = float("-inf")


@dataclasses.dataclass(frozen=True)
class HeadTopKParams:
  chunk: int = 256  # vocabulary entries per program
  block_k: int = 64  # contraction step (a [chunk, block_k] tile of the head per step)
  num_warps: int = 4
  num_stages: int = 3


def head_top_k_reference(x: jax.Array, w: jax.Array, k: int, *, transposed: bool):
  """x [R, E], head w [E, V] (or [V, E] with `transposed`): the logits as the model's
  `logits` computes them (product in x's dtype, then float32), their top k and their
  log-normalizer. Returns (values [R, k] f32, tokens [R, k] int32, lse [R] f32)."""
  spec = "re,ve->rv" if transposed else "re,ev->rv"
  logits = jnp.einsum(spec, x, w, preferred_element_type=jnp.float32).astype(x.dtype).astype(jnp.float32)
  # -0.0 and 0.0 tie, as in the kernel's comparisons (top_k's total order puts -0.0 lower).
  values, tokens = jax.lax.top_k(jnp.where(logits == 0, 0.0, logits), k)
  return values, tokens, jax.nn.logsumexp(logits, axis=-1)


def _kernel(
  x_ref,
  w_ref,
  values_ref,
  tokens_ref,
  max_ref,
  sum_ref,
  *,
  k: int,
  chunk: int,
  block_k: int,
  steps: int,
  e: int,
  v: int,
  transposed: bool,
  exact: bool,
  dtype,
):
  # x_ref [R_pad, E_pad]; w_ref [E, V] or [V, E]; values/tokens [k, R_pad]; max/sum [R_pad].
  c = pl.program_id(0)
  cols = pl.ds(c * chunk, chunk)
  col_ok = c * chunk + jnp.arange(chunk) < v

  def step(i, acc):
    ks = pl.ds(i * block_k, block_k)
    k_ok = i * block_k + jnp.arange(block_k) < e
    if transposed:
      tile, mask = w_ref.at[cols, ks], col_ok[:, None] & k_ok[None, :]
    else:
      tile, mask = w_ref.at[ks, cols], k_ok[:, None] & col_ok[None, :]
    w = plgpu.load(tile, mask=mask, other=0.0) if e % block_k or v % chunk else tile[...]
    return acc + plgpu.dot(x_ref[:, ks], w, trans_b=transposed, allow_tf32=not exact)

  acc = jax.lax.fori_loop(0, steps, step, jnp.zeros((x_ref.shape[0], chunk), jnp.float32))
  logits = jnp.where(col_ok[None, :], acc.astype(dtype).astype(jnp.float32), NEG_INF)  # [R_pad, chunk]
  peak = jnp.max(logits, axis=1)
  max_ref[...] = peak
  sum_ref[...] = jnp.sum(jnp.exp(logits - peak[:, None]), axis=1)
  lane = jnp.arange(chunk)[None, :]
  for j in range(k):  # k argmax passes, each taking out its winner
    best = jnp.argmax(logits, axis=1).astype(jnp.int32)
    values_ref[j, :] = jnp.max(logits, axis=1)
    tokens_ref[j, :] = best + c * chunk
    logits = jnp.where(lane == best[:, None], NEG_INF, logits)


@functools.partial(jax.jit, static_argnames=("k", "transposed", "params", "interpret"))
def head_candidates(
  x: jax.Array,
  w: jax.Array,
  k: int,
  *,
  transposed: bool,
  params: HeadTopKParams = HeadTopKParams(),
  interpret: bool = False,
):
  """The fused pass (module docstring): x [R, E] and the head w [E, V] (or [V, E] with
  `transposed`, a tied embedding). Returns (values [R, C * k] f32, tokens [R, C * k]
  int32, lse [R] f32): each of the C chunks' k best logits, chunk after chunk, best
  first within a chunk, and the log-normalizer of all logits. The top k of the
  candidates (`jax.lax.top_k`, or any exact top-k) is `head_top_k_reference`'s."""
  r, e = x.shape
  v = w.shape[0] if transposed else w.shape[1]
  r_pad = pl.cdiv(r, BLOCK_ROWS) * BLOCK_ROWS
  steps = pl.cdiv(e, params.block_k)
  rows = jnp.pad(x, ((0, r_pad - r), (0, steps * params.block_k - e)))  # x is small; w is never padded
  chunks = pl.cdiv(v, params.chunk)
  kernel = functools.partial(
    _kernel,
    k=k,
    chunk=params.chunk,
    block_k=params.block_k,
    steps=steps,
    e=e,
    v=v,
    transposed=transposed,
    exact=x.dtype == jnp.float32,
    dtype=x.dtype,
  )
  values, tokens, peak, total = pl.pallas_call(
    kernel,
    grid=(chunks,),
    in_specs=[pl.BlockSpec(rows.shape, lambda c: (0, 0)), pl.BlockSpec(w.shape, lambda c: (0, 0))],
    out_specs=[
      pl.BlockSpec((None, k, r_pad), lambda c: (c, 0, 0)),
      pl.BlockSpec((None, k, r_pad), lambda c: (c, 0, 0)),
      pl.BlockSpec((None, r_pad), lambda c: (c, 0)),
      pl.BlockSpec((None, r_pad), lambda c: (c, 0)),
    ],
    out_shape=[
      jax.ShapeDtypeStruct((chunks, k, r_pad), jnp.float32),
      jax.ShapeDtypeStruct((chunks, k, r_pad), jnp.int32),
      jax.ShapeDtypeStruct((chunks, r_pad), jnp.float32),
      jax.ShapeDtypeStruct((chunks, r_pad), jnp.float32),
    ],
    compiler_params=plgpu.CompilerParams(num_warps=params.num_warps, num_stages=params.num_stages),
    interpret=interpret,
    name="head_top_k",
  )(rows, w)
  top = jnp.max(peak, axis=0)  # [R_pad]
  lse = top + jnp.log(jnp.sum(total * jnp.exp(peak - top), axis=0))
  flat = lambda a: jnp.moveaxis(a, 2, 0).reshape(r_pad, chunks * k)[:r]  # [R, C * k], chunk-major
  return flat(values), flat(tokens), lse[:r]
