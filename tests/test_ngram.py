"""Prompt lookup against a plain Python search."""

import jax.numpy as jnp
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from longspec_jax.ngram import PromptLookup


def reference_lookup(tokens, max_ngram, gamma):
  for n in range(max_ngram, 0, -1):
    if len(tokens) <= n:
      continue
    tail = tokens[-n:]
    for s in range(len(tokens) - n - 1, -1, -1):  # most recent earlier occurrence first
      if tokens[s : s + n] == tail:
        return tokens[s + n : s + n + gamma]
  return []


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), vocab=st.integers(2, 6), max_ngram=st.integers(1, 4))
def test_lookup_matches_reference(seed, vocab, max_ngram):
  rng = np.random.default_rng(seed)
  size, batch, gamma = 40, 3, 5
  history = rng.integers(0, vocab, size=(batch, size))
  end = rng.integers(0, size, size=batch)  # index of the root
  drafted, valid = PromptLookup(max_ngram, gamma).lookup(jnp.asarray(history, jnp.int32), jnp.asarray(end, jnp.int32))
  for b in range(batch):
    expected = reference_lookup(history[b, : end[b] + 1].tolist(), max_ngram, gamma)
    got = np.asarray(drafted[b])[np.asarray(valid[b])].tolist()
    assert got == expected
