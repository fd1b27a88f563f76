"""The generation loop: chunked prefill, then propose -> verify -> accept -> commit rounds.

One loop serves every method: a proposer (`methods/`) turns the context into a token
tree, the target verifies all of it in one forward pass (hybrid attention with the
ancestor mask), the longest path the target agrees with is kept and its K/V committed.
Plain autoregressive decoding (AR) is the one-node tree.

The model enters jit as (graphdef, params): graphdef is static, params a pytree. Prefill
runs the prompt in fixed-size chunks (bounded activation memory, one compilation). Rounds
run on device in `lax.while_loop` chunks; where the call returns before its chunk is
done, the host dispatches the next chunk before it reads the previous chunk's tokens, so
streaming costs no device time (on a GPU the call waits for its chunk: XLA steps the
loop from the host; there the next chunk is sized from the one just done, and none is
dispatched after the last, `_Chunk`). A chunk runs as
many rounds as fit in about `CHUNK_SECONDS` (measured as it goes), so text streams at
that pace whether a round takes 1 ms (AR on a GPU) or 0.3 s (a tree on a CPU), and the
host (Ctrl-C included) gets control back as often. `auto` (`methods/auto.py`) chooses each
round's kind on device; on a GPU one program holds a loop per kind, run in turn, elsewhere
each kind is a program of its own and a chunk of its rounds is one call per run of one
kind (`_Rounds`, `_one_program`).
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from longspec_jax import backend
from longspec_jax.decoding.compiles import Compiles
from longspec_jax.decoding.sampling import (
  Draw,
  RowSampling,
  SamplingConfig,
  generation_keys,
  probs,
  recent_tokens,
  round_keys,
  sample,
)
from longspec_jax.decoding.verify import accept_greedy, accept_sampled, emitted_tokens, fraction_read, verify
from longspec_jax.errors import UserError
from longspec_jax.methods import prices
from longspec_jax.methods.base import RootOnly
from longspec_jax.methods.past import Past
from longspec_jax.models.cache import KVCache
from longspec_jax.models.config import SparseVerify
from longspec_jax.models.target import Transformer
from longspec_jax.ops import gemm
from longspec_jax.ops.attention import causal_block_mask

PAD_ID = -1  # fills token slots after a sequence has finished
# Device time per chunk of rounds: the host streams text once per chunk (a chunk costs one
# dispatch and one transfer, ~0.1 ms, hidden behind the next chunk).
CHUNK_SECONDS = 0.2
# Rounds one chunk may run (its token buffer is [B, MAX_ROUNDS_PER_CHUNK * tree size]).
MAX_ROUNDS_PER_CHUNK = 128


@dataclasses.dataclass
class Memory:
  """What a generation leaves to the next ones: seconds per round of the latest full chunk,
  by (decoding, batch, target config), from which a generation's first chunk is sized (from
  one round instead, a short generation ran three chunks, each with a fixed cost: prompt
  lookup's 256 tokens in 48 rounds took 87 ms on an H100, its first chunk 6.4 ms for its one
  round); `auto`'s gains at the end of the latest generation, by (decoding, target config),
  from which the next starts (`auto.Learnt`); the measured price of each kind of round; and
  the outputs of finished generations, by (target config, ring size), for prompt lookup's
  search of them (`methods.past`). `generate` uses the process's `MEMORY` unless given
  another."""

  pace: dict[tuple, float] = dataclasses.field(default_factory=dict)
  learnt: dict[tuple, Any] = dataclasses.field(default_factory=dict)
  prices: prices.PriceBook = dataclasses.field(default_factory=prices.PriceBook)
  past: dict[tuple, Past] = dataclasses.field(default_factory=dict)

  def past_for(self, config, decoding: Decoding) -> Past | None:
    """The ring of past outputs `decoding`'s proposer searches for targets of `config`
    (made empty on first use); None when it searches none."""
    size = decoding.past_tokens
    if not size:
      return None
    key = (config, size)
    if key not in self.past:
      self.past[key] = Past.empty(size)
    return self.past[key]


MEMORY = Memory()


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DecodeState:
  cache: KVCache
  history: jax.Array  # [B, S] int32: prompt and emitted tokens; the root sits at index cache.lengths
  root: jax.Array  # [B] int32: the newest token, chosen but not yet in the cache
  done: jax.Array  # [B] bool: sequence emitted EOS or reached the token limit
  emitted: jax.Array  # [B] int32: new tokens so far, the root included
  rounds: jax.Array  # [] int32: decoding rounds (target forward passes) so far
  # [B, D + 2] int32: rounds in which the sequence was not yet done, by the tokens each
  # emitted (0 .. D + 1, D the proposer's depth; `acceptance_by_depth`)
  rounds_by_length: jax.Array
  # [B] float32: the share of the cached K/V each round's verification read, summed over
  # the rounds the sequence was not yet done (1 per dense round; `verify.fraction_read`)
  kv_read: jax.Array
  key: jax.Array  # PRNG key
  nonfinite: jax.Array  # [B] bool: some logits were NaN or inf
  proposal: Any  # the proposer's state (e.g. the draft's ring buffer); None if it has none
  # each sequence's own temperature and top-p (`SamplingConfig.per_sequence`); None: the config's
  rows: RowSampling | None = None
  # [E] int32: the tokens that end a sequence (`Decoding.eos_ids`; PAD_ID: none). Traced, so
  # that rounds which must not stop (`batching.Slots.measure_prices`) share the program.
  eos: jax.Array | None = None

  @classmethod
  def start(
    cls,
    cache: KVCache,
    history: jax.Array,
    root: jax.Array,
    done: jax.Array,
    key: jax.Array,
    nonfinite: jax.Array | None = None,
    proposal: Any = None,
    depth: int = 0,
    rows: RowSampling | None = None,
    eos: jax.Array | None = None,
  ) -> DecodeState:
    """The state after prefill: `root` (the first new token) sits at history[b, lengths[b]];
    rounds emit at most `depth` + 1 tokens; `eos`: the tokens that end a sequence (none)."""
    batch = root.shape[0]
    return cls(
      cache=cache,
      history=history,
      root=root,
      done=done,
      emitted=jnp.ones((batch,), jnp.int32),
      rounds=jnp.int32(0),
      rounds_by_length=jnp.zeros((batch, depth + 2), jnp.int32),
      kv_read=jnp.zeros((batch,), jnp.float32),
      key=key,
      nonfinite=jnp.zeros((batch,), bool) if nonfinite is None else nonfinite,
      proposal=proposal,
      rows=rows,
      eos=jnp.full((1,), PAD_ID, jnp.int32) if eos is None else eos,
    )


@dataclasses.dataclass(frozen=True)
class Decoding:
  """How to decode, fixed for a generation (static under jit): the proposer that drafts
  each round's tree (AR's one-node tree by default), the logit processors, and the tokens
  that end a sequence."""

  proposer: Any = RootOnly()  # a `methods.base.Proposer`
  sampling: SamplingConfig = SamplingConfig()
  eos_ids: tuple[int, ...] = ()

  def eos_array(self) -> np.ndarray:
    """The EOS ids as int32 [E] (PAD_ID, which no token equals, when there are none)."""
    return np.asarray(self.eos_ids or (PAD_ID,), np.int32)

  @property
  def multi_kind(self) -> bool:
    """Whether the proposer chooses each round's kind (`methods.base.MultiKind`: `auto`),
    whose rounds then run as a loop per kind."""
    return hasattr(self.proposer, "kinds")

  @property
  def past_tokens(self) -> int:
    """The size of the ring of earlier outputs the proposer's prompt lookup searches (0:
    none; `methods.past`)."""
    return getattr(self.proposer, "past_tokens", 0)

  @property
  def sparse(self) -> SparseVerify | None:
    """How the proposer's trees are verified sparsely (SpecAttn, lossy:
    `longspec.LongSpecDraft.sparse`); None: the whole cache is read."""
    return getattr(self.proposer, "sparse", None)


@dataclasses.dataclass(frozen=True)
class GenerationStats:
  num_new_tokens: int  # over the batch, EOS included
  rounds: int  # target forward passes after prefill, summed over the sequences still running
  mean_accepted_length: float  # tau: tokens per round after the first token (bonus included)
  prefill_seconds: float  # prefill, the first token and the proposer's start
  time_to_first_token_seconds: float  # from the call to the first token handed on (prefill included)
  decode_seconds: float  # the rounds, streaming included
  compile_seconds: float  # the decode loop's compilation (outside both timings)
  decode_compile_seconds: float  # compilations inside decode_seconds all the same (0: all compiled before)
  kv_cache_bytes: int  # the target's cache, allocated for prompt + new tokens
  proposer_state_bytes: int  # e.g. the draft's ring buffer
  tokens_per_second: float  # after the first token
  # every new token over prefill + decoding (the decode loop's compilation left out)
  end_to_end_tokens_per_second: float
  # the longest wait between two streamed chunks, the first token's among them (the decode
  # loop's compilation after it is a wait a reader sees)
  max_stream_gap_seconds: float
  chunks: int  # chunks of rounds streamed (each read back by the host; `auto`'s a call per run of one kind)
  # rounds by the tokens each emitted (0 .. the proposer's depth + 1), over the batch
  rounds_by_length: tuple[int, ...] = ()
  # `auto` (`auto.Adaptive`): rounds of each kind, their measured seconds per round,
  # and the decode time spent measuring them (0 when known from an earlier generation)
  rounds_by_kind: dict[str, int] | None = None
  # (and "switch": a change of kind; None: not measured yet)
  round_seconds_by_kind: dict[str, float | None] | None = None
  calibration_seconds: float = 0.0
  # the share of the cached K/V the verifier read, averaged over rounds (1.0: every round
  # read all of it; below 1 only under sparse verification, `Decoding.sparse`)
  kv_fraction_read: float = 1.0

  @property
  def acceptance_by_depth(self) -> list[float | None]:
    return acceptance_by_depth(self.rounds_by_length)


def acceptance_by_depth(rounds_by_length) -> list[float | None]:
  """Per tree depth d = 1 .. D, of the rounds that accepted a node at depth d - 1 (the
  root, for d = 1), the share that accepted one at depth d, from rounds counted by the
  tokens they emitted (`GenerationStats.rounds_by_length`; a round that emitted k tokens
  accepted depths 1 .. k - 1); None where no round reached depth d - 1. A depth a
  round's tree lacks (AR's, a short chain's) counts as not accepted."""
  reached = np.cumsum(np.asarray(rounds_by_length)[::-1])[::-1]  # [k]: rounds that emitted >= k tokens
  return [float(reached[d + 1] / reached[d]) if reached[d] else None for d in range(1, len(reached) - 1)]


