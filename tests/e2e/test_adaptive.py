"""`auto`: the round-by-round choice, what it learns from a round, the draft's catch-up
after rounds without it, and lossless output whatever it chooses."""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from longspec_jax import engine
from longspec_jax.decoding.sampling import SamplingConfig
from longspec_jax.engine import Decoding, generate, prefill
from longspec_jax.methods import longspec, prices
from longspec_jax.methods.auto import CHOOSE, CYCLE, Adaptive, AdaptiveState, Kind, Plan
from longspec_jax.methods.longspec import LongSpecDraft
from longspec_jax.methods.prompt_lookup import PromptLookup
from longspec_jax.models.cache import KVCache
from longspec_jax.models.config import CapeConfig, DraftConfig
from longspec_jax.models.draft import random_draft

from helpers import tiny_target


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
  model = tiny_target("llama")
  return model


def draft_for(target, widths=(2, 2), **config):
  draft = random_draft(DraftConfig.for_target(target.config, window=8, **config), target.dtype)
  graphdef, params = nnx.split(draft)
  return LongSpecDraft(graphdef, widths), params, draft


# The kinds' indices (`Adaptive.kinds`) of a proposer of one continuation: AR, COPY and
# with a draft DRAFT (with several continuations, CHAIN comes after AR).
AR, COPY, DRAFT = 0, 1, 2


def state_with(
  copy_gain, costs, draft_gain=None, force=CHOOSE, since_draft=0, explore_after=32, switch=0.0, last=-1, chain=3
) -> AdaptiveState:
  """copy_gain [B]: every n-gram length's chain gain; draft_gain [B, 2] (default: none);
  since_draft and explore_after: both cases' (a number) or each's [2]."""
  copy_gain = jnp.broadcast_to(jnp.asarray(copy_gain, jnp.float32)[:, None], (len(copy_gain), 3))
  draft_gain = jnp.zeros((copy_gain.shape[0], 2)) if draft_gain is None else jnp.asarray(draft_gain, jnp.float32)
  return AdaptiveState(
    draft=None,
    past=None,
    copy_gain=copy_gain,
    chain_gain=jnp.copy(copy_gain),
    draft_gain=draft_gain,
    costs=jnp.asarray(costs, jnp.float32),
    switch=jnp.float32(switch),
    force=jnp.int32(force),
    last=jnp.int32(last),
    next_kind=jnp.int32(COPY),
    since_draft=by_case(since_draft),
    explore_after=by_case(explore_after),
    rounds_by_kind=jnp.zeros((len(costs),), jnp.int32),
    **no_pending(len(copy_gain), chain),
  )


def by_case(value) -> jax.Array:
  """A per-case count [2] (no match, a match) from one number for both or a pair."""
  return jnp.broadcast_to(jnp.asarray(value, jnp.int32), (2,))


def no_pending(batch, chain, matches=1):
  return dict(
    pending=jnp.zeros((batch, matches, chain), jnp.int32),
    pending_valid=jnp.zeros((batch, matches, chain), bool),
    pending_ngram=jnp.zeros((batch,), jnp.int32),
    pending_at=jnp.zeros((batch,), jnp.int32),
    pending_chained=jnp.zeros((batch,), bool),
  )


def plan_of(kind, copies, ngram, at, valid=None):
  """A round's plan: its kind, continuations [B, M, G] or one [B, G] (all valid by
  default), n-gram length [B] and the history index [B] of their first token."""
  copies = jnp.asarray(copies)
  if copies.ndim == 2:
    copies = copies[:, None]
    valid = None if valid is None else jnp.asarray(valid)[:, None]
  ngram = jnp.asarray(ngram)
  cases = jnp.any((ngram > 0)[:, None] == jnp.arange(2), axis=0)
  return Plan(
    kind=jnp.int32(kind),
    copies=copies,
    copy_valid=jnp.ones(copies.shape, bool) if valid is None else jnp.asarray(valid),
    ngram=ngram,
    at=jnp.asarray(at),
    cases=cases,
    explored=jnp.asarray(False),
    displaced=jnp.float32(0),
    draft_price=jnp.float32(1),
  )


def observe(proposer, state, plan, count, active, history, lengths):
  return proposer.observe(
    state,
    plan,
    jnp.asarray(count),
    jnp.asarray(active),
    history=jnp.asarray(history, jnp.int32),
    lengths=jnp.asarray(lengths, jnp.int32),
  )


def plan_for(proposer, state, history, lengths, done=None):
  cache = KVCache(k=jnp.zeros((1, 1, 1, 1, 1)), v=jnp.zeros((1, 1, 1, 1, 1)), lengths=jnp.asarray(lengths, jnp.int32))
  done = jnp.zeros((len(lengths),), bool) if done is None else jnp.asarray(done)
  return proposer.plan(state, cache=cache, history=jnp.asarray(history, jnp.int32), done=done)


# history [2, 8]: row 0 repeats (prompt lookup matches the 2-gram "5 6" -> 7 8 9), row 1 has no repeat.
HISTORY = [[5, 6, 7, 8, 9, 5, 6, 0], [1, 2, 3, 4, 10, 11, 12, 0]]


