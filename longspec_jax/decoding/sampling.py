"""Turning logits into the next token: the logit processors and sampling.

`SamplingConfig` is static under jit (new settings compile a new step); a batch whose
sequences ask for their own temperature and top-p carries them as arrays (`RowSampling`).
The processors define the target distribution every method must reproduce, and are
applied the same way wherever a distribution is formed (AR, drafting, verification):

1. TokenSwift's contextual penalty (paper Eq. 3): the logits of tokens among the last
   `penalty_window` tokens of the sequence (prompt included) are divided by `penalty`;
2. temperature;
3. top-k, then top-p (the smallest set of most likely tokens whose mass reaches p), then
   min-p (tokens at least min_p times the most likely one), each renormalizing.

At temperature 0 the choice is the argmax of the penalized logits (the other processors
never change it), so greedy decoding is exactly reproducible. Above it, `Draw` says how the
randomness is drawn; by default the sampled text too is a function of the seed, the prompt
and the target alone, whatever the method.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from longspec_jax.errors import UserError
from longspec_jax.ops.topk import top_k


class Draw(enum.StrEnum):
  """How a sampled token's randomness is drawn.

  POSITION: Gumbel-max with noise keyed by (seed, position): the token at position p is
  argmax(log P(x) + G_p(x)), G_p standard Gumbel noise drawn from the seed and p alone, so
  it is distributed as P and the text is a function of the seed, the prompt and the target,
  whatever the method and however its rounds fell. A speculative round accepts a drafted
  token where it equals the target's own draw there (`verify.accept_greedy` on the draws):
  for the deterministic trees every proposer here builds, each child is accepted with
  probability P(child), the acceptance law of STREAM's walk.
  STREAM: one random stream, split per round, and speculative sampling's walk over the tree
  (`verify.accept_sampled`): the same law, but the text depends on the rounds' schedule
  (a method or `auto`'s measured choice of kinds gives another text for the same seed)."""

  POSITION = "position"
  STREAM = "stream"


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
  temperature: float = 0.0
  top_k: int = 0  # 0: off
  top_p: float = 1.0  # 1: off
  min_p: float = 0.0  # 0: off
  penalty: float = 1.0  # theta of the contextual penalty; 1: off
  penalty_window: int = 1024  # W: how many of the latest tokens are penalized
  draw: Draw = Draw.POSITION

  def __post_init__(self):
    checks = [
      (0.0 <= self.temperature < math.inf, f"temperature must be finite and >= 0, got {self.temperature}"),
      (self.top_k >= 0, f"top_k must be >= 0 (0: off), got {self.top_k}"),
      (0.0 < self.top_p <= 1.0, f"top_p must be in (0, 1], got {self.top_p}"),
      (0.0 <= self.min_p < 1.0, f"min_p must be in [0, 1), got {self.min_p}"),
      (1.0 <= self.penalty < math.inf, f"penalty must be finite and >= 1 (1: off), got {self.penalty}"),
      (self.penalty_window >= 1, f"penalty_window must be >= 1, got {self.penalty_window}"),
    ]
    for ok, message in checks:
      if not ok:
        raise UserError(message + ".")

  @property
  def greedy(self) -> bool:
    return self.temperature == 0.0

  @property
  def penalized(self) -> bool:
    return self.penalty != 1.0

  def per_sequence(self, temperatures: Sequence[float], top_ps: Sequence[float]) -> RowSampling:
    """Each sequence's own temperature and top-p in place of this config's (a server's
    requests ask for their own), checked as this config's are (`check_rows`); the other
    processors and the draw stay this config's."""
    temperatures, top_ps = self.check_rows(temperatures, top_ps)
    return RowSampling(jnp.asarray(temperatures), jnp.asarray(top_ps), *_flags(temperatures, top_ps))

  def check_rows(self, temperatures: Sequence[float], top_ps: Sequence[float]) -> tuple[np.ndarray, np.ndarray]:
    """`per_sequence`'s check on the host alone: each row's settings valid as this config's,
    and this config drawing by position (the only draw whose text a row's own settings and
    seed decide). Returns them as [B] float32 arrays. A server checks each request with it
    before queuing it: touching the device there would wait behind the running prefill."""
    if self.draw is not Draw.POSITION:
      raise UserError("each sequence's own temperature and top-p need draws keyed by position (--draw position).")
    if len(temperatures) != len(top_ps):
      raise ValueError(f"{len(temperatures)} temperatures for {len(top_ps)} top-p values: give one a sequence.")
    for temperature, top_p in zip(temperatures, top_ps):
      dataclasses.replace(self, temperature=float(temperature), top_p=float(top_p))  # (raises UserError)
    return np.asarray(temperatures, np.float32), np.asarray(top_ps, np.float32)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class RowSampling:
  """Per-sequence temperature and top-p, [B] float32 each, that replace a `SamplingConfig`'s
  own (`SamplingConfig.per_sequence`): traced, so that sequences asking for different ones
  share a batch and a compilation. A row at temperature 0 is greedy.

  `sampled` (some row draws) and `nucleus` (some drawing row cuts to its top-p) are static:
  the host knows them, and a batch without draws compiles without them. Deciding them on
  the device instead (a `lax.cond` a round) has a GPU's host read the predicate between the
  round's CUDA graphs, every round."""

  temperature: jax.Array
  top_p: jax.Array
  sampled: bool = dataclasses.field(default=True, metadata=dict(static=True))
  nucleus: bool = dataclasses.field(default=True, metadata=dict(static=True))

  def flagged(self, live: np.ndarray | None = None) -> RowSampling:
    """The same rows with `sampled` and `nucleus` read from their values (a host read), over
    the rows `live` [B] bool marks (default all: rows that emit nothing may draw or not)."""
    live = np.ones(self.temperature.shape, bool) if live is None else live
    sampled, nucleus = _flags(np.asarray(self.temperature)[live], np.asarray(self.top_p)[live])
    return dataclasses.replace(self, sampled=sampled, nucleus=nucleus)

  def at(self, ndim: int) -> tuple[jax.Array, jax.Array]:
    """(temperature, top_p) shaped [B, 1, ...] to broadcast against arrays of `ndim` axes."""
    shape = (-1,) + (1,) * (ndim - 1)
    return self.temperature.reshape(shape), self.top_p.reshape(shape)


def _flags(temperatures: np.ndarray, top_ps: np.ndarray) -> tuple[bool, bool]:
  """(`RowSampling.sampled`, `nucleus`) of rows with these settings."""
  drawing = temperatures > 0
  return bool(drawing.any()), bool((drawing & (top_ps < 1.0)).any())


def penalize(logits: jax.Array, seen: jax.Array | None, config: SamplingConfig) -> jax.Array:
  """logits [..., V] with those of `seen` [..., V] tokens (recent ones) divided by theta."""
  if not config.penalized or seen is None:
    return logits
  return jnp.where(seen, logits / config.penalty, logits)


def log_probs(
  logits: jax.Array, seen: jax.Array | None, config: SamplingConfig, rows: RowSampling | None = None
) -> jax.Array:
  """The processed distribution as log-probabilities [B, ..., V] (-inf where removed), for
  temperature > 0; with `rows`, each row's temperature (a row at 0 divides by 1: its
  draw is the argmax, `sample`) and top-p in place of the config's."""
  if rows is None:
    temperature, top_p = config.temperature, config.top_p
  else:
    temperature, top_p = rows.at(logits.ndim)
    temperature = jnp.where(temperature > 0, temperature, 1.0)
  scores = jax.nn.log_softmax(penalize(logits.astype(jnp.float32), seen, config) / temperature, axis=-1)
  if config.top_k:
    kth = top_k(scores, min(config.top_k, scores.shape[-1]))[0][..., -1:]
    scores = jax.nn.log_softmax(jnp.where(scores >= kth, scores, -jnp.inf), axis=-1)
  if rows is None and top_p < 1.0:
    scores = _nucleus(scores, top_p)
  elif rows is not None and rows.nucleus:  # (the vocabulary's sort only where some row asks for it)
    scores = jnp.where(top_p < 1.0, _nucleus(scores, top_p), scores)
  if config.min_p > 0.0:
    floor = jnp.max(scores, axis=-1, keepdims=True) + jnp.log(config.min_p)
    scores = jax.nn.log_softmax(jnp.where(scores >= floor, scores, -jnp.inf), axis=-1)
  return scores


def _nucleus(scores: jax.Array, top_p) -> jax.Array:
  """Top-p of log-probabilities [..., V]: the smallest set of most likely tokens whose mass
  reaches top_p (a float, or an array broadcasting against [..., 1]), renormalized."""
  ordered = jnp.sort(scores, axis=-1)[..., ::-1]
  mass_before = jnp.cumsum(jnp.exp(ordered), axis=-1) - jnp.exp(ordered)  # mass of strictly likelier tokens
  cutoff = jnp.min(jnp.where(mass_before < top_p, ordered, jnp.inf), axis=-1, keepdims=True)
  return jax.nn.log_softmax(jnp.where(scores >= cutoff, scores, -jnp.inf), axis=-1)


def probs(logits: jax.Array, seen: jax.Array | None, config: SamplingConfig) -> jax.Array:
  return jnp.exp(log_probs(logits, seen, config))


def sample(
  logits: jax.Array,
  key: jax.Array,
  config: SamplingConfig,
  seen: jax.Array | None = None,
  positions: jax.Array | None = None,
  rows: RowSampling | None = None,
) -> jax.Array:
  """logits [B, ..., V] float32 -> token ids [B, ...] int32: the argmax when greedy, else
  a draw from the processed distribution, by `config.draw` the Gumbel-max draw for the
  token at `positions` [B, ...] (`key`: the rows' keys [B], the same for every position)
  or a categorical one from `key`. With `rows` (`SamplingConfig.per_sequence`, drawn by
  position), each row is greedy or draws by its own temperature and top-p; a batch of
  greedy rows (`RowSampling.sampled` false) draws no noise."""
  if rows is not None:
    greedy = jnp.argmax(penalize(logits, seen, config), axis=-1).astype(jnp.int32)
    if not rows.sampled:
      return greedy
    scores = log_probs(logits, seen, config, rows) + position_noise(key, positions, logits.shape[-1])
    drawn = jnp.argmax(scores, axis=-1).astype(jnp.int32)
    return jnp.where(rows.at(greedy.ndim)[0] > 0, drawn, greedy)
  if config.greedy:
    return jnp.argmax(penalize(logits, seen, config), axis=-1).astype(jnp.int32)
  scores = log_probs(logits, seen, config)
  if config.draw is Draw.POSITION:
    return jnp.argmax(scores + position_noise(key, positions, logits.shape[-1]), axis=-1).astype(jnp.int32)
  return jax.random.categorical(key, scores, axis=-1).astype(jnp.int32)


def position_noise(keys: jax.Array, positions: jax.Array, vocab: int) -> jax.Array:
  """Standard Gumbel noise [B, ..., V] for the tokens of row b at `positions` [B, ...]: a
  function of the row's key `keys` [B] and the position alone."""

  def row(key, at):
    noise = jax.vmap(lambda p: jax.random.gumbel(jax.random.fold_in(key, p), (vocab,), jnp.float32))
    return noise(at.reshape(-1)).reshape(*at.shape, vocab)

  return jax.vmap(row)(keys, positions)


@jax.jit
def _row_keys(seeds: jax.Array) -> jax.Array:
  """A key per seed [B] (uint32), in one program."""
  return jax.vmap(jax.random.key)(seeds)


def generation_keys(seeds: Sequence[int], config: SamplingConfig) -> tuple[jax.Array, jax.Array]:
  """(the key a generation's rounds start from, the first token's key) for rows drawing
  with `seeds` (one a row): under `Draw.POSITION` a key per row [B] from its seed, so a
  row draws as it would alone with its seed, in any batch; under `Draw.STREAM` one stream
  from the first seed, split."""
  if config.draw is Draw.POSITION:
    keys = _row_keys(np.asarray(np.asarray(seeds) % 2**32, np.uint32))
    return keys, keys
  key, first_key = jax.random.split(jax.random.key(seeds[0]))
  return key, first_key


def round_keys(key: jax.Array, config: SamplingConfig) -> tuple[jax.Array, jax.Array]:
  """(the key the next round starts from, this round's key): the stream split, or under
  `Draw.POSITION` the rows' keys as they are (their draws are keyed by position)."""
  if config.draw is Draw.POSITION:
    return key, key
  key, step_key = jax.random.split(key)
  return key, step_key


def recent_tokens(
  history: jax.Array, ends: jax.Array, tail: jax.Array, config: SamplingConfig, vocab: int
) -> jax.Array:
  """Which tokens the penalty sees [B, N, V] for N continuations of each sequence:
  continuation n is history [B, S] up to index ends [B] (inclusive) followed by its own
  tokens tail [B, N, D] (-1 where shorter: a tree node's path below the root). The
  window is the last `penalty_window` tokens of that."""
  batch, n, depth = tail.shape
  window = config.penalty_window
  length = jnp.sum(tail >= 0, axis=-1)  # [B, N]
  # Window slot j holds sequence index ends + length - window + 1 + j.
  index = (ends[:, None, None] + length[:, :, None] - window + 1) + jnp.arange(window)[None, None, :]  # [B, N, W]
  from_history = jnp.take_along_axis(
    history, jnp.clip(index, 0, history.shape[1] - 1).reshape(batch, -1), axis=1
  ).reshape(batch, n, window)
  tail_slot = jnp.clip(index - ends[:, None, None] - 1, 0, depth - 1)
  from_tail = jnp.take_along_axis(tail, tail_slot, axis=2)
  tokens = jnp.where(index > ends[:, None, None], from_tail, from_history)
  tokens = jnp.where(index >= 0, tokens, -1)  # before the sequence start: nothing
  seen = jnp.zeros((batch, n, vocab + 1), bool)
  b = jnp.arange(batch)[:, None, None]
  m = jnp.arange(n)[None, :, None]
  return seen.at[b, m, jnp.where(tokens >= 0, tokens, vocab)].set(True)[..., :vocab]
