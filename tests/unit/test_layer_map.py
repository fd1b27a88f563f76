"""SpecAttn's layer mapping: the DP equals a search over every monotone mapping, and the
KL similarity scores the layers that attend alike highest."""

import itertools

import numpy as np
import pytest

from longspec_jax.methods.layer_map import kl_similarity, monotone_map


def total(score, mapping):
  return sum(score[i, j] for j, i in enumerate(mapping))


@pytest.mark.parametrize("m, n", [(1, 6), (3, 5), (4, 4), (5, 3), (2, 7)])
def test_the_mapping_is_the_best_monotone_one(m, n):
  rng = np.random.default_rng(m * 10 + n)
  for _ in range(5):
    score = rng.standard_normal((m, n))
    mapping = monotone_map(score)
    assert len(mapping) == n and all(a <= b for a, b in zip(mapping, mapping[1:]))
    best = max(total(score, f) for f in itertools.combinations_with_replacement(range(m), n))  # (every monotone f)
    assert total(score, mapping) == pytest.approx(best)
  assert monotone_map(np.zeros((1, 4))) == (0, 0, 0, 0)  # a one-layer draft: every layer maps to it


def test_layers_that_attend_alike_score_highest():
  """Draft layer i attends as target layers 2i and 2i + 1 do (plus noise): the mapping
  pairs them so, and a layer's score with itself is 0."""
  rng = np.random.default_rng(0)
  rows, positions = 12, 40
  target = rng.dirichlet(np.full(positions, 0.3), size=(6, rows))  # [Lt, N, S]
  noisy = target[::2] * rng.uniform(0.8, 1.2, size=(3, rows, positions))
  draft = noisy / noisy.sum(axis=-1, keepdims=True)
  score = kl_similarity(target, draft)
  assert score.shape == (3, 6) and np.all(score <= 1e-12)
  assert np.allclose(np.diag(kl_similarity(target, target)), 0.0)
  assert monotone_map(score)[::2] == (0, 1, 2)
  with pytest.raises(ValueError, match="same rows and positions"):
    kl_similarity(target, draft[:, :, :-1])