def test_a_round_takes_the_most_tokens_per_second():
  copy_only = Adaptive(PromptLookup(num_tokens=3))
  # Row 0 copies 3 tokens a round at 1.5x an AR step's price: copying wins.
  plan = plan_for(copy_only, state_with([3], [1.0, 1.5]), HISTORY[:1], [6])
  assert int(plan.kind) == COPY and int(plan.ngram[0]) == 2
  # Row 1 has no match: a copy round is an AR step at a higher price.
  assert int(plan_for(copy_only, state_with([3], [1.0, 1.5]), HISTORY[1:], [6]).kind) == AR
  # Summed over the batch: 3 + 1 tokens at 1.5 against 2 at 1.
  assert int(plan_for(copy_only, state_with([3, 3], [1.0, 1.5]), HISTORY, [6, 6]).kind) == COPY
  # The gain of the matched n-gram length counts: 2-gram chains have given 1.2 tokens.
  poor_bigrams = dataclasses.replace(state_with([3], [1.0, 1.5]), copy_gain=jnp.asarray([[3.0, 1.2, 3.0]]))
  assert int(plan_for(copy_only, poor_bigrams, HISTORY[:1], [6]).kind) == AR
  # A finished sequence counts for nothing.
  plan = plan_for(copy_only, state_with([3, 3], [1.0, 1.5]), HISTORY, [6, 6], done=[True, False])
  assert int(plan.kind) == AR
  np.testing.assert_array_equal(np.asarray(plan.copies[0]), [[7, 8, 9]])


def test_chain_rounds_come_with_several_continuations_and_win_where_the_others_add_little(tiny):
  one, several = PromptLookup(num_tokens=3), PromptLookup(num_tokens=3, matches=2)
  assert Adaptive(one).kinds == (Kind.AR, Kind.COPY) and Adaptive(one).index(Kind.CHAIN) == -1
  with_draft = Adaptive(several, draft_for(tiny)[0])
  assert with_draft.kinds == (Kind.AR, Kind.CHAIN, Kind.COPY, Kind.DRAFT) and with_draft.index(Kind.DRAFT) == 3
  proposer = Adaptive(several)
  ar, chain, copy = (proposer.index(k) for k in (Kind.AR, Kind.CHAIN, Kind.COPY))
  costs = [1.0, 1.2, 1.6]
  # The trie gives 3.2 tokens at 1.6, its first continuation alone 3 at 1.2: the chain.
  state = dataclasses.replace(state_with([3.2], costs), chain_gain=jnp.full((1, 3), 3.0))
  plan = plan_for(proposer, state, HISTORY[:1], [6])
  assert int(plan.kind) == chain
  # The trie gives 5: the trie. Without a match both are an AR step at a higher price.
  assert (
    int(plan_for(proposer, dataclasses.replace(state, copy_gain=jnp.full((1, 3), 5.0)), HISTORY[:1], [6]).kind) == copy
  )
  assert int(plan_for(proposer, state, HISTORY[1:], [6]).kind) == ar


def test_a_copy_round_shows_its_first_continuations_gain_and_a_chain_round_keeps_the_others(tiny):
  """A COPY round of two continuations that emitted 4 tokens where the first one agreed
  on 1: the trie's gain is 4, the first one's alone 2. A CHAIN round learns the first
  one's from its count, and the trie's once every continuation it kept has broken."""
  proposer = Adaptive(PromptLookup(num_tokens=3, matches=2), ema=1.0)
  chain, copy = proposer.index(Kind.CHAIN), proposer.index(Kind.COPY)
  state = dataclasses.replace(state_with([np.nan], [1, 1, 1]), **no_pending(1, 3, matches=2))
  prefix = [5, 6, 1, 5]  # the root at index 3; the continuations' first tokens at 4
  continuations = [[[7, 8, 9], [7, 4, 4]]]
  after = observe(proposer, state, plan_of(copy, continuations, [2], [4]), [4], [True], [prefix + [7, 4, 4, 2, 0]], [7])
  assert float(after.copy_gain[0, 1]) == 4.0 and float(after.chain_gain[0, 1]) == 2.0
  assert int(after.pending_ngram[0]) == 0 and list(np.asarray(after.rounds_by_kind)) == [0, 0, 1]
  # A CHAIN round of 7 3 3 that emitted 7 and the target's 4 (2 tokens): the first
  # continuation broke after 1; the second (7 4 4) goes on, and the next round emits its 4.
  continuations = [[[7, 3, 3], [7, 4, 4]]]
  after = observe(
    proposer, state, plan_of(chain, continuations, [2], [4]), [2], [True], [prefix + [7, 4, 0, 0, 0]], [5]
  )
  assert float(after.chain_gain[0, 1]) == 2.0 and np.isnan(float(after.copy_gain[0, 1]))
  assert bool(after.pending_chained[0])
  after = observe(
    proposer, after, plan_of(0, [[[1, 1, 1]] * 2], [2], [6]), [1], [True], [prefix + [7, 4, 4, 0, 0]], [6]
  )
  # The trie would have given 1 + 3; the chain's gain is not learnt twice from one round.
  assert float(after.copy_gain[0, 1]) == 4.0 and float(after.chain_gain[0, 1]) == 2.0


