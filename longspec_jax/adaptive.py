"""`auto`: each round, the kind of tree that is expected to emit the most tokens per second.

Three kinds of round (`Kind`), all lossless, so the choice only moves the speed:

  AR     the root alone: one target step.
  COPY   prompt lookup's chain (PLD): cheap, and long when the output copies the context.
  DRAFT  the LongSpec draft's beam tree with the same chain grafted in (when the target
         has a draft): the most tokens a round, at the highest price.

A round of kind k is expected to emit gain[k] tokens at cost[k] seconds; the proposer
takes the kind with the most gain / cost, summed over the batch's running sequences.
The costs are measured on the device at hand, for this target and context: the engine
runs the first rounds of a generation as each kind in turn and times them
(`calibration_kinds`, `with_costs`). The gains are moving averages of what rounds of
each kind emitted; the chain's gain also from draft rounds (how far it agreed with what
was emitted), and it counts only when prompt lookup finds a match: without one a COPY
round is an AR step at a higher price. A draft round runs at least every
`explore_every` rounds, so that its gain follows the text. The choice depends on
earlier rounds only, so every round's tokens keep the target's law (greedy: AR's
tokens).
"""

from __future__ import annotations

import dataclasses
import enum
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
from flax import nnx

from longspec_jax.cache import RingCache
from longspec_jax.ngram import PromptLookup
from longspec_jax.tree import Tree, chain, graft_chain

if TYPE_CHECKING:
  from longspec_jax.proposers import LongSpecDraft


class Kind(enum.IntEnum):
  """A round's kind, also its branch index."""

  AR = 0
  COPY = 1
  DRAFT = 2


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class AdaptiveState:
  ring: RingCache | None  # the draft's ring (None without a draft); behind after AR and COPY rounds
  gains: jax.Array  # [B, K] float32: moving average of tokens a round of each kind emits
  costs: jax.Array  # [K] float32: seconds per round of each kind (measured; 1 until then)
  force: jax.Array  # [] int32: the kind every round takes (calibration), or -1: choose
  since_draft: jax.Array  # [] int32: rounds since the last draft round
  rounds_by_kind: jax.Array  # [K] int32: rounds run of each kind


@dataclasses.dataclass(frozen=True)
class Plan:
  """What a round's choice saw: the kind, and prompt lookup's chain [B, G] (and which of
  its tokens are real), which COPY and DRAFT rounds verify."""

  kind: jax.Array  # [] int32
  copies: jax.Array  # [B, G] int32
  copy_valid: jax.Array  # [B, G] bool


