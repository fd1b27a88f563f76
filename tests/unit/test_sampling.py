"""The logit processors against direct NumPy definitions, and the penalty's window."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from longspec_jax.decoding.sampling import (
  Draw,
  SamplingConfig,
  generation_keys,
  log_probs,
  position_noise,
  recent_tokens,
  round_keys,
  sample,
)
from longspec_jax.errors import UserError


def reference_probs(logits, seen, c: SamplingConfig):
  x = np.where(seen, logits / c.penalty, logits) / c.temperature
  p = np.exp(x - x.max())
  p /= p.sum()
  if c.top_k:
    p = np.where(p >= np.sort(p)[::-1][c.top_k - 1], p, 0)
    p /= p.sum()
  if c.top_p < 1:
    order = np.argsort(-p, kind="stable")
    before = np.cumsum(p[order]) - p[order]
    keep = np.zeros_like(p, bool)
    keep[order[before < c.top_p]] = True
    p = np.where(p >= p[keep].min(), p, 0)
    p /= p.sum()
  if c.min_p:
    p = np.where(p >= c.min_p * p.max(), p, 0)
    p /= p.sum()
  return p


@pytest.mark.parametrize(
  "config",
  [
    SamplingConfig(temperature=0.7),
    SamplingConfig(temperature=1.0, top_k=5),
    SamplingConfig(temperature=1.3, top_p=0.6),
    SamplingConfig(temperature=1.0, min_p=0.2),
    SamplingConfig(temperature=0.9, top_k=20, top_p=0.9, min_p=0.05, penalty=1.3),
  ],
)
def test_processors_match_their_definitions(config):
  rng = np.random.default_rng(0)
  logits = rng.normal(0, 3, (4, 97)).astype(np.float32)
  seen = rng.random((4, 97)) < 0.2
  got = np.exp(np.asarray(log_probs(jnp.asarray(logits), jnp.asarray(seen), config)))
  for b in range(4):
    np.testing.assert_allclose(got[b], reference_probs(logits[b].astype(np.float64), seen[b], config), atol=1e-6)


def test_greedy_is_the_argmax_of_the_penalized_logits():
  logits = jnp.asarray([[2.0, 1.9, -1.0]])
  seen = jnp.asarray([[True, False, False]])
  assert int(sample(logits, jax.random.key(0), SamplingConfig(), seen)[0]) == 0
  assert int(sample(logits, jax.random.key(0), SamplingConfig(penalty=1.2), seen)[0]) == 1


@pytest.mark.parametrize("draw", list(Draw))
def test_a_draw_follows_the_processed_distribution(draw):
  """20,000 draws of one token (rows with seeds of their own, positions 0..19 under
  POSITION) against the processed distribution: a chi-square goodness-of-fit test must
  not reject at the 1% level."""
  from scipy.stats import chisquare

  config = SamplingConfig(temperature=0.9, top_k=12, penalty=1.3, draw=draw)
  rng = np.random.default_rng(3)
  logits = rng.normal(0, 2, 31).astype(np.float32)
  seen = rng.random(31) < 0.3
  rows = 20_000
  keys, _ = generation_keys(list(range(rows // 20)), config)
  positions = jnp.broadcast_to(jnp.arange(20), (rows // 20, 20))
  tokens = sample(
    jnp.broadcast_to(jnp.asarray(logits), (rows // 20, 20, 31)),
    keys,
    config,
    jnp.broadcast_to(jnp.asarray(seen), (rows // 20, 20, 31)),
    positions,
  )
  counts = np.bincount(np.asarray(tokens).ravel(), minlength=31)
  expected = reference_probs(logits.astype(np.float64), seen, config) * rows
  kept = expected > 0
  assert counts[~kept].sum() == 0  # (removed tokens are never drawn)
  assert chisquare(counts[kept], expected[kept] / expected[kept].sum() * rows).pvalue > 0.01


def test_a_position_draw_depends_on_the_row_seed_and_the_position_alone():
  """The noise of row b at position p is the same whatever else the call holds (other
  rows, other positions, their order), differs across positions and seeds, and a row's
  key stays the same round after round."""
  config = SamplingConfig(temperature=1.0)
  keys, first = generation_keys([7, 8, 7], config)
  noise = position_noise(keys, jnp.asarray([[3, 4], [3, 4], [4, 9]]), 50)  # [B, 2, V]
  alone = position_noise(generation_keys([7], config)[0], jnp.asarray([[4]]), 50)
  np.testing.assert_array_equal(noise[0, 1], alone[0, 0])
  np.testing.assert_array_equal(noise[2, 0], alone[0, 0])  # (row 2: seed 7 again)
  assert not np.array_equal(noise[0, 0], noise[0, 1]) and not np.array_equal(noise[0, 0], noise[1, 0])
  assert jax.random.key_data(round_keys(keys, config)[0]).tolist() == jax.random.key_data(keys).tolist()
  assert jax.random.key_data(first).tolist() == jax.random.key_data(keys).tolist()


def test_recent_tokens_window_spans_history_and_path():
  rng = np.random.default_rng(1)
  history = rng.integers(0, 30, (2, 12))
  ends = np.array([9, 3])
  tail = np.array([[[5, 6, -1], [7, -1, -1]], [[-1, -1, -1], [8, 9, 10]]])
  config = SamplingConfig(penalty=1.5, penalty_window=6)
  seen = np.asarray(recent_tokens(jnp.asarray(history), jnp.asarray(ends), jnp.asarray(tail), config, 30))
  for b in range(2):
    for n in range(2):
      context = list(history[b, : ends[b] + 1]) + [t for t in tail[b, n] if t >= 0]
      assert set(np.flatnonzero(seen[b, n])) == set(context[-6:]), (b, n)


@pytest.mark.parametrize(
  "field,value,message",
  [
    ("top_p", 0.0, "top_p must be"),
    ("min_p", 1.0, "min_p must be"),
    ("penalty", 0.5, "penalty must be"),
    ("top_k", -1, "top_k must be"),
    ("temperature", float("inf"), "temperature must be finite"),
    ("penalty", float("inf"), "penalty must be finite"),
  ],
)
def test_bad_settings_are_refused(field, value, message):
  with pytest.raises(UserError, match=message):
    SamplingConfig(**{field: value})


def test_each_sequence_draws_as_its_own_config_would():
  """Per-sequence temperature and top-p in one batch: each row draws, token for token, what
  a config of its own settings draws for it (greedy rows included), under the shared
  top-k, min-p and penalty; an all-greedy batch is the argmax."""
  rng = np.random.default_rng(4)
  logits = jnp.asarray(rng.standard_normal((4, 3, 50)) * 3, jnp.float32)
  seen = jnp.asarray(rng.random((4, 3, 50)) < 0.1)
  positions = jnp.asarray(rng.integers(0, 1000, (4, 3)), jnp.int32)
  keys, _ = generation_keys([5, 6, 7, 8], SamplingConfig(temperature=1.0))
  shared = SamplingConfig(top_k=30, min_p=0.02, penalty=1.3)
  settings = [(0.0, 1.0), (0.7, 0.9), (1.3, 1.0), (0.5, 0.3)]
  rows = shared.per_sequence(*zip(*settings))
  got = np.asarray(sample(logits, keys, shared, seen, positions, rows))
  for b, (temperature, top_p) in enumerate(settings):
    alone = SamplingConfig(temperature=temperature, top_p=top_p, top_k=30, min_p=0.02, penalty=1.3)
    expected = sample(logits[b : b + 1], keys[b : b + 1], alone, seen[b : b + 1], positions[b : b + 1])
    np.testing.assert_array_equal(got[b], np.asarray(expected)[0])
  greedy = shared.per_sequence([0.0] * 4, [0.5] * 4)
  np.testing.assert_array_equal(
    np.asarray(sample(logits, keys, shared, seen, positions, greedy)), np.asarray(sample(logits, keys, shared, seen))
  )


def test_a_batch_without_draws_compiles_none():
  """`RowSampling`'s static flags: a batch whose live rows are all greedy samples the argmax
  in a program with neither a draw nor a branch (a branch a round made a GPU's host read
  its predicate); one without a top-p below 1 among its drawing rows sorts no vocabulary."""
  config = SamplingConfig()
  greedy = config.per_sequence([0.0, 0.0], [0.5, 1.0])
  assert (greedy.sampled, greedy.nucleus) == (False, False)
  drawing = config.per_sequence([0.0, 0.7], [0.5, 1.0])
  assert (drawing.sampled, drawing.nucleus) == (True, False)
  assert config.per_sequence([0.7, 0.0], [0.9, 1.0]).nucleus
  assert not drawing.flagged(np.array([True, False])).sampled  # (only live rows count)
  logits, positions = jnp.zeros((2, 3, 50)), jnp.zeros((2, 3), jnp.int32)
  keys, _ = generation_keys([1, 2], SamplingConfig(temperature=1.0))
  program = lambda rows: jax.jit(sample, static_argnums=2).lower(logits, keys, config, None, positions, rows).as_text()
  assert not any(op in program(greedy) for op in ("case", "threefry", "sort"))
  assert "threefry" in program(drawing) and "sort" not in program(drawing)


@pytest.mark.parametrize("check", ["per_sequence", "check_rows"])
def test_per_sequence_settings_are_checked(check):
  """The same sentences from the device-side settings and from the host-side check a
  server runs before queuing a request (which returns host arrays, never device ones)."""
  with pytest.raises(UserError, match="top_p must be in"):
    getattr(SamplingConfig(), check)([0.5], [1.5])
  with pytest.raises(UserError, match="temperature must be"):
    getattr(SamplingConfig(), check)([-1.0], [1.0])
  with pytest.raises(UserError, match="keyed by position"):
    getattr(SamplingConfig(draw=Draw.STREAM), check)([0.5], [1.0])
  temperatures, top_ps = SamplingConfig().check_rows([0.5, 0.0], [0.9, 1.0])
  assert isinstance(temperatures, np.ndarray) and temperatures.dtype == np.float32
  np.testing.assert_array_equal(top_ps, np.float32([0.9, 1.0]))