def test_draft_rounds_are_chosen_by_gain_explored_and_forced(tiny):
  proposer = Adaptive(PromptLookup(num_tokens=3), draft_for(tiny)[0])
  costs = [1.0, 1.5, 2.0]
  good = state_with([3, 3], costs, draft_gain=[[5, 5], [5, 5]])
  assert int(plan_for(proposer, good, HISTORY, [6, 6]).kind) == DRAFT
  poor = state_with([3, 3], costs, draft_gain=[[1.2, 1.2], [1.2, 1.2]])
  assert int(plan_for(proposer, poor, HISTORY, [6, 6]).kind) == COPY
  # Without a match the draft's gain without one counts: 3 tokens at 2 beat AR, 1.5 do not.
  assert int(plan_for(proposer, state_with([3], costs, [[3, 1]]), HISTORY[1:], [6]).kind) == DRAFT
  assert int(plan_for(proposer, state_with([3], costs, [[1.5, 9]]), HISTORY[1:], [6]).kind) == AR
  explore = dataclasses.replace(poor, since_draft=by_case(proposer.explore_every))
  plan = plan_for(proposer, explore, HISTORY, [6, 6])
  assert int(plan.kind) == DRAFT and bool(plan.explored)
  assert not bool(plan_for(proposer, dataclasses.replace(good, since_draft=by_case(40)), HISTORY, [6, 6]).explored)
  # Each case waits on its own count: a round of the case that is due explores, one of the other does not.
  due_without_match = dataclasses.replace(poor, since_draft=by_case([proposer.explore_every, 0]))
  assert bool(plan_for(proposer, due_without_match, HISTORY[1:], [6]).explored)
  assert not bool(plan_for(proposer, due_without_match, HISTORY[:1], [6]).explored)
  assert int(plan_for(proposer, dataclasses.replace(poor, force=jnp.int32(0)), HISTORY, [6, 6]).kind) == AR


def test_a_change_of_kind_is_paid_for_and_cycling_takes_the_next_kind():
  copy_only = Adaptive(PromptLookup(num_tokens=3), run=4)
  # Row 0's chain gives 1.1 tokens at 1.05: a little better than AR's 1 at 1 ...
  state = state_with([1.1], [1.0, 1.05])
  assert int(plan_for(copy_only, dataclasses.replace(state, last=jnp.int32(AR)), HISTORY[:1], [6]).kind) == 1
  # ... but not worth a change that costs 0.4 spread over 4 rounds: stay with the last kind.
  for last in AR, COPY:
    paying = state_with([1.1], [1.0, 1.05], switch=0.4, last=last)
    assert int(plan_for(copy_only, paying, HISTORY[:1], [6]).kind) == last
  # A chain worth far more is worth the change.
  assert int(plan_for(copy_only, state_with([3], [1.0, 1.05], switch=0.4, last=AR), HISTORY[:1], [6]).kind) == 1
  for last, following in (-1, 0), (0, 1), (1, 0):
    cycling = state_with([3], [1.0, 1.05], force=CYCLE, last=last)
    plan = plan_for(copy_only, cycling, HISTORY[:1], [6])
    assert int(plan.kind) == following and not bool(plan.explored)


def test_an_ar_rounds_chain_is_kept_until_the_tokens_emitted_since_show_its_gain():
  """Row 0's chain 7 8 9 is emitted a token a round: it has given 4 once all of it was
  (while it agrees and goes on, nothing is learnt); row 1's breaks at once: it gave 1.
  Later rounds' chains wait until the kept one is shown."""
  proposer = Adaptive(PromptLookup(num_tokens=3), ema=0.5)
  state = dataclasses.replace(state_with([1.0, 3.0], [1, 1]), copy_gain=jnp.asarray([[1.0, 1.0, 1.0], [3, 3, 3.0]]))
  prefix = [5, 6, 1, 5]  # the root at index 3; the chains' first tokens at 4
  emitted = [[7, 8, 9], [4, 7, 8]]
  gains = []
  for step in range(3):
    plan = plan_of(AR, [[7, 8, 9]] * 2 if step == 0 else [[1, 1, 1]] * 2, [2, 2], [4 + step] * 2)
    history = [prefix + row[: step + 1] + [0] * 4 for row in emitted]
    state = observe(proposer, state, plan, [1, 1], [True, True], history, [4 + step] * 2)
    gains.append(np.asarray(state.copy_gain[:, 1]).tolist())
    assert int(state.last) == AR
  # (row 1: each round's chain is kept and breaks at once: 3 -> 2 -> 1.5 -> 1.25)
  assert gains == [[1.0, 2.0], [1.0, 1.5], [2.5, 1.25]]
  np.testing.assert_array_equal(np.asarray(state.pending_ngram), [0, 0])
  unseen = dataclasses.replace(state_with([np.nan, np.nan], [1, 1]))
  shown = observe(
    proposer,
    unseen,
    plan_of(AR, [[7, 8, 9]] * 2, [2, 2], [4, 4]),
    [1, 1],
    [True, True],
    [prefix + [4, 0, 0, 0, 0]] * 2,
    [4, 4],
  )
  np.testing.assert_array_equal(np.asarray(shown.copy_gain[:, 1]), [1, 1])


