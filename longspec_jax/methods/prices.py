"""The measured cost of each kind of round of `auto` (`auto.Adaptive`), and their cache.

A round's price depends on the device, the target, the trees, the sampling and the
context length, so it is measured, not modelled: the first generation that needs it runs
its first rounds as each kind in turn, timed on the host. A chunk of rounds costs a fixed
launch and read-back on top of its rounds (measured: ~1.6-2.3 ms a chunk on an H100 with
SmolLM2, more than an AR step), so each kind runs a chunk of one round (its first run:
untimed), then chunks of one and of `Schedule.rounds` + 1 rounds in turn, and its price
is, over the fastest chunk of one round, the least time per further round of the longer
chunks (`price`), once `Schedule.repeats` of each have run (on a GPU 31 rounds a kind; off
one, where a round takes tens of milliseconds or more, 7: the fixed part matters less
there, and 31 rounds of each kind took 79 s of a CPU's first generation with the shipped
draft): the fixed part cancels,
and the fastest times are the least disturbed (a host thread stepping the loop only ever
adds time: with the median of two pairs, one disturbed chunk priced an H100's copy rounds
at half an AR step's price and AR at 1.8 of its own; with one pair on a CPU, copy rounds
at 3 AR steps where they cost 1.5-1.9). A chunk cut short by the generation's end counts
with the rounds it ran (the state counts them), so short generations still add to the
measurement (64-token generations on a CPU almost never held a whole 9-round chunk of
copy rounds). A difference lost in the chunks' own jitter (below a quarter of a chunk's
time per round) is replaced by that time per round, an overestimate, so that no kind
ever looks free. Last comes the price of a change of kind (the engine leaves one kind's
loop for another's, on a CPU through a call from the host): the same chunks with rounds
that each take the kind after the previous round's (`auto.CYCLE`), less their
rounds' prices, leave a change a round beyond the first.

A generation chooses by the prices as measured. Corrected instead by least squares over the
decode times of the generations that chose by them, they drifted on the generations' noise
(an H200's chain round from 1.50 to 1.74 ms, above the trie's 1.65, where it runs 0.2 ms
cheaper alone), and a kind priced out was never run again to set its price right
(docs/results.md, "End-to-end decoding").

The rounds emit tokens as any other. A generation that ends first keeps the prices it
finished and the chunks it timed, and the next one goes on from there: without that,
generations shorter than the measurement (256 tokens of copy-friendly text with a draft
on an H100) measured again every time and spent most of their rounds forced. The
measurements are kept per process and in a JSON file under the cache directory
(`files.cache_root`), keyed by everything they depend on, so later generations
(and later runs on the same machine) start choosing at once.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import time
from pathlib import Path

import jax
import numpy as np

from longspec_jax import backend
from longspec_jax.files import cache_root, write_whole
from longspec_jax.methods import auto


@dataclasses.dataclass(frozen=True)
class Schedule:
  """How a kind's price is measured: chunks of one round and of `rounds` + 1, `repeats`
  of each, after one untimed round."""

  rounds: int
  repeats: int

  @property
  def per_kind(self) -> int:
    return 1 + self.repeats * (1 + self.rounds + 1)


GPU = Schedule(rounds=8, repeats=3)
HOST = Schedule(rounds=1, repeats=2)


def schedule() -> Schedule:
  """The measurement for this backend: GPU's, or HOST's off a GPU."""
  return GPU if backend.on_gpu() else HOST


FILE_NAME = "round_costs.json"
# Part of every key: raised when what a price covers changes, so that no table written
# before is read as current (2: a GPU changes kind inside one program again, where for
# a while the host's call was priced, ~2.5 ms on an H100; 3: CHAIN rounds among the kinds).
PRICES_VERSION = 3


@dataclasses.dataclass(frozen=True)
class Prices:
  """Seconds per round of each kind, then seconds per change of kind (None: not measured
  yet), and the timed chunks (rounds run, seconds) of those still being measured."""

  seconds: tuple[float | None, ...]
  chunks: tuple[tuple[tuple[int, float], ...], ...]

  @classmethod
  def none(cls, kinds: int) -> Prices:
    return cls(seconds=(None,) * kinds, chunks=((),) * kinds)

  @property
  def complete(self) -> bool:
    return None not in self.seconds

  def to_json(self) -> dict:
    return {"seconds": list(self.seconds), "chunks": [[list(c) for c in chunks] for chunks in self.chunks]}

  @classmethod
  def from_json(cls, entry) -> Prices | None:
    """The prices of a JSON entry, or None for one of another form (an older file's)."""
    try:
      seconds = tuple(None if s is None else float(s) for s in entry["seconds"])
      chunks = tuple(tuple((int(r), float(t)) for r, t in kind) for kind in entry["chunks"])
    except (TypeError, KeyError, ValueError, AttributeError):
      return None
    return cls(seconds, chunks) if len(seconds) == len(chunks) else None


def price(chunks, switch: bool, repeats: int) -> float | None:
  """The price per round (or per change of kind) that timed `chunks` [(rounds, seconds)]
  show, once `repeats` chunks of one round and as many of more have run (else None):
  over the fastest chunk of one round, the least time per further round. A chunk is only
  ever late (timed on the host), so the fastest times are the least disturbed; a chunk
  cut short by the generation's end counts with the rounds it ran."""
  ones = [t for r, t in chunks if r == 1]
  more = [(r, t) for r, t in chunks if r > 1]
  if min(len(ones), len(more)) < repeats:
    return None
  difference = min((t - min(ones)) / (r - 1) for r, t in more)
  if switch:
    return max(difference, 0.0)
  whole = min(t / r for r, t in more)
  return difference if difference > whole / 4 else whole


def cost_key(model, proposer, proposer_params, sampling, batch: int, max_len: int) -> str:
  """What a round's price depends on: what a price covers (`PRICES_VERSION`), the device,
  the target's config, dtype and code choices, the trees of every kind (the draft's array
  shapes included), the sampling (a sampled round's acceptance costs more than a greedy
  one's), and the batch and the cache's length, each to the next power of two: a batch
  of 13 pays about what one of 16 does, and measuring each size anew would cost every
  new batch size its calibration."""
  shapes = [(x.shape, str(x.dtype)) for x in jax.tree.leaves(proposer_params)]
  draft = proposer.draft
  parts = [
    PRICES_VERSION,
    jax.devices()[0].device_kind,
    jax.default_backend(),
    repr(model.config),
    str(model.dtype),
    str(model.attention),
    str(model.gemm),
    str(model.batch_invariant),
    repr(proposer.lookup),
    None if draft is None else (draft.widths, draft.cape),
    shapes,
    repr(sampling),
    1 << max(0, (batch - 1).bit_length()),
    1 << max(0, (max_len - 1).bit_length()),
  ]
  return hashlib.sha256(repr(parts).encode()).hexdigest()[:24]


@dataclasses.dataclass
class PriceBook:
  """Prices measured by key (`cost_key`): this process's, backed by a JSON file in
  `directory` (default: the cache directory) that later processes read."""

  directory: Path | None = None
  measured: dict[str, Prices] = dataclasses.field(default_factory=dict)

  @property
  def path(self) -> Path:
    return (self.directory or cache_root()) / FILE_NAME

  def known(self, key: str) -> Prices | None:
    """What was measured before under `key` (this process, then the file), or None."""
    if key not in self.measured:
      try:
        stored = Prices.from_json(json.loads(self.path.read_text()).get(key))
      except (OSError, ValueError, AttributeError):
        stored = None
      if stored is not None:
        self.measured[key] = stored
    return self.measured.get(key)

  def remember(self, key: str, prices: Prices) -> None:
    self.measured[key] = prices
    try:
      table = json.loads(self.path.read_text()) if self.path.exists() else {}
    except ValueError:
      table = {}  # a damaged file is rewritten
    table[key] = prices.to_json()
    try:
      write_whole(self.path, json.dumps(table, indent=1))
    except OSError:
      pass  # a read-only cache: the prices stay in this process


@dataclasses.dataclass
class Calibrated:
  state: object  # the decode state after the timed rounds
  prices: Prices  # (incomplete when every sequence finished first)
  rounds: int  # rounds run
  finished: bool  # every sequence finished during the measurement


def calibrate(
  proposer, run_chunk, state, emit, known: Prices | None = None, plan: Schedule | None = None
) -> Calibrated:
  """Times each kind of round of `proposer` whose price `known` lacks, then the change of
  kind, from `state` (module docstring): `run_chunk(state, rounds) -> (state, tokens,
  finished)` runs rounds on device, `emit` receives each chunk's tokens; `plan`: the
  backend's `schedule()` by default. Stops early when every sequence is done; once every
  price is known the state carries them (`with_costs`)."""
  plan = plan or schedule()
  kinds = len(proposer.kinds)
  known = known or Prices.none(kinds + 1)
  seconds, chunks, ran, finished = list(known.seconds), [list(c) for c in known.chunks], 0, False

  def timed(state, rounds):
    """The state after a chunk of `rounds`, the rounds it ran, its seconds less those
    rounds' known prices (all of them, when it measures the change of kind), and whether
    it finished."""
    nonlocal ran
    jax.block_until_ready(state)
    before = np.asarray(state.proposal.rounds_by_kind)
    t0 = time.perf_counter()
    state, out, finished = run_chunk(state, rounds)
    out = np.asarray(out)
    seconds_taken = time.perf_counter() - t0
    emit(out)  # (after the timing: streaming the text is no part of a round's price)
    by_kind = np.asarray(state.proposal.rounds_by_kind) - before
    ran += int(by_kind.sum())
    if None not in seconds[:kinds]:
      seconds_taken -= float(np.dot(by_kind, seconds[:kinds]))
    return state, int(by_kind.sum()), seconds_taken, bool(finished)

  for index in range(kinds + 1):
    if seconds[index] is not None:
      continue
    switch = index == kinds  # (rounds that each change kind: their prices are taken off)
    force = auto.CYCLE if switch else index
    state = dataclasses.replace(state, proposal=proposer.forced(state.proposal, force))
    state, _, _, finished = timed(state, 1)  # (untimed: a kind's first run)
    while seconds[index] is None and not finished:
      for size in 1, plan.rounds + 1:
        state, rounds, taken, finished = timed(state, size)
        if rounds:
          chunks[index].append((rounds, taken))
        if finished:
          break
      seconds[index] = price(chunks[index], switch, plan.repeats)
      if seconds[index] is not None:
        chunks[index] = []
    if finished:
      return Calibrated(state, Prices(tuple(seconds), tuple(map(tuple, chunks))), ran, finished=True)
  prices = Prices(tuple(seconds), ((),) * len(seconds))
  return Calibrated(
    dataclasses.replace(state, proposal=proposer.with_costs(state.proposal, list(seconds))), prices, ran, finished=False
  )
