"""`auto`: each round, the kind of tree expected to emit the most tokens per second.

Four kinds of round (`Kind`), all lossless, so the choice moves only the speed: AR (the
root alone), CHAIN (prompt lookup's first continuation alone: the cheapest copy round, and
much the cheaper at a large target's long contexts, where a tree's attention is
compute-bound), COPY (prompt lookup's continuations as a trie) and DRAFT (the draft's beam
tree with the same continuations grafted in, when a draft is named).

A round of kind k is expected to emit gain[k] tokens at cost[k] seconds; the proposer
takes the kind with the most gain / cost over the batch's running sequences. The costs are
measured on the device for this target and context (`prices`); a change of kind has its own
price, spread over `run` rounds so that the choice does not flap. The gains are moving
averages per sequence: the draft's tree's, and the continuations' per matched n-gram length
and source (the context or earlier outputs; the trie's and the first continuation's apart),
learnt also in rounds of other kinds by setting their continuations against the tokens
emitted after them. An unseen gain counts as half the tree's depth, so each kind gets
tried; a generation starts from the gains the previous one learnt (`Learnt`). A draft
round runs after at most `explore_every` rounds without one, per case (with and without a
match); a forced round that loses doubles that wait, one that wins is followed by another.
The choice depends on earlier rounds only, so every round's tokens keep the target's law
(greedy: AR's tokens).
"""

from __future__ import annotations

import dataclasses
import enum
import functools
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from longspec_jax.decoding.tree import Tree, chain, copy_tree, graft_chains
from longspec_jax.methods.longspec import DraftState
from longspec_jax.methods.past import PastTokens
from longspec_jax.methods.prompt_lookup import PromptLookup

if TYPE_CHECKING:
  from longspec_jax.methods.longspec import LongSpecDraft


class Kind(enum.Enum):
  """A round's kind. A proposer's kinds are `Adaptive.kinds`; the state and the plan
  name a kind by its index there (its loop's, price's and count's)."""

  AR = "ar"
  CHAIN = "chain"
  COPY = "copy"
  DRAFT = "draft"


CHOOSE = -1  # `AdaptiveState.force`: each round's kind is chosen (below)
CYCLE = -2  # each round takes the kind after the latest round's (calibration: the price of a change)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class AdaptiveState:
  draft: DraftState | None  # (None without a draft) its ring is behind after AR, CHAIN and COPY rounds
  past: PastTokens | None  # the ring of earlier outputs prompt lookup searches (None: none)
  # [B, L] float32: tokens the continuations give, by their first one's evidence (`PromptLookup.match`); NaN: unseen
  copy_gain: jax.Array
  chain_gain: jax.Array  # [B, L] float32: tokens the first continuation alone gives, likewise
  draft_gain: jax.Array  # [B, 2] float32: tokens a draft round gives, without and with a chain's match; NaN: unseen
  costs: jax.Array  # [K] float32: seconds per round of each kind (measured; 1 until then)
  switch: jax.Array  # [] float32: seconds to change kind (measured; 0 until then)
  force: jax.Array  # [] int32: the kind (index) every round takes (calibration), CHOOSE or CYCLE
  last: jax.Array  # [] int32: the latest round's kind (index; -1: none yet)
  next_kind: jax.Array  # [] int32: the kind (index) of the next round, chosen after the latest (a guess before any)
  # By case (no chain's match, a match; the draft's two gains), a round being of a case
  # when some running sequence is:
  since_draft: jax.Array  # [2] int32: rounds of the case since its last draft round
  explore_after: jax.Array  # [2] int32: rounds of the case without the draft after which one is forced
  rounds_by_kind: jax.Array  # [K] int32: rounds run of each kind
  # An AR or draft round's continuations, kept until the tokens emitted since show their gain:
  pending: jax.Array  # [B, M, G] int32
  pending_valid: jax.Array  # [B, M, G] bool
  pending_ngram: jax.Array  # [B] int32: its first one's evidence (`PromptLookup.match`); 0: none kept
  pending_at: jax.Array  # [B] int32: the history index of its first token
  pending_chained: jax.Array  # [B] bool: kept by a CHAIN round, which showed the first one's gain itself


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Plan:
  """What a round's choice saw: the kind (its index in `Adaptive.kinds`), prompt lookup's
  continuations [B, M, G] (which of their tokens are real) that CHAIN, COPY and DRAFT
  rounds verify, and the first one's evidence (its match's n-gram length and source:
  `PromptLookup.match`)."""

  kind: jax.Array  # [] int32
  copies: jax.Array  # [B, M, G] int32
  copy_valid: jax.Array  # [B, M, G] bool
  ngram: jax.Array  # [B] int32: the first continuation's evidence; 0 when there is no match
  at: jax.Array  # [B] int32: the history index the chain's first token would take
  cases: jax.Array  # [2] bool: some running sequence has no match / a match
  explored: jax.Array  # [] bool: a DRAFT round forced by the wait, not chosen on its merit
  displaced: jax.Array  # [] float32: an explored round's bar: the tokens per second the choice it displaced expected
  draft_price: jax.Array  # [] float32: an explored round's seconds


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Learnt:
  """A generation's gains, averaged over its sequences (NaN where none saw that case),
  to start the next generation from. The waits before exploring the draft are not
  carried (module docstring)."""

  copy_gain: jax.Array  # [L]
  chain_gain: jax.Array  # [L]
  draft_gain: jax.Array  # [2]


