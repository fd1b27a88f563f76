"""`make_proposer`'s choices that need no weights: `auto`'s continuations by batch size."""

import pytest

from longspec_jax import backend
from longspec_jax.methods.factory import auto_copies, make_proposer, verify_rows
from longspec_jax.methods.registry import ProposerOptions

BATCHES = (1, 2, 3, 4, 8, 16, 17, 32, 64, 100, 128, 255, 256, 512)


@pytest.fixture(params=[False, True], ids=["cpu", "gpu"])
def platform(request, monkeypatch):
  monkeypatch.setattr(backend, "on_gpu", lambda: request.param)
  return request.param


def test_a_single_sequence_keeps_the_measured_continuations(platform):
  assert auto_copies(1) == ((24, 4) if platform else (10, 1))


@pytest.mark.parametrize("tokens", [None, 6, 40])
def test_a_batch_shrinks_the_trie_into_the_row_budget_and_never_grows_it(platform, tokens):
  sizes = [auto_copies(batch, tokens) for batch in BATCHES]
  for batch, (length, matches) in zip(BATCHES, sizes):
    assert length >= 1 and matches >= 1
    assert batch * (1 + length * matches) <= verify_rows(batch) or (length, matches) == (1, 1)
  tries = [1 + length * matches for length, matches in sizes]
  assert tries == sorted(tries, reverse=True)
  assert sizes[-1] == (1, 1)  # (past the budget: a chain of one token, which `auto` weighs against AR)


def test_the_measured_batches_get_the_measured_chains(platform):
  if platform:
    assert [auto_copies(batch) for batch in (2, 16, 64)] == [(24, 4), (15, 1), (7, 1)]


def test_the_draft_copy_length_is_the_start_and_the_flags_are_kept(platform):
  assert auto_copies(1, 6)[0] == 6
  lookup = make_proposer("auto", None, ProposerOptions(batch=64))[0].lookup
  assert (lookup.num_tokens, lookup.matches) == auto_copies(64)
  lookup = make_proposer("auto", None, ProposerOptions(batch=64, copy_tokens=20, copy_matches=3))[0].lookup
  assert (lookup.num_tokens, lookup.matches) == (20, 3)  # (a user's sizes are not second-guessed)
