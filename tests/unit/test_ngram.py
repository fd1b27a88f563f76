"""Prompt lookup against a plain Python search; TokenSwift's n-gram table against a dictionary."""

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from longspec_jax.methods.prompt_lookup import CANDIDATES_PER_MATCH, COUNT_BLOCK, PromptLookup, latest
from longspec_jax.methods.tokenswift import NGramTable

from helpers import examples


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


# One program per configuration, shared by the examples that draw it.
match = jax.jit(PromptLookup.match, static_argnums=0)


@examples(60)
@given(
  seed=st.integers(0, 2**31 - 1),
  vocab=st.integers(2, 6),
  max_ngram=st.integers(1, 4),
  matches=st.sampled_from([1, 1, 2, 4]),
)
def test_lookup_matches_reference(seed, vocab, max_ngram, matches):
  rng = np.random.default_rng(seed)
  size, batch, gamma = 40, 3, 5
  history = rng.integers(0, vocab, size=(batch, size))
  end = rng.integers(0, size, size=batch)  # index of the root
  lookup = PromptLookup(max_ngram, gamma, matches)
  drafted, valid, ngram = match(lookup, jnp.asarray(history, jnp.int32), jnp.asarray(end, jnp.int32))
  assert drafted.shape == valid.shape == (batch, matches, gamma)
  for b in range(batch):
    expected = reference_lookup(history[b, : end[b] + 1].tolist(), max_ngram, gamma, matches)
    got = [np.asarray(drafted[b, m])[np.asarray(valid[b, m])].tolist() for m in range(matches)]
    assert got == expected + [[]] * (matches - len(expected))
    assert (ngram[b] > 0) == bool(expected)


@examples(25)
@given(
  seed=st.integers(0, 2**31 - 1),
  size=st.sampled_from([1, 7, COUNT_BLOCK, 3 * COUNT_BLOCK + 5, 1000]),
  k=st.sampled_from([1, 2, 16]),
  density=st.sampled_from([0.0, 0.01, 0.3, 1.0]),
)
def test_latest_are_the_last_true_positions_latest_first(seed, size, k, density):
  mask = np.random.default_rng(seed).random((2, 3, size)) < density  # [..., L]: leading axes kept
  got = np.asarray(latest(jnp.asarray(mask), k))
  assert got.shape == (2, 3, k)
  for index in np.ndindex(2, 3):
    expected = np.flatnonzero(mask[index])[::-1][:k].tolist()
    assert got[index].tolist() == expected + [-1] * (k - len(expected))


def reference_table(tokens, n, slots):
  """Each first token's `slots` most frequent continuations in `tokens` (ties: the one
  seen first), as [continuation, count] lists, most frequent first."""
  seen = {}
  for s in range(len(tokens) - n + 1):
    gram = tuple(tokens[s : s + n])
    count, first = seen.get(gram, (0, s))
    seen[gram] = (count + 1, first)
  table = {}
  for gram, (count, _) in sorted(seen.items(), key=lambda item: (-item[1][0], item[1][1])):
    row = table.setdefault(gram[0], [])
    if len(row) < slots:
      row.append([list(gram[1:]), count])
  return {token: row + [None] * (slots - len(row)) for token, row in table.items()}


def reference_add(table, gram, slots):
  """One n-gram added: a held continuation counts once more, else it takes the first slot
  of the least count (empty slots count 0)."""
  row = table.setdefault(gram[0], [None] * slots)
  tail = list(gram[1:])
  for entry in row:
    if entry is not None and entry[0] == tail:
      entry[1] += 1
      return
  times = [0 if entry is None else entry[1] for entry in row]
  row[times.index(min(times))] = [tail, 1]


def table_rows(table, b, vocab):
  """The table's sequence b as reference_table's dictionary."""
  rows = {}
  for token in range(vocab):
    row = [
      None if c == 0 else [t.tolist(), int(c)]
      for t, c in zip(np.asarray(table.continuations[b, token]), np.asarray(table.counts[b, token]))
    ]
    if any(entry is not None for entry in row):
      rows[token] = row
  return rows