@jax.jit
def _learnt(copy_gain: jax.Array, chain_gain: jax.Array, draft_gain: jax.Array) -> Learnt:
  """`Adaptive.learnt`: each gain [B, ...] averaged over the rows that saw it (NaN: none)."""

  def mean(gain):
    seen = ~jnp.isnan(gain)
    count = jnp.sum(seen, axis=0)
    return jnp.where(count > 0, jnp.sum(jnp.where(seen, gain, 0), axis=0) / jnp.maximum(count, 1), jnp.nan)

  return Learnt(copy_gain=mean(copy_gain), chain_gain=mean(chain_gain), draft_gain=mean(draft_gain))


@dataclasses.dataclass(frozen=True)
class Adaptive:
  """The `auto` proposer: `lookup` drafts the chain; `draft` (None when the target has no
  draft) grows the tree of DRAFT rounds, with the chain grafted in."""

  lookup: PromptLookup = PromptLookup()
  draft: LongSpecDraft | None = None
  ema: float = 0.3  # weight of the newest round in the gains
  explore_every: int = 32
  max_explore_every: int = 512
  run: int = 4  # rounds a change of kind is expected to last: its price is spread over them

  @property
  def kinds(self) -> tuple[Kind, ...]:
    """The kinds of round this proposer runs: a CHAIN only where the lookup proposes
    several continuations (else it is the COPY round), a DRAFT only with a draft."""
    return (
      (Kind.AR,)
      + ((Kind.CHAIN,) if self.lookup.matches > 1 else ())
      + (Kind.COPY,)
      + ((Kind.DRAFT,) if self.draft is not None else ())
    )

  def index(self, kind: Kind) -> int:
    """`kind`'s index in `kinds` (-1 where this proposer has none)."""
    return self.kinds.index(kind) if kind in self.kinds else -1

  @property
  def tree_size(self) -> int:
    """The largest tree of any kind (the engine's budget)."""
    return max(self.lookup.tree_size, 0 if self.draft is None else self._draft().tree_size)

  @property
  def depth(self) -> int:
    return max(self.lookup.depth, 0 if self.draft is None else self._draft().depth)

  def _draft(self) -> LongSpecDraft:
    """The draft with prompt lookup's continuations as its copies (its depth then covers
    what any round can accept, which its catch-up pass reads)."""
    return dataclasses.replace(self.draft, copy_tokens=self.lookup.num_tokens, copy_matches=self.lookup.matches)

  def describe(self) -> dict:
    """The draft's tree (None without a draft) and prompt lookup's continuations; the
    rounds by kind are in the generation's stats."""
    shape = {"tree_widths": None} if self.draft is None else self.draft.describe()
    return {**shape, **self.lookup.describe()}

  @property
  def past_tokens(self) -> int:
    return self.lookup.past_tokens

  def start(
    self, params, *, target, cache, history, learnt: Learnt | None = None, seconds=None, past=None
  ) -> AdaptiveState:
    """The state after prefill, its gains started from what earlier generations `learnt`
    and its prices the measured `seconds` per round of each kind, then of a change of kind
    (NaN where not measured yet: calibration then forces each kind in turn); `past`: the
    ring of earlier outputs (`PromptLookup.past_tokens`)."""
    batch = history.shape[0]
    draft = None if self.draft is None else self.draft.start(params, target=target, cache=cache, history=history)
    kinds = len(self.kinds)
    unseen = lambda: jnp.full((batch, self.lookup.levels), jnp.nan, jnp.float32)  # (buffers of their own: donated)
    state = AdaptiveState(
      draft=draft,
      past=past,
      copy_gain=unseen(),
      chain_gain=unseen(),
      draft_gain=jnp.full((batch, 2), jnp.nan, jnp.float32),
      costs=jnp.ones((kinds,), jnp.float32),
      switch=jnp.float32(0),
      force=jnp.int32(CHOOSE),
      last=jnp.int32(-1),
      next_kind=jnp.int32(self.index(Kind.COPY)),
      since_draft=jnp.zeros((2,), jnp.int32),
      explore_after=jnp.full((2,), self.explore_every, jnp.int32),
      rounds_by_kind=jnp.zeros((kinds,), jnp.int32),
      pending=jnp.zeros((batch, self.lookup.matches, self.lookup.num_tokens), jnp.int32),
      pending_valid=jnp.zeros((batch, self.lookup.matches, self.lookup.num_tokens), bool),
      pending_ngram=jnp.zeros((batch,), jnp.int32),
      pending_at=jnp.zeros((batch,), jnp.int32),
      pending_chained=jnp.zeros((batch,), bool),
    )
    state = state if learnt is None else self.with_learnt(state, learnt)
    return state if seconds is None else _with_costs(state, seconds)

  def plan(self, state: AdaptiveState, *, cache, history, done) -> Plan:
    """This round's kind (module docstring) and prompt lookup's chain."""
    copies, copy_valid, ngram = self.lookup.match(history, cache.lengths, state.past)
    copy_gain = self._matched_gain(state.copy_gain, ngram)  # [B]: 0 without a match
    gains = {
      Kind.AR: jnp.ones_like(copy_gain),
      Kind.COPY: jnp.where(ngram > 0, copy_gain, 1.0),
      Kind.CHAIN: jnp.where(ngram > 0, self._matched_gain(state.chain_gain, ngram), 1.0),
    }
    if self.draft is not None:  # (the continuations are in the draft's tree too)
      draft_gain = jnp.take_along_axis(state.draft_gain, (ngram > 0).astype(jnp.int32)[:, None], axis=1)[:, 0]
      gains[Kind.DRAFT] = jnp.maximum(self._guessed(draft_gain, self.depth), copy_gain)
    change = (jnp.arange(len(self.kinds)) != state.last) & (state.last >= 0)  # [K]
    price = state.costs + jnp.where(change, state.switch / self.run, 0.0)
    per_kind = jnp.stack([gains[k] for k in self.kinds], axis=1)  # [B, K]
    value = jnp.sum(jnp.where(done[:, None], 0.0, per_kind), axis=0) / price  # [K]
    kind = jnp.argmax(value).astype(jnp.int32)
    cases = jnp.any(~done[:, None] & ((ngram > 0)[:, None] == jnp.arange(2)[None, :]), axis=0)  # [2]
    explored, displaced, draft_price = jnp.asarray(False), jnp.max(value), jnp.float32(1)
    if self.draft is not None:
      draft = self.index(Kind.DRAFT)
      explored = jnp.any(cases & (state.since_draft >= state.explore_after)) & (kind != draft)
      kind = jnp.where(explored, jnp.int32(draft), kind)
      draft_price = price[draft]
    forced = jnp.where(state.force == CYCLE, (state.last + 1) % len(self.kinds), state.force)
    return Plan(
      kind=jnp.where(state.force == CHOOSE, kind, forced),
      copies=copies,
      copy_valid=copy_valid,
      ngram=ngram,
      at=cache.lengths + 1,
      cases=cases,
      explored=explored & (state.force == CHOOSE),
      displaced=displaced,
      draft_price=draft_price,
    )

  def _matched_gain(self, gain: jax.Array, ngram: jax.Array) -> jax.Array:
    """The expected tokens [B] of each sequence's continuations by `gain [B, L]` (the
    trie's or the first one's) at the first one's evidence `ngram` (0 without a match)."""
    at = jnp.take_along_axis(gain, jnp.maximum(ngram - 1, 0)[:, None], axis=1)[:, 0]
    return jnp.where(ngram > 0, self._guessed(at, self.lookup.depth), 0.0)

  @staticmethod
  def _guessed(gain: jax.Array, depth: int) -> jax.Array:
    """`gain`, or where it is unseen (NaN) the guess for a tree `depth` deep."""
    return jnp.where(jnp.isnan(gain), 1.0 + depth / 2, gain)

  def propose(
    self, kind: Kind, params, state: AdaptiveState, plan: Plan, *, target, cache, history, root
  ) -> tuple[Tree, AdaptiveState]:
    """The tree of a round of `kind` (static: each kind is a loop of the engine's)."""
    if kind is Kind.AR:
      return chain(root, jnp.zeros((root.shape[0], 0), jnp.int32)), state
    if kind is Kind.CHAIN:
      return copy_tree(root, plan.copies[:, :1], plan.copy_valid[:, :1]), state
    if kind is Kind.COPY:
      return copy_tree(root, plan.copies, plan.copy_valid), state
    draft = self._draft()
    model = nnx.merge(draft.graphdef, params)
    root_hidden, ring = draft.catch_up(model, target, cache, history, state.draft.ring, lagging=True)
    tree = draft.grow(model, target, cache, ring, root, root_hidden, state.draft.rows)
    tree = graft_chains(tree, plan.copies, plan.copy_valid)
    return tree, dataclasses.replace(state, draft=dataclasses.replace(state.draft, ring=ring))

  def observe(
    self,
    state: AdaptiveState,
    plan: Plan,
    count: jax.Array,
    active: jax.Array,
    *,
    history: jax.Array,
    lengths: jax.Array,
  ) -> AdaptiveState:
    """The state after a round of `plan.kind` that emitted `count [B]` tokens in the
    sequences `active [B]`, committed to `history [B, S]` up to `lengths [B]` (the root's
    index): the gains move toward what the round showed."""
    kind = plan.kind
    of_kind = lambda k: kind == self.index(k)  # [] bool
    count = count.astype(jnp.float32)
    move = lambda old, seen, where: jnp.where(
      where, jnp.where(jnp.isnan(old), seen, (1 - self.ema) * old + self.ema * seen), old
    )
    at_ngram = lambda ngram: jnp.arange(1, self.lookup.levels + 1)[None, :] == ngram[:, None]  # [B, L]
    copy_round, chain_round = active & of_kind(Kind.COPY), active & of_kind(Kind.CHAIN)  # [B]
    copy_gain = move(state.copy_gain, count[:, None], copy_round[:, None] & at_ngram(plan.ngram))
    # A COPY round also shows its first continuation's gain whole (the trie accepted at
    # least as deep as that one agrees); a CHAIN round's is its count.
    first, _ = _agreement(plan.copies[:, :1], plan.copy_valid[:, :1], plan.at, history, lengths)  # [B, 1]
    chain_gain = move(
      state.chain_gain,
      jnp.where(copy_round, 1.0 + first[:, 0], count)[:, None],
      (copy_round | chain_round)[:, None] & at_ngram(plan.ngram),
    )
    # The other rounds' continuations are kept where none are, then every kept one is set
    # against the history: what they would have given is known once each has broken or
    # ended (the longest agreement; the first one's alone for CHAIN rounds).
    keep = active & ~of_kind(Kind.COPY) & (state.pending_ngram == 0) & (plan.ngram > 0)  # [B]
    pending = jnp.where(keep[:, None, None], plan.copies, state.pending)
    pending_valid = jnp.where(keep[:, None, None], plan.copy_valid, state.pending_valid)
    pending_ngram = jnp.where(keep, plan.ngram, state.pending_ngram)
    pending_at = jnp.where(keep, plan.at, state.pending_at)
    pending_chained = jnp.where(keep, chain_round, state.pending_chained)
    agree, ended = _agreement(pending, pending_valid, pending_at, history, lengths)  # [B, M]
    shown = (pending_ngram > 0) & jnp.all(ended, axis=1)
    copy_gain = move(copy_gain, (1.0 + jnp.max(agree, axis=1))[:, None], shown[:, None] & at_ngram(pending_ngram))
    chain_gain = move(
      chain_gain, (1.0 + agree[:, 0])[:, None], (shown & ~pending_chained)[:, None] & at_ngram(pending_ngram)
    )
    draft_round = of_kind(Kind.DRAFT)
    won = plan.explored & (jnp.sum(jnp.where(active, count, 0.0)) / plan.draft_price >= plan.displaced)
    return dataclasses.replace(
      state,
      copy_gain=copy_gain,
      chain_gain=chain_gain,
      draft_gain=move(
        state.draft_gain, count[:, None], (active & draft_round)[:, None] & ((plan.ngram > 0)[:, None] == jnp.arange(2))
      ),
      last=kind,
      # (an explored round that won leaves its case's count where it was: the next round
      # of the case explores again)
      since_draft=jnp.where(plan.cases & ~won, jnp.where(draft_round, 0, state.since_draft + 1), state.since_draft),
      explore_after=jnp.where(
        plan.cases & plan.explored & ~won,
        jnp.minimum(2 * state.explore_after, self.max_explore_every),
        jnp.where(plan.cases & draft_round & ~plan.explored, self.explore_every, state.explore_after),
      ),
      rounds_by_kind=state.rounds_by_kind.at[kind].add(1),
      pending=pending,
      pending_valid=pending_valid,
      pending_ngram=jnp.where(shown, 0, pending_ngram),
      pending_at=pending_at,
      pending_chained=pending_chained,
    )

  def forced(self, state: AdaptiveState, kind: int) -> AdaptiveState:
    """The state (donated) with every following round of `kind` (or CHOOSE, CYCLE)."""
    return _donated(_forced, state, np.int32(kind))

  def nothing_learnt(self) -> Learnt:
    """What a first generation starts from: every gain unseen."""
    unseen = np.full((self.lookup.levels,), np.nan, np.float32)
    return Learnt(copy_gain=unseen, chain_gain=unseen, draft_gain=np.full((2,), np.nan, np.float32))

  @staticmethod
  def learnt(state: AdaptiveState) -> Learnt:
    """The state's gains averaged over its sequences, those that saw each case: on the
    device, in one program, so that a slot's release waits for nothing (reading them to
    the host would wait for every round queued before)."""
    return _learnt(state.copy_gain, state.chain_gain, state.draft_gain)

  @staticmethod
  def with_learnt(state: AdaptiveState, learnt: Learnt) -> AdaptiveState:
    """The state with every sequence's gains started from `learnt`."""
    batch = state.copy_gain.shape[0]
    by_ngram = lambda gain: jnp.broadcast_to(jnp.asarray(gain, jnp.float32), state.copy_gain.shape)
    return dataclasses.replace(
      state,
      copy_gain=by_ngram(learnt.copy_gain),
      chain_gain=by_ngram(learnt.chain_gain),
      draft_gain=jnp.broadcast_to(jnp.asarray(learnt.draft_gain, jnp.float32), (batch, 2)),
    )

  def with_past(self, state: AdaptiveState, past: PastTokens) -> AdaptiveState:
    """The state reading `past` (the ring after more outputs were written)."""
    return dataclasses.replace(state, past=past)

  def with_costs(self, state: AdaptiveState, seconds: list[float]) -> AdaptiveState:
    """The state (donated) with the measured seconds per round of each kind, then of a
    change of kind (`prices.Prices.seconds`), choosing each round's kind."""
    return _donated(_with_costs, state, np.asarray(seconds, np.float32))


