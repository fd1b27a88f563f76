"""Continuous batching: a fixed number of slots decoding together, each request admitted
into a free slot between chunks of rounds and leaving when it is done.

The slots are one batch (`engine.DecodeState` of `slots` rows, one cache of `positions`).
A request is prefilled alone (`engine.start` on a batch of one, its cache as long as the
slots') and its rows of that state are written into its slot's. Which arrays of the state
hold a row per sequence, and along which axis, is read off the state's own shapes at batch
sizes one and two, so every proposer's state (a draft's ring, `auto`'s gains) follows
without code of its own, and what the batch shares (`auto`'s prices and counts) stays the
batch's. The rows of other slots are untouched, and a round's tokens for one row do not
depend on the others (the engine's batch invariance), so under greedy decoding or draws
keyed by position (the default) a request's tokens are those it gets alone.

With `shrink` (a server's slots, whose load changes) a chunk of rounds computes only the
rows up to the last busy slot, rounded up to a power of two: a lone request in eight slots
computes one row a round, not eight. A row's bits then follow the count of rows only where
they follow the batch size anyway (not under batch-invariant numerics).

A slot's cache outlives its request: a prompt that begins with the tokens a free slot holds
(the next turn of a chat: the conversation so far, the last answer included) is admitted
there and prefills only what is new (`choose`, `admit`), except for a batch-invariant target,
whose requests write the same bits whatever ran before them.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from longspec_jax import engine
from longspec_jax.engine import DecodeState, Decoding
from longspec_jax.methods import prices
from longspec_jax.models.cache import KVCache
from longspec_jax.models.target import Transformer

# Fewest prompt tokens a slot's cache is reused for: a pass continuing a cache is another
# compiled program than a prompt's first pass, and a few shared tokens (a chat template's
# system prompt, a coincidental first token) save less prefill than its compilation costs
# the request that meets it first (0.4-0.6 s for SmolLM2 on a CPU).
MIN_REUSED = 32


def batch_axes(one: Any, two: Any) -> tuple[int | None, ...]:
  """Per leaf of two states of one pytree structure, at batch sizes one and two: the axis
  along which the batch runs (the one whose size differs), None for a leaf the batch
  shares."""
  leaves_one, leaves_two = jax.tree.leaves(one), jax.tree.leaves(two)
  axes = []
  for a, b in zip(leaves_one, leaves_two):
    differ = [i for i, (x, y) in enumerate(zip(np.shape(a), np.shape(b))) if x != y]
    axes.append(differ[0] if differ else None)
  return tuple(axes)


@functools.partial(jax.jit, static_argnames=("axes",), donate_argnums=0)
def _splice(state: Any, started: Any, at: jax.Array, row: jax.Array, axes: tuple[int | None, ...]) -> Any:
  """`state` (donated) with `started`'s row `at` written at `row` along each leaf's batch axis."""
  leaves, tree = jax.tree.flatten(state)
  one = lambda new, axis: jax.lax.dynamic_slice_in_dim(new, at, 1, axis)
  written = [
    leaf if axis is None else jax.lax.dynamic_update_slice_in_dim(leaf, one(new, axis).astype(leaf.dtype), row, axis)
    for leaf, new, axis in zip(leaves, jax.tree.leaves(started), axes)
  ]
  return jax.tree.unflatten(tree, written)


@functools.partial(jax.jit, static_argnames=("rows", "axes"))
def _first_rows(state: Any, rows: int, axes: tuple[int | None, ...]) -> Any:
  """The first `rows` rows of `state` (a copy: a chunk donates it), what the batch shares as it is."""
  leaves, tree = jax.tree.flatten(state)
  first = lambda leaf, axis: leaf if axis is None else jax.lax.slice_in_dim(leaf, 0, rows, axis=axis)
  return jax.tree.unflatten(tree, [first(leaf, axis) for leaf, axis in zip(leaves, axes)])


@functools.partial(jax.jit, static_argnames=("axes",), donate_argnums=0)
def _with_first_rows(state: Any, first: Any, axes: tuple[int | None, ...]) -> Any:
  """`state` (donated) with `first`'s rows written over its first ones and what the batch
  shares taken from `first` (the rounds it ran since)."""
  leaves, tree = jax.tree.flatten(state)
  written = [
    new if axis is None else jax.lax.dynamic_update_slice_in_dim(leaf, new.astype(leaf.dtype), 0, axis)
    for leaf, new, axis in zip(leaves, jax.tree.leaves(first), axes)
  ]
  return jax.tree.unflatten(tree, written)


# The rounds' programs run as CUDA graphs on a GPU, which hold the addresses of the buffers
# they read; XLA rewrites a graph when one of them moved since its last run (~5 ms for
# SmolLM2's copy round on an H100, once per kind a chunk runs). So what a release changes
# is written into the buffers the state holds (donated), never into arrays made afresh.


@functools.partial(jax.jit, donate_argnums=0)
def _finished(done: jax.Array, slot: jax.Array) -> jax.Array:
  """`done` [B] (donated) with row `slot` set."""
  return done.at[slot].set(True)


@functools.partial(jax.jit, static_argnums=0, donate_argnums=1)
def _with_past(proposer, proposal: Any, past: Any) -> Any:
  """The proposer's state `proposal` (donated) reading the ring `past`, written into the
  buffers that held its ring before."""
  new = proposer.with_past(proposal, past)
  return jax.tree.map(lambda old, leaf: jax.lax.dynamic_update_slice(old, leaf, (0,) * old.ndim), proposal, new)


class Admitted(NamedTuple):
  first: int  # the request's first token
  done: bool  # it ends there: an EOS, or a limit of one token
  reused: int  # prompt tokens whose K/V the slot held already (not prefilled again)


def _row(cache: KVCache, slot: int, count: int) -> KVCache:
  """A cache of one sequence, a copy of `slot`'s row of `cache` (prefill donates it, and a
  slice of a batch of one is the batch's own array), its first `count` positions kept."""
  row = lambda layers: jax.lax.dynamic_slice_in_dim(layers, slot, 1, axis=1)  # (an op: a buffer of its own)
  return KVCache(k=row(cache.k), v=row(cache.v), lengths=jnp.full((1,), count, jnp.int32))


