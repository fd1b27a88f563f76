"""The proposer protocol, and the AR proposer.

A proposer is a frozen (hashable) dataclass, static under jit, that turns the context into
a token tree each round. Its arrays, if it has any, travel separately: `params` (e.g. draft
weights, a pytree) and a per-sequence `state` (e.g. the draft's ring buffer) that the
engine carries from round to round.

`history [B, S]` holds each sequence's tokens with the root (the newest token, not yet in
the cache) at index `cache.lengths`. `tree_size` is the static node budget and `depth`
the deepest a node can be (the root is at depth 0).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol

import jax.numpy as jnp

from longspec_jax.decoding.tree import Tree, chain


class Proposer(Protocol):
  """What the engine asks of every method's proposer."""

  @property
  def tree_size(self) -> int: ...

  @property
  def depth(self) -> int: ...

  def start(self, params, *, target, cache, history) -> Any:
    """The proposer's state, once, after prefill."""

  def propose(self, params, state, *, target, cache, history, root) -> tuple[Tree, Any]:
    """This round's tree (the root first) and the state after it."""

  def describe(self) -> dict:
    """The trees it verifies, as results record them (widths, continuations)."""


class MultiKind(Protocol):
  """A proposer that chooses each round's kind of tree on device (`auto.Adaptive`). The
  engine runs each kind's rounds as a loop of its own, with `plan` before each round and
  `observe` after it, and carries what the proposer learnt (`learnt`) and the measured
  price of each kind from one generation to the next, into the next one's `start` (in the
  program that starts the state: no call of its own inside the decode time) or, once
  calibration measured them, `with_costs`. The engine asks whether a proposer is one once,
  through `Decoding.multi_kind`."""

  kinds: tuple[Any, ...]
  tree_size: int
  depth: int

  def start(self, params, *, target, cache, history, learnt, seconds) -> Any:
    """The state after prefill, its gains from `learnt` and its prices `seconds` per round
    of each kind, then per change of kind (NaN: not measured yet)."""

  def plan(self, state, *, cache, history, done) -> Any:
    """This round's kind (an index in `kinds`) and what its tree needs."""

  def propose(self, kind, params, state, plan, *, target, cache, history, root) -> tuple[Tree, Any]:
    """The tree of a round of `kind` (static: each kind is a loop of its own)."""

  def observe(self, state, plan, count, active, *, history, lengths) -> Any:
    """The state after a round that emitted `count [B]` tokens."""

  def nothing_learnt(self) -> Any: ...

  def learnt(self, state) -> Any: ...

  def with_costs(self, state, seconds: list[float]) -> Any: ...

  def describe(self) -> dict: ...


@dataclasses.dataclass(frozen=True)
class RootOnly:
  """The AR "proposal": a tree of just the root, so every round emits one target token."""

  tree_size: int = dataclasses.field(default=1, init=False)
  depth: int = dataclasses.field(default=0, init=False)

  def start(self, params, *, target, cache, history):
    return None

  def propose(self, params, state, *, target, cache, history, root):
    return chain(root, jnp.zeros((root.shape[0], 0), jnp.int32)), state

  def describe(self) -> dict:
    return {}
