"""The fused LM head + top-k (interpret mode on CPU) against its jnp twin."""

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from pallas_kernels.head_topk import HeadTopKParams, head_candidates, head_top_k_reference

from helpers import DTYPES, SEEDS, examples

PARAMS = HeadTopKParams(chunk=32, block_k=16)  # small blocks: many chunks and steps on small shapes


def fused(x, w, k, transposed):
  values, tokens, lse = head_candidates(x, w, k, transposed=transposed, params=PARAMS, interpret=True)
  best, pick = jax.lax.top_k(values, k)
  return best, jnp.take_along_axis(tokens, pick, axis=-1), lse


@examples(8)
@given(
  seed=SEEDS,
  rows=st.integers(1, 20),
  e=st.integers(1, 70),
  v=st.integers(16, 300),
  k=st.integers(1, 16),
  transposed=st.booleans(),
  dtype=DTYPES,
)
def test_integer_logits_give_the_reference_exactly(seed, rows, e, v, k, transposed, dtype):
  """Small integer inputs: every logit is exact, so values, tokens, the order of ties
  (lower token first, across chunks and within one) and lse must all agree; odd sizes
  (a vocabulary and a width that are no multiples of the blocks)."""
  rng = np.random.default_rng(seed)
  x = jnp.asarray(rng.integers(-2, 3, (rows, e)), dtype)
  w = jnp.asarray(rng.integers(-1, 2, (v, e) if transposed else (e, v)), dtype)
  k = min(k, v)
  # (jitted: one program each instead of every op compiled eagerly for this example's shapes)
  got = jax.jit(fused, static_argnums=(2, 3))(x, w, k, transposed)
  want = jax.jit(head_top_k_reference, static_argnums=2, static_argnames="transposed")(x, w, k, transposed=transposed)
  np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(want[0]))
  np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(want[1]))
  np.testing.assert_allclose(np.asarray(got[2]), np.asarray(want[2]), rtol=1e-6)


def test_random_logits_of_a_real_vocabulary_size():
  """SmolLM2's 49,152-token tied head at a small width, bf16: the same tokens, values
  within the products' rounding."""
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.standard_normal((5, 48)), jnp.bfloat16)
  w = jnp.asarray(rng.standard_normal((49152, 48)) * 0.2, jnp.bfloat16)
  got = head_candidates(x, w, 16, transposed=True, interpret=True)
  best, pick = jax.lax.top_k(got[0], 16)
  want = head_top_k_reference(x, w, 16, transposed=True)
  np.testing.assert_allclose(np.asarray(best), np.asarray(want[0]), rtol=1e-2)
  np.testing.assert_allclose(np.asarray(got[2]), np.asarray(want[2]), rtol=1e-5)
  same = np.asarray(jnp.take_along_axis(got[1], pick, axis=-1)) == np.asarray(want[1])
  assert same.mean() > 0.95  # (bf16 near-ties may swap neighbours)