def _each(values: Sequence[float | None] | None, default: float, count: int) -> list[float]:
  """One value a prompt: `values`' own, `default` where there is none."""
  return [default if v is None else v for v in (values or [None] * count)]


def _powers_of_two(count: int) -> list[int]:
  """`count` as a sum of distinct powers of two, largest first (13: 8, 4, 1)."""
  return [1 << i for i in reversed(range(count.bit_length())) if count >> i & 1]


def _common(a: Sequence[int], b: Sequence[int]) -> int:
  """The length of the longest common prefix of `a` and `b`."""
  n = 0
  for x, y in zip(a, b):
    if x != y:
      break
    n += 1
  return n


# Cache positions a group admitted together holds at most (`Slots.admit_together`): its new
# cache beside the slots' until spliced in, and its passes' activations.
GROUP_POSITIONS = 65536


@dataclasses.dataclass
class Slots:
  """`slots` sequences decoding together in a cache of `positions`: `admit` a prompt into a
  free slot, `run` chunks of rounds, `release` a slot once its request is done (or given
  up). `limits`: each slot's token limit."""

  model: Transformer
  decoding: Decoding
  proposer_params: Any
  positions: int
  state: DecodeState
  axes: tuple[int | None, ...]
  limits: np.ndarray  # [slots] int32
  busy: np.ndarray  # [slots] bool
  carried: dict | None
  tokens: list[list[int]]  # per slot: its request's prompt and the tokens emitted since
  prompted: np.ndarray  # [slots] int32: the length of each slot's prompt (where its output begins in `tokens`)
  round_time: float | None = None  # seconds a round took over the latest chunk (None: none ran yet)
  round_seconds: tuple | None = None  # `auto`'s prices (`prices.Prices.seconds`); None for other proposers
  # `auto`'s prices for each count of rows a chunk may run (`row_counts`), and the count whose
  # prices the state holds now (0: none that `run` set yet):
  seconds_by_rows: dict[int, tuple] = dataclasses.field(default_factory=dict)
  priced_rows: int = 0
  memory: engine.Memory | None = None  # where `auto`'s gains are left for later slots and generations
  rounds_before: Any = 0  # `auto`'s rounds by kind when the slots opened (its calibration's)
  shrink: bool = False  # a chunk runs only the rows up to the last busy slot (`live_rows`)

  @classmethod
  def open(
    cls,
    model: Transformer,
    decoding: Decoding,
    proposer_params: Any,
    slots: int,
    positions: int,
    memory: engine.Memory | None = None,
    per_sequence_sampling: bool = False,
    shrink: bool = False,
  ) -> Slots:
    """Every slot free. `auto` starts from the prices and gains `memory` holds (default the
    process's) for `slots` sequences in `positions`, and leaves there the gains it learns;
    prices not measured yet are measured now (`measure_prices`). With
    `per_sequence_sampling`, each request may bring its own temperature and top-p
    (`admit`). With `shrink`, a chunk computes only the rows up to the last busy slot
    (`live_rows`): a server's load changes, and a lone request in a slot of eight would
    pay for eight rows a round; each count of rows is a program of its own (`compile`)
    and `auto`'s prices of its own (`seconds_by_rows`, measured here where `memory` has
    none)."""
    memory = engine.MEMORY if memory is None else memory
    _, _, carried = engine.carried_state(memory, model, decoding, proposer_params, slots, positions)
    temperature = decoding.sampling.temperature
    empty = lambda batch: (
      engine.start(
        model,
        [[0]] * batch,
        1,
        decoding,
        proposer_params,
        carried=carried,
        positions=positions,
        temperatures=[temperature] * batch if per_sequence_sampling else None,  # (top-p: the config's)
      ).state
    )
    axes = batch_axes(empty(1), empty(2))
    opened = cls(
      model=model,
      decoding=decoding,
      proposer_params=proposer_params,
      positions=positions,
      state=empty(slots),
      axes=axes,
      limits=np.ones(slots, np.int32),
      busy=np.zeros(slots, bool),
      carried=carried,
      tokens=[[] for _ in range(slots)],
      prompted=np.zeros(slots, np.int32),
      memory=memory,
      shrink=shrink,
    )
    opened._flag_rows()
    opened._compile_release()
    if decoding.multi_kind:
      # A chunk of fewer rows (`shrink`) pays what that many sequences pay, not all of them.
      for rows in opened.row_counts:  # (all of them last: the state then holds their prices)
        key = prices.cost_key(model, decoding.proposer, proposer_params, decoding.sampling, rows, positions)
        table = memory.prices.known(key) or prices.Prices.none(len(decoding.proposer.kinds) + 1)
        if not table.complete:
          table = opened.measure_prices(table, rows)
          memory.prices.remember(key, table)
        opened.seconds_by_rows[rows] = table.seconds
      opened.round_seconds = opened.seconds_by_rows[slots]
      opened.rounds_before = np.asarray(opened.state.proposal.rounds_by_kind)
    return opened

  def _compile_release(self) -> None:
    """Compiles what `release` runs, on a free slot (each slot is free here), so that no
    request waits through it (~50 ms on a GPU)."""
    self.state = dataclasses.replace(self.state, done=_finished(self.state.done, np.int32(0)))
    if "past" in self.carried:
      proposal = _with_past(self.decoding.proposer, self.state.proposal, self.carried["past"])
      self.state = dataclasses.replace(self.state, proposal=proposal)
    if self.decoding.multi_kind:
      self.decoding.proposer.learnt(self.state.proposal)

  def kind_stats(self) -> dict:
    """`auto`'s rounds by kind since the slots opened and its prices (`engine.kind_stats`);
    {} for other proposers."""
    return engine.kind_stats(self.decoding, self.state.proposal, self.round_seconds, self.rounds_before)

  def measure_prices(self, table: prices.Prices, rows: int) -> prices.Prices:
    """`auto`'s prices of a round of each kind (and of a change of kind) over the first
    `rows` slots, those `table` lacks, measured by rounds of a prompt that repeats itself
    (so that copying rounds run whole) in each of them (`prices.calibrate`); every slot is
    free after. No token ends a slot's rounds here: a real target may well answer such a
    prompt with an EOS at once, and its rounds, whatever they emit, are what is timed.
    Returns the table (complete unless the rounds ran out first)."""
    prompt = [3 + i % 61 for i in range(min(128, self.positions // 4))]
    room = min(
      self.positions - engine.verified_size(self.decoding.proposer), self.model.config.max_position_embeddings
    ) - len(prompt)
    for slot in self.free:
      if slot < rows:
        self.admit(slot, prompt, room)
    run = lambda state, rounds: engine.decode_chunk(
      self.model, state, self.decoding, self.proposer_params, max_new_tokens=self.limits[:rows].tolist(), rounds=rounds
    )

    def calibrated(state):
      endless = dataclasses.replace(state, done=jnp.zeros_like(state.done), eos=jnp.full_like(state.eos, engine.PAD_ID))
      measured = prices.calibrate(self.decoding.proposer, run, endless, lambda tokens: None, table)
      # Every slot freed, learning nothing: the repeated prompt's gains are no request's.
      return dataclasses.replace(measured.state, eos=state.eos, done=jnp.ones_like(state.done)), measured.prices

    table = self._on_rows(rows, calibrated)
    self.busy[:] = False
    self._flag_rows()
    return table

  def _flag_rows(self) -> None:
    """Whether the busy slots' requests draw or cut to a top-p, as the rounds' programs
    take it: static (`RowSampling.flagged`), so that greedy requests run the greedy program."""
    if self.state.rows is not None:
      self.state = dataclasses.replace(self.state, rows=self.state.rows.flagged(self.busy))

  @property
  def group(self) -> int:
    """Prompts `admit_together` takes at most in one call."""
    return max(1, GROUP_POSITIONS // self.positions)

  def groupable(self, prompts: Sequence[Sequence[int]]) -> int:
    """How many of `prompts`, taken in order, `admit_together` starts in one call: as many as
    the free slots and a group take, up to the first that a free slot holds part of (that one
    is admitted alone, from what its slot holds)."""
    count = 0
    for prompt in prompts[: min(len(self.free), self.group)]:
      if self.held(self.choose(prompt), prompt):
        break
      count += 1
    return count

  @property
  def free(self) -> list[int]:
    return [int(i) for i in np.flatnonzero(~self.busy)]

  def held(self, slot: int, prompt: Sequence[int]) -> int:
    """How many of `prompt`'s first tokens `slot`'s cache holds the K/V of and would be
    reused for (at most all but its last, whose hidden state gives the first new token;
    0 below `MIN_REUSED`, and always 0 for a batch-invariant target: the pass over the rest
    of a prompt computes its K/V with other bits than a pass over the whole prompt, and a
    request's tokens then depend on what its slot held before)."""
    if self.model.batch_invariant:
      return 0
    cached = int(np.asarray(self.state.cache.lengths)[slot])
    held = min(_common(self.tokens[slot][:cached], prompt), len(prompt) - 1)
    return held if held >= MIN_REUSED else 0

  def choose(self, prompt: Sequence[int]) -> int | None:
    """The free slot to admit `prompt` into: the one holding the most of it (the first
    free one where none does); None when every slot is busy."""
    free = self.free
    return max(free, key=lambda slot: (self.held(slot, prompt), -slot)) if free else None

  def admit(
    self,
    slot: int,
    prompt: Sequence[int],
    max_new_tokens: int,
    seed: int = 0,
    *,
    temperature: float | None = None,
    top_p: float | None = None,
    prefill_chunk: int | None = None,
    between: Callable[[], None] | None = None,
  ) -> Admitted:
    """Prefills `prompt` alone into the free `slot` in passes of `prefill_chunk` tokens
    (default the engine's), from the first token the slot's cache does not hold already.
    `between` runs after each pass but the last: there the other slots can `run`, so that
    they go on streaming while a long prompt is prefilled. `temperature`, `top_p`: the
    request's own (slots opened with `per_sequence_sampling`; default the config's)."""
    if self.busy[slot]:
      raise ValueError(f"slot {slot} holds a request; release it first.")
    config, own = self.decoding.sampling, self.state.rows is not None
    if not own and (temperature is not None or top_p is not None):
      raise ValueError("these slots sample by their config alone; open them with per_sequence_sampling.")
    reused = self.held(slot, prompt)
    started = engine.start(
      self.model,
      [prompt],
      max_new_tokens,
      self.decoding,
      self.proposer_params,
      seed=[seed],
      prefill_chunk=prefill_chunk,
      on_prefill=None if between is None else lambda done, total: between() if done < total else None,
      carried=self.carried,
      positions=self.positions,
      prefix=_row(self.state.cache, slot, reused) if reused else None,
      temperatures=[config.temperature if temperature is None else temperature] if own else None,
      top_ps=[config.top_p if top_p is None else top_p] if own else None,
    )
    return self._occupy([slot], [prompt], [max_new_tokens], started, reused)[0]

  def admit_together(
    self,
    slots: Sequence[int],
    prompts: Sequence[Sequence[int]],
    max_new_tokens: Sequence[int],
    seeds: Sequence[int],
    *,
    temperatures: Sequence[float] | None = None,
    top_ps: Sequence[float] | None = None,
    prefill_chunk: int | None = None,
    between: Callable[[], None] | None = None,
    per_octave: int = 8,
  ) -> list[Admitted]:
    """Prefills `prompts` together, one into each of the free `slots`, in passes as wide as
    one prompt's alone (`engine.prefill_chunk_tokens(1)`): so under batch-invariant
    numerics each row's bits are those of its prompt prefilled alone, whatever the group
    holds, and a batch file's records start in one call instead of one each (no slot's
    cache is reused). The prompts go in calls of a power of two each (7: 4, 2, 1): each
    count is a program of its own, and the counts that arrive follow the rounds' timing,
    so a count not met before would compile inside a timed run (`compile_group` compiles
    them before). `per_octave`: the widths a pass is padded to (`engine.prefill_width`;
    one, a power of two, makes few enough programs to compile every count's at a server's
    start). `temperatures`, `top_ps`:
    as `admit`'s, one a prompt (None: the config's). `prefill_chunk`: each prompt's tokens
    a pass takes (default one prompt's alone, as above). `between`: as `admit`'s, after each
    pass but the group's last; the slots take their requests only after that one, so
    that the other slots' rounds run between passes never step a half-admitted group."""
    if any(self.busy[slot] for slot in slots) or len(set(slots)) != len(slots):
      raise ValueError(f"slots {list(slots)} are not as many free slots as prompts.")
    own = self.state.rows is not None
    if not own and (temperatures is not None or top_ps is not None):
      raise ValueError("these slots sample by their config alone; open them with per_sequence_sampling.")
    config = self.decoding.sampling
    temperatures = _each(temperatures, config.temperature, len(prompts)) if own else None
    top_ps = _each(top_ps, config.top_p, len(prompts)) if own else None
    ends = np.cumsum(_powers_of_two(len(prompts))).tolist()
    parts = [slice(start, end) for start, end in zip([0, *ends], ends)]

    def after_pass(last: bool):  # (`between` after each pass but the group's last)
      if between is not None:
        return lambda done, total: between() if done < total or not last else None

    started = [
      engine.start(
        self.model,
        prompts[part],
        list(max_new_tokens[part]),
        self.decoding,
        self.proposer_params,
        seed=list(seeds[part]),
        prefill_chunk=prefill_chunk or engine.prefill_chunk_tokens(1),
        on_prefill=after_pass(part.stop == len(prompts)),
        carried=self.carried,
        positions=self.positions,
        temperatures=temperatures[part] if own else None,
        top_ps=top_ps[part] if own else None,
        per_octave=per_octave,
      )
      for part in parts
    ]
    return [
      one
      for part, group in zip(parts, started)
      for one in self._occupy(slots[part], prompts[part], max_new_tokens[part], group, 0)
    ]

  @property
  def group_counts(self) -> list[int]:
    """The counts of prompts `admit_together` starts in one call: the powers of two up to
    the slots' count and a group's."""
    most = min(len(self.busy), self.group)
    return [1 << i for i in range(most.bit_length())]

  def compile_group(
    self, count: int, longest: int, prefill_chunks: Sequence[int | None] = (None,), per_octave: int = 8
  ) -> None:
    """Compiles what `admit_together` runs for `count` (of `group_counts`) greedy prompts
    of up to `longest` tokens in passes of any of `prefill_chunks` tokens each (None: the
    engine's default) padded to `per_octave` widths: a pass of each width it may take,
    first and later (`engine.compile_prefill`), the first token, the proposer's start and
    the splice into a slot. The slots must all be free: the latter run once on prompts of
    one token, spliced into the first slot, which stays free."""
    if self.busy.any():
      raise ValueError("compile a group's programs before any slot holds a request.")
    chunks = list(dict.fromkeys(chunk or engine.prefill_chunk_tokens(1) for chunk in prefill_chunks))
    passes = set().union(*(engine.prefill_passes(longest, chunk, per_octave) for chunk in chunks))
    engine.compile_prefill(self.model, count, self.positions, passes)
    chunk = chunks[0]  # (a prompt of one token: one pass, whatever the chunk)
    own, sampling = self.state.rows is not None, self.decoding.sampling
    started = engine.start(
      self.model,
      [[0]] * count,
      1,
      self.decoding,
      self.proposer_params,
      seed=[0] * count,
      prefill_chunk=chunk,
      carried=self.carried,
      positions=self.positions,
      temperatures=[sampling.temperature] * count if own else None,
      top_ps=[sampling.top_p] * count if own else None,
      per_octave=per_octave,
    )
    self.state = _splice(self.state, started.state, np.int32(0), np.int32(0), self.axes)
    self.state = dataclasses.replace(self.state, done=_finished(self.state.done, np.int32(0)))

  def _occupy(self, slots, prompts, max_new_tokens, started: engine.Started, reused: int) -> list[Admitted]:
    """Each started row into its slot, the slot then busy with its request."""
    first, done = np.asarray(started.first), np.asarray(started.state.done)
    for at, (slot, prompt, limit) in enumerate(zip(slots, prompts, max_new_tokens)):
      self.state = _splice(self.state, started.state, np.int32(at), np.int32(slot), self.axes)
      self.limits[slot] = limit
      self.busy[slot] = True
      self.tokens[slot] = [*prompt, int(first[at])]
      self.prompted[slot] = len(prompt)
    self._flag_rows()
    return [Admitted(int(first[at]), bool(done[at]), reused) for at in range(len(slots))]

  @property
  def live_rows(self) -> int:
    """The rows a chunk runs: the fewest of `row_counts` that reach the last busy slot
    (every slot where none is busy). The slots past them are free, and a chunk leaves
    their state (a chat's cache kept for its next turn) as it is."""
    busy = np.flatnonzero(self.busy)
    last = int(busy[-1]) if len(busy) else len(self.busy) - 1
    return next(rows for rows in self.row_counts if rows > last)

  def run(self, rounds: int, rows: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Up to `rounds` rounds over the first `rows` slots (default `live_rows`): (the new
    tokens [slots, n], PAD_ID where a slot has none; which slots are done)."""
    rows = rows or self.live_rows
    if self.seconds_by_rows and rows != self.priced_rows:  # (`auto` weighs its kinds at this many rows' prices)
      proposal = self.decoding.proposer.with_costs(self.state.proposal, self.seconds_by_rows[rows])
      self.state, self.priced_rows = dataclasses.replace(self.state, proposal=proposal), rows
    run = lambda state: engine.decode_chunk(
      self.model,
      state,
      self.decoding,
      self.proposer_params,
      max_new_tokens=self.limits[:rows].tolist(),
      rounds=rounds,
    )
    ran = np.asarray(self._on_rows(rows, lambda state: run(state)[:2]))
    tokens = np.full((len(self.busy), ran.shape[1]), engine.PAD_ID, ran.dtype)  # (PAD_ID past the rows that ran)
    tokens[:rows] = ran
    for slot in np.flatnonzero(self.busy):
      self.tokens[slot] += [int(t) for t in tokens[slot] if t != engine.PAD_ID]
    return tokens, np.asarray(self.state.done)

  def step(self, seconds: float) -> tuple[np.ndarray, np.ndarray]:
    """`run` for a chunk of about `seconds`, sized by the time a round took in the latest
    chunk (over the rounds it ran: one that every request left early ran fewer than it
    was given)."""
    before = int(self.state.rounds)
    started = time.perf_counter()
    out = self.run(engine.rounds_in(self.round_time, seconds))
    ran = int(self.state.rounds) - before
    if ran:
      self.round_time = (time.perf_counter() - started) / ran
    return out

  @property
  def row_counts(self) -> list[int]:
    """The counts of rows a chunk may run (`live_rows`): with `shrink`, the powers of two
    below the slots' count, then all of them; else all of them."""
    slots = len(self.busy)
    return [*([1 << i for i in range((slots - 1).bit_length())] if self.shrink else []), slots]

  def compile(self) -> None:
    """Compiles the chunks' programs for every count of `row_counts` (and the copies of rows
    out and back), running no round."""
    for rows in self.row_counts:
      self._on_rows(
        rows, lambda state: (state, engine.compile_chunk(self.model, state, self.decoding, self.proposer_params))
      )

  def _on_rows(self, rows: int, work: Callable[[DecodeState], tuple[DecodeState, Any]]) -> Any:
    """`work` (state -> (state after, a result)) on the state's first `rows` rows: the whole
    state, or its rows copied out and written back (once a chunk, not a round), what the
    batch shares taken from the rows that ran. Returns the result."""
    if rows == len(self.busy):
      self.state, result = work(self.state)
      return result
    first, result = work(_first_rows(self.state, rows, self.axes))
    self.state = _with_first_rows(self.state, first, self.axes)
    return result

  def sequence_stats(self, slot: int) -> dict:
    """The request in `slot`'s own stats so far (`engine.sequence_stats`)."""
    emitted = int(np.asarray(self.state.emitted)[slot])
    return engine.sequence_stats(emitted, np.asarray(self.state.rounds_by_length)[slot])

  def release(self, slot: int) -> None:
    """Frees `slot`, done or not (a request given up): its row emits nothing until a request
    is admitted there. `auto`'s next requests start from the gains the slots learnt so far
    (as a generation starts from the previous one's, `engine.Memory`), not from none; so do
    later slots and generations of this memory. Where prompt lookup searches past outputs,
    the slot's is added to them, for every slot's next rounds."""
    self.state = dataclasses.replace(self.state, done=_finished(self.state.done, np.int32(slot)))
    self.busy[slot] = False
    self._flag_rows()
    past = self.memory.past_for(self.model.config, self.decoding) if self.memory is not None else None
    if past is not None:  # (what it wrote, for the next requests' prompt lookup, theirs and the running ones')
      past.append(self.tokens[slot][self.prompted[slot] :])
      # (the ring's own arrays, written into the state's before the ring's next update
      # reuses them; `carried` keeps the copy the slots opened with: a request admitted
      # later reads the state's ring, which `_splice` keeps, and `start` takes only its shape)
      searched = past.on_device(copy=False)
      self.state = dataclasses.replace(
        self.state, proposal=_with_past(self.decoding.proposer, self.state.proposal, searched)
      )
    if self.decoding.multi_kind:
      learnt = self.decoding.proposer.learnt(self.state.proposal)
      self.carried = {**self.carried, "learnt": learnt}
      if self.memory is not None:
        self.memory.learnt[(self.decoding, self.model.config)] = learnt
