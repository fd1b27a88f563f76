"""Exact top-k over a vocabulary-sized last axis, in two stages; and the LM head's top-k
log-probabilities of a few rows, fused with the head's product on a GPU.

XLA's GPU top-k of a few rows of 49k logits (the beam search's frontier) takes ~170 us on
an H100, for one row as for sixteen (`python -m lab.profile`). Taking the top k of each
chunk first, then of the chunks' winners, spreads a row over many small problems. The
result is `jax.lax.top_k`'s, order and ties included: the global top k lie among the
chunks' top k, and the candidates stay in index order among equals. A vocabulary split
over devices (tensor-parallel inference, `sharding.py`) is the same two stages with a
device's share as the chunk: each device its own top k, the devices' k gathered, their
top k; the logits are never gathered. On the CPU, and for
many rows on the GPU, XLA's one pass is the faster (`python -m lab.bench_target --suite
topk`), so the chunks are for a GPU and a few rows.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from longspec_jax import backend
from longspec_jax.ops import sharding

# H100, top-16 of 49k-128k entries (`lab.bench_target --suite topk`, docs/results.md): chunks of
# 512 took 60-170 us against lax.top_k's 165-285 us for up to 16 rows, and lost at 64.
CHUNK = 512
MAX_ROWS = 16


def top_k(x: jax.Array, k: int, chunk: int | None = None) -> tuple[jax.Array, jax.Array]:
  """(values, indices) of the k largest entries along the last axis of float x, largest
  first, lower index first among equals: `jax.lax.top_k`'s result. `chunk`: entries per
  first-stage chunk (default: CHUNK for up to MAX_ROWS rows on a GPU, else one pass)."""
  n = x.shape[-1]
  devices = sharding.splits("vocab", n)
  if devices > 1 and k <= n // devices:
    local = lambda x: _gathered(*_offset(top_k(x, k, chunk), x.shape[-1]))
    return _best(*sharding.per_device(local, (x,), (("vocab",),), (None, None)), k)
  few_rows = math.prod(x.shape[:-1]) <= MAX_ROWS
  chunk = chunk or (CHUNK if backend.on_gpu() and few_rows else n)
  if n <= 2 * chunk or k > chunk:
    return jax.lax.top_k(x, k)
  chunks = -(-n // chunk)
  lead = x.shape[:-1]
  # -inf padding sorts after every real entry (after real -inf ones too: it comes last).
  padded = jnp.pad(x, [(0, 0)] * len(lead) + [(0, chunks * chunk - n)], constant_values=-jnp.inf)
  values, index = jax.lax.top_k(padded.reshape(*lead, chunks, chunk), k)  # [..., chunks, k]
  index = index + (jnp.arange(chunks) * chunk)[:, None]
  return _best(values.reshape(*lead, chunks * k), index.reshape(*lead, chunks * k), k)


def _best(values: jax.Array, index: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
  """The top k of candidates values [..., M] (index order among equals) with their indices."""
  best, pick = jax.lax.top_k(values, k)  # [..., k]
  return best, jnp.take_along_axis(index, pick, axis=-1)


def _offset(candidates, size: int) -> tuple[jax.Array, jax.Array]:
  """Inside `sharding.per_device` over the vocabulary: a device's (values, indices) of its
  share of `size` entries, the indices made global."""
  values, index = candidates
  return values, index + jax.lax.axis_index(sharding.RULES["vocab"]) * size


def _gathered(*arrays: jax.Array) -> tuple[jax.Array, ...]:
  """Inside `sharding.per_device` over the vocabulary: each array [..., M] of every device
  side by side, [..., devices * M], in device order (so in vocabulary order)."""
  axis = sharding.RULES["vocab"]
  return tuple(jax.lax.all_gather(a, axis, axis=a.ndim - 1, tiled=True) for a in arrays)


def fused_head_pays(rows: int) -> bool:
  """Whether the fused head + top-k pass (`head_top_log_probs`) beats the logits, a
  log-softmax and `top_k` for `rows` rows: on a GPU, for a draft's few frontier rows."""
  return backend.on_gpu() and rows <= MAX_ROWS


def head_top_log_probs(hidden: jax.Array, head: jax.Array, k: int, *, transposed: bool):
  """The k most likely next tokens after each row of hidden [..., E] under the LM head
  (w [E, V], or [V, E] with `transposed`) and their log-probabilities, largest first:
  `top_k(log_softmax(logits), k)` without the logits in HBM
  (`pallas_kernels/head_topk.py`; interpreted off a GPU). Returns (log_probs, tokens),
  each [..., k]."""
  from pallas_kernels.head_topk import head_candidates

  lead, e = hidden.shape[:-1], hidden.shape[-1]
  vocab = head.shape[0] if transposed else head.shape[1]
  candidates = lambda rows, head: head_candidates(rows, head, k, transposed=transposed, interpret=not backend.on_gpu())
  rows = hidden.reshape(-1, e)
  if sharding.splits("vocab", vocab) > 1:  # each device's candidates and normalizer, gathered

    def local(rows, head):
      values, tokens, lse = candidates(rows, head)
      share = head.shape[0] if transposed else head.shape[1]  # this device's entries
      values, tokens, lse = _gathered(*_offset((values, tokens), share), lse[:, None])
      return values, tokens, jax.nn.logsumexp(lse, axis=-1)

    head_axes = ("vocab", "embed") if transposed else ("embed", "vocab")
    values, tokens, lse = sharding.per_device(local, (rows, head), (None, head_axes), (None, None, None))
  else:
    values, tokens, lse = candidates(rows, head)
  best, tokens = _best(values, tokens, k)
  return (best - lse[:, None]).reshape(*lead, k), tokens.reshape(*lead, k)
