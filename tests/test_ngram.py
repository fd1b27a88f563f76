"""Prompt lookup against a plain Python search."""

import jax.numpy as jnp
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from longspec_jax.ngram import CANDIDATES_PER_MATCH, COUNT_BLOCK, PromptLookup, latest


def reference_lookup(tokens, max_ngram, gamma, matches=1):
  """The continuations prompt lookup proposes, most recent first: of the longest n-gram's
  latest matches (CANDIDATES_PER_MATCH * matches of them looked at), then the shorter
  ones', those not already held by an earlier one (with one match, the latest of the
  longest n-gram)."""
  looked_at = 1 if matches == 1 else CANDIDATES_PER_MATCH * matches
  found = []
  for n in range(max_ngram, 0, -1):
    if len(tokens) <= n:
      continue
    tail = tokens[-n:]
    starts = [s for s in range(len(tokens) - n - 1, -1, -1) if tokens[s : s + n] == tail][:looked_at]
    for s in starts:  # most recent earlier occurrence first
      continuation = tokens[s + n : s + n + gamma]
      if not any(held[: len(continuation)] == continuation for held in found):
        found.append(continuation)
  return found[:matches]


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), vocab=st.integers(2, 6), max_ngram=st.integers(1, 4),
       matches=st.sampled_from([1, 1, 2, 4]))
def test_lookup_matches_reference(seed, vocab, max_ngram, matches):
  rng = np.random.default_rng(seed)
  size, batch, gamma = 40, 3, 5
  history = rng.integers(0, vocab, size=(batch, size))
  end = rng.integers(0, size, size=batch)  # index of the root
  lookup = PromptLookup(max_ngram, gamma, matches)
  drafted, valid, ngram = lookup.match(jnp.asarray(history, jnp.int32), jnp.asarray(end, jnp.int32))
  assert drafted.shape == valid.shape == (batch, matches, gamma)
  for b in range(batch):
    expected = reference_lookup(history[b, : end[b] + 1].tolist(), max_ngram, gamma, matches)
    got = [np.asarray(drafted[b, m])[np.asarray(valid[b, m])].tolist() for m in range(matches)]
    assert got == expected + [[]] * (matches - len(expected))
    assert (ngram[b] > 0) == bool(expected)


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), size=st.sampled_from([1, 7, COUNT_BLOCK, 3 * COUNT_BLOCK + 5, 1000]),
       k=st.sampled_from([1, 2, 16]), density=st.sampled_from([0.0, 0.01, 0.3, 1.0]))
def test_latest_are_the_last_true_positions_latest_first(seed, size, k, density):
  mask = np.random.default_rng(seed).random((2, 3, size)) < density  # [..., L]: leading axes kept
  got = np.asarray(latest(jnp.asarray(mask), k))
  assert got.shape == (2, 3, k)
  for index in np.ndindex(2, 3):
    expected = np.flatnonzero(mask[index])[::-1][:k].tolist()
    assert got[index].tolist() == expected + [-1] * (k - len(expected))