def test_kept_continuations_show_their_gain_once_each_has_broken_or_ended():
  """Two continuations kept by an AR round: the gain is the longest agreement among
  them, known only when every one of them has broken or ended."""
  proposer = Adaptive(PromptLookup(num_tokens=3, matches=2), ema=1.0)
  state = dataclasses.replace(state_with([np.nan], [1, 1]), **no_pending(1, 3, matches=2))
  prefix = [5, 6, 1, 5]  # the root at index 3; the continuations' first tokens at 4
  plan = plan_of(AR, [[[7, 8, 9], [7, 4, 4]]], [2], [4])
  state = observe(proposer, state, plan, [1], [True], [prefix + [7] + [0] * 4], [4])
  assert np.isnan(float(state.copy_gain[0, 1]))  # both still agree
  state = observe(proposer, state, plan_of(AR, [[1, 1, 1]], [2], [5]), [1], [True], [prefix + [7, 8] + [0] * 3], [5])
  assert np.isnan(float(state.copy_gain[0, 1]))  # the second broke, the first goes on
  state = observe(proposer, state, plan_of(AR, [[1, 1, 1]], [2], [6]), [1], [True], [prefix + [7, 8, 3] + [0] * 2], [6])
  assert float(state.copy_gain[0, 1]) == 3.0  # the first broke after 2: 1 + 2 tokens a copy round would have given


def test_exploring_a_draft_that_loses_waits_twice_as_long_and_a_chosen_draft_resets_the_wait(tiny):
  proposer = Adaptive(PromptLookup(num_tokens=3), draft_for(tiny)[0], explore_every=4, max_explore_every=10)
  state = state_with([3], [1.0, 1.5, 2.0], draft_gain=[[1.2, 1.2]], since_draft=[2, 4], explore_after=4)
  history, lengths = [[5, 6, 7, 8, 9, 5, 6, 7, 1, 0]], [8]
  waits = []
  for _ in range(3):  # explored where chains match, losing each time: 4 -> 8 -> 10 (the cap)
    plan = plan_for(proposer, dataclasses.replace(state, since_draft=state.explore_after), HISTORY[:1], [6])
    assert int(plan.kind) == DRAFT and bool(plan.explored)
    state = observe(proposer, state, plan, [2], [True], history, lengths)
    waits.append(np.asarray(state.explore_after).tolist())
  # (rounds without a match keep their own wait and count)
  assert waits == [[4, 8], [4, 10], [4, 10]] and np.asarray(state.since_draft).tolist() == [2, 0]
  chosen = plan_of(DRAFT, [[7, 8, 9]], [2], [7])
  assert np.asarray(observe(proposer, state, chosen, [6], [True], history, lengths).explore_after).tolist() == [4, 4]
  copy = dataclasses.replace(chosen, kind=jnp.int32(COPY))
  after = observe(proposer, state, copy, [2], [True], history, lengths)
  assert np.asarray(after.explore_after).tolist() == [4, 10] and np.asarray(after.since_draft).tolist() == [2, 1]


def test_an_explored_draft_that_wins_is_explored_again_until_one_loses(tiny):
  """A draft round forced by the wait that gave more tokens per second than the choice
  it displaced expected leaves the wait due: the next round of its case explores again."""
  proposer = Adaptive(PromptLookup(num_tokens=3), draft_for(tiny)[0], explore_every=4, max_explore_every=16)
  state = state_with([3], [1.0, 1.5, 2.0], draft_gain=[[0.5, 1.0]], explore_after=4, since_draft=4)
  history, lengths = [HISTORY[1] + [0, 0]], [6]
  for count, explores_next in ((3, True), (1, False)):  # 3 tokens at 2 beat AR's 1 at 1; 1 at 2 does not
    plan = plan_for(proposer, state, HISTORY[1:], [6])
    assert int(plan.kind) == DRAFT and bool(plan.explored) and float(plan.displaced) == 1.0
    state = observe(proposer, state, plan, [count], [True], history, lengths)
    # (after the win the gain, 0.5 moved by ema toward 3, is still below AR's: not chosen on its merit)
    assert bool(plan_for(proposer, state, HISTORY[1:], [6]).explored) == explores_next
  assert np.asarray(state.explore_after).tolist() == [8, 4] and np.asarray(state.since_draft).tolist() == [0, 4]


def test_a_draft_gain_seen_low_once_is_explored_again_in_rounds_without_a_match(tiny):
  """One draft round without a match that gave 1 token made every later such round an
  AR round, when the only wait counted every round and draft rounds kept happening
  where chains matched: the case without a match now waits on its own rounds."""
  proposer = Adaptive(PromptLookup(num_tokens=3), draft_for(tiny)[0], explore_every=4)
  state = state_with([3], [1.0, 1.5, 2.0], draft_gain=[[1.0, 9.0]], explore_after=4)
  history, lengths = [HISTORY[1] + [0, 0]], [6]
  kinds = []
  for round_ in range(9):
    row = HISTORY[0] if round_ % 3 == 2 else HISTORY[1]  # mostly without a match; every third with one
    plan = plan_for(proposer, state, [row], [6])
    kinds.append(int(plan.kind))
    state = observe(proposer, state, plan, [2 if int(plan.kind) != DRAFT else 5], [True], history, lengths)
  # Without a match: 4 AR rounds, then the draft explored (5 tokens: chosen on its merit from then on).
  assert kinds == [AR, AR, DRAFT, AR, AR, DRAFT, DRAFT, DRAFT, DRAFT]


