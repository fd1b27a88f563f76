"""Few-row matrix products that stream the weights: y [M, N] = x [M, K] @ w [K, N] for the
M of decoding (1 row), a tree verification (16-128 rows) and a draft pass, where the
weights are the bytes that matter and must be read once, at memory bandwidth.

The grid is (N / block_n, splits): program (j, s) streams w[K_s, j-th column block] for
its share K_s of the contraction, multiplies it with all M rows of x (padded to a
power of two, at least 16), accumulates in float32 over block_k steps in order, and writes a
float32 partial [M, block_n]; the partials of the splits are then added in split order.
Enough programs to fill the GPU come from the column blocks times the splits, never from
the rows.

Batch-invariant: every output element's sum runs over the same block_k steps, then the
same splits, in the same order, whatever M is (the parameters depend on K and N only, and
zero padding adds exact zeros). So a row computes the same bits alone, as in AR decoding,
and among a tree's 69 rows, as in verification: speculative output can equal AR output
exactly in bf16, not only up to ties.

Reference twin: `matmul_reference` (XLA's dot with float32 accumulation).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

MIN_ROWS = 16  # rows are padded to a power of two (Triton's blocks), at least a tensor-core tile


@dataclasses.dataclass(frozen=True)
class MatmulParams:
  block_n: int = 64  # output columns per program
  block_k: int = 128  # contraction step
  splits: int = 1  # contraction ranges, each its own program
  num_warps: int = 4
  num_stages: int = 3


def matmul_reference(x: jax.Array, w: jax.Array) -> jax.Array:
  """x [..., K] @ w [K, N] with float32 accumulation, in x's dtype."""
  return jnp.einsum("...k,kn->...n", x, w, preferred_element_type=jnp.float32).astype(x.dtype)


def default_params(k: int, n: int, programs: int = 132) -> MatmulParams:
  """Parameters from the weight's shape alone (so that they, and the sums, do not depend
  on the row count): column blocks of 64, and splits of the contraction until about
  `programs` programs (one wave; an H100 has 132 SMs) or splits of 512 columns."""
  block_n, block_k = 64, 128
  column_blocks = pl.cdiv(n, block_n)
  splits = max(1, min(programs // column_blocks, k // 512))
  return MatmulParams(block_n=block_n, block_k=block_k, splits=splits)


def _kernel(x_ref, w_ref, out_ref, *, block_k: int, steps: int, exact: bool):
  # x_ref [M_pad, K_s], w_ref [K_s, block_n], out_ref [M_pad, block_n] float32.
  def step(i, acc):
    ks = pl.ds(i * block_k, block_k)
    return acc + plgpu.dot(x_ref[:, ks], w_ref[ks, :], allow_tf32=not exact)

  out_ref[...] = jax.lax.fori_loop(0, steps, step, jnp.zeros(out_ref.shape, jnp.float32))


@functools.partial(jax.jit, static_argnames=("params", "interpret"))
def matmul(x: jax.Array, w: jax.Array, *, params: MatmulParams | None = None, interpret: bool = False) -> jax.Array:
  """x [..., K] @ w [K, N] -> [..., N] in x's dtype, float32 accumulation, batch-invariant
  (see the module docstring); `params` default to `default_params(K, N)`."""
  *lead, k = x.shape
  n = w.shape[1]
  params = params or default_params(k, n)
  rows = x.reshape(-1, k)
  m = rows.shape[0]
  m_pad = max(MIN_ROWS, pl.next_power_of_2(m))
  span = params.splits * params.block_k  # K is padded to whole steps of every split
  k_pad = pl.cdiv(k, span) * span
  n_pad = pl.cdiv(n, params.block_n) * params.block_n
  rows = jnp.pad(rows, ((0, m_pad - m), (0, k_pad - k)))
  w = jnp.pad(w, ((0, k_pad - k), (0, n_pad - n)))
  k_split = k_pad // params.splits
  kernel = functools.partial(_kernel, block_k=params.block_k, steps=k_split // params.block_k,
                             exact=x.dtype == jnp.float32)
  partials = pl.pallas_call(
      kernel,
      grid=(n_pad // params.block_n, params.splits),
      in_specs=[
          pl.BlockSpec((m_pad, k_split), lambda j, s: (0, s)),
          pl.BlockSpec((k_split, params.block_n), lambda j, s: (s, j)),
      ],
      out_specs=pl.BlockSpec((None, m_pad, params.block_n), lambda j, s: (s, 0, j)),
      out_shape=jax.ShapeDtypeStruct((params.splits, m_pad, n_pad), jnp.float32),
      compiler_params=plgpu.CompilerParams(num_warps=params.num_warps, num_stages=params.num_stages),
      interpret=interpret,
  )(rows, w)
  out = partials[0]
  for s in range(1, params.splits):  # in split order, whatever M is
    out = out + partials[s]
  return out[:m, :n].astype(x.dtype).reshape(*lead, n)
