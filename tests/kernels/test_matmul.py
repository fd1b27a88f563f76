"""The few-row weight-streaming matmul (interpret mode on CPU) against its jnp twin."""

import jax.numpy as jnp
import numpy as np
from hypothesis import given
from hypothesis import strategies as st
from jax.experimental import pallas as pl

from pallas_kernels.matmul import (
  MAX_ROW_BLOCKS,
  MatmulParams,
  default_params,
  matmul,
  matmul_reference,
  row_groups,
)

from helpers import DTYPES, SEEDS, examples

TOLERANCE = {jnp.float32: 1e-4, jnp.bfloat16: 2e-2}  # relative to the output's scale


@examples(8)
@given(
  seed=SEEDS,
  rows=st.integers(1, 128),
  k=st.integers(1, 300),
  n=st.integers(1, 200),
  dtype=DTYPES,
  splits=st.integers(1, 3),
  block_rows=st.sampled_from([16, 64]),
  transposed=st.booleans(),
  stacked=st.booleans(),
)
def test_matches_reference(seed, rows, k, n, dtype, splits, block_rows, transposed, stacked):
  """Odd sizes: rows 1..128, contraction and columns not multiples of the blocks; row tiles
  of 16 and 64; weights plain or transposed, alone or a layer of a stack."""
  rng = np.random.default_rng(seed)
  x = jnp.asarray(rng.standard_normal((rows, k)), dtype)
  shape = (n, k) if transposed else (k, n)
  w = jnp.asarray(rng.standard_normal((3, *shape)) / np.sqrt(k), dtype)
  params = MatmulParams(block_rows=block_rows, block_n=32, block_k=32, splits=splits)
  layer = int(rng.integers(3))
  got = (
    matmul(x, w, layer, transposed=transposed, params=params, interpret=True)
    if stacked
    else (matmul(x, w[layer], transposed=transposed, params=params, interpret=True))
  )
  want = np.asarray(matmul_reference(x, w[layer], transposed=transposed), np.float32)
  assert got.shape == (rows, n) and got.dtype == dtype
  np.testing.assert_allclose(np.asarray(got, np.float32), want, atol=TOLERANCE[dtype] * 4, rtol=TOLERANCE[dtype])


def test_leading_axes_and_default_params():
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.standard_normal((2, 3, 96)), jnp.float32)
  w = jnp.asarray(rng.standard_normal((96, 40)), jnp.float32)
  np.testing.assert_allclose(
    np.asarray(matmul(x, w, interpret=True)), np.asarray(matmul_reference(x, w)), rtol=1e-5, atol=1e-5
  )
  # The parameters come from the weight's shape only, and fill about one wave of programs.
  assert default_params(4096, 14336) == default_params(4096, 14336)
  params = default_params(14336, 4096)
  assert params.splits > 1 and (4096 // params.block_n) * params.splits <= 132
  assert default_params(576, 960).block_k == 64  # SmolLM2's width: a step that divides it
  assert default_params(4096, 128256).block_k == 64 and default_params(4096, 4096).block_k == 128
  # Rows spread over groups only where the columns and splits leave the GPU's programs idle.
  assert row_groups(7, programs_without=9) == 7  # SmolLM2's 576 columns: a group per row block
  assert row_groups(8, programs_without=27) == 4 and row_groups(1, programs_without=9) == 1
  assert row_groups(5, programs_without=128) == 1  # Llama-3.1-8B's: the grid is full already
  # Never more than MAX_ROW_BLOCKS row blocks a program (a batch of trees: shared memory).
  assert row_groups(97, programs_without=384) == pl.cdiv(97, MAX_ROW_BLOCKS)
  assert row_groups(97, programs_without=9) == 14


def test_a_row_computes_the_same_bits_alone_and_among_others():
  """Batch invariance: row i of a 69-row product (its rows in 5 groups) equals the 1-row
  product of row i, bit for bit (bf16 in, float32 sums in a fixed order), for a layer of
  a stacked weight and for a transposed one."""
  rng = np.random.default_rng(1)
  x = jnp.asarray(rng.standard_normal((69, 256)), jnp.bfloat16)
  w = jnp.asarray(rng.standard_normal((2, 256, 96)) / 16, jnp.bfloat16)
  params = MatmulParams(block_n=32, block_k=64, splits=2)
  for weights, transposed in ((w, False), (jnp.swapaxes(w, 1, 2), True)):
    many = np.asarray(matmul(x, weights, 1, transposed=transposed, params=params, interpret=True), np.float32)
    for i in (0, 17, 68):
      alone = matmul(x[i : i + 1], weights, 1, transposed=transposed, params=params, interpret=True)
      np.testing.assert_array_equal(np.asarray(alone, np.float32)[0], many[i])


def test_rows_past_one_programs_share_compute_the_same_bits():
  """Where the columns fill the GPU already, 150 rows still run in two programs per column
  block (at most MAX_ROW_BLOCKS row blocks each), and each row equals its 1-row product."""
  rng = np.random.default_rng(2)
  x = jnp.asarray(rng.standard_normal((150, 64)), jnp.bfloat16)
  w = jnp.asarray(rng.standard_normal((64, 32 * 140)) / 8, jnp.bfloat16)
  params = MatmulParams(block_n=32, block_k=64)
  assert row_groups(pl.cdiv(150, params.block_rows), programs_without=140) == 2
  many = np.asarray(matmul(x, w, params=params, interpret=True), np.float32)
  np.testing.assert_allclose(many, np.asarray(matmul_reference(x, w), np.float32), rtol=2e-2, atol=2e-2)
  for i in (0, 127, 128, 149):
    alone = matmul(x[i : i + 1], w, params=params, interpret=True)
    np.testing.assert_array_equal(np.asarray(alone, np.float32)[0], many[i])