@functools.partial(jax.jit, static_argnums=0, donate_argnums=1)
def _donated(update, state: AdaptiveState, value) -> AdaptiveState:
  """`update(state, value)` on device, with the state's buffers donated: the new state
  takes them over. On a GPU the decode loop's CUDA graphs hold the addresses of the
  buffers they read, and XLA rewrites a graph (~5 ms for SmolLM2's copy round, ~8 ms for
  its draft round, H100) when one of them moved since its last run: arrays made afresh
  on the host for each generation moved every time, a graph rewrite per kind per
  generation that plain prompt lookup never paid."""
  return update(state, value)


def _agreement(
  copies: jax.Array, valid: jax.Array, at: jax.Array, history: jax.Array, lengths: jax.Array
) -> tuple[jax.Array, jax.Array]:
  """How many leading tokens of each continuation `copies [B, M, G]` (`valid`: which are
  real; the first one's history index `at [B]`) the history [B, S] holds, up to index
  `lengths [B]`: [B, M] int32; and whether that is final [B, M] (the continuation broke
  within the tokens emitted, or ended)."""
  index = at[:, None] + jnp.arange(copies.shape[2])[None, :]  # [B, G]
  emitted = jnp.take_along_axis(history, jnp.minimum(index, history.shape[1] - 1), axis=1)
  same = valid & (index <= lengths[:, None])[:, None, :] & (copies == emitted[:, None, :])  # [B, M, G]
  agree = jnp.sum(jnp.cumprod(same.astype(jnp.int32), axis=2), axis=2)
  seen = jnp.minimum(lengths + 1 - at, copies.shape[2])  # [B]: their tokens emitted since
  return agree, (agree < seen[:, None]) | (agree == jnp.sum(valid, axis=2))


def _forced(state: AdaptiveState, kind) -> AdaptiveState:
  return dataclasses.replace(state, force=kind)


def _with_costs(state: AdaptiveState, seconds) -> AdaptiveState:
  """The state choosing by `seconds` (NaN: not measured, the start's price kept)."""
  seconds = jnp.asarray(seconds, jnp.float32)
  costs, switch = seconds[:-1], seconds[-1]
  return dataclasses.replace(
    state,
    costs=jnp.where(jnp.isnan(costs), state.costs, costs),
    switch=jnp.where(jnp.isnan(switch), state.switch, switch),
    force=jnp.int32(CHOOSE),
  )
