"""The few-row weight-streaming matmul (interpret mode on CPU) against its jnp twin."""

import jax.numpy as jnp
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from pallas_kernels.matmul import MatmulParams, default_params, matmul, matmul_reference

from kernel_inputs import DTYPES, SEEDS

TOLERANCE = {jnp.float32: 1e-4, jnp.bfloat16: 2e-2}  # relative to the output's scale


@settings(max_examples=8, deadline=None)
@given(seed=SEEDS, rows=st.integers(1, 128), k=st.integers(1, 300), n=st.integers(1, 200), dtype=DTYPES,
       splits=st.integers(1, 3))
def test_matches_reference(seed, rows, k, n, dtype, splits):
  """Odd sizes: rows 1..128, contraction and columns not multiples of the blocks."""
  rng = np.random.default_rng(seed)
  x = jnp.asarray(rng.standard_normal((rows, k)), dtype)
  w = jnp.asarray(rng.standard_normal((k, n)) / np.sqrt(k), dtype)
  params = MatmulParams(block_n=32, block_k=32, splits=splits)
  got = np.asarray(matmul(x, w, params=params, interpret=True), np.float32)
  want = np.asarray(matmul_reference(x, w), np.float32)
  assert got.shape == (rows, n)
  np.testing.assert_allclose(got, want, atol=TOLERANCE[dtype] * 4, rtol=TOLERANCE[dtype])


def test_leading_axes_and_default_params():
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.standard_normal((2, 3, 96)), jnp.float32)
  w = jnp.asarray(rng.standard_normal((96, 40)), jnp.float32)
  np.testing.assert_allclose(np.asarray(matmul(x, w, interpret=True)), np.asarray(matmul_reference(x, w)),
                             rtol=1e-5, atol=1e-5)
  # The parameters come from the weight's shape only, and fill about one wave of programs.
  assert default_params(4096, 14336) == default_params(4096, 14336)
  params = default_params(14336, 4096)
  assert params.splits > 1 and (4096 // params.block_n) * params.splits <= 132


def test_a_row_computes_the_same_bits_alone_and_among_others():
  """Batch invariance: row i of a 69-row product equals the 1-row product of row i,
  bit for bit (bf16 in, float32 sums in a fixed order)."""
  rng = np.random.default_rng(1)
  x = jnp.asarray(rng.standard_normal((69, 256)), jnp.bfloat16)
  w = jnp.asarray(rng.standard_normal((256, 96)) / 16, jnp.bfloat16)
  params = MatmulParams(block_n=32, block_k=64, splits=2)
  many = np.asarray(matmul(x, w, params=params, interpret=True), np.float32)
  for i in (0, 17, 68):
    alone = np.asarray(matmul(x[i : i + 1], w, params=params, interpret=True), np.float32)
    np.testing.assert_array_equal(alone[0], many[i])
