"""Drafting from earlier requests' outputs: a bounded ring of the tokens that finished
generations wrote (`Past`, kept on the host by `engine.Memory`), searched on device by
each round's prompt lookup (`match_past`), SuffixDecoding-style.

Prompt lookup searches the request's own context; what a process wrote before (the answer
a user asks again after a small change, records of one schema one after another) is not
there. The ring holds the latest `size` tokens of outputs, each followed by a separator;
a round looks for the latest earlier occurrences of the context's last n tokens (n from
`PAST_NGRAMS`' longest down; at least 4 tokens, since a short n-gram recurs by chance in a
long history) and proposes what followed them there, up to a separator, ranked by how often
it followed (`match_past`).

The host keeps, beside each ring position and for each n, a 32-bit key of the n tokens
ending there (`ngram_key`; 0 where they hold a separator or no token follows them), updated
where an output is written. The device holds each n's keys sorted with the positions' ages
(`PastTokens.index_keys`, `index_ends`), and a round's search counts the keys at most the
context's per n (`count_at_most`): the last entry of the context's key is its newest
occurrence. The count compares the key with every sqrt(H)-th entry, then with the entries of
the one block it falls in: about 2 sqrt(H) words a search (8 KB at a million tokens) in two
fused passes, where a binary search is 20 dependent steps, each its own kernels on a GPU.
Once outputs are written, the device takes out the entries of the positions they changed
and merges their new keys in as the newest (`_update`: a few passes over the index, the
tokens and keys written the only upload), instead of sorting the whole ring again: at a
million tokens a sort and upload after every output cost ~14 ms on an H200 (docs/results.md,
"Many prompts at once"). The chosen occurrence's tokens are compared with the context's, so
a key collision (about one in 2^31 positions) proposes nothing that round rather than
another text. A ring holds 4 bytes a token on the host and 28 on the device with its index:
a million tokens take 28 MB of device memory, twice while rounds read a copy.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from longspec_jax.decoding.tree import distinct_continuations

SEPARATOR = -1  # ends each output in the ring, and fills it before anything is written
PAST_NGRAMS = (8, 6, 4)  # the n-gram lengths searched, longest first
# Occurrences looked at per continuation sought, and how many of a continuation's first
# tokens its rank counts the agreement of (`match_past`).
CANDIDATES_PER_MATCH = 4
RANKED_PREFIX = 4
MIN_SIZE = max(PAST_NGRAMS) + 2  # the smallest ring: an n-gram, a token after it, a separator
MAX_SIZE = 2**30  # the largest: positions and ages are int32
_MULTIPLIER = 0x01000193  # FNV's prime: the keys' polynomial over the n tokens
_NO_TAIL = 2  # a context's key where it holds fewer than n tokens: even, so no position's (odd or 0)


def ngram_key(windows):
  """The key of each n-gram windows [..., n] (uint32, numpy or jax arrays alike): a
  polynomial of its tokens, mixed (a 32-bit finalizer) and made odd, so that 0 can mark
  the positions that hold none."""
  xp = jnp if isinstance(windows, jax.Array) else np
  key = xp.zeros(windows.shape[:-1], xp.uint32)
  for i in range(windows.shape[-1]):
    key = key * xp.uint32(_MULTIPLIER) + windows[..., i].astype(xp.uint32) + xp.uint32(1)
  key = (key ^ (key >> 16)) * xp.uint32(0x7FEB352D)
  key = (key ^ (key >> 15)) * xp.uint32(0x846CA68B)
  return (key ^ (key >> 16)) | xp.uint32(1)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PastTokens:
  """The ring as a round reads it (on device)."""

  tokens: jax.Array  # [H] int32: outputs, each followed by SEPARATOR; the oldest overwritten first
  index_keys: jax.Array  # [N, H] uint32: per n of PAST_NGRAMS, the positions' keys (`Past.keys`) ascending
  index_ends: jax.Array  # [N, H] int32: the position each of them ends at, the oldest first among equal keys
  written: jax.Array  # [] int32: tokens written so far modulo H: where the next goes, the oldest sits


@dataclasses.dataclass
class Past:
  """The ring on the host, where finished generations append their outputs."""

  tokens: np.ndarray  # [H] int32
  keys: np.ndarray  # [N, H] uint32 (`PastTokens.keys`)
  written: int = 0
  # The ring on the device as of `on_device`'s last call, and the tokens written since
  # (`written` - `unsent` is where they start):
  device: PastTokens | None = dataclasses.field(default=None, repr=False)
  unsent: int = 0

  @classmethod
  def empty(cls, size: int) -> Past:
    if not MIN_SIZE <= size <= MAX_SIZE:
      raise ValueError(f"a ring of past outputs holds {MIN_SIZE} to {MAX_SIZE} tokens, got {size}.")
    return cls(np.full((size,), SEPARATOR, np.int32), np.zeros((len(PAST_NGRAMS), size), np.uint32))

  @property
  def size(self) -> int:
    return self.tokens.shape[0]

  def append(self, output) -> None:
    """Writes `output`'s tokens and a separator after it (of an output longer than the ring,
    its last tokens), and the keys of the positions whose n-grams or next token changed."""
    output = np.asarray(output, np.int32)[-(self.size - 1) :]
    written = np.concatenate([output, [SEPARATOR]]).astype(np.int32)
    at = (self.written + np.arange(written.shape[0])) % self.size
    self.tokens[at] = written
    # The n-grams ending from the token before the first written (its next token changed)
    # to the last that holds a written token.
    span = min(written.shape[0] + max(PAST_NGRAMS), self.size)
    ends = (self.written - 1 + np.arange(span)) % self.size  # [E]
    self.written = int((self.written + written.shape[0]) % self.size)
    self.unsent += written.shape[0]
    followed = self.tokens[(ends + 1) % self.size] != SEPARATOR  # [E]
    for row, n in enumerate(PAST_NGRAMS):
      windows = self.tokens[(ends[:, None] - n + 1 + np.arange(n)[None, :]) % self.size]  # [E, n]
      whole = np.all(windows != SEPARATOR, axis=-1) & followed
      self.keys[row, ends] = np.where(whole, ngram_key(windows), np.uint32(0))

  def on_device(self, copy: bool = True) -> PastTokens:
    """The ring as rounds read it: the device's copy brought up to date with the outputs
    written since the last call (the whole ring sorted again only the first time, or where
    they changed about all of it). With `copy` (a decoding state's buffers may be donated
    to the program that runs its rounds), a copy of it; else the arrays this ring keeps,
    for a caller that only reads them before the next call: an update writes the ring's
    new state into the buffers of its old one (donated), so that what a release changes
    allocates nothing on the device (a new allocation may move the buffers the rounds'
    CUDA graphs read, which XLA then rewrites: ~4 ms each for SmolLM2's rounds on an
    H200). The host's arrays go to the compiled programs as they are: an array made on
    the device by a call outside them is a dispatch of its own, ~0.2 ms on an H200."""
    span = self.unsent + max(PAST_NGRAMS)  # the positions whose keys changed, from the first written's predecessor
    written = np.int32(self.written)
    if self.device is None and not self.keys.any():  # (no n-gram written yet: no sort)
      self.device = _indexed_empty(self.tokens, written)
    elif self.device is None or 2 * span > self.size:
      self.device = _indexed(self.tokens, self.keys, written)
    elif self.unsent:
      first = (self.written - self.unsent - 1) % self.size
      # [W]: the first `span` changed, the rest padding
      ends = ((first + np.arange(_bucket(span))) % self.size).astype(np.int32)
      spans = np.asarray([self.unsent + n for n in PAST_NGRAMS], np.int32)
      self.device = _update(self.device, np.int32(first), spans, ends, self.tokens[ends], self.keys[:, ends], written)
    self.unsent = 0
    return _copied(self.device) if copy else self.device


def _bucket(span: int) -> int:
  """The width an update's arrays are padded to: a power of two, so that a few programs
  serve every output length."""
  return max(64, 1 << (span - 1).bit_length())


@jax.jit
def _indexed(tokens: jax.Array, keys: jax.Array, written: jax.Array) -> PastTokens:
  """The ring of `tokens` [H] whose positions hold `keys` [N, H], with each row's keys
  ascending beside the position of each, oldest first among equal keys."""
  size = keys.shape[1]
  ends = jnp.broadcast_to(jnp.arange(size, dtype=jnp.int32), keys.shape)
  age = (ends - written) % size  # 0: the oldest
  index_keys, _, index_ends = jax.lax.sort((keys, age, ends), dimension=1, num_keys=2)
  return PastTokens(tokens, index_keys, index_ends, written)


@jax.jit
def _indexed_empty(tokens: jax.Array, written: jax.Array) -> PastTokens:
  """`_indexed` of a ring nothing was written to: every key 0, so each row lists the
  positions by age (a million-token ring's sort costs ~7 ms on an H200; this, a fill)."""
  size = tokens.shape[0]
  ends = jnp.broadcast_to((jnp.arange(size, dtype=jnp.int32) + written) % size, (len(PAST_NGRAMS), size))
  return PastTokens(tokens, jnp.zeros((len(PAST_NGRAMS), size), jnp.uint32), ends, written)


@jax.jit
def _copied(past: PastTokens) -> PastTokens:
  """A copy of `past` in buffers of its own, in one program."""
  return jax.tree.map(jnp.copy, past)


def count_at_most(ascending: jax.Array, queries: jax.Array) -> jax.Array:
  """How many entries of `ascending` [H] are at most each of `queries` [Q] (`jnp.searchsorted`
  with side="right"), in two passes of about sqrt(H) comparisons each: the entries that end
  each block of `block` count the blocks wholly at most a query, then the block after those
  (the last `block` entries, where they are all at most it) adds its own."""
  size = ascending.shape[0]
  block = min(1 << (max(size - 1, 1).bit_length() + 1) // 2, size)  # a power of two near sqrt(H), at most H
  fences = ascending[block - 1 :: block]  # [F]: each whole block's largest
  if size % block:
    fences = jnp.concatenate([fences, ascending[-1:]])  # (the partial block's)
  whole = jnp.sum(fences[None, :] <= queries[:, None], axis=1, dtype=jnp.int32)  # [Q]: blocks at most the query
  start = jnp.minimum(whole * block, size - block)  # [Q]: the entries before it are all at most the query
  window = jax.vmap(lambda at: jax.lax.dynamic_slice(ascending, (at,), (block,)))(start)  # [Q, block]
  return start + jnp.sum(window <= queries[:, None], axis=1, dtype=jnp.int32)


@functools.partial(jax.jit, donate_argnums=0)
def _update(device: PastTokens, first, spans, ends, tokens, keys, written) -> PastTokens:
  """`device` (donated) with new tokens [W] and keys [N, W] at the ring positions `ends` [W] (`first`,
  `first` + 1, ... mod H) and `written` the new write position. Row n's keys changed at
  its first spans[n] positions (the tokens written, the position before them, and the
  n-grams that reach into them), the tokens at all but the last n - 1 of those. Per n, the
  entries of those positions leave the sorted index, which keeps its order, and their new
  keys join it sorted, each after the equal keys already there: the positions written are
  the ring's newest, so (key, age) order holds without sorting the rest. (The positions
  after the written tokens, the oldest, now hold key 0, no n-gram, among whose entries
  the order is not kept: no search asks for it.) Each place of the new index gathers its
  entry, a new one or the kept one that counts of the few removed and added entries lead
  to: three running sums and gathers over the index, and no scatter but of those few."""
  size = device.tokens.shape[0]
  width = ends.shape[0]
  written_tokens = jnp.arange(width) < spans[0] - PAST_NGRAMS[0] + 1  # the written ones and the one before
  ring = device.tokens.at[jnp.where(written_tokens, ends, size)].set(tokens, mode="drop")
  top = jnp.uint32(0xFFFFFFFF)

  def row(index_keys, index_ends, new_keys, span):  # [H], [H], [W], []
    slots = jnp.arange(width)
    real = slots < span  # [W]: the changed positions; the rest padding
    removed = (index_ends - first) % size < span  # [H]: entries of rewritten positions, which leave
    # The removed entries' places, ascending: the j-th is where the running count of them passes j.
    removed_at = count_at_most(jnp.cumsum(removed, dtype=jnp.int32), slots)  # [W]
    # The k-th kept entry sits past the removed ones before it: those with at most k kept before them.
    passed = jnp.zeros((size,), jnp.int32).at[jnp.where(real, removed_at - slots, size)].add(1, mode="drop")
    kept_from = jnp.arange(size) + jnp.cumsum(passed)  # [H]: the k-th kept entry's place (k < H - span)
    # The new entries by key, in position order (their ages') among equal keys; the padding last.
    new_keys, order = jax.lax.sort((jnp.where(real, new_keys, top), slots), num_keys=1, is_stable=True)
    # Each new entry goes after the kept keys up to its own: those of the whole index less the removed.
    removed_keys = jnp.where(real, index_keys[jnp.minimum(removed_at, size - 1)], top)  # [W]
    kept_up_to = count_at_most(index_keys, new_keys) - jnp.sum(removed_keys <= new_keys[:, None], axis=1)
    new_at = jnp.where(real, slots + kept_up_to, size)  # [W]: their places in the merged index, ascending
    # Every place of the merged index read by a gather: a new entry, or the kept entry its count reaches.
    is_new = jnp.zeros((size,), bool).at[new_at].set(True, mode="drop")  # [H]
    new_up_to = jnp.cumsum(is_new, dtype=jnp.int32)  # [H]
    kept = jnp.clip(jnp.arange(size) - new_up_to, 0, size - 1)  # [H]: a kept entry's rank
    source = jnp.minimum(kept_from[kept], size - 1)  # [H]: its old place
    pick = jnp.clip(new_up_to - 1, 0, width - 1)  # [H]: a new entry's rank
    index_keys = jnp.where(is_new, new_keys[pick], index_keys[source])
    index_ends = jnp.where(is_new, ends[order][pick], index_ends[source])
    return index_keys, index_ends

  index_keys, index_ends = jax.vmap(row)(device.index_keys, device.index_ends, keys, spans)
  return PastTokens(ring, index_keys, index_ends, written)


def match_past(past: PastTokens, history: jax.Array, end: jax.Array, num_tokens: int, matches: int = 1):
  """Each sequence's continuations from the ring: what followed the earlier occurrences
  there of the context's last n tokens (history [B, S] holds each sequence's tokens up to
  and including index `end [B]`), n the longest of `PAST_NGRAMS` that occurs.
  An occurrence is a run of ring positions that holds no separator (so never wraps past
  the oldest token: the newest is a separator) and that a token follows; its continuation
  stops at a separator or at the oldest token.

  Of the `CANDIDATES_PER_MATCH` x `matches` most recent occurrences, the continuations
  come ranked as SuffixDecoding ranks them, by how often they followed: by the number of
  candidates that share their first token, then their first two, ... up to
  `RANKED_PREFIX` tokens, then by recency (one occurrence: the most recent). One that a
  continuation ranked before it holds whole (its tokens a prefix of that one's) adds
  nothing and is dropped. Returns tokens [B, M, G] (G = `num_tokens`, M = `matches`,
  best first), which are real [B, M, G] (none where fewer were found) and the n matched
  [B] (0: none)."""
  size = past.tokens.shape[0]
  batch = history.shape[0]
  count = end + 1  # tokens in the context, root included
  longest = max(PAST_NGRAMS)
  tail = jax.vmap(lambda h, c: jax.lax.dynamic_slice(h, (c - longest,), (longest,)))(
    jnp.pad(history, ((0, 0), (longest, 0))), count + longest
  )  # [B, L]: the context's last `longest` tokens (padding before a short context's)
  keys = jnp.stack(
    [jnp.where(count >= n, ngram_key(tail[:, longest - n :]), jnp.uint32(_NO_TAIL)) for n in PAST_NGRAMS]
  )  # [N, B]: the context's key per n
  # The last entry of each key is its newest occurrence: every n's search at once.
  at = jax.vmap(count_at_most)(past.index_keys, keys) - 1  # [N, B]
  found = (at >= 0) & (jnp.take_along_axis(past.index_keys, jnp.maximum(at, 0), axis=1) == keys)  # [N, B]
  row = jnp.argmax(found, axis=0)  # [B]: the longest n found (rows run longest first)
  matched = jnp.where(jnp.any(found, axis=0), jnp.asarray(PAST_NGRAMS, jnp.int32)[row], 0)  # [B]
  # The candidates: the newest entries of the key, at, at - 1, ... while the key holds.
  candidates = CANDIDATES_PER_MATCH * matches
  entry = at[row, jnp.arange(batch)][:, None] - jnp.arange(candidates)[None, :]  # [B, C]
  safe = jnp.maximum(entry, 0)
  key = keys[row, jnp.arange(batch)]  # [B]
  last = past.index_ends[row[:, None], safe]  # [B, C]: the ring position each occurrence ends at
  # Each occurrence's tokens against the context's (a key's collision: no occurrence).
  seen = past.tokens[(last[:, :, None] - longest + 1 + jnp.arange(longest)) % size]  # [B, C, L]
  considered = jnp.arange(longest) >= longest - matched[:, None, None]
  occurs = (
    (matched[:, None] > 0)
    & (entry >= 0)
    & (past.index_keys[row[:, None], safe] == key[:, None])
    & jnp.all((seen == tail[:, None, :]) | ~considered, axis=-1)
  )  # [B, C]
  start = (last + 1) % size
  tokens = past.tokens[(start[:, :, None] + jnp.arange(num_tokens)) % size]  # [B, C, G]
  # Real until the first separator or the oldest token (age 0: the ring's end of recency).
  within = jnp.arange(num_tokens) < (size - (start - past.written) % size)[:, :, None]
  real = jnp.cumprod(within & (tokens != SEPARATOR), axis=-1).astype(bool) & occurs[:, :, None]  # [B, C, G]
  # How often each one's first k tokens followed, k = 1 .. RANKED_PREFIX, as one integer, then recency.
  head, head_real = tokens[..., :RANKED_PREFIX], real[..., :RANKED_PREFIX]  # [B, C, K]
  same = jnp.cumprod(
    (head[:, :, None, :] == head[:, None, :, :]) & head_real[:, :, None, :] & head_real[:, None, :, :], axis=-1
  )  # [B, C, C', K]: C and C' agree on their first k + 1 real tokens
  shared = jnp.sum(same, axis=2)  # [B, C, K]
  ranked = shared.shape[-1]
  score = jnp.sum(shared * (candidates + 1) ** jnp.arange(ranked - 1, -1, -1), axis=-1)  # [B, C]
  score = jnp.where(real[:, :, 0], score, -1)
  order = jnp.argsort(-score, axis=1, stable=True)  # [B, C]: best first, the newest first among equals
  tokens, real = (jnp.take_along_axis(x, order[:, :, None], axis=1) for x in (tokens, real))
  pick, some = distinct_continuations(tokens, real, matches)  # [B, M] x2
  tokens = jnp.take_along_axis(tokens, pick[:, :, None], axis=1)
  real = jnp.take_along_axis(real, pick[:, :, None], axis=1) & some[:, :, None]
  return tokens, real, jnp.where(some[:, 0], matched, 0)