def test_a_round_teaches_its_gain_and_a_draft_round_the_chains(tiny):
  proposer = Adaptive(PromptLookup(num_tokens=3), draft_for(tiny)[0], ema=0.5)
  state = state_with([3, 3], [1, 1, 1], draft_gain=[[4, 4], [4, 4]])
  valid = [[True, True, True], [False, False, False]]  # row 1: no match
  # The draft round emitted 5 tokens after the root at index 3: row 0's chain agreed on 2.
  history = [[1, 2, 3, 0, 7, 8, 2, 3, 3, 0], [1, 2, 3, 0, 4, 4, 4, 4, 4, 0]]
  plan = plan_of(DRAFT, [[7, 8, 9]] * 2, [2, 0], [4, 4], valid)
  after = observe(proposer, state, plan, [5, 5], [True, True], history, [8, 8])
  # Draft gains move halfway to 5 (row 0: with a match, row 1: without); row 0's 2-gram chain
  # would have given 2 tokens + the bonus = 3; row 1 had no chain.
  np.testing.assert_allclose(np.asarray(after.draft_gain), [[4, 4.5], [4.5, 4]])
  np.testing.assert_allclose(np.asarray(after.copy_gain), [[3, 3, 3], [3, 3, 3]])
  assert np.asarray(after.since_draft).tolist() == [0, 0] and list(np.asarray(after.rounds_by_kind)) == [0, 0, 1]
  plan = plan_of(COPY, [[7, 8, 9]] * 2, [2, 0], [9, 9], valid)
  after = observe(proposer, after, plan, [2, 1], [True, False], history, [8, 8])
  np.testing.assert_allclose(np.asarray(after.copy_gain), [[3, 2.5, 3], [3, 3, 3]])  # row 1 inactive
  assert np.asarray(after.since_draft).tolist() == [1, 1]  # (row 1, inactive, counts for neither)


def test_an_unseen_gain_is_guessed_until_its_first_sighting_replaces_it(tiny):
  """A gain no round has shown yet (NaN) counts as half the tree's depth; the first round
  that shows it sets it whole, later ones move it by `ema`."""
  proposer = Adaptive(PromptLookup(num_tokens=4), draft_for(tiny, widths=(2, 2))[0], ema=0.5)
  state = state_with([np.nan], [1.0, 1.5, 100.0], draft_gain=[[np.nan, np.nan]], chain=4)
  # Guess: a 2-gram chain gives 1 + 4 / 2 = 3 tokens at 1.5 (2 a unit of cost) > AR's 1.
  assert int(plan_for(proposer, state, HISTORY[:1], [6]).kind) == COPY
  plan = plan_of(COPY, [[7, 8, 9, 5]], [2], [7])
  history = [HISTORY[0] + [0] * 6]
  after = observe(proposer, state, plan, [1], [True], history, [6])
  np.testing.assert_array_equal(np.asarray(after.copy_gain[0]), [np.nan, 1.0, np.nan])  # seen whole
  assert int(plan_for(proposer, after, HISTORY[:1], [6]).kind) == AR
  after = observe(proposer, after, plan, [5], [True], history, [6])
  np.testing.assert_array_equal(np.asarray(after.copy_gain[0]), [np.nan, 3.0, np.nan])  # then by ema
  assert np.isnan(np.asarray(after.draft_gain)).all()


def test_gains_learnt_are_averaged_over_the_sequences_that_saw_them_and_the_waits_start_again():
  state = state_with([1.0, 3.0], [1, 1, 1], draft_gain=[[np.nan, 4.0], [np.nan, 6.0]], explore_after=64)
  state = dataclasses.replace(state, copy_gain=state.copy_gain.at[0, 2].set(np.nan))
  learnt = Adaptive.learnt(state)
  np.testing.assert_array_equal(learnt.copy_gain, [2.0, 2.0, 3.0])
  np.testing.assert_array_equal(learnt.draft_gain, [np.nan, 5.0])
  started = Adaptive.with_learnt(state_with([np.nan] * 3, [1, 1, 1], draft_gain=[[np.nan] * 2] * 3), learnt)
  np.testing.assert_array_equal(np.asarray(started.copy_gain), [[2.0, 2.0, 3.0]] * 3)
  np.testing.assert_array_equal(np.asarray(started.draft_gain), [[np.nan, 5.0]] * 3)
  assert np.asarray(started.explore_after).tolist() == [32, 32]  # (each generation's text is new)
  priced = Adaptive(PromptLookup()).with_costs(started, [np.nan, 2.0, 3.0, np.nan])  # (NaN: not measured yet)
  np.testing.assert_array_equal(np.asarray(priced.costs), [1.0, 2.0, 3.0])
  assert float(priced.switch) == 0.0


