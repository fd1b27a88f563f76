"""Few-row matrix products that stream the weights: y [M, N] = x [M, K] @ w [K, N] for the
M of decoding (1 row), a tree verification (16-128 rows) and a draft pass, where the
weights are the bytes that matter and must be read once, at memory bandwidth.

The grid is (N / block_n, splits): program (j, s) streams w[K_s, j-th column block] for
its share K_s of the contraction, one block_k step at a time; each step's weight tile is
loaded once and multiplied with every `block_rows`-row block of x in turn, each into its
own float32 accumulator; the program writes a float32 partial [M, block_n], and the partials
of the splits are then added in split order. Enough programs to fill the GPU come from
the column blocks times the splits, never from the rows.

The weights may be a layer of a stack [L, K, N] named by an index read at run time (as
the attention kernels read a layer of the stacked KV cache): inside the model's layer
scan, a slice handed to a custom call would be a copy of that layer's weights per call.
They may also be stored transposed, [N, K] (a tied LM head is the embedding [V, E]).
Nothing of the weights is padded or copied: the edges of K and N are masked loads.

Batch-invariant: every output element's sum runs over the same block_k steps, then the
same splits, in the same order, through a product of the same row tile shape, whatever
M is (the parameters depend on K and N only, and zero rows are never mixed into a real
row's sum). So a row computes the same bits alone, as in AR decoding, and among a tree's
69 rows, as in verification: speculative output can equal AR output exactly in bf16, not
only up to ties.

Reference twin: `matmul_reference` (XLA's dot with float32 accumulation).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu


@dataclasses.dataclass(frozen=True)
class MatmulParams:
  block_rows: int = 16  # the row tile of every product, whatever M is (a tensor-core tile)
  block_n: int = 64  # output columns per program
  block_k: int = 128  # contraction step
  splits: int = 1  # contraction ranges, each its own program
  num_warps: int = 4
  num_stages: int = 3


def matmul_reference(x: jax.Array, w: jax.Array, *, transposed: bool = False) -> jax.Array:
  """x [..., K] @ w [K, N] (or w [N, K] with `transposed`) with float32 accumulation, in
  x's dtype."""
  spec = "...k,nk->...n" if transposed else "...k,kn->...n"
  return jnp.einsum(spec, x, w, preferred_element_type=jnp.float32).astype(x.dtype)


