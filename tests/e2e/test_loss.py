"""The chunked per-token cross-entropy equals the plain one, value and gradient, against
token labels and against a teacher's distribution."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from train.loss import chunked_token_losses

B, T, E, V = 2, 13, 8, 31


@pytest.fixture
def inputs():
  rng = np.random.default_rng(0)
  hidden = jnp.asarray(rng.standard_normal((B, T, E)), jnp.float32)
  teacher = jnp.asarray(rng.standard_normal((B, T, E)), jnp.float32)
  head = jnp.asarray(rng.standard_normal((E, V)), jnp.float32)
  labels = jnp.asarray(rng.integers(0, V, (B, T)))
  weights = jnp.asarray(rng.random((B, T)) < 0.7, jnp.float32)
  return hidden, teacher, head, labels, weights


@pytest.mark.parametrize("distill", [False, True])
def test_chunked_equals_full_loss_and_gradient(inputs, distill):
  hidden, teacher, head, labels, weights = inputs

  def full(hidden, head, teacher):
    log_q = jax.nn.log_softmax(hidden @ head, -1)
    if distill:
      p = jax.nn.softmax(jax.lax.stop_gradient(teacher @ head), -1)
      return jnp.sum(-jnp.sum(p * log_q, -1) * weights)
    return jnp.sum(-jnp.take_along_axis(log_q, labels[..., None], -1)[..., 0] * weights)

  def chunked(hidden, head, teacher):
    loss, _ = chunked_token_losses(hidden, lambda h: h @ head, labels, 4, teacher if distill else None)
    return jnp.sum(loss * weights)

  np.testing.assert_allclose(chunked(hidden, head, teacher), full(hidden, head, teacher), rtol=1e-5)
  got, want = jax.grad(chunked, (0, 1, 2))(hidden, head, teacher), jax.grad(full, (0, 1, 2))(hidden, head, teacher)
  for g, w in zip(got, want):
    np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-4, atol=1e-5)
  assert not np.asarray(got[2]).any()  # the teacher is frozen


def test_hits_are_argmax_agreement(inputs):
  hidden, teacher, head, labels, _ = inputs
  argmax = jnp.argmax(hidden @ head, -1)
  _, hit = chunked_token_losses(hidden, lambda h: h @ head, argmax.at[:, ::2].set(-1), 4)
  np.testing.assert_array_equal(np.asarray(hit), np.arange(T)[None, :].repeat(B, 0) % 2 == 1)
  _, hit = chunked_token_losses(hidden, lambda h: h @ head, labels, 4, teacher)
  np.testing.assert_array_equal(np.asarray(hit), np.asarray(argmax == jnp.argmax(teacher @ head, -1)))


@pytest.mark.parametrize("distill", [False, True])
def test_passes_scored_together_equal_each_scored_alone(inputs, distill):
  """Three passes over the same tokens in one call (the teacher's logits computed once a
  chunk for all): each pass's losses, hits and gradients as one call of its own gives."""
  hidden, teacher, head, labels, weights = inputs
  passes = jnp.stack([hidden, 0.5 * hidden + 1.0, -hidden])  # [P, B, T, E]
  teacher = teacher if distill else None

  def together(passes, head):
    loss, hit = chunked_token_losses(passes, lambda h: h @ head, labels, 6, teacher)
    return jnp.sum(loss * weights), hit

  def alone(passes, head):
    runs = [chunked_token_losses(p, lambda h: h @ head, labels, 2, teacher) for p in passes]
    return sum(jnp.sum(loss * weights) for loss, _ in runs), jnp.stack([hit for _, hit in runs])

  (got, got_hit), got_grads = jax.value_and_grad(together, (0, 1), has_aux=True)(passes, head)
  (want, want_hit), want_grads = jax.value_and_grad(alone, (0, 1), has_aux=True)(passes, head)
  np.testing.assert_allclose(got, want, rtol=1e-5)
  np.testing.assert_array_equal(np.asarray(got_hit), np.asarray(want_hit))
  for g, w in zip(got_grads, want_grads):
    np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-4, atol=1e-5)