@pytest.mark.parametrize("lag_rows", [5, longspec.LAG_ROWS])
def test_catching_up_after_rounds_without_the_draft_rebuilds_the_ring(tiny, lag_rows, monkeypatch):
  """A ring many tokens behind (AR and COPY rounds do not run the draft) caught up in
  passes of `lag_rows` (several, or one) holds what a ring started at the new length
  holds, and the root's hidden state."""
  monkeypatch.setattr(longspec, "LAG_ROWS", lag_rows)
  proposer, params, draft = draft_for(tiny, num_layers=2)
  rng = np.random.default_rng(3)
  prompt = rng.integers(3, 211, size=40).tolist()
  cache, _ = prefill(tiny, [prompt], 64)
  history = jnp.asarray([prompt + [0] * 24], jnp.int32)
  behind = proposer.start(
    params, target=tiny, cache=dataclasses.replace(cache, lengths=cache.lengths - 13), history=history
  ).ring
  cache = dataclasses.replace(cache, lengths=cache.lengths - 1)  # the last token is the root
  hidden, ring = proposer.catch_up(draft, tiny, cache, history, behind, lagging=True)
  fresh = proposer.start(params, target=tiny, cache=cache, history=history).ring
  want, fresh = proposer.catch_up(draft, tiny, cache, history, fresh)
  assert int(ring.length[0]) == int(fresh.length[0]) == 40
  for a, b in ((hidden, want), (ring.k, fresh.k), (ring.v, fresh.v)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=2e-5)
  np.testing.assert_array_equal(np.asarray(ring.positions), np.asarray(fresh.positions))


@pytest.mark.parametrize("with_draft, one_program, matches", [(False, False, 2), (True, False, 1), (True, True, 2)])
def test_auto_emits_the_ar_tokens(tiny, with_draft, one_program, matches, monkeypatch):
  """Greedy auto on a repetitive and a random prompt (batched, unequal lengths, an EOS):
  AR's tokens, with every kind of round run (CHAIN rounds with two continuations);
  near-zero temperature too (1e-6: this model's top two logits lie 2.5e-5 apart at one
  step, a coin flip at 1e-4). Both structures: a program per kind (a CPU's) and every
  kind in one program (a GPU's)."""
  monkeypatch.setattr(prices, "HOST", prices.Schedule(rounds=1, repeats=1))  # (every kind measured within 100 tokens)
  monkeypatch.setattr(engine, "_one_program", lambda: one_program)
  rng = np.random.default_rng(5)
  pattern = rng.integers(3, 211, size=9).tolist()
  prompts = [pattern * 4, rng.integers(3, 211, size=23).tolist()]
  reference = generate(tiny, prompts, 100).token_ids
  eos = reference[1][90]
  draft, params, _ = draft_for(tiny, widths=(2, 3)) if with_draft else (None, None, None)
  proposer = Adaptive(PromptLookup(num_tokens=4, matches=matches), draft)
  result = generate(tiny, prompts, 100, Decoding(proposer=proposer, eos_ids=(eos,)), params)
  assert result.token_ids == [r[: r.index(eos) + 1] if eos in r else r for r in reference]
  kinds = result.stats.rounds_by_kind
  # (calibration may end the generation: timed rounds emit tokens too)
  assert set(kinds) == {k.value for k in proposer.kinds} and min(kinds.values()) >= 1
  assert result.stats.calibration_seconds > 0
  sampled = Decoding(proposer=proposer, sampling=SamplingConfig(temperature=1e-6))
  assert generate(tiny, prompts, 100, sampled, params, seed=2).token_ids == reference


def test_one_program_of_every_kind_passes_the_cache_on_in_place(tiny, monkeypatch):
  """The program holding every kind's loop has no copy of the K/V cache (under a switch,
  XLA copied it into and out of the branches: a whole cache per change of kind)."""
  monkeypatch.setattr(engine, "_one_program", lambda: True)
  proposer = Adaptive(PromptLookup(num_tokens=4, matches=2))
  decoding = Decoding(proposer=proposer)
  state = engine.start(tiny, [list(range(3, 40))] * 2, 64, decoding).state
  graphdef, params = nnx.split(tiny)
  program = engine._decode_chunk[tiny.compilation(rounds=True)]
  limits, rounds = jnp.asarray([64, 64], jnp.int32), jnp.int32(8)
  text = program.lower(graphdef, params, state, decoding, None, limits, rounds, 8, None).compile().as_text()
  cache_shape = f"[{','.join(map(str, state.cache.k.shape))}]"
  copies = [line for line in text.splitlines() if " copy(" in line and cache_shape in line.split(" copy(")[0]]
  assert not copies, copies


