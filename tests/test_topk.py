"""Two-stage top-k against jax.lax.top_k: same values, same indices, same order of ties."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from longspec_jax.topk import top_k


@pytest.mark.parametrize("n, k, chunk", [(5000, 16, 64), (4097, 4, 128), (200, 7, 64), (1000, 1, 32)])
def test_equals_lax_top_k(n, k, chunk):
  rng = np.random.default_rng(n)
  x = rng.standard_normal((2, 3, n)).astype(np.float32)
  x[0, 0, rng.integers(0, n, 40)] = 3.5  # ties across chunks, above everything else
  x[0, 1, :] = np.round(x[0, 1, :])  # ties everywhere
  x[1, 2, : n - k // 2] = -np.inf  # fewer finite entries than k, ties at -inf
  got = top_k(jnp.asarray(x), k, chunk)
  want = jax.lax.top_k(jnp.asarray(x), k)
  np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(want[0]))
  np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(want[1]))


def test_bfloat16_rows():
  x = jax.random.normal(jax.random.key(0), (4, 49152), jnp.bfloat16)
  got, want = top_k(x, 16, chunk=1024), jax.lax.top_k(x, 16)
  np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(want[1]))
