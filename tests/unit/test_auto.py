"""`auto`'s choice of kind on synthetic texts and prices, no model: greedy rounds replayed
against a known text (`lab.replay_auto`), so each kind's gain is what the text makes it."""

import itertools

import pytest

from lab.replay_auto import replay
from longspec_jax.methods.auto import CHOOSE, Adaptive, Kind
from longspec_jax.methods.prompt_lookup import PromptLookup

AUTO = Adaptive(lookup=PromptLookup(num_tokens=8, matches=2))
CHEAP_COPY = [1.0, 1.1, 1.3, 0.0]  # seconds of an AR, CHAIN and COPY round, then of a change of kind
DEAR_COPY = [1.0, 1.1, 4.0, 0.0]


TOKENS = itertools.count(100)


def fresh(n):
  """n tokens no other call draws: a text of them repeats nothing."""
  return [next(TOKENS) for _ in range(n)]


def run(prompt, text, seconds, force=None):
  """The replay's result; `force`: a kind's name, every round of it."""
  force = CHOOSE if force is None else AUTO.index(Kind(force))
  result, _ = replay(AUTO, prompt, text, seconds, AUTO.nothing_learnt(), force=force)
  return result


def best_single_kind(prompt, text, seconds):
  return min(run(prompt, text, seconds, kind)["seconds"] for kind in ("ar", "chain", "copy"))


def test_text_that_repeats_the_prompt_is_copied_by_the_cheapest_tree():
  """Every continuation holds: the chain emits what the trie does, at its lower price."""
  block = fresh(120)
  prompt, text = block + block[:20], block[20:100]
  result = run(prompt, text, CHEAP_COPY)
  assert result["rounds_by_kind"]["chain"] > 3 * result["rounds_by_kind"]["copy"]
  assert result["seconds"] <= 1.05 * best_single_kind(prompt, text, CHEAP_COPY)


def test_text_with_nothing_to_copy_runs_ar_rounds():
  prompt, text = fresh(60), fresh(40)
  result = run(prompt, text, CHEAP_COPY)
  assert result["rounds_by_kind"] == {"ar": 39, "chain": 0, "copy": 0}


@pytest.mark.parametrize("seconds", [CHEAP_COPY, DEAR_COPY], ids=["cheap-trie", "dear-trie"])
def test_where_the_latest_continuation_breaks_the_choice_keeps_up_with_the_best_kind(seconds):
  """Two payloads alternate after a separator longer than prompt lookup's n-grams: a round
  that starts after a separator finds the other payload as its latest continuation (the
  chain breaks at once) and the right one second (the trie holds). Whatever the trie's
  price, `auto` emits the text as fast as the best single kind or faster; at 4 AR rounds
  the trie runs no more than the once its unseen gain is tried."""
  separator, first, second = fresh(5), fresh(6), fresh(6)
  both = separator + first + separator + second
  prompt, text = both * 3, both * 4
  result = run(prompt, text, seconds)
  assert result["seconds"] <= 1.05 * best_single_kind(prompt, text, seconds)
  if seconds is DEAR_COPY:
    assert result["rounds_by_kind"]["copy"] <= 1