@pytest.mark.parametrize(
  "one_program, cape",
  [(False, None), (True, None), (False, CapeConfig(gamma=3, sizes=(2,) * 4))],
  ids=["program-per-kind", "one-program", "cape-draft"],
)
def test_a_chunk_of_auto_runs_its_rounds_across_changes_of_kind(tiny, one_program, cape, monkeypatch):
  """A chunk goes on across changes of kind until its rounds have run: each run of rounds
  of one kind a call of that kind's program, which stops where the choice changes kind
  (a CPU's structure), or every kind's loop in one program, in turn (a GPU's, run here
  too). With every round of another kind (CYCLE): 7 rounds AR, COPY, DRAFT, AR, ...,
  AR's tokens; the draft's rounds with CAPE's tree too."""
  monkeypatch.setattr(engine, "_one_program", lambda: one_program)
  rng = np.random.default_rng(7)
  prompts = [rng.integers(3, 211, size=8).tolist() * 4, rng.integers(3, 211, size=29).tolist()]
  reference = generate(tiny, prompts, 30).token_ids
  draft, params, _ = draft_for(tiny, widths=(2, 3))
  draft = dataclasses.replace(draft, cape=cape)
  proposer = Adaptive(PromptLookup(num_tokens=5), draft)
  decoding = Decoding(proposer=proposer)
  started = engine.start(tiny, prompts, 30, decoding, params)
  state = dataclasses.replace(started.state, proposal=proposer.forced(started.state.proposal, CYCLE))
  state, tokens, finished = engine.decode_chunk(tiny, state, decoding, params, max_new_tokens=30, rounds=7)
  assert int(state.rounds) == 7 and not bool(finished)
  np.testing.assert_array_equal(np.asarray(state.proposal.rounds_by_kind), [3, 2, 2])
  emitted = [
    [int(started.first[b])] + [int(t) for t in row if t != engine.PAD_ID] for b, row in enumerate(np.asarray(tokens))
  ]
  assert all(len(row) >= 8 and row == ref[: len(row)] for row, ref in zip(emitted, reference))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Holder:
  """A stand-in decode state: only the proposer's part."""

  proposal: AdaptiveState


class FakeChunks:
  """Chunks of rounds on a fake clock: `fixed` seconds a chunk, each round its kind's price,
  `switch` seconds each time a round's kind differs from the previous one's; every
  sequence is done once `budget` rounds have run (a chunk stops there)."""

  def __init__(self, monkeypatch, per_round, fixed=7.0, switch=0.0, budget=10**6):
    self.clock, self.per_round, self.fixed, self.switch, self.budget = 0.0, per_round, fixed, switch, budget
    self.forced = []  # each chunk's `force`
    monkeypatch.setattr(prices.time, "perf_counter", lambda: self.clock)

  def __call__(self, state, rounds):
    proposal = state.proposal
    force, last, kinds = int(proposal.force), int(proposal.last), len(self.per_round)
    self.forced.append(force)
    ran = []
    for _ in range(min(rounds, self.budget)):
      ran.append((last + 1) % kinds if force == CYCLE else force)
      changes = len(ran) > 1 and ran[-1] != ran[-2]
      self.clock += self.per_round[ran[-1]] + self.switch * changes
      last = ran[-1]
    self.clock += self.fixed
    self.budget -= len(ran)
    proposal = dataclasses.replace(
      proposal, last=jnp.int32(last), rounds_by_kind=proposal.rounds_by_kind + np.bincount(ran, minlength=kinds)
    )
    return Holder(proposal), np.zeros((1, 4), np.int32), self.budget <= 0


PRICES = [1.0, 1.5, 2.5]  # AR, COPY, DRAFT


def test_prices_are_the_difference_of_two_chunks_and_are_kept(tiny, monkeypatch):
  """A chunk costs a fixed launch plus its rounds: the measured price is the rounds' alone;
  one lost in the chunks' jitter is their time per round, never ~0; a change of kind is
  priced from chunks whose rounds each change kind, less their rounds' prices. Prices are
  kept per process and on disk: a later generation with the same key measures nothing."""
  proposer = Adaptive(PromptLookup(num_tokens=2), draft_for(tiny)[0])
  start = lambda: Holder(state_with([2], [1, 1, 1], draft_gain=[[3, 3]]))  # (each calibration donates its own)
  chunks = FakeChunks(monkeypatch, PRICES, switch=0.75)
  measured = prices.calibrate(proposer, chunks, start(), lambda out: None, plan=prices.GPU)
  np.testing.assert_allclose(measured.prices.seconds, PRICES + [0.75])
  assert measured.prices.complete and measured.prices.chunks == ((),) * 4
  assert measured.rounds == 4 * prices.GPU.per_kind == 4 * 31
  np.testing.assert_allclose(np.asarray(measured.state.proposal.costs), PRICES)
  assert float(measured.state.proposal.switch) == 0.75 and int(measured.state.proposal.force) == CHOOSE
  # (a kind that ran as fast as the chunk's overhead jitters)
  jittery = prices.calibrate(
    proposer, FakeChunks(monkeypatch, [1.0, 0.0, 2.5]), start(), lambda out: None, plan=prices.GPU
  )
  assert jittery.prices.seconds[COPY] == 7.0 / (prices.GPU.rounds + 1)
  # (off a GPU, where a round costs far more than a chunk's launch: chunks of one and two rounds, twice each)
  host = prices.calibrate(proposer, FakeChunks(monkeypatch, PRICES, fixed=0.01, switch=0.75), start(), lambda out: None)
  np.testing.assert_allclose(host.prices.seconds, PRICES + [0.75])
  assert host.rounds == 4 * prices.HOST.per_kind == 4 * 7

  greedy = SamplingConfig()
  key = prices.cost_key(tiny, proposer, None, greedy, 1, 300)
  assert key == prices.cost_key(tiny, proposer, None, greedy, 1, 400)  # (one power of two)
  assert key != prices.cost_key(tiny, proposer, None, greedy, 2, 300)
  assert prices.cost_key(tiny, proposer, None, greedy, 13, 300) == prices.cost_key(
    tiny, proposer, None, greedy, 16, 300
  )
  assert prices.cost_key(tiny, proposer, None, greedy, 16, 300) != prices.cost_key(
    tiny, proposer, None, greedy, 17, 300
  )
  assert key != prices.cost_key(tiny, proposer, None, SamplingConfig(temperature=0.6), 1, 300)
  book = engine.MEMORY.prices
  assert book.known(key) is None
  book.remember(key, measured.prices)
  book.measured.clear()  # a new process: from the file
  assert book.known(key) == measured.prices
  book.path.write_text(json.dumps({key: [1.0, 2.0, 3.0]}))  # an older file's form: measured again
  book.measured.clear()
  assert book.known(key) is None