@dataclasses.dataclass(frozen=True)
class Adaptive:
  """The `auto` proposer: `lookup` drafts the chain; `draft` (None when the target has no
  draft) grows the tree of DRAFT rounds, with the chain grafted in."""

  lookup: PromptLookup = PromptLookup()
  draft: LongSpecDraft | None = None
  ema: float = 0.3  # weight of the newest round in the gains
  explore_every: int = 32

  @property
  def kinds(self) -> tuple[Kind, ...]:
    return (Kind.AR, Kind.COPY) + ((Kind.DRAFT,) if self.draft is not None else ())

  @property
  def tree_size(self) -> int:
    """The largest tree of any kind (the engine's budget)."""
    return max(self.lookup.tree_size, 0 if self.draft is None else self._draft().tree_size)

  @property
  def depth(self) -> int:
    return max(self.lookup.depth, 0 if self.draft is None else self._draft().depth)

  def _draft(self) -> LongSpecDraft:
    """The draft with the chain's length as its copy budget (its depth then covers what
    any round can accept, which its catch-up pass reads)."""
    return dataclasses.replace(self.draft, copy_tokens=self.lookup.num_tokens)

  def start(self, params, *, target, cache, history) -> AdaptiveState:
    batch = history.shape[0]
    ring = None if self.draft is None else self.draft.start(params, target=target, cache=cache, history=history)
    # Before any measurement: every kind looks as good as its tree is deep, so each gets tried.
    prior = jnp.asarray([1.0, 1.0 + self.lookup.depth / 2, 1.0 + self.depth / 2][: len(self.kinds)], jnp.float32)
    return AdaptiveState(ring=ring, gains=jnp.broadcast_to(prior, (batch, len(self.kinds))),
                         costs=jnp.ones((len(self.kinds),), jnp.float32), force=jnp.int32(-1),
                         since_draft=jnp.int32(0), rounds_by_kind=jnp.zeros((len(self.kinds),), jnp.int32))

  def plan(self, state: AdaptiveState, *, cache, history, done) -> Plan:
    """This round's kind (module docstring) and prompt lookup's chain."""
    copies, copy_valid = self.lookup.lookup(history, cache.lengths)
    match = copy_valid[:, 0]  # [B]
    gains = state.gains
    per_kind = [jnp.ones_like(gains[:, 0]), jnp.where(match, gains[:, Kind.COPY], 1.0)]
    if self.draft is not None:  # (the chain is in the draft's tree too)
      per_kind.append(jnp.maximum(gains[:, Kind.DRAFT], jnp.where(match, gains[:, Kind.COPY], 0.0)))
    value = jnp.sum(jnp.where(done[:, None], 0.0, jnp.stack(per_kind, axis=1)), axis=0) / state.costs  # [K]
    kind = jnp.argmax(value).astype(jnp.int32)
    if self.draft is not None:
      kind = jnp.where(state.since_draft >= self.explore_every, jnp.int32(Kind.DRAFT), kind)
    kind = jnp.where(state.force >= 0, state.force, kind)
    return Plan(kind=kind, copies=copies, copy_valid=copy_valid)

  def propose(self, kind: Kind, params, state: AdaptiveState, plan: Plan, *, target, cache, history,
              root) -> tuple[Tree, AdaptiveState]:
    """The tree of a round of `kind` (a static branch of the engine's switch)."""
    if kind is Kind.AR:
      return chain(root, jnp.zeros((root.shape[0], 0), jnp.int32)), state
    if kind is Kind.COPY:
      return chain(root, plan.copies, plan.copy_valid), state
    draft = self._draft()
    model = nnx.merge(draft.graphdef, params)
    root_hidden, ring = draft.catch_up(model, target, cache, history, state.ring, lagging=True)
    tree = graft_chain(draft.grow(model, target, cache, ring, root, root_hidden), plan.copies, plan.copy_valid)
    return tree, dataclasses.replace(state, ring=ring)

  def observe(self, state: AdaptiveState, plan: Plan, count: jax.Array, new: jax.Array,
              active: jax.Array) -> AdaptiveState:
    """The state after a round of `plan.kind` that emitted `count [B]` tokens `new [B, N]`
    in the sequences `active [B]`: the gains move toward what the round showed."""
    kind = plan.kind
    count = count.astype(jnp.float32)
    match = plan.copy_valid[:, 0]
    # How many tokens the chain alone would have given: the root's bonus plus its leading
    # tokens that equal what was emitted (at most what was emitted).
    agree = jnp.cumprod(plan.copy_valid & (plan.copies == new[:, : plan.copies.shape[1]]), axis=1)
    chain_gain = jnp.minimum(1.0 + jnp.sum(agree, axis=1), count)
    observed = jnp.stack([count, jnp.where(kind == Kind.COPY, count, chain_gain), count][: len(self.kinds)], axis=1)
    learn = active[:, None] & (jnp.arange(len(self.kinds))[None, :] == kind)  # [B, K]
    if self.draft is not None:  # a draft round shows the chain's gain too
      learn |= active[:, None] & (kind == Kind.DRAFT) & (jnp.arange(len(self.kinds)) == Kind.COPY)[None, :]
    learn &= (jnp.arange(len(self.kinds)) != Kind.COPY)[None, :] | match[:, None]  # the chain's gain: where it exists
    gains = jnp.where(learn, (1 - self.ema) * state.gains + self.ema * observed, state.gains)
    return dataclasses.replace(
        state, gains=gains, since_draft=jnp.where(kind == Kind.DRAFT, 0, state.since_draft + 1),
        rounds_by_kind=state.rounds_by_kind.at[kind].add(1),
    )

  def forced(self, state: AdaptiveState, kind: int) -> AdaptiveState:
    """The state with every following round of `kind` (-1: chosen again)."""
    return dataclasses.replace(state, force=jnp.int32(kind))

  def with_costs(self, state: AdaptiveState, seconds: list[float]) -> AdaptiveState:
    """The state with the measured seconds per round of each kind."""
    return dataclasses.replace(state, costs=jnp.asarray(seconds, jnp.float32), force=jnp.int32(-1))