def default_params(k: int, n: int, programs: int = 132, block_n: int | None = None) -> MatmulParams:
  """Parameters from the weight's shape alone (so that they, and the sums, do not depend
  on the row count), the best rule of a sweep over Llama-3.1-8B's products at 1, 69 and
  128 rows on an H100 (docs/results.md, "Few-row matmuls"): column blocks of 128 where they
  divide N, else 64 (every column block reloads x's rows, so wider blocks load them fewer
  times; 256 spills registers at 128 rows; a masked edge on every step costs more); a
  contraction step of 64 where the column blocks alone fill about `programs` programs
  (one wave; an H100 has 132 SMs), else 128, each narrowed to one that divides K; and
  splits of the contraction until about `programs` programs or splits of 512 columns."""
  block_n = block_n or (128 if n % 128 == 0 else 64)
  column_blocks = pl.cdiv(n, block_n)
  widest = 64 if column_blocks >= programs else 128
  block_k = next((b for b in (128, 64, 32, 16) if b <= widest and k % b == 0), widest)
  splits = max(1, min(programs // column_blocks, k // 512))
  return MatmulParams(block_n=block_n, block_k=block_k, splits=splits)


def _kernel(
  layer_ref,
  x_ref,
  w_ref,
  out_ref,
  *,
  block_rows: int,
  block_k: int,
  block_n: int,
  steps: int,
  steps_per_split: int,
  k: int,
  n: int,
  transposed: bool,
  exact: bool,
):
  # x_ref [M_pad, K_pad] (zero-padded); w_ref [L, K, N] or [L, N, K]; out_ref [M_pad, block_n] f32.
  layer = layer_ref[0]
  j, s = pl.program_id(0), pl.program_id(1)
  cols = pl.ds(j * block_n, block_n)
  col_ok = j * block_n + jnp.arange(block_n) < n
  row_blocks = out_ref.shape[0] // block_rows

  def step(i, accs):
    ks = pl.ds(i * block_k, block_k)
    k_ok = i * block_k + jnp.arange(block_k) < k
    if transposed:
      tile, mask = w_ref.at[layer, cols, ks], col_ok[:, None] & k_ok[None, :]  # [block_n, block_k]
    else:
      tile, mask = w_ref.at[layer, ks, cols], k_ok[:, None] & col_ok[None, :]  # [block_k, block_n]
    w = plgpu.load(tile, mask=mask, other=0.0) if k % block_k or n % block_n else tile[...]
    return tuple(
      acc + plgpu.dot(x_ref[pl.ds(r * block_rows, block_rows), ks], w, trans_b=transposed, allow_tf32=not exact)
      for r, acc in enumerate(accs)
    )

  first = s * steps_per_split
  accs = jax.lax.fori_loop(
    first,
    jnp.minimum(first + steps_per_split, steps),
    step,
    tuple(jnp.zeros((block_rows, block_n), jnp.float32) for _ in range(row_blocks)),
  )
  for r, acc in enumerate(accs):
    out_ref[pl.ds(r * block_rows, block_rows), :] = acc


@functools.partial(jax.jit, static_argnames=("transposed", "params", "interpret"))
def matmul(
  x: jax.Array,
  w: jax.Array,
  layer=None,
  *,
  transposed: bool = False,
  params: MatmulParams | None = None,
  interpret: bool = False,
) -> jax.Array:
  """x [..., K] @ w -> [..., N] in x's dtype, float32 accumulation, batch-invariant (see
  the module docstring). w is [K, N], or [N, K] with `transposed`; with `layer` (an int
  or an int32 scalar), w is a stack [L, ...] of such weights and `layer` names the one
  to use, read in place. `params` default to `default_params(K, N)`."""
  if layer is None:
    w, layer = w[None], 0
  *lead, k = x.shape
  n = w.shape[1] if transposed else w.shape[2]
  params = params or default_params(k, n)
  rows = x.reshape(-1, k)
  m = rows.shape[0]
  m_pad = pl.cdiv(m, params.block_rows) * params.block_rows
  steps = pl.cdiv(k, params.block_k)
  steps_per_split = pl.cdiv(steps, params.splits)
  rows = jnp.pad(rows, ((0, m_pad - m), (0, steps * params.block_k - k)))  # x is small; w is never padded
  n_pad = pl.cdiv(n, params.block_n) * params.block_n
  kernel = functools.partial(
    _kernel,
    block_rows=params.block_rows,
    block_k=params.block_k,
    block_n=params.block_n,
    steps=steps,
    steps_per_split=steps_per_split,
    k=k,
    n=n,
    transposed=transposed,
    exact=x.dtype == jnp.float32,
  )
  partials = pl.pallas_call(
    kernel,
    grid=(n_pad // params.block_n, params.splits),
    in_specs=[
      pl.BlockSpec((1,), lambda j, s: (0,)),
      pl.BlockSpec(rows.shape, lambda j, s: (0, 0)),
      pl.BlockSpec(w.shape, lambda j, s: (0, 0, 0)),
    ],
    out_specs=pl.BlockSpec((None, m_pad, params.block_n), lambda j, s: (s, 0, j)),
    out_shape=jax.ShapeDtypeStruct((params.splits, m_pad, n_pad), jnp.float32),
    compiler_params=plgpu.CompilerParams(num_warps=params.num_warps, num_stages=params.num_stages),
    interpret=interpret,
    name="matmul",
  )(jnp.asarray(layer, jnp.int32).reshape(1), rows, w)
  out = partials[0]
  for s in range(1, params.splits):  # in split order, whatever M is
    out = out + partials[s]
  return out[:m, :n].astype(x.dtype).reshape(*lead, n)