@examples(15)
@given(
  seed=st.integers(0, 2**31 - 1),
  vocab=st.integers(2, 5),
  n=st.integers(2, 4),
  slots=st.integers(1, 4),
  size=st.sampled_from([1, 3, 17, 40]),
)
def test_ngram_table_builds_and_adds_like_a_dictionary(seed, vocab, n, slots, size):
  """TokenSwift's n-gram table against a plain dictionary: built from each sequence's
  text, then the n-grams of more text added a few at a time; `top` lists each first
  token's most frequent continuations."""
  rng = np.random.default_rng(seed)
  batch = 3
  history = rng.integers(0, vocab, size=(batch, size + 12))
  count = rng.integers(0, size + 1, size=batch)
  # (jitted: one program each instead of every op compiled eagerly for this example's shapes)
  table = jax.jit(NGramTable.build, static_argnums=(2, 3, 4))(
    jnp.asarray(history, jnp.int32), jnp.asarray(count, jnp.int32), vocab, slots, n
  )
  expected = [reference_table(history[b, : count[b]].tolist(), n, slots) for b in range(batch)]
  for b in range(batch):
    assert table_rows(table, b, vocab) == expected[b]
  start = np.maximum(count - n + 1, 0)  # the n-grams that end in the text added next
  for added in (2, 5):
    stop = np.minimum(start + rng.integers(0, added + 1, size=batch), history.shape[1] - n + 1)
    table = jax.jit(NGramTable.add, static_argnames="most")(
      table, jnp.asarray(history, jnp.int32), jnp.asarray(start, jnp.int32), jnp.asarray(stop, jnp.int32), most=added
    )
    for b in range(batch):
      for s in range(start[b], stop[b]):
        reference_add(expected[b], history[b, s : s + n].tolist(), slots)
      assert table_rows(table, b, vocab) == expected[b]
    start = stop
  first = rng.integers(0, vocab, size=batch)
  k = min(slots, 2)
  grams, real = table.top(jnp.asarray(first, jnp.int32), k)
  for b in range(batch):
    row = [(entry[1], -slot, entry[0]) for slot, entry in enumerate(expected[b].get(first[b], [])) if entry]
    best = [[int(first[b]), *tail] for _, _, tail in sorted(row, reverse=True)[:k]]
    assert np.asarray(grams[b])[np.asarray(real[b])].tolist() == best


def test_past_outputs_fill_the_continuations_the_context_leaves_empty_and_name_their_evidence():
  from longspec_jax.methods.past import Past

  past = Past.empty(64)
  past.append([7, 1, 2, 3, 4, 50, 51, 52])
  lookup = PromptLookup(max_ngram=3, num_tokens=3, matches=2, past_tokens=64)
  # Row 0 ends in 1 2 3 4, a 4-gram the past holds, and its own context holds a 1-gram (4 ...
  # 4): its own continuation first, the past's in the slot left. Row 1's tail 8 9 the past
  # lacks: its own alone. Row 2's context repeats nothing: the past's first.
  history = jnp.asarray([[4, 60, 61, 1, 2, 3, 4], [8, 9, 70, 8, 9, 0, 0], [11, 12, 1, 2, 3, 4, 0]], jnp.int32)
  drafted, valid, evidence = match(lookup, history, jnp.asarray([6, 4, 5], jnp.int32), past.on_device())
  got = lambda b, m: np.asarray(drafted[b, m])[np.asarray(valid[b, m])].tolist()
  assert got(0, 0) == [60, 61, 1] and got(0, 1) == [50, 51, 52] and int(evidence[0]) == 1
  assert got(1, 0) == [70, 8, 9] and got(1, 1) == [] and int(evidence[1]) == 2
  assert got(2, 0) == [50, 51, 52] and got(2, 1) == [] and int(evidence[2]) == 3 + 1  # (the past's 4-gram)