def test_a_measurement_cut_short_keeps_its_prices_and_the_next_measures_the_rest(tiny, monkeypatch):
  """A generation that ends while its kinds are being timed keeps the prices it finished
  and the chunks it timed, a chunk cut short with the rounds it ran; the next one goes on
  from them, then chooses with all of them."""
  proposer = Adaptive(PromptLookup(num_tokens=2), draft_for(tiny)[0])
  start = state_with([2], [1, 1, 1], draft_gain=[[3, 3]])
  chunks = FakeChunks(monkeypatch, PRICES, budget=50)
  cut = prices.calibrate(proposer, chunks, Holder(start), lambda out: None, plan=prices.GPU)
  # AR: its first round and 3 chunks of 1 and of 9 rounds (31 rounds); COPY: its first
  # round, 1 and 9, then 1 and 7 (cut short, counted with the rounds it ran).
  assert cut.finished and cut.prices.seconds == (1.0, None, None, None) and not cut.prices.complete
  assert cut.prices.chunks == ((), ((1, 8.5), (9, 20.5), (1, 8.5), (7, 17.5)), (), ())
  chunks.forced.clear()
  chunks.budget = 1000
  rest = prices.calibrate(proposer, chunks, cut.state, lambda out: None, cut.prices, plan=prices.GPU)
  # COPY: its first round, 1 and 9; DRAFT and the change of kind: a first round, 3 x (1, 9)
  assert chunks.forced == [COPY] * 3 + [DRAFT] * 7 + [CYCLE] * 7 and not rest.finished
  np.testing.assert_allclose(rest.prices.seconds, PRICES + [0.0], atol=1e-9)
  np.testing.assert_allclose(np.asarray(rest.state.proposal.costs), PRICES)


def test_a_later_generation_uses_the_kept_prices_and_starts_from_the_gains_learnt(tiny, monkeypatch):
  monkeypatch.setattr(prices, "HOST", prices.Schedule(rounds=1, repeats=1))  # (all measured in the first generation)
  rng = np.random.default_rng(6)
  prompts = [rng.integers(3, 211, size=30).tolist()]
  decoding = Decoding(proposer=Adaptive(PromptLookup(num_tokens=3)))
  first = generate(tiny, prompts, 120, decoding)
  learnt = engine.MEMORY.learnt[(decoding, tiny.config)]
  np.testing.assert_array_equal(learnt.copy_gain, Adaptive.learnt(first.state.proposal).copy_gain)
  started, start = [], engine.start

  def starting(*args, **kwargs):
    started.append(kwargs["carried"])
    return start(*args, **kwargs)

  monkeypatch.setattr(engine, "start", starting)
  again = generate(tiny, prompts, 120, decoding)
  (carried,) = started  # (the state starts from them: `Adaptive.start`)
  np.testing.assert_array_equal(carried["learnt"].copy_gain, learnt.copy_gain)
  np.testing.assert_array_equal(carried["seconds"], np.float32(list(first.stats.round_seconds_by_kind.values())))
  assert first.stats.calibration_seconds > 0 and again.stats.calibration_seconds == 0
  assert again.stats.round_seconds_by_kind == first.stats.round_seconds_by_kind
  assert again.token_ids == first.token_ids


def test_a_generation_after_the_first_compiles_nothing(tiny, monkeypatch):
  """A warm-up of one generation covers every program of the later ones, those that
  start from the gains learnt too: a compile there is timed as decoding."""
  monkeypatch.setattr(prices, "HOST", prices.Schedule(rounds=1, repeats=1))
  rng = np.random.default_rng(7)
  prompts = [rng.integers(3, 211, size=30).tolist()]
  decoding = Decoding(proposer=Adaptive(PromptLookup(num_tokens=3)))
  generate(tiny, prompts, 60, decoding)
  compiles = []

  def listener(event, seconds, **kwargs):
    if "backend_compile" in event:
      compiles.append(event)

  jax.monitoring.register_event_duration_secs_listener(listener)
  try:
    for _ in range(2):
      generate(tiny, prompts, 60, decoding)
  finally:
    jax.monitoring.unregister_event_duration_listener(listener)
  assert compiles == []
