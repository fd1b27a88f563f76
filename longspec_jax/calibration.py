"""The measured cost of each kind of round of `auto` (`adaptive.Adaptive`), and their cache.

A round's price depends on the device, the target, the trees, the sampling and the
context length, so it is measured, not modelled: the first generation that needs it runs
its first rounds as each kind in turn, timed on the host. A chunk of rounds costs a fixed
launch and read-back on top of its rounds (measured: ~1.6-2.3 ms a chunk on an H100 with
SmolLM2, more than an AR step), so each kind runs a chunk of one round (its first run:
untimed), then chunks of one and of `ROUNDS` + 1 rounds, twice, and its price is the
median difference over `ROUNDS`: the fixed part cancels (~21 rounds a kind). A
generation that ends first keeps the prices of the kinds it finished, and the next one
measures only the rest: without that, generations shorter than the measurement (256
tokens of copy-friendly text with a draft, measured on the H100) measured again every
time and spent most of their rounds forced. A difference lost in the
chunks' own jitter (below a quarter of a chunk's time per round) is replaced by that
time per round, an overestimate, so that no kind ever looks free. The rounds emit tokens
as any other. The prices are kept per process and in a JSON file under the cache
directory (`weights.default.cache_root`), keyed by everything they depend on, so later
generations (and later runs on the same machine) start choosing at once.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import statistics
import time

import jax
import numpy as np

from longspec_jax.weights.default import cache_root

ROUNDS = 8  # timed rounds per kind, beyond the chunk of one
REPEATS = 2
FILE_NAME = "round_costs.json"
_MEMORY: dict[str, list[float]] = {}


def cost_key(model, proposer, proposer_params, sampling, batch: int, max_len: int) -> str:
  """What a round's price depends on: the device, the target's config, dtype and code
  choices, the trees of every kind (the draft's array shapes included), the sampling (a
  sampled round's acceptance costs more than a greedy one's), the batch and the cache's
  length (to the next power of two)."""
  shapes = [(x.shape, str(x.dtype)) for x in jax.tree.leaves(proposer_params)]
  draft = proposer.draft
  parts = [jax.devices()[0].device_kind, jax.default_backend(), repr(model.config), str(model.dtype),
           str(model.attention), str(model.gemm), str(model.batch_invariant), proposer.lookup.num_tokens,
           None if draft is None else draft.widths, shapes, repr(sampling), batch,
           1 << max(0, (max_len - 1).bit_length())]
  return hashlib.sha256(repr(parts).encode()).hexdigest()[:24]


def known_costs(key: str) -> list[float | None] | None:
  """Seconds per round of each kind measured before under `key` (this process, then the
  cache file; None for a kind not measured yet), or None."""
  if key not in _MEMORY:
    try:
      stored = json.loads((cache_root() / FILE_NAME).read_text()).get(key)
    except (OSError, ValueError):
      stored = None
    if stored is not None:
      _MEMORY[key] = stored
  return _MEMORY.get(key)


def remember(key: str, seconds: list[float | None]) -> None:
  _MEMORY[key] = seconds
  path = cache_root() / FILE_NAME
  try:
    table = json.loads(path.read_text()) if path.exists() else {}
  except ValueError:
    table = {}  # a damaged file is rewritten
  table[key] = seconds
  try:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(table, indent=1))
    tmp.replace(path)  # whole or not at all
  except OSError:
    pass  # a read-only cache: the prices stay in this process


def complete(seconds: list[float | None] | None) -> bool:
  return seconds is not None and None not in seconds


@dataclasses.dataclass
class Calibrated:
  state: object  # the decode state after the timed rounds
  seconds: list[float | None]  # per round, by kind (None: not measured, every sequence finished first)
  rounds: int  # rounds run
  finished: bool  # every sequence finished during the measurement


def calibrate(proposer, run_chunk, state, emit, known: list[float | None] | None = None) -> Calibrated:
  """Times each kind of round of `proposer` whose price `known` lacks, from `state`
  (module docstring): `run_chunk(state, rounds) -> (state, tokens, finished)` runs rounds
  on device, `emit` receives each chunk's tokens. Stops early when every sequence is
  done; once every kind has a price the state carries them (`with_costs`)."""
  seconds, ran = list(known or [None] * len(proposer.kinds)), 0
  for index, kind in enumerate(proposer.kinds):
    if seconds[index] is not None:
      continue
    state = dataclasses.replace(state, proposal=proposer.forced(state.proposal, kind))
    times = {1: [], ROUNDS + 1: []}
    for rounds in (1,) + (1, ROUNDS + 1) * REPEATS:
      jax.block_until_ready(state)
      t0 = time.perf_counter()
      state, out, finished = run_chunk(state, rounds)
      out = np.asarray(out)
      times[rounds].append(time.perf_counter() - t0)
      ran += rounds
      emit(out)
      if bool(finished):
        return Calibrated(state, seconds, ran, finished=True)
    whole = statistics.median(times[ROUNDS + 1]) / (ROUNDS + 1)
    difference = statistics.median(b - a for a, b in zip(times[1][1:], times[ROUNDS + 1])) / ROUNDS
    seconds[index] = difference if difference > whole / 4 else whole
  return Calibrated(dataclasses.replace(state, proposal=proposer.with_costs(state.proposal, seconds)), seconds, ran,
                    finished=False)
