"""Drafting from earlier requests' outputs: a bounded ring of the tokens that finished
generations wrote (`Past`, kept on the host by `engine.Memory`), searched on device by
each round's prompt lookup (`match_past`), SuffixDecoding-style.

Prompt lookup searches the request's own context; what a process wrote before (the answer
a user asks again after a small change, records of one schema one after another) is not
there. The ring holds the latest `size` tokens of outputs, each followed by a separator;
a round looks for the most recent earlier occurrence of the context's last n tokens (n
from `PAST_NGRAMS`' longest down; at least 4 tokens, since a short n-gram recurs by chance
in a long history) and proposes what followed it there, up to a separator. The search is a
comparison of every ring position per n-gram length, fused by XLA into one pass over the
ring per length: no index to keep consistent, and a ring of a million tokens is 4 MB.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

SEPARATOR = -1  # ends each output in the ring, and fills it before anything is written
PAST_NGRAMS = (8, 6, 4)  # the n-gram lengths searched, longest first
MIN_SIZE = max(PAST_NGRAMS) + 2  # the smallest ring: an n-gram, a token after it, a separator


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PastTokens:
  """The ring as a round reads it (on device)."""

  tokens: jax.Array  # [H] int32: outputs, each followed by SEPARATOR; the oldest overwritten first
  written: jax.Array  # [] int32: tokens written so far modulo H: where the next goes, the oldest sits


@dataclasses.dataclass
class Past:
  """The ring on the host, where finished generations append their outputs."""

  tokens: np.ndarray  # [H] int32
  written: int = 0

  @classmethod
  def empty(cls, size: int) -> Past:
    if size < MIN_SIZE:
      raise ValueError(f"a ring of past outputs holds at least {MIN_SIZE} tokens, got {size}.")
    return cls(np.full((size,), SEPARATOR, np.int32))

  @property
  def size(self) -> int:
    return self.tokens.shape[0]

  def append(self, output) -> None:
    """Writes `output`'s tokens and a separator after it (of an output longer than the ring,
    its last tokens)."""
    output = np.asarray(output, np.int32)[-(self.size - 1) :]
    written = np.concatenate([output, [SEPARATOR]]).astype(np.int32)
    at = (self.written + np.arange(written.shape[0])) % self.size
    self.tokens[at] = written
    self.written = int((self.written + written.shape[0]) % self.size)

  def on_device(self) -> PastTokens:
    return PastTokens(jnp.asarray(self.tokens), jnp.int32(self.written))


def match_past(past: PastTokens, history: jax.Array, end: jax.Array, num_tokens: int):
  """Each sequence's continuation from the ring: the tokens that followed the most recent
  earlier occurrence there of the context's last n tokens (history [B, S] holds each
  sequence's tokens up to and including index `end [B]`), n the longest of `PAST_NGRAMS`
  that occurs. An occurrence is a run of ring positions that neither wraps past the oldest
  token nor holds a separator, and that a token follows; its continuation stops at a
  separator or at the oldest token. Returns tokens [B, G], which are real [B, G] (G =
  `num_tokens`; none without an occurrence) and the n matched [B] (0: none)."""
  size = past.tokens.shape[0]
  count = end + 1  # tokens in the context, root included
  position = jnp.arange(size, dtype=jnp.int32)
  age = (position - past.written) % size  # [H]: 0 the oldest
  best_start = jnp.full(history.shape[:1], -1, jnp.int32)  # [B]: where the continuation starts in the ring
  best_n = jnp.zeros(history.shape[:1], jnp.int32)
  followed = jnp.roll(past.tokens, -1) != SEPARATOR  # [H]: a token comes after it (the newest is a separator)
  for n in (n for n in PAST_NGRAMS if n <= history.shape[1]):
    tail = jax.vmap(lambda h, c: jax.lax.dynamic_slice(h, (c - n,), (n,)))(history, jnp.maximum(count, n))  # [B, n]
    # The occurrence ending at each position: its n tokens are the n ring positions up to it.
    window = jnp.stack([jnp.roll(past.tokens, n - 1 - i) for i in range(n)], axis=-1)  # [H, n]
    # No wrap past the oldest, no separator, and a token after it.
    whole = (age >= n - 1) & jnp.all(window != SEPARATOR, axis=-1) & followed
    hit = jnp.all(window[None] == tail[:, None, :], axis=-1) & whole[None] & (count[:, None] >= n)  # [B, H]
    # The most recent occurrence: the greatest age; the continuation begins after it.
    newest = jnp.max(jnp.where(hit, age[None, :], -1), axis=-1)  # [B]
    found = (newest >= 0) & (best_n == 0)
    best_start = jnp.where(found, (newest + 1 + past.written) % size, best_start)
    best_n = jnp.where(found, n, best_n)
  offsets = best_start[:, None] + jnp.arange(num_tokens, dtype=jnp.int32)[None, :]  # [B, G]
  tokens = past.tokens[offsets % size]
  # Real until the first separator or the oldest token (age 0: the ring's end of recency).
  within = (jnp.arange(num_tokens)[None, :] < size - ((best_start - past.written) % size)[:, None]) & (
    best_start[:, None] >= 0
  )
  real = jnp.cumprod((within & (tokens != SEPARATOR)).astype(jnp.int32), axis=1).astype(bool)
  return tokens, real, best_n
