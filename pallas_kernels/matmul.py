"""Few-row matrix products that stream the weights: y [M, N] = x [M, K] @ w [K, N] for the
M of decoding (1 row), a tree verification (16-128 rows) and a draft pass, where the
weights are the bytes that matter and must be read once, at memory bandwidth.

The grid is (N / block_n, splits, row groups): program (j, s, g) streams w[K_s, j-th
column block] for its share K_s of the contraction, one block_k step at a time; each
step's weight tile is loaded once and multiplied with each `block_rows`-row block of its
group g of x's rows in turn, each into its own float32 accumulator; the program writes a
float32 partial [its rows, block_n], and the partials of the splits are then added in
split order. The programs that fill the GPU come from the column blocks times the splits;
only where those are too few for it (a small model's narrow weights: SmolLM2's 576
columns are 9 blocks) are the row blocks spread over groups, each group reading the
weight tiles again (`row_groups`). On SmolLM2's shape at 4k (H200) a batch-invariant
round over a 97-node trie took 1.85 ms against 2.40 ms with every row in one program
(docs/results.md, "Kernels").

The weights may be a layer of a stack [L, K, N] named by an index read at run time (as
the attention kernels read a layer of the stacked KV cache): inside the model's layer
scan, a slice handed to a custom call would be a copy of that layer's weights per call.
They may also be stored transposed, [N, K] (a tied LM head is the embedding [V, E]).
Nothing is padded or copied: the edges of M, K and N are masked loads (a pad of x would
be a kernel of its own before every product).

Batch-invariant: every output element's sum runs over the same block_k steps, then the
same splits, in the same order, through a product of the same row tile shape, whatever
M is (the parameters depend on K and N only, zero rows are never mixed into a real row's
sum, and which program a row block runs in does not change its sum). So a row computes
the same bits alone, as in AR decoding, and among a tree's 69 rows, as in verification:
speculative output can equal AR output exactly in bf16, not only up to ties.

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


# Programs a grid aims to fill: one wave on an H100 (132 SMs).
PROGRAMS = 132


def default_params(k: int, n: int, programs: int = PROGRAMS, block_n: int | None = None) -> MatmulParams:
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


# Row blocks one program holds at most: each has its own accumulator and its x tile in every
# pipeline stage (128 rows at block_k 128: 32 KiB a stage beside the weight tile's 32 KiB).
# The verification of a batch of trees (16 x 97 rows for SmolLM2) asked a program with
# every row for 240 KiB of shared memory, beyond an H100's or H200's 227 KiB.
MAX_ROW_BLOCKS = 8


def row_groups(row_blocks: int, programs_without: int, programs: int = PROGRAMS) -> int:
  """How many groups to spread `row_blocks` row blocks over, where the column blocks times
  the splits make `programs_without` programs: as many as fill about `programs` (whole
  multiples only), at most one per row block, and at least enough that none holds more
  than `MAX_ROW_BLOCKS`. Each group reads the weight tiles again, so a grid that already
  fills the GPU keeps up to that many row blocks in one group."""
  return max(1, min(row_blocks, programs // programs_without), pl.cdiv(row_blocks, MAX_ROW_BLOCKS))


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
  m: int,
  k: int,
  n: int,
  ragged: bool,
  transposed: bool,
  exact: bool,
):
  # x_ref [M, K]; w_ref [L, K, N] or [L, N, K]; out_ref [group rows, block_n] f32.
  layer = layer_ref[0]
  j, s, g = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  cols = pl.ds(j * block_n, block_n)
  col_ok = j * block_n + jnp.arange(block_n) < n
  row_blocks = out_ref.shape[0] // block_rows
  first_row = g * out_ref.shape[0]

  def step(i, accs):
    ks = pl.ds(i * block_k, block_k)
    k_ok = i * block_k + jnp.arange(block_k) < k
    if transposed:
      tile, mask = w_ref.at[layer, cols, ks], col_ok[:, None] & k_ok[None, :]  # [block_n, block_k]
    else:
      tile, mask = w_ref.at[layer, ks, cols], k_ok[:, None] & col_ok[None, :]  # [block_k, block_n]
    w = plgpu.load(tile, mask=mask, other=0.0) if k % block_k or n % block_n else tile[...]

    def rows(r):  # [block_rows, block_k]: zeros past x's rows and columns (x is never padded)
      at = first_row + r * block_rows
      tile = x_ref.at[pl.ds(at, block_rows), ks]
      if not ragged:
        return tile[...]
      return plgpu.load(tile, mask=(at + jnp.arange(block_rows) < m)[:, None] & k_ok[None, :], other=0.0)

    return tuple(acc + plgpu.dot(rows(r), w, trans_b=transposed, allow_tf32=not exact) for r, acc in enumerate(accs))

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
  n_pad = pl.cdiv(n, params.block_n) * params.block_n
  row_blocks = pl.cdiv(m, params.block_rows)
  groups = row_groups(row_blocks, n_pad // params.block_n * params.splits)
  group_rows = pl.cdiv(row_blocks, groups) * params.block_rows
  m_pad = groups * group_rows
  steps = pl.cdiv(k, params.block_k)
  steps_per_split = pl.cdiv(steps, params.splits)
  kernel = functools.partial(
    _kernel,
    block_rows=params.block_rows,
    block_k=params.block_k,
    block_n=params.block_n,
    steps=steps,
    steps_per_split=steps_per_split,
    m=m,
    k=k,
    n=n,
    ragged=m != m_pad or k % params.block_k != 0,
    transposed=transposed,
    exact=x.dtype == jnp.float32,
  )
  partials = pl.pallas_call(
    kernel,
    grid=(n_pad // params.block_n, params.splits, groups),
    in_specs=[
      pl.BlockSpec((1,), lambda j, s, g: (0,)),
      pl.BlockSpec(rows.shape, lambda j, s, g: (0, 0)),
      pl.BlockSpec(w.shape, lambda j, s, g: (0, 0, 0)),
    ],
    out_specs=pl.BlockSpec((None, group_rows, params.block_n), lambda j, s, g: (s, g, j)),
    out_shape=jax.ShapeDtypeStruct((params.splits, m_pad, n_pad), jnp.float32),
    compiler_params=plgpu.CompilerParams(num_warps=params.num_warps, num_stages=params.num_stages),
    interpret=interpret,
    name="matmul",
  )(jnp.asarray(layer, jnp.int32).reshape(1), rows, w)
  out = partials[0]
  for s in range(1, params.splits):  # in split order, whatever M is
    out = out + partials[s]
  return out[:m, :n].astype(x.dtype).reshape(*lead, n)