@dataclasses.dataclass(frozen=True)
class GenerationResult:
  token_ids: list[list[int]]  # generated ids per sequence, EOS included when emitted
  stats: GenerationStats
  state: DecodeState  # the final state (its caches stay allocated while it is held)


def sequence_stats(new_tokens: int, rounds_by_length) -> dict:
  """One sequence's stats from its new tokens and its rounds by the tokens each emitted
  (`DecodeState.rounds_by_length`'s row): the rounds it ran in (before it was done), its
  tau and its acceptance by depth."""
  rounds = int(np.sum(rounds_by_length))
  return {
    "num_new_tokens": new_tokens,
    "rounds": rounds,
    "mean_accepted_length": (new_tokens - 1) / rounds if rounds else 1.0,
    "acceptance_by_depth": acceptance_by_depth(rounds_by_length),
  }


@dataclasses.dataclass(frozen=True)
class Started:
  """What `start` returns: the decode state after prefill, the first token of each
  sequence [B], and the seconds prefill took."""

  state: DecodeState
  first: np.ndarray
  prefill_seconds: float


def _left_aligned(prompts: Sequence[Sequence[int]], width: int) -> np.ndarray:
  """Prompts as rows of a zero-padded int32 array [B, width]."""
  rows = np.zeros((len(prompts), width), np.int32)
  for row, prompt in zip(rows, prompts):
    row[: len(prompt)] = prompt
  return rows


