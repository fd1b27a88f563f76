"""The chunked cross-entropy equals the plain one, value and gradient."""

import jax
import jax.numpy as jnp
import numpy as np

from train.loss import chunked_cross_entropy


def test_chunked_equals_full_loss_and_gradient():
  rng = np.random.default_rng(0)
  hidden = jnp.asarray(rng.standard_normal((2, 13, 8)), jnp.float32)
  head = jnp.asarray(rng.standard_normal((8, 31)), jnp.float32)
  labels = jnp.asarray(rng.integers(0, 31, (2, 13)))
  weights = jnp.asarray(rng.random((2, 13)) < 0.7, jnp.float32)

  def full(hidden, head):
    logits = hidden @ head
    losses = jax.nn.logsumexp(logits, -1) - jnp.take_along_axis(logits, labels[..., None], -1)[..., 0]
    return jnp.sum(losses * weights)

  def chunked(hidden, head):
    return chunked_cross_entropy(hidden, lambda h: h @ head, labels, weights, chunk=4)[0]

  np.testing.assert_allclose(chunked(hidden, head), full(hidden, head), rtol=1e-5)
  for got, want in zip(jax.grad(chunked, (0, 1))(hidden, head), jax.grad(full, (0, 1))(hidden, head)):
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-5)
  assert float(chunked_cross_entropy(hidden, lambda h: h @ head, labels, weights, chunk=4)[1]) == float(weights.sum())
