"""The ring of past outputs against a plain Python list of what it should hold, and its
search against a plain Python search of that list."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from longspec_jax.methods import past as ring
from longspec_jax.methods.past import (
  CANDIDATES_PER_MATCH,
  MAX_SIZE,
  MIN_SIZE,
  PAST_NGRAMS,
  RANKED_PREFIX,
  SEPARATOR,
  Past,
  count_at_most,
  match_past,
  ngram_key,
)

from helpers import examples

match = jax.jit(match_past, static_argnums=(3, 4))


def held(outputs: list[list[int]], size: int) -> list[int]:
  """What a ring of `size` holds after `outputs`, oldest first: each output (its last
  size - 1 tokens) and a separator, the latest `size` tokens, separators before."""
  stream = [SEPARATOR] * size
  for output in outputs:
    stream += output[-(size - 1) :] + [SEPARATOR]
  return stream[-size:]


def reference_match(ring: list[int], context: list[int], gamma: int, matches: int) -> tuple[list[list[int]], int]:
  """The continuations (up to a separator) after the CANDIDATES_PER_MATCH x `matches` most
  recent occurrences in `ring` (oldest first) of the context's last n tokens that a token
  follows, n the longest of PAST_NGRAMS found: ranked by how many of them share their first
  1, 2, ... RANKED_PREFIX tokens, then by recency, those held whole by one ranked before
  them dropped, the first `matches`."""
  for n in PAST_NGRAMS:
    if len(context) < n:
      continue
    tail = context[-n:]
    occurrences = [s for s in range(len(ring) - n - 1, -1, -1) if ring[s : s + n] == tail and ring[s + n] != SEPARATOR]
    if not occurrences:
      continue
    continuations = []
    for s in occurrences[: CANDIDATES_PER_MATCH * matches]:
      continuation = []
      for token in ring[s + n : s + n + gamma]:
        if token == SEPARATOR:
          break
        continuation.append(token)
      continuations.append(continuation)

    def shared(c, k):
      return sum(len(c) >= k and len(d) >= k and d[:k] == c[:k] for d in continuations)

    order = sorted(
      range(len(continuations)),
      key=lambda i: (tuple(-shared(continuations[i], k) for k in range(1, RANKED_PREFIX + 1)), i),
    )
    kept = []
    for i in order:
      c = continuations[i]
      if not any(c == k[: len(c)] for k in kept):
        kept.append(c)
    return kept[:matches], n
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
  matches=st.sampled_from([1, 3]),
)
def test_the_ring_holds_the_latest_outputs_and_is_searched_like_a_list(seed, vocab, size, outputs, gamma, matches):
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
  device = past.on_device()
  tokens, real, ngram = match(device, jnp.asarray(history, jnp.int32), jnp.asarray(end, jnp.int32), gamma, matches)
  assert tokens.shape == real.shape == (batch, matches, gamma)
  for b in range(batch):
    context = history[b, : end[b] + 1].tolist()
    if SEPARATOR in context:
      continue  # (a context holds real tokens only)
    expected, n = reference_match(ring, context, gamma, matches)
    got = [np.asarray(tokens[b, m])[np.asarray(real[b, m])].tolist() for m in range(matches)]
    assert got == expected + [[]] * (matches - len(expected)) and int(ngram[b]) == (n if expected else 0)
    for m in range(matches):
      assert not np.asarray(real[b, m])[len(got[m]) :].any()  # (real up to where it stops)


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


@pytest.mark.parametrize("size, written", [(10, 0), (97, 0), (97, 41), (300, 299)])
def test_an_empty_rings_index_is_the_sorted_one(size, written):
  """A ring holding no n-gram is indexed without a sort: the positions by age."""
  empty = Past(np.full((size,), SEPARATOR, np.int32), np.zeros((len(PAST_NGRAMS), size), np.uint32), written)
  got = empty.on_device()
  want = ring._indexed(empty.tokens, empty.keys, np.int32(written))
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@examples(40)
@given(
  seed=st.integers(0, 2**31 - 1),
  size=st.sampled_from([10, 40, 97, 300]),
  outputs=st.integers(1, 12),
  first_empty=st.booleans(),
)
def test_the_index_updated_where_outputs_land_equals_the_index_sorted_whole(seed, size, outputs, first_empty):
  rng = np.random.default_rng(seed)
  past = Past.empty(size)
  if first_empty:  # (the updates start from the empty ring's index, built without a sort)
    past.on_device()
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


@examples(60)
@given(
  seed=st.integers(0, 2**31 - 1),
  size=st.integers(1, 300),
  spread=st.sampled_from([3, 50, 2**32 - 1]),
  queries=st.integers(1, 9),
)
def test_counting_the_keys_at_most_a_query_equals_a_binary_search(seed, size, spread, queries):
  rng = np.random.default_rng(seed)
  ascending = np.sort(rng.integers(0, spread, size, dtype=np.uint64)).astype(np.uint32)  # repeats where spread is small
  drawn = rng.integers(0, spread, queries, dtype=np.uint64)
  asked = np.concatenate([drawn, ascending[:1], [0xFFFFFFFF]]).astype(np.uint32)
  got = np.asarray(count_at_most(jnp.asarray(ascending), jnp.asarray(asked)))
  assert (got == np.searchsorted(ascending, asked, side="right")).all()


def test_an_output_repeated_is_proposed_whole_up_to_its_end():
  past = Past.empty(64)
  past.append([5, 6, 7, 8, 9, 10, 11, 12])
  past.append([20, 21, 22, 23, 24])
  history = jnp.asarray([[1, 2, 5, 6, 7, 8, 0, 0], [1, 2, 3, 21, 22, 23, 24, 0]], jnp.int32)
  tokens, real, ngram = match(past.on_device(), history, jnp.asarray([5, 6], jnp.int32), 6, 1)
  assert np.asarray(tokens[0, 0])[np.asarray(real[0, 0])].tolist() == [9, 10, 11, 12] and int(ngram[0]) == 4
  assert not np.asarray(real[1]).any() and int(ngram[1]) == 0  # (nothing followed 21-24 but its end)


def test_continuations_are_ranked_by_how_often_they_followed_then_by_recency():
  past = Past.empty(64)
  for output in ([1, 2, 3, 4, 10, 11], [1, 2, 3, 4, 20, 21], [1, 2, 3, 4, 20, 22], [1, 2, 3, 4, 30]):
    past.append(output)
  history = jnp.asarray([[9, 1, 2, 3, 4]], jnp.int32)
  tokens, real, ngram = match(past.on_device(), history, jnp.asarray([4], jnp.int32), 2, 3)
  got = [np.asarray(tokens[0, m])[np.asarray(real[0, m])].tolist() for m in range(3)]
  # (20 followed twice, the newer of them first; then what agrees with itself for two tokens)
  assert got == [[20, 22], [20, 21], [10, 11]] and int(ngram[0]) == 4


def test_a_ring_too_small_for_an_ngram_or_too_large_for_its_scores_is_refused():
  for size in (MIN_SIZE - 1, MAX_SIZE + 1):
    with pytest.raises(ValueError, match=f"{MIN_SIZE} to {MAX_SIZE}"):
      Past.empty(size)


def test_the_keys_are_the_same_on_host_and_device():
  windows = np.random.default_rng(0).integers(0, 2**17, (50, 8)).astype(np.int32)
  assert (np.asarray(ngram_key(jnp.asarray(windows))) == ngram_key(windows)).all()
  assert (ngram_key(windows) % 2 == 1).all()