@gemm.jit(static_argnames=("graphdef", "first"), donate_argnames=("cache",))
def _prefill_chunk(graphdef, params, cache: KVCache, tokens, start, prompt_lengths, last_hidden, first: bool):
  """Runs prompt tokens [B, C] at positions start..start+C; keeps each sequence's hidden
  state at its last prompt token in `last_hidden [B, E]`. The `first` chunk (start 0, the
  cache still empty) attends causally over its own tokens alone (`Transformer.__call__`
  without a mask: a fused causal pass on a GPU), the later ones over the cache too."""
  model = nnx.merge(graphdef, params)
  chunk = tokens.shape[1]
  positions = start + jnp.broadcast_to(jnp.arange(chunk), tokens.shape)  # [B, C]
  valid = positions < prompt_lengths[:, None]
  hidden, cache = model(tokens, positions, None if first else causal_block_mask(positions, valid), cache)
  last = prompt_lengths - 1 - start  # [B]: index of the last prompt token in this chunk
  here = (last >= 0) & (last < chunk)
  picked = jnp.take_along_axis(hidden, jnp.clip(last, 0, chunk - 1)[:, None, None], axis=1)[:, 0]
  last_hidden = jnp.where(here[:, None], picked, last_hidden)
  return cache.advance(jnp.sum(valid, axis=1, dtype=jnp.int32)), last_hidden


