"""The batch-invariant RMSNorm kernel (interpret mode on CPU) against its jnp twin."""

import jax.numpy as jnp
import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from longspec_jax.models.layers import rms_norm as reference
from pallas_kernels.rms_norm import rms_norm

from helpers import DTYPES, SEEDS, examples


def hidden_states(rng, rows: int, k: int, dtype) -> jnp.ndarray:
  """Normal values with a few outlier dimensions (as a real model's residual stream has),
  so that a row's float32 sum of squares is inexact and its order shows."""
  x = rng.standard_normal((rows, k))
  x[:, rng.choice(k, size=max(1, k // 64), replace=False)] *= 1000.0
  return jnp.asarray(x, dtype)


@examples(8)
@given(seed=SEEDS, rows=st.integers(1, 128), k=st.integers(1, 300), dtype=DTYPES, stacked=st.booleans())
def test_matches_reference(seed, rows, k, dtype, stacked):
  """Odd sizes: rows 1..128, widths not powers of two; the gain alone or a layer of a
  stack. The kernel rounds as the twin does, so the two differ only where their sums'
  orders do: by one unit of the dtype at most."""
  rng = np.random.default_rng(seed)
  x = hidden_states(rng, rows, k, dtype)
  gains = jnp.asarray(rng.standard_normal((3, k)), dtype)
  layer = int(rng.integers(3))
  got = rms_norm(x, gains, 1e-5, layer, interpret=True) if stacked else rms_norm(x, gains[layer], 1e-5, interpret=True)
  want = np.asarray(reference(x, gains[layer], 1e-5), np.float32)
  assert got.shape == (rows, k) and got.dtype == dtype
  ulp = 2.0**-7 if dtype == jnp.bfloat16 else 2.0**-22
  np.testing.assert_allclose(np.asarray(got, np.float32), want, rtol=ulp, atol=ulp * np.abs(want).max())


def test_a_row_computes_the_same_bits_alone_and_among_others():
  """Batch invariance: row i of 69 rows equals the row alone, bit for bit, in bf16 with
  outliers (inexact sums), leading axes kept, through the model's entry point."""
  rng = np.random.default_rng(1)
  x = hidden_states(rng, 69, 576, jnp.bfloat16).reshape(1, 69, 576)
  gains = jnp.asarray(rng.standard_normal((2, 576)), jnp.bfloat16)
  many = np.asarray(reference(x, gains, 1e-5, layer=1, invariant=True), np.float32)
  assert many.shape == (1, 69, 576)
  for i in (0, 17, 68):
    alone = reference(x[:, i : i + 1], gains, 1e-5, layer=1, invariant=True)
    np.testing.assert_array_equal(np.asarray(alone, np.float32)[0, 0], many[0, i])
