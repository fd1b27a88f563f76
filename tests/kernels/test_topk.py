"""Two-stage top-k against jax.lax.top_k: same values, same indices, same order of ties."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from longspec_jax.ops.topk import top_k


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


def test_head_top_log_probs_equal_log_softmax_and_top_k():
  """The fused head pass (interpreted) gives the log-probs and tokens of the unfused one,
  for a separate head and a tied embedding, with leading axes."""
  from longspec_jax.ops.topk import head_top_log_probs

  rng = np.random.default_rng(3)
  hidden = jnp.asarray(rng.standard_normal((2, 3, 40)), jnp.float32)
  head = jnp.asarray(rng.standard_normal((40, 700)), jnp.float32)
  want = top_k(jax.nn.log_softmax(jnp.einsum("bfe,ev->bfv", hidden, head), axis=-1), 5)
  for weights, transposed in ((head, False), (head.T, True)):
    got = head_top_log_probs(hidden, weights, 5, transposed=transposed)
    np.testing.assert_allclose(np.asarray(got[0]), np.asarray(want[0]), rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(want[1]))


@pytest.mark.parametrize("kind", ["llama", "qwen2"])  # a separate head, a tied embedding
@pytest.mark.parametrize("fused", [False, True])
def test_top_log_probs_over_a_vocabulary_subset_equal_masked_full_logits(kind, fused, monkeypatch):
  """A draft scoring a subset of the vocabulary (FR-Spec) gets the top k of the full
  logits with every other token masked out, normalized over the subset, whether the
  head's product is fused with the top-k (interpreted) or not."""
  from longspec_jax.ops import topk

  from helpers import tiny_target

  monkeypatch.setattr(topk, "fused_head_pays", lambda rows: fused)
  model = tiny_target(kind)
  vocab = model.config.vocab_size
  rng = np.random.default_rng(7)
  tokens = jnp.asarray(np.sort(rng.choice(vocab, 57, replace=False)), jnp.int32)
  hidden = jnp.asarray(rng.standard_normal((2, 3, model.config.hidden_size)), jnp.float32)
  got = model.top_log_probs(hidden, 5, model.head_rows(tokens))
  masked = jnp.where(jnp.isin(jnp.arange(vocab), tokens), model.logits(hidden), -jnp.inf)
  want = jax.lax.top_k(jax.nn.log_softmax(masked, axis=-1), 5)
  np.testing.assert_allclose(np.asarray(got[0]), np.asarray(want[0]), rtol=1e-5, atol=1e-5)
  np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(want[1]))