def prefill_chunk_tokens(batch: int) -> int:
  """Prompt tokens of each sequence a prefill pass takes: on a GPU whole prompts up to
  32k tokens over the batch (one pass: its attention is a fused causal pass, memory linear
  in the tokens, and every pass costs each layer's launches again: 512-token chunks took
  ~15x the compute floor of a 3k-token SmolLM2 prompt on an H100); elsewhere 512 (the
  reference attention holds a pass's scores, tokens x keys)."""
  return max(512, 32768 // batch) if backend.on_gpu() else 512


def prefill_width(tokens: int, per_octave: int = 8) -> int:
  """The padded length of a pass over prompts of `tokens` tokens: the next of `per_octave`
  steps (a power of two) per power of two, at least 16. With eight, a pass computes at most
  1/8 more than the prompt (a power of two padded a 3,072-token prompt to 4,096) and every
  length of one octave shares eight compiled programs; with one, a width is a power of
  two, few enough programs to compile them all before they are met (`Slots.compile_group`)."""
  step = 1 << max(4, (tokens - 1).bit_length() - per_octave.bit_length())
  return -(-tokens // step) * step


def prefill(
  model: Transformer,
  prompts: Sequence[Sequence[int]],
  max_len: int,
  chunk: int | None = None,
  on_progress: Callable[[int, int], None] | None = None,
  prefix: KVCache | None = None,
  per_octave: int = 8,
):
  """Fills a new cache with the prompts in passes of `chunk` tokens a sequence (default
  `prefill_chunk_tokens`); returns (cache, hidden [B, E] at each last prompt token). The
  last pass is only as wide as `prefill_width` of what is left (a 640-token prompt in
  512-token passes computes 512 + 128 tokens, not 1,024). `on_progress(done, total)` is
  called after each pass has run (which then waits for the device pass by pass, instead of
  queueing them all). `prefix`: a cache of `max_len` that already holds the K/V of each
  prompt's first `prefix.lengths` tokens (the same count for all, fewer than any prompt
  has), which the passes continue from. `per_octave`: the widths a pass is padded to
  (`prefill_width`)."""
  graphdef, params = nnx.split(model)
  lengths = np.array([len(p) for p in prompts], np.int32)
  longest = int(lengths.max())
  chunk = chunk or prefill_chunk_tokens(len(prompts))
  held = 0  # prompt tokens the cache holds already, the same for every prompt
  if prefix is not None:
    counts = np.asarray(prefix.lengths)
    if prefix.max_len != max_len or np.any(counts != counts[0]) or counts[0] >= lengths.min():
      raise ValueError(
        f"a prefix must hold as many positions as the cache ({max_len}) and the same count of each prompt's"
        f" first tokens, fewer than any prompt has; got {prefix.max_len} positions holding {counts.tolist()}."
      )
    held = int(counts[0])
  passes = [(start, min(chunk, prefill_width(longest - start, per_octave))) for start in range(held, longest, chunk)]
  padded = _left_aligned(prompts, held + sum(width for _, width in passes))
  cache = KVCache.create(model.config, len(prompts), max_len, model.dtype) if prefix is None else prefix
  last_hidden = np.zeros((len(prompts), model.config.hidden_size), model.dtype)  # (the first pass's input)
  for start, width in passes:
    cache, last_hidden = _prefill_chunk[model.compilation()](
      graphdef, params, cache, padded[:, start : start + width], start, lengths, last_hidden, first=start == 0
    )
    if on_progress:
      jax.block_until_ready(last_hidden)
      on_progress(min(start + width, longest), longest)
  return cache, last_hidden


def prefill_passes(longest: int, chunk: int, per_octave: int = 8) -> set[tuple[int, bool]]:
  """Each (width, first) of the passes `prefill` runs over prompts of up to `longest`
  tokens in passes of `chunk` (with no prefix): the compiled programs they take."""
  width = lambda tokens: min(chunk, prefill_width(tokens, per_octave))
  firsts = {(width(n), True) for n in range(1, longest + 1)}
  return firsts | {(width(n), False) for n in range(1, longest - chunk + 1)}


def compile_prefill(model: Transformer, batch: int, max_len: int, passes: Iterable[tuple[int, bool]]) -> None:
  """Compiles `prefill`'s passes over `batch` prompts into a cache of `max_len` positions,
  each (width, first) of `passes`, running none: ahead of time and several at once (XLA
  releases the GIL while it compiles; a pass of another width is another program)."""
  graphdef, params = nnx.split(model)
  cache = jax.eval_shape(lambda: KVCache.create(model.config, batch, max_len, model.dtype))
  lengths = jax.ShapeDtypeStruct((batch,), jnp.int32)
  hidden = jax.ShapeDtypeStruct((batch, model.config.hidden_size), model.dtype)
  program = _prefill_chunk[model.compilation()]

  def one(width_first: tuple[int, bool]) -> None:
    width, first = width_first
    tokens = jax.ShapeDtypeStruct((batch, width), jnp.int32)
    program.lower(graphdef, params, cache, tokens, 0, lengths, hidden, first=first).compile()

  with ThreadPoolExecutor() as pool:
    list(pool.map(one, sorted(passes)))


@gemm.jit(static_argnames=("graphdef", "proposer"))
def _start_proposer(graphdef, params, proposer, proposer_params, cache, history, carried):
  """The proposer's state after prefill; `carried`: a multi-kind proposer's gains learnt
  and prices (`generate`), set in the same program ({} for other proposers)."""
  model = nnx.merge(graphdef, params)
  return proposer.start(proposer_params, target=model, cache=cache, history=history, **carried)


def token_limits(prompts: Sequence, max_new_tokens: int | Sequence[int]) -> tuple[int, ...]:
  """New tokens each sequence may emit: one limit for all, or one a prompt."""
  if isinstance(max_new_tokens, int):
    return (max_new_tokens,) * len(prompts)
  if len(max_new_tokens) != len(prompts):
    raise ValueError(f"{len(max_new_tokens)} token limits for {len(prompts)} prompts: give one a prompt, or one int.")
  return tuple(int(n) for n in max_new_tokens)


def cache_length(prompts: Sequence[Sequence[int]], max_new_tokens: int | Sequence[int], proposer) -> int:
  """Positions the cache holds: the longest prompt with its new tokens, and one verified
  tree, rounded up to a multiple of 128."""
  longest = max(len(p) + n for p, n in zip(prompts, token_limits(prompts, max_new_tokens)))
  return -(-(longest + verified_size(proposer)) // 128) * 128


def verified_size(proposer) -> int:
  """Nodes a round verifies: the proposer's tree, padded to rows the target's products
  take as they are (`gemm.aligned_rows`)."""
  return gemm.aligned_rows(proposer.tree_size)


def propose(model: Transformer, proposer, proposer_params, state: DecodeState):
  """One round's tree [B, `verified_size`] and the proposer's next state, from the decode
  state."""
  tree, proposal = proposer.propose(
    proposer_params, state.proposal, target=model, cache=state.cache, history=state.history, root=_live_root(state)
  )
  return tree.padded(verified_size(proposer)), proposal


def _live_root(state: DecodeState) -> jax.Array:
  """The roots [B] a round grows from: finished sequences carry on with a dummy one."""
  return jnp.maximum(state.root, 0)


@gemm.jit(static_argnames=("graphdef", "decoding", "max_rounds", "kind"), donate_argnames=("state",))
def _decode_chunk(
  graphdef, params, state: DecodeState, decoding: Decoding, proposer_params, limit, rounds, max_rounds, kind=None
):
  """Up to `rounds` (<= `max_rounds`, a traced count: chunks of any size share one
  compilation) propose -> verify -> accept -> commit rounds on device, until every
  sequence is done; `auto`'s rounds of one `kind` (an index in its `kinds`) until the choice
  changes kind, or with no `kind` its rounds of every kind (`_one_program`). Returns the
  new state, this chunk's tokens [B, max_rounds * N] (each row's tokens first, PAD_ID
  after them) and whether every sequence is now done."""
  model = nnx.merge(graphdef, params)
  proposer, sampling = decoding.proposer, decoding.sampling
  eos_ids = state.eos
  batch = state.root.shape[0]
  size = verified_size(proposer)  # the nodes of the largest tree a round verifies
  width = max_rounds * size
  rows = jnp.arange(batch)[:, None]
  first_round = state.rounds

  def cond(carry):
    state, _, _ = carry
    return (state.rounds < first_round + rounds) & ~jnp.all(state.done)

  def one_round(state, step_key, make_tree):
    """propose -> verify -> accept for the tree `make_tree()` returns: the accepted path
    and the new tokens [B, N] at the tree's own size (padded to the largest tree's, an AR
    round of `auto` moved its one node's K/V as a whole tree's path, a gather before a
    scatter, and XLA copied the K/V cache every round to do it)."""
    # (Named scopes: `python -m lab.profile` charges device time to them.)
    with jax.named_scope("propose"):
      tree, proposal = make_tree()
      tree = tree.padded(gemm.aligned_rows(tree.size))  # (`propose`'s trees are already)
    with jax.named_scope("verify"):
      logits, ancestors, cache = verify(model, tree, state.cache, decoding.sparse, ~state.done)  # logits [B, N, V]
      read = fraction_read(tree.kept, state.cache.lengths, decoding.sparse, model.config.num_layers)  # [B]
    with jax.named_scope("accept"):
      seen = _recent_at_nodes(tree, ancestors, state, sampling, logits.shape[-1]) if sampling.penalized else None
      if sampling.greedy or sampling.draw is Draw.POSITION:  # the target's own token after each node
        after = state.cache.lengths[:, None] + tree.depths + 1  # [B, N]: its position
        drawn = sample(logits, step_key, sampling, seen, after, state.rows)
        acceptance = accept_greedy(tree, drawn, ancestors)
      else:
        acceptance = accept_sampled(tree, probs(logits, seen, sampling), ancestors, step_key)
      new = emitted_tokens(tree, acceptance)  # [B, N]
    finite = jnp.all(jnp.isfinite(logits), axis=(1, 2))
    return acceptance.path, acceptance.count, new, cache, finite, proposal, read

  def commit(state, key, round_result, out, written):
    """The state after a round's `round_result` (one_round's), its tokens appended to `out`."""
    path, accepted, new, cache, finite, proposal, read = round_result
    with jax.named_scope("commit"):
      # Keep tokens up to the first EOS and the token limit; finished sequences keep none.
      index = jnp.arange(new.shape[1])[None, :]
      is_eos = jnp.isin(new, eos_ids) & (index < accepted[:, None])
      first_eos = jnp.min(jnp.where(is_eos, index, size), axis=1)
      count = jnp.minimum(jnp.minimum(accepted, first_eos + 1), limit - state.emitted)
      count = jnp.where(state.done, 0, count)
      keep = index < count[:, None]

      lengths = cache.lengths
      cache = cache.commit_path(path, count)
      slots = jnp.where(keep, lengths[:, None] + 1 + index, state.history.shape[1])  # past the end: dropped
      history = state.history.at[rows, slots].set(new, mode="drop")
      out = out.at[rows, jnp.where(keep, written[:, None] + index, width)].set(new, mode="drop")
      last = jnp.take_along_axis(new, jnp.maximum(count - 1, 0)[:, None], axis=1)[:, 0]
      emitted = state.emitted + count
      new_state = DecodeState(
        cache=cache,
        history=history,
        root=jnp.where(count > 0, last, state.root),
        done=state.done | (first_eos < count) | (emitted >= limit),
        emitted=emitted,
        rounds=state.rounds + 1,
        rounds_by_length=state.rounds_by_length.at[rows[:, 0], count].add((~state.done).astype(jnp.int32), mode="drop"),
        kv_read=state.kv_read + jnp.where(state.done, 0.0, read),
        key=key,
        nonfinite=state.nonfinite | (~state.done & ~finite),
        proposal=proposal,
        rows=state.rows,
        eos=state.eos,
      )
    return new_state, out, written + count

  out = jnp.full((batch, width), PAD_ID, jnp.int32)
  written = jnp.zeros((batch,), jnp.int32)
  if not decoding.multi_kind:

    def body(carry):
      state, out, written = carry
      key, step_key = round_keys(state.key, sampling)
      result = one_round(state, step_key, functools.partial(propose, model, proposer, proposer_params, state))
      return commit(state, key, result, out, written)

    state, out, _ = jax.lax.while_loop(cond, body, (state, out, written))
    return state, out, jnp.all(state.done)

  # `auto`: each round's kind is chosen after the round before. With a `kind`, this call's
  # rounds are all of it, and the loop ends where the choice changes kind (the host then
  # calls that kind's program, `_Rounds`); without one, one program holds a loop per kind
  # and runs them in turn, each running while the choice is its kind (`_one_program`).
  def plan(state):
    return proposer.plan(state.proposal, cache=state.cache, history=state.history, done=state.done)

  def kind_body(kind):
    def body(carry):
      state, out, written, chosen = carry
      key, step_key = round_keys(state.key, sampling)
      make_tree = functools.partial(
        proposer.propose,
        proposer.kinds[kind],
        proposer_params,
        state.proposal,
        chosen,
        target=model,
        cache=state.cache,
        history=state.history,
        root=_live_root(state),
      )
      result = one_round(state, step_key, make_tree)
      committed, out, written = commit(state, key, result, out, written)
      proposal = proposer.observe(
        committed.proposal, chosen, result[1], ~state.done, history=committed.history, lengths=committed.cache.lengths
      )
      return dataclasses.replace(committed, proposal=proposal), out, written, plan(committed)

    return body

  def kind_loop(kind):
    return functools.partial(jax.lax.while_loop, lambda c: cond(c[:3]) & (c[3].kind == kind), kind_body(kind))

  carry = (state, out, written, plan(state))
  if kind is None:

    def each_kind(carry):  # (every kind's loop in turn: those of other kinds than the chosen one run no round)
      for k in range(len(proposer.kinds)):
        carry = kind_loop(k)(carry)
      return carry

    carry = jax.lax.while_loop(lambda c: cond(c[:3]), each_kind, carry)
  else:
    carry = kind_loop(kind)(carry)
  state, out, _, chosen = carry
  state = dataclasses.replace(state, proposal=dataclasses.replace(state.proposal, next_kind=chosen.kind))
  return state, out, jnp.all(state.done)


def _one_program() -> bool:
  """Whether `auto`'s rounds of every kind run in one program (its kinds' loops in turn
  inside one loop) rather than as a program per kind that the host calls where the choice
  changes kind. The loops run one after another, not under a switch: XLA copied the K/V
  cache into and out of a switch's branches, a copy of the whole cache per change of kind
  (at 64 sequences of 4k tokens SmolLM2's cache is 6.8 GB), where loops in turn pass it
  on in place, at the price of a loop condition per kind that runs no round. A call from
  the host costs set-up, graph updates and a read-back: on a GPU the dearer (~2.5 ms on
  an H100 with SmolLM2, two of its AR steps); on a CPU ~4.5 ms of a ~50 ms round, where the
  nested loops measured dearer (~47 ms a chunk, beside the switch's copies then)."""
  return backend.on_gpu()


def _recent_at_nodes(tree, ancestors, state: DecodeState, sampling: SamplingConfig, vocab: int) -> jax.Array:
  """The contextual penalty's tokens [B, N, V] after each tree node: the sequence up to
  the root, then the node's path."""
  depth = max(tree.size - 1, 1)
  below = tree.depths[:, :, None] == jnp.arange(1, depth + 1)[None, None, :]  # [B, N, D]
  on_path = ancestors[..., None] & below[:, None, :, :]  # [B, node, ancestor, D]
  tail = jnp.max(jnp.where(on_path, tree.tokens[:, None, :, None], -1), axis=2)  # [B, N, D]
  return recent_tokens(state.history, state.cache.lengths, tail, sampling, vocab)


@gemm.jit(static_argnames=("graphdef", "sampling"))
def _first_token(graphdef, params, last_hidden, key, sampling, history, lengths, rows):
  logits = nnx.merge(graphdef, params).logits(last_hidden)
  seen = None
  if sampling.penalized:  # the prompt's last tokens
    tail = jnp.full((history.shape[0], 1, 1), -1, jnp.int32)
    seen = recent_tokens(history, lengths - 1, tail, sampling, logits.shape[-1])[:, 0]
  return sample(logits, key, sampling, seen, lengths, rows), ~jnp.all(jnp.isfinite(logits), axis=-1)


def check_capacity(config, prompts: Sequence[Sequence[int]], max_new_tokens: int | Sequence[int]) -> None:
  """Each prompt is not empty and fits the model's context with its new tokens (one limit
  for all, or one a prompt)."""
  if not prompts or any(len(p) == 0 for p in prompts):
    raise UserError("the prompt is empty; give at least one token of text.")
  for prompt, limit in zip(prompts, token_limits(prompts, max_new_tokens)):
    if limit < 1:
      raise UserError(f"at least 1 new token must be asked for, got {limit}.")
    if len(prompt) + limit > config.max_position_embeddings:
      raise UserError(
        f"the prompt ({len(prompt)} token{'' if len(prompt) == 1 else 's'}) plus {limit} new"
        f" token{'' if limit == 1 else 's'} exceeds the model's context of"
        f" {config.max_position_embeddings} tokens."
      )


def check_invariant_depth(model: Transformer, proposer) -> None:
  """Batch-invariant decoding takes a query's last RECENT positions from its own path, so
  its trees must be shallower than that."""
  from pallas_kernels.hybrid import RECENT

  if model.batch_invariant and proposer.depth >= RECENT:
    raise UserError(
      f"batch-invariant decoding verifies trees at most {RECENT - 1} tokens deep; this proposer's"
      f" trees reach depth {proposer.depth}."
    )


def start(
  model: Transformer,
  prompts: Sequence[Sequence[int]],
  max_new_tokens: int | Sequence[int],
  decoding: Decoding = Decoding(),
  proposer_params: Any = None,
  *,
  seed: int | Sequence[int] = 0,
  prefill_chunk: int | None = None,
  on_prefill: Callable[[int, int], None] | None = None,
  carried: dict | None = None,
  positions: int | None = None,
  prefix: KVCache | None = None,
  temperatures: Sequence[float] | None = None,
  top_ps: Sequence[float] | None = None,
  per_octave: int = 8,
) -> Started:
  """Prefill, the first token of each sequence, and the proposer's start: the state that
  `decode_chunk` continues. The cache holds `positions` (default `cache_length`). `max_new_tokens`:
  one limit for all, or one a prompt. `seed`: one a prompt,
  or one int, row b then drawing with seed + b (`generate`). `carried`: what a multi-kind
  proposer starts from (`MultiKind.start`'s `learnt` and `seconds`). `prefix`: a cache
  already holding the prompts' first tokens (`prefill`), which prefill continues from.
  `temperatures`, `top_ps`: one a prompt, each sequence's own in place of the config's
  (either alone: the config's for the other; `SamplingConfig.per_sequence`). `per_octave`:
  the widths prefill's passes are padded to (`prefill_width`)."""
  check_capacity(model.config, prompts, max_new_tokens)
  check_invariant_depth(model, decoding.proposer)
  graphdef, params = nnx.split(model)
  needed = cache_length(prompts, max_new_tokens, decoding.proposer)
  max_len = positions or needed
  if needed > max_len:
    raise UserError(f"the prompt and its new tokens need a cache of {needed} positions; this one holds {max_len}.")
  seeds = [seed + row for row in range(len(prompts))] if isinstance(seed, int) else list(seed)
  if len(seeds) != len(prompts):
    raise ValueError(f"{len(seeds)} seeds for {len(prompts)} prompts: give one a prompt, or one int.")
  key, first_key = generation_keys(seeds, decoding.sampling)
  rows = per_sequence_sampling(decoding.sampling, len(prompts), temperatures, top_ps)
  t0 = time.perf_counter()
  cache, last_hidden = prefill(model, prompts, max_len, prefill_chunk, on_prefill, prefix, per_octave)
  history = _left_aligned(prompts, max_len)
  lengths = [len(p) for p in prompts]
  root, nonfinite = _first_token[model.compilation()](
    graphdef,
    params,
    last_hidden,
    first_key,
    decoding.sampling,
    history,
    np.asarray(lengths, np.int32),
    rows,
  )
  first = np.asarray(root)
  history[np.arange(len(prompts)), lengths] = first  # the root follows its prompt
  history = jax.device_put(history)
  proposal = _start_proposer[model.compilation()](
    graphdef, params, decoding.proposer, proposer_params, cache, history, carried or {}
  )
  jax.block_until_ready(proposal)
  limits = np.asarray(token_limits(prompts, max_new_tokens), np.int32)
  state = _started_state(
    cache, history, root, limits, key, nonfinite, proposal, decoding.proposer.depth, rows, decoding.eos_array()
  )
  return Started(state=state, first=first, prefill_seconds=time.perf_counter() - t0)


@functools.partial(jax.jit, static_argnames="depth")
def _started_state(cache, history, root, limits, key, nonfinite, proposal, depth: int, rows, eos) -> DecodeState:
  """`DecodeState.start` with each row done where its root is an EOS or its limit
  `limits` [B] is one token, in one program: each array made outside one is a dispatch
  of its own (~0.2 ms on an H200), and a request's start would make two dozen."""
  done = jnp.isin(root, eos) | (limits == 1)
  return DecodeState.start(cache, history, root, done, key, nonfinite, proposal, depth, rows, eos)


def per_sequence_sampling(
  sampling: SamplingConfig, batch: int, temperatures: Sequence[float] | None, top_ps: Sequence[float] | None
) -> RowSampling | None:
  """Each of `batch` sequences' own temperature and top-p (the config's where one list is
  not given); None when neither is."""
  if temperatures is None and top_ps is None:
    return None
  temperatures = [sampling.temperature] * batch if temperatures is None else list(temperatures)
  top_ps = [sampling.top_p] * batch if top_ps is None else list(top_ps)
  if len(temperatures) != batch or len(top_ps) != batch:
    raise ValueError(f"{len(temperatures)} temperatures, {len(top_ps)} top-p values for {batch} prompts: one a prompt.")
  return sampling.per_sequence(temperatures, top_ps)


def decode_chunk(
  model: Transformer,
  state: DecodeState,
  decoding: Decoding = Decoding(),
  proposer_params: Any = None,
  *,
  max_new_tokens: int | Sequence[int],
  rounds: int,
  max_rounds: int = MAX_ROUNDS_PER_CHUNK,
):
  """Up to `rounds` rounds from `state` (donated) on device, stopping early when every
  sequence is done. Returns (state, tokens [B, n] with PAD_ID where there is none,
  whether every sequence is done). Chunks of any `rounds` <= `max_rounds` share one
  compilation, as do any token limits (one for all, or one a sequence)."""
  return _chunk_rounds(model, state, decoding, proposer_params, max_new_tokens, max_rounds)(state, rounds)


def compile_chunk(
  model: Transformer, state: DecodeState, decoding: Decoding = Decoding(), proposer_params: Any = None
) -> None:
  """Compiles the programs `decode_chunk` runs for `state`'s shapes (for `auto` off a GPU,
  every kind's), running none: a server compiles before its first request does."""
  _chunk_rounds(model, state, decoding, proposer_params, 1, MAX_ROUNDS_PER_CHUNK).compile(state)


def _chunk_rounds(model, state, decoding, proposer_params, max_new_tokens, max_rounds) -> _Rounds:
  graphdef, params = nnx.split(model)
  return _Rounds(
    _decode_chunk[model.compilation(rounds=True)],
    graphdef,
    params,
    decoding,
    proposer_params,
    token_limits(state.root, max_new_tokens),
    max_rounds,
  )


@dataclasses.dataclass(frozen=True)
class _Rounds:
  """Runs a chunk of rounds (`_decode_chunk`): one call, or for `auto` off a GPU one call
  per run of rounds of one kind, each kind its own program (a plain loop, as prompt
  lookup's): the round before chooses the next one's kind on device, and the host reads
  it back and calls that kind's program where it changes (`_one_program`)."""

  decode_fn: Callable
  graphdef: Any
  params: Any
  decoding: Decoding
  proposer_params: Any
  limits: tuple[int, ...]  # new tokens each sequence may emit
  max_rounds: int

  def args(self, state: DecodeState, rounds: int, kind: int | None = None) -> tuple:
    """`_decode_chunk`'s arguments, the counts as traced int32 (any value, one compilation)."""
    return (
      self.graphdef,
      self.params,
      state,
      self.decoding,
      self.proposer_params,
      np.asarray(self.limits, np.int32),
      np.int32(rounds),
      self.max_rounds,
      kind,
    )

  @property
  def kinds(self) -> list[int | None]:
    """The programs: one per kind (its index) for `auto` off a GPU (`_one_program`), else
    one (None)."""
    proposer = self.decoding.proposer
    per_kind = self.decoding.multi_kind and not _one_program()
    return list(range(len(proposer.kinds))) if per_kind else [None]

  def compile(self, state: DecodeState) -> None:
    for kind in self.kinds:
      self.decode_fn.lower(*self.args(state, 1, kind)).compile()

  def __call__(self, state: DecodeState, rounds: int):
    if self.kinds == [None]:
      return self.decode_fn(*self.args(state, rounds))
    tokens, left = [], rounds
    ran, kind = jax.device_get((state.rounds, state.proposal.next_kind))  # (one read-back a call)
    while True:  # (a call whose kind was not the choice runs no round and reads the choice)
      state, out, finished = self.decode_fn(*self.args(state, left, int(kind)))
      tokens.append(out)
      now, kind, done = jax.device_get((state.rounds, state.proposal.next_kind, finished))
      left, ran = left - (now - ran), now
      if left <= 0 or done:  # (tokens joined on the host, where they are read next: jnp's
        # concatenate compiles anew for each count of calls, inside a generation's time)
        return state, tokens[0] if len(tokens) == 1 else np.concatenate(jax.device_get(tokens), axis=1), finished


@dataclasses.dataclass(frozen=True)
class _Chunk:
  """A dispatched chunk of rounds: its state, tokens and done flag (on device), its
  rounds, when it was dispatched, and when it was done if the call itself waited for
  that. On a GPU it does: XLA steps the rounds' while loop from the host, so the call
  returns when the loop has run (measured on an H100: every chunk of 1 to 32 rounds was
  ready at return); elsewhere it returns at once. Chunk sizes come from the time a chunk
  took, which is thus known at return, or else when its tokens arrive."""

  state: DecodeState
  tokens: jax.Array | np.ndarray  # [B, n] (`_Rounds` joins a chunk of several calls on the host)
  finished: jax.Array
  rounds: int
  started: float
  done_at: float | None

  @classmethod
  def run(cls, decode_fn, args, rounds: int) -> _Chunk:
    started = time.perf_counter()
    state, tokens, finished = decode_fn(*args)
    ready = not isinstance(tokens, jax.Array) or tokens.is_ready()  # (on the host already: `_Rounds`)
    return cls(state, tokens, finished, rounds, started, time.perf_counter() if ready else None)


def rounds_in(per_round: float | None, seconds: float | None = None) -> int:
  """Rounds for a chunk of about `seconds` (default `CHUNK_SECONDS`) at `per_round`
  seconds a round (one while the pace is unknown)."""
  if per_round is None:
    return 1
  return int(np.clip((CHUNK_SECONDS if seconds is None else seconds) / max(per_round, 1e-9), 1, MAX_ROUNDS_PER_CHUNK))


def generate(
  model: Transformer,
  prompts: Sequence[Sequence[int]],
  max_new_tokens: int | Sequence[int],
  decoding: Decoding = Decoding(),
  proposer_params: Any = None,
  *,
  seed: int | Sequence[int] = 0,
  prefill_chunk: int | None = None,
  rounds_per_chunk: int | None = None,
  on_tokens: Callable[[np.ndarray], None] | None = None,
  on_prefill: Callable[[int, int], None] | None = None,
  memory: Memory | None = None,
  temperatures: Sequence[float] | None = None,
  top_ps: Sequence[float] | None = None,
) -> GenerationResult:
  """Decodes a batch of prompts with `decoding.proposer`'s trees (its arrays:
  `proposer_params`) verified by the target; the AR baseline is the one-node tree.
  `max_new_tokens`: one limit for all, or one a prompt.
  `on_tokens` receives each chunk of new tokens [B, n] (PAD_ID marks no token) as soon as
  it is on the host; a chunk is `rounds_per_chunk` rounds, by default as many as run in
  about `CHUNK_SECONDS`. `on_prefill(done, total)` reports prefill progress in tokens.
  `memory`: what earlier generations left (`Memory`; default the process's `MEMORY`).
  Sampled, each row draws with its seed, one a prompt or for one int `seed + row`: under
  the default `Draw.POSITION` a row's text is a function of its prompt, its seed and the
  target, whatever the method (row b of a batch writes what that prompt writes alone with
  the same seed). `temperatures`, `top_ps`: one a prompt, each sequence's own (`start`)."""
  called = time.perf_counter()
  memory = MEMORY if memory is None else memory
  if rounds_per_chunk is not None and not 1 <= rounds_per_chunk <= MAX_ROUNDS_PER_CHUNK:
    raise ValueError(f"rounds_per_chunk must be in [1, {MAX_ROUNDS_PER_CHUNK}], got {rounds_per_chunk}.")
  key, table, carried = carried_state(
    memory,
    model,
    decoding,
    proposer_params,
    len(prompts),
    cache_length(prompts, max_new_tokens, decoding.proposer),
  )
  started = start(
    model,
    prompts,
    max_new_tokens,
    decoding,
    proposer_params,
    seed=seed,
    prefill_chunk=prefill_chunk,
    on_prefill=on_prefill,
    carried=carried,
    temperatures=temperatures,
    top_ps=top_ps,
  )
  state, first = started.state, started.first
  first_at = time.perf_counter()
  if on_tokens:
    on_tokens(first[:, None])
  graphdef, params = nnx.split(model)  # once, not per chunk
  limits = token_limits(prompts, max_new_tokens)
  run = _Rounds(
    _decode_chunk[model.compilation(rounds=True)],
    graphdef,
    params,
    decoding,
    proposer_params,
    limits,
    MAX_ROUNDS_PER_CHUNK,
  )
  tc = time.perf_counter()  # compile outside the timed region
  run.compile(state)
  compile_seconds = time.perf_counter() - tc

  with Compiles() as inside:  # (a compilation in there is timed as decoding: reported)
    t1 = time.perf_counter()
    chunks = [first[:, None]]
    pace_key = (decoding, len(prompts), model.config)
    rounds = rounds_per_chunk or rounds_in(memory.pace.get(pace_key))
    dispatched, pending, ready_at, max_gap = 0, None, first_at, 0.0
    previous_done = t1
    round_seconds, calibration_seconds = None, 0.0

    def emit(tokens: np.ndarray) -> None:
      """Hands a chunk on, counting the wait since the last one."""
      nonlocal ready_at, max_gap
      now = time.perf_counter()
      max_gap, ready_at = max(max_gap, now - ready_at), now
      chunks.append(tokens)
      if on_tokens:
        on_tokens(tokens)

    if decoding.multi_kind:  # the measured price of each kind of round
      if not table.complete:  # measured by the first rounds, which emit tokens as usual
        measured = prices.calibrate(decoding.proposer, run, state, emit, table)
        state, table, dispatched = measured.state, measured.prices, measured.rounds
        if measured.finished:
          dispatched = max(limits)  # every sequence finished: nothing left to dispatch
        memory.prices.remember(key, table)  # (a part too: the next generation goes on from it)
        previous_done = time.perf_counter()
        calibration_seconds = previous_done - t1
      round_seconds = list(table.seconds)

    def stream(chunk: _Chunk) -> bool:
      """Hands the chunk's tokens on, sizes the next chunks from its pace; whether every
      sequence is done."""
      nonlocal rounds, previous_done
      tokens = np.asarray(chunk.tokens)
      now = time.perf_counter()
      done_at = chunk.done_at or now
      finished = bool(chunk.finished)
      if not finished:  # (a chunk that finished may have run fewer rounds than it was given)
        memory.pace[pace_key] = max(done_at - max(chunk.started, previous_done), 1e-6) / chunk.rounds
        rounds = rounds_per_chunk or rounds_in(memory.pace[pace_key])
      previous_done = done_at
      emit(tokens)
      return finished

    while True:
      if pending is not None and pending.done_at is not None:  # done when its call returned (a GPU)
        if stream(pending):
          break
        pending = None
      launched = None
      if dispatched < max(limits):  # each round emits >= 1 token per unfinished sequence
        launched = _Chunk.run(run, (state, rounds), rounds)
        state = launched.state
        dispatched += rounds
      if pending is not None and stream(pending):  # read while the device runs the next chunk
        break
      if launched is None:
        break
      pending = launched
    rounds_by_length = np.asarray(state.rounds_by_length)
    if bool(np.any(np.asarray(state.nonfinite))):
      raise UserError("the model produced NaN or infinite logits; the weights or the dtype are unsuitable.")
    decode_seconds = time.perf_counter() - t1
  if decoding.multi_kind:
    memory.learnt[(decoding, model.config)] = decoding.proposer.learnt(state.proposal)

  tokens = np.concatenate(chunks, axis=1)
  token_ids = [[int(t) for t in row if t != PAD_ID] for row in tokens]
  past = memory.past_for(model.config, decoding)
  for row in token_ids if past is not None else ():  # (for the next generations' prompt lookup)
    past.append(row)
  new_tokens = sum(len(r) for r in token_ids)
  rounds_done = int(rounds_by_length.sum())
  batch = len(prompts)
  stats = GenerationStats(
    num_new_tokens=new_tokens,
    rounds=rounds_done,
    mean_accepted_length=(new_tokens - batch) / rounds_done if rounds_done else 1.0,
    prefill_seconds=started.prefill_seconds,
    time_to_first_token_seconds=first_at - called,
    decode_seconds=decode_seconds,
    compile_seconds=compile_seconds,
    decode_compile_seconds=inside.seconds,
    kv_cache_bytes=state.cache.nbytes(),
    proposer_state_bytes=sum(x.nbytes for x in jax.tree.leaves(state.proposal)),
    tokens_per_second=(new_tokens - batch) / decode_seconds if decode_seconds > 0 else 0.0,
    end_to_end_tokens_per_second=new_tokens / (started.prefill_seconds + decode_seconds),
    max_stream_gap_seconds=max_gap,
    chunks=len(chunks) - 1,  # (the first token's is none)
    rounds_by_length=tuple(rounds_by_length.sum(axis=0).tolist()),
    **kind_stats(decoding, state.proposal, round_seconds),
    calibration_seconds=calibration_seconds,
    kv_fraction_read=float(np.sum(state.kv_read)) / rounds_done if rounds_done else 1.0,
  )
  return GenerationResult(token_ids=token_ids, stats=stats, state=state)


def carried_state(memory: Memory, model: Transformer, decoding: Decoding, proposer_params, batch: int, positions: int):
  """What a generation of `batch` sequences in a cache of `positions` starts from: for a
  multi-kind proposer (`auto`), the key of its round prices and their table (measured or
  not yet), else (None, None); and `start`'s `carried`: the gains earlier generations
  learnt and those prices (`auto`), the ring of past outputs (a proposer that searches
  one)."""
  past = memory.past_for(model.config, decoding)
  carried = {} if past is None else {"past": past.on_device()}
  if not decoding.multi_kind:
    return None, None, carried
  key = prices.cost_key(model, decoding.proposer, proposer_params, decoding.sampling, batch, positions)
  table = memory.prices.known(key) or prices.Prices.none(len(decoding.proposer.kinds) + 1)
  carried |= {
    "learnt": memory.learnt.get((decoding, model.config)) or decoding.proposer.nothing_learnt(),
    "seconds": np.asarray([np.nan if price is None else price for price in table.seconds], np.float32),
  }
  return key, table, carried


def kind_stats(decoding: Decoding, proposal, round_seconds, rounds_before=0) -> dict:
  """A multi-kind proposer's rounds by kind (those since `rounds_before`, [K]) and the
  measured seconds a round of each kind costs, for `GenerationStats`; {} for others."""
  if not decoding.multi_kind:
    return {}
  names = [kind.value for kind in decoding.proposer.kinds]
  return {
    "rounds_by_kind": dict(zip(names, (np.asarray(proposal.rounds_by_kind) - rounds_before).tolist())),
    "round_seconds_by_kind": None if round_seconds is None else dict(zip([*names, "switch"], round_seconds)),
  }
