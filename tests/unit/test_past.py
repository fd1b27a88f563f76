"""The ring of past outputs against a plain Python list of what it should hold, and its
search against a plain Python search of that list."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from longspec_jax.methods.past import MAX_SIZE, MIN_SIZE, PAST_NGRAMS, SEPARATOR, Past, match_past, ngram_key

from helpers import examples

match = jax.jit(match_past, static_argnums=3)


def held(outputs: list[list[int]], size: int) -> list[int]:
  """What a ring of `size` holds after `outputs`, oldest first: each output (its last
  size - 1 tokens) and a separator, the latest `size` tokens, separators before."""
  stream = [SEPARATOR] * size
  for output in outputs:
    stream += output[-(size - 1) :] + [SEPARATOR]
  return stream[-size:]


def reference_match(ring: list[int], context: list[int], gamma: int) -> tuple[list[int], int]:
  """The continuation after the most recent occurrence in `ring` (oldest first) of the
  context's last n tokens that a token follows, n the longest of PAST_NGRAMS found; up to
  a separator."""
  for n in PAST_NGRAMS:
    if len(context) < n:
      continue
    tail = context[-n:]
    for s in range(len(ring) - n - 1, -1, -1):  # most recent first
      if ring[s : s + n] == tail and ring[s + n] != SEPARATOR:  # (a separator never equals a context token)
        continuation = []
        for token in ring[s + n : s + n + gamma]:
          if token == SEPARATOR:
            break
          continuation.append(token)
        return continuation, n
  return [], 0


def keys_of(tokens: np.ndarray) -> np.ndarray:
  """Every position's key recomputed from the ring alone."""
  size = tokens.shape[0]
  ends = np.arange(size)
  keys = []
  for n in PAST_NGRAMS:
    windows = tokens[(ends[:, None] - n + 1 + np.arange(n)[None, :]) % size]
    whole = np.all(windows != SEPARATOR, axis=-1) & (tokens[(ends + 1) % size] != SEPARATOR)
    keys.append(np.where(whole, ngram_key(windows), 0))
  return np.stack(keys)


@examples(60)
@given(
  seed=st.integers(0, 2**31 - 1),
  vocab=st.integers(2, 4),
  size=st.sampled_from([10, 13, 40, 97]),
  outputs=st.integers(0, 6),
  gamma=st.sampled_from([1, 5, 12]),
)
def test_the_ring_holds_the_latest_outputs_and_is_searched_like_a_list(seed, vocab, size, outputs, gamma):
  rng = np.random.default_rng(seed)
  past = Past.empty(size)
  written = [rng.integers(0, vocab, rng.integers(0, 2 * size)).tolist() for _ in range(outputs)]
  for output in written:
    past.append(output)
    if rng.random() < 0.5:  # (the device's copy brought up to date here, else after several)
      past.on_device()
  ring = held(written, size)
  order = (np.arange(size) + past.written) % size  # ring positions, oldest first
  assert past.tokens[order].tolist() == ring
  assert (past.keys == keys_of(past.tokens)).all()  # (written where they changed: as if recomputed whole)
  batch, length = 4, 30
  history = rng.integers(0, vocab, (batch, length))
  end = rng.integers(0, length, batch)  # the root's index
  history[0, : end[0] + 1] = (ring[-12:] * 3)[: end[0] + 1] if ring[-12:] else history[0, : end[0] + 1]
  tokens, real, ngram = match(past.on_device(), jnp.asarray(history, jnp.int32), jnp.asarray(end, jnp.int32), gamma)
  assert tokens.shape == real.shape == (batch, gamma)
  for b in range(batch):
    context = history[b, : end[b] + 1].tolist()
    if SEPARATOR in context:
      continue  # (a context holds real tokens only)
    expected, n = reference_match(ring, context, gamma)
    assert np.asarray(tokens[b])[np.asarray(real[b])].tolist() == expected and int(ngram[b]) == n
    assert not np.asarray(real[b])[len(expected) :].any()


def test_the_device_index_lists_keys_ascending_the_oldest_first_among_equal_ones():
  past = Past.empty(40)
  for output in ([1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 5, 7], [9] * 20, [1, 2, 3, 4, 5, 8]):
    past.append(output)
  device = past.on_device()
  keys, ends = np.asarray(device.index_keys), np.asarray(device.index_ends)
  age = (ends - past.written) % past.size
  for row in range(len(PAST_NGRAMS)):
    assert sorted(keys[row].tolist()) == sorted(past.keys[row].tolist())
    assert (past.keys[row][ends[row]] == keys[row]).all()  # (each entry's position holds its key)
    order = np.lexsort((age[row], keys[row]))
    assert (order == np.arange(past.size)).all()  # (ascending by key, then by age)


@examples(40)
@given(
  seed=st.integers(0, 2**31 - 1),
  size=st.sampled_from([10, 40, 97, 300]),
  outputs=st.integers(1, 12),
)
def test_the_index_updated_where_outputs_land_equals_the_index_sorted_whole(seed, size, outputs):
  rng = np.random.default_rng(seed)
  past = Past.empty(size)
  for _ in range(outputs):
    past.append(rng.integers(0, 3, rng.integers(0, size // 3 + 2)).tolist())
    if rng.random() < 0.6:
      past.on_device()
  device = past.on_device()
  whole = Past(past.tokens.copy(), past.keys.copy(), past.written).on_device()
  assert (np.asarray(device.tokens) == past.tokens).all() and int(device.written) == past.written
  for row in range(len(PAST_NGRAMS)):
    keys, ends = np.asarray(device.index_keys[row]), np.asarray(device.index_ends[row])
    want_keys, want_ends = np.asarray(whole.index_keys[row]), np.asarray(whole.index_ends[row])
    assert (keys == want_keys).all()
    some = keys != 0  # (the order among positions that hold no n-gram is not kept)
    assert (ends[some] == want_ends[some]).all() and sorted(ends[~some]) == sorted(want_ends[~some])


def test_an_output_repeated_is_proposed_whole_up_to_its_end():
  past = Past.empty(64)
  past.append([5, 6, 7, 8, 9, 10, 11, 12])
  past.append([20, 21, 22, 23, 24])
  history = jnp.asarray([[1, 2, 5, 6, 7, 8, 0, 0], [1, 2, 3, 21, 22, 23, 24, 0]], jnp.int32)
  tokens, real, ngram = match(past.on_device(), history, jnp.asarray([5, 6], jnp.int32), 6)
  assert np.asarray(tokens[0])[np.asarray(real[0])].tolist() == [9, 10, 11, 12] and int(ngram[0]) == 4
  assert not np.asarray(real[1]).any() and int(ngram[1]) == 0  # (nothing followed 21-24 but its end)


def test_a_ring_too_small_for_an_ngram_or_too_large_for_its_scores_is_refused():
  for size in (MIN_SIZE - 1, MAX_SIZE + 1):
    with pytest.raises(ValueError, match=f"{MIN_SIZE} to {MAX_SIZE}"):
      Past.empty(size)


def test_the_keys_are_the_same_on_host_and_device():
  windows = np.random.default_rng(0).integers(0, 2**17, (50, 8)).astype(np.int32)
  assert (np.asarray(ngram_key(jnp.asarray(windows))) == ngram_key(windows)).all()
  assert (ngram_key(windows) % 2 == 1).all()
