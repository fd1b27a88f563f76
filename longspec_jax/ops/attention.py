"""Attention entry points and their pure-jnp reference implementations.

Every attention the models do is *hybrid*: new queries attend to (a) the committed prefix
in the KV cache, with no mask beyond its per-sequence length, and (b) the new tokens of
this step (a causal chunk, one AR token, or a speculation tree) under an explicit mask.
Each pass returns (out, lse) and `merge` combines them exactly. The Pallas kernels in
`pallas_kernels/` compute the same functions; these are the ground truth.

Shapes: queries are grouped by KV head, [B, T, K, G, D] (K kv heads, G query heads per
kv head), keys/values are [B, S, K, D]. `lse` is the natural-log normalizer [B, T, K, G].
A cached prefix may also come as every layer's stacked [L, B, S, K, D] with `layer`
naming one (a traced index inside a layer scan): the Pallas kernels then read that layer
where it lies, where a slice would be a copy of the whole layer's cache per call.

Under a mesh (tensor-parallel inference, a data-parallel training step: `sharding.py`)
each kernel runs per device on its own sequences and KV heads (`sharding.per_device`); the
jnp references are split by XLA's partitioner as they are.
"""

from __future__ import annotations

import enum
import functools

import jax
import jax.numpy as jnp

from longspec_jax import backend
from longspec_jax.ops import sharding

_NEG_INF = -jnp.inf

# The kernels' operands by logical axis (`sharding.per_device`): split by sequence (a
# data-parallel batch) and by KV head (tensor parallelism); a layer index whole.
_QUERIES = ("batch", None, "kv_heads", None, None)  # queries and outputs [B, T, K, G, D]
_LSE = ("batch", None, "kv_heads", None)  # [B, T, K, G]
_CHUNKS = ("batch", "kv_heads", None)  # kept chunks or their mass [B, K, C]
_WHOLE = None


def _keys(x: jax.Array) -> tuple[str, ...]:
  """Keys or values: one layer's [B, S, K, D] (a cache's or a step's own) or a stacked
  cache's [L, B, S, K, D]."""
  return sharding.CACHE_AXES[-x.ndim :]


def _rows(x: jax.Array | None) -> tuple[str | None, ...] | None:
  """Lengths [B] or [B, T], positions [B, T], masks [B, T, S]: per sequence."""
  return None if x is None else ("batch",) + (None,) * (x.ndim - 1)


class Impl(enum.Enum):
  """Which code computes attention. The one choice point: each model holds its `Impl`
  (`Transformer.attention`, `Draft.attention`, set when it is built or loaded) and every
  attention it runs goes through the entry points below with it.

  REFERENCE: the pure-jnp functions of this module; any backend, differentiable, the
  ground truth in tests. PALLAS: the kernels of `pallas_kernels/` (GPU; interpreted
  elsewhere, slowly); not differentiable; a causal pass over whole prompts (a prefill's
  first) runs FLASH's. FLASH: training, over whole sequences (the
  draft, and the frozen target's forward it reads): `jax.nn.dot_product_attention`
  (cuDNN's fused forward and backward on a GPU in bf16, never a [T, T] score matrix; XLA
  elsewhere), for the two structured masks training has (`causal_attention`,
  `delayed_attention`)."""

  REFERENCE = "reference"
  PALLAS = "pallas"
  FLASH = "flash"

  @classmethod
  def default(cls) -> Impl:
    """PALLAS on a GPU, REFERENCE elsewhere."""
    return cls.PALLAS if backend.on_gpu() else cls.REFERENCE


class Invariance(enum.Enum):
  """What a hybrid attention's bits may depend on, besides the queries' own inputs.

  NONE: anything (the fastest launch for each shape). CACHE: not the cache's allocated
  length (the kernels, interpreted off a GPU, with fixed split-K ranges): prefill under
  batch-invariant decoding, so that the prompt's cached K/V are the same bits whatever
  room a method's trees need after it. FULL: neither that nor the call's other queries:
  batch-invariant decoding rounds (`pallas_kernels.hybrid.invariant_hybrid_attention`)."""

  NONE = "none"
  CACHE = "cache"
  FULL = "full"


def _softmax_pass(scores: jnp.ndarray, visible: jnp.ndarray, v: jnp.ndarray) -> tuple[jnp.ndarray, jnp.ndarray]:
  """Softmax over the last axis of scores [B, K, G, T, S] where visible; rows with no
  visible key give out = 0 and lse = -inf, so they vanish in `merge`."""
  scores = jnp.where(visible, scores, _NEG_INF)
  row_max = jnp.max(scores, axis=-1, keepdims=True)
  row_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)
  weights = jnp.exp(scores - row_max)  # masked entries are exp(-inf) = 0
  denom = jnp.sum(weights, axis=-1)  # [B, K, G, T]
  out = jnp.einsum("bkgts,bskd->btkgd", weights, v.astype(jnp.float32))
  out = out / jnp.maximum(denom, jnp.finfo(jnp.float32).tiny).transpose(0, 3, 1, 2)[..., None]
  lse = jnp.log(denom) + row_max[..., 0]  # log(0) = -inf for empty rows
  return out, lse.transpose(0, 3, 1, 2)


def _scores(q: jnp.ndarray, k: jnp.ndarray) -> jnp.ndarray:
  scale = q.shape[-1] ** -0.5
  return jnp.einsum("btkgd,bskd->bkgts", q.astype(jnp.float32) * scale, k.astype(jnp.float32))


def prefix_attention_reference(
  q: jnp.ndarray,
  k: jnp.ndarray,
  v: jnp.ndarray,
  lengths: jnp.ndarray,
  q_positions: jnp.ndarray | None = None,
  window: int | None = None,
) -> tuple[jnp.ndarray, jnp.ndarray]:
  """Queries [B, T, K, G, D] over cached keys/values [B, S, K, D], slots < lengths only:
  `lengths` is [B] (one committed length per sequence) or [B, T] (a limit per query, as
  the draft's delayed cross-attention uses).

  With `window`, a query at position p also ignores cached slots <= p - window (the
  committed prefix holds position i in slot i). Returns (out f32 [B,T,K,G,D], lse [B,T,K,G]).
  """
  slots = jnp.arange(k.shape[1])
  limits = lengths[:, None] if lengths.ndim == 1 else lengths  # [B, 1] or [B, T]
  visible = slots[None, None, :] < limits[:, :, None]  # [B, 1 or T, S]
  if window is not None:
    visible = visible & (q_positions[:, :, None] - slots[None, None, :] < window)  # [B, T, S]
  return masked_attention_reference(q, k, v, visible)


def sparse_prefix_attention_reference(
  q: jnp.ndarray, k: jnp.ndarray, v: jnp.ndarray, lengths: jnp.ndarray, kept: jnp.ndarray, chunk: int
) -> tuple[jnp.ndarray, jnp.ndarray]:
  """The prefix pass over the chunks a selection kept (SpecAttn's sparse verification):
  queries [B, T, K, G, D] over cached keys/values [B, S, K, D] at slots < lengths [B]
  whose chunk of `chunk` slots kept [B, K, ceil(S / chunk)] marks for the query's KV
  head. Returns (out f32, lse), as `prefix_attention_reference`."""
  slots = jnp.arange(k.shape[1])
  visible = (slots[None, None, :] < lengths[:, None, None]) & kept[:, :, slots // chunk]  # [B, K, S]
  return _softmax_pass(_scores(q, k), visible[:, :, None, None, :], v)


def masked_attention_reference(
  q: jnp.ndarray, k: jnp.ndarray, v: jnp.ndarray, mask: jnp.ndarray
) -> tuple[jnp.ndarray, jnp.ndarray]:
  """Queries [B, T, K, G, D] over keys/values [B, S, K, D] under mask [B, T or 1, S]
  (mask[b, i, j]: query i sees key j): the pass over a step's own tokens or a tree.
  Returns (out f32, lse)."""
  return _softmax_pass(_scores(q, k), mask[:, None, None, :, :], v)


def prefix_attention(q, k, v, lengths, q_positions=None, window=None, *, layer=None, impl: Impl):
  """The prefix pass with the chosen implementation; see `prefix_attention_reference`
  (and the module docstring for `layer`)."""
  if impl is Impl.PALLAS:
    from pallas_kernels.flash_decode import flash_decode

    kernel = lambda q, k, v, lengths, q_positions, layer: flash_decode(
      q, k, v, lengths, q_positions, window, layer=layer
    )
    return sharding.per_device(
      kernel,
      (q, k, v, lengths, q_positions, layer),
      (_QUERIES, _keys(k), _keys(v), _rows(lengths), _rows(q_positions), _WHOLE),
      (_QUERIES, _LSE),
    )
  k, v = _layer(k, v, layer)
  return prefix_attention_reference(q, k, v, lengths, q_positions, window)


def sparse_prefix_attention(q, k, v, lengths, kept, chunk: int, *, layer=None, impl: Impl):
  """The prefix pass over the chunks `kept` [B, K, ceil(S / chunk)] marks, with the chosen
  implementation; see `sparse_prefix_attention_reference`."""
  if impl is Impl.PALLAS:
    from pallas_kernels.sparse_decode import sparse_flash_decode

    kernel = lambda q, k, v, lengths, kept, layer: sparse_flash_decode(q, k, v, lengths, kept, chunk=chunk, layer=layer)
    return sharding.per_device(
      kernel,
      (q, k, v, lengths, kept, layer),
      (_QUERIES, _keys(k), _keys(v), _rows(lengths), _CHUNKS, _WHOLE),
      (_QUERIES, _LSE),
    )
  k, v = _layer(k, v, layer)
  return sparse_prefix_attention_reference(q, k, v, lengths, kept, chunk)


def layer_chunks(kept, layers: int, dense_layers: int) -> jnp.ndarray:
  """The chunks each layer of a sparse pass reads: kept [B, K, C] (one set for every
  layer) or [L, B, K, C] (one per layer) -> [L, B, K, C], every chunk in the first
  `dense_layers` layers (SpecAttn keeps them dense)."""
  dense = jnp.arange(layers) < dense_layers  # [L]
  return jnp.broadcast_to(kept, (layers, *kept.shape[-3:])) | dense[:, None, None, None]


def select_chunks(mass, p: float, *, impl: Impl) -> jnp.ndarray:
  """SpecAttn's top-p over chunks with the chosen implementation: mass [..., C] -> the
  chunks [..., C] bool holding at least p of each row's mass (`pallas_kernels.topp`)."""
  from pallas_kernels.topp import select_chunks as kernel
  from pallas_kernels.topp import select_chunks_reference

  def select(mass):
    rows = mass.reshape(-1, mass.shape[-1])
    kept = kernel(rows, p) if impl is Impl.PALLAS else select_chunks_reference(rows, p)
    return kept.reshape(mass.shape)

  # (each row a KV head's: per device on its own heads where mass is [..., K, C])
  return sharding.per_device(select, (mass,), (_CHUNKS,), _CHUNKS) if impl is Impl.PALLAS else select(mass)


def prefix_chunk_mass(q, k, lse, lengths, chunk: int, *, layer=None) -> jnp.ndarray:
  """How much of a prefix pass's attention fell in each chunk of `chunk` slots, per KV
  head: queries [B, T, K, G, D] that saw cached keys [B, S, K, D] (layer `layer` of a
  stacked cache) at slots < lengths ([B] or [B, T]) with normalizer lse [B, T, K, G] ->
  [B, K, ceil(S / chunk)] float32, summed over the queries and the heads of each group
  (SpecAttn's signal for which chunks a verification reads). Recomputes the scores from
  q and K (XLA; one read of the layer's keys, not its values)."""
  from pallas_kernels.topp import chunk_mass

  if layer is not None:
    k = k[layer]
  slots = jnp.arange(k.shape[1])
  limits = lengths[:, None] if lengths.ndim == 1 else lengths  # [B, 1] or [B, T]
  visible = slots[None, None, :] < limits[:, :, None]  # [B, T or 1, S]
  safe = jnp.where(jnp.isfinite(lse), lse, jnp.inf)  # queries that saw nothing weigh nothing
  weights = jnp.exp(_scores(q, k) - safe.transpose(0, 2, 3, 1)[..., None])  # [B, K, G, T, S]
  weights = jnp.where(visible[:, None, None], weights, 0.0)
  return chunk_mass(jnp.einsum("bkgts->bks", weights), chunk)  # [B, K, S] -> [B, K, C]


def _layer(k, v, layer):
  return (k, v) if layer is None else (k[layer], v[layer])


def masked_attention(q, k, v, mask, *, impl: Impl):
  """The masked pass with the chosen implementation; see `masked_attention_reference`
  (mask [B, T, S] here)."""
  if impl is Impl.PALLAS:
    from pallas_kernels.tree_attention import tree_attention

    return sharding.per_device(
      tree_attention, (q, k, v, mask), (_QUERIES, _keys(k), _keys(v), _rows(mask)), (_QUERIES, _LSE)
    )
  return masked_attention_reference(q, k, v, mask)


def causal_attention(q, k, v, window: int | None, *, impl: Impl) -> jnp.ndarray:
  """A sequence's queries [B, T, K, G, D] over its own keys/values [B, T, K, D], each key
  at or before its query and (with `window`) fewer than `window` tokens back: the draft's
  self-attention in training, and a prefill's first pass. Returns out [B, T, K, G, D]
  (compute dtype with FLASH and PALLAS, float32 with REFERENCE). PALLAS runs FLASH's fused
  pass: whole prompts are a shape no decoding kernel here is for."""
  if impl in (Impl.FLASH, Impl.PALLAS):
    return _flash(q, k, v, local_window_size=None if window is None else (window - 1, 0))
  index = jnp.broadcast_to(jnp.arange(q.shape[1]), q.shape[:2])
  return masked_attention(q, k, v, causal_block_mask(index, jnp.ones(q.shape[:2], bool), window), impl=impl)[0]


def delayed_attention(q, k, v, delay: jnp.ndarray, *, impl: Impl) -> jnp.ndarray:
  """A sequence's queries [B, T, K, G, D] over the target's keys/values [B, T, K, D] of the
  same tokens, query i seeing keys 0 .. i - delay[b] (delay [B] int32; flash noisy
  training's cross-attention; queries before the first key get 0). Returns out [B, T, K,
  G, D]."""
  if impl is Impl.FLASH:  # query i is query i - delay of a plain causal pass, shifted
    length = q.shape[1]
    index = jnp.arange(length)[None, :]
    take = lambda x, at: jnp.take_along_axis(x, jnp.clip(at, 0, length - 1)[:, :, None, None, None], axis=1)
    out = _flash(take(q, index + delay[:, None]), k, v)  # (rows past length - delay: never read)
    return jnp.where((index >= delay[:, None])[:, :, None, None, None], take(out, index - delay[:, None]), 0)
  limits = jnp.maximum(jnp.arange(q.shape[1])[None, :] - delay[:, None] + 1, 0)
  return prefix_attention(q, k, v, limits, impl=impl)[0]


def blockwise_attention(q, k, v, block: int, *, impl: Impl) -> jnp.ndarray:
  """A sequence's queries [B, T, K, G, D] over the target's keys/values [B, T, K, D] of the
  same tokens, in blocks of `block` tokens: query i sees the keys of the blocks before its
  own, 0 .. (i // block) * block - 1 (GLIDE's training cross-attention mask, glide-cape.md
  section 4.1; the first block sees none and gets 0). With `Impl.FLASH`, `block` passes
  of `delayed_attention`: a query at offset j of its block is one delayed by j + 1.
  Returns out [B, T, K, G, D]."""
  batch, length = q.shape[:2]
  index = jnp.arange(length)
  if impl is Impl.FLASH:
    out = None
    for offset in range(block):
      delayed = delayed_attention(q, k, v, jnp.full((batch,), offset + 1, jnp.int32), impl=impl)
      out = delayed if out is None else jnp.where((index % block == offset)[None, :, None, None, None], delayed, out)
    return out
  limits = jnp.broadcast_to(index // block * block, (batch, length))
  return prefix_attention(q, k, v, limits, impl=impl)[0]


def rollout_attention(q, far_k, far_v, near_k, near_v, delay: int, window: int | None, block: int = 512):
  """A draft's self-attention as inference computes its pass at one tree depth, for every
  position of a sequence at once (training-time test): query i [B, T, K, G, D] sees the
  `far` keys/values [B, T, K, D] (the ring: every position as the draft's first pass over
  committed tokens wrote it) at positions i - window < j <= i - delay, and its own `near`
  ones [B, T, U, K, D] (its ancestors in the tree and itself, each as its own pass wrote
  it; near[:, i, u] is the key at position i - u), in one softmax. The far keys a query
  sees lie within `window` of it, so queries run in blocks of `block`, each over the
  block's band of keys (memory linear in T; each block recomputed in the backward pass).
  Returns out [B, T, K, G, D] float32."""
  batch, length, kv_heads, g, dim = q.shape
  reach = window if window is not None else length  # far keys a query may see, at most
  blocks = -(-length // block)
  pad = blocks * block - length
  queries = jnp.pad(q, ((0, 0), (0, pad), (0, 0), (0, 0), (0, 0)))
  near = [jnp.pad(x, ((0, 0), (0, pad)) + ((0, 0),) * 3) for x in (near_k, near_v)]
  # Far keys shifted by `reach`: block b's band is the slice [b * block, b * block + block + reach).
  far = [jnp.pad(x, ((0, 0), (reach, pad), (0, 0), (0, 0))) for x in (far_k, far_v)]
  scale = dim**-0.5

  @jax.checkpoint
  def one_block(start):
    qb = jax.lax.dynamic_slice_in_dim(queries, start, block, axis=1).astype(jnp.float32) * scale  # [B, C, K, G, D]
    kf, vf = (jax.lax.dynamic_slice_in_dim(x, start, block + reach, axis=1).astype(jnp.float32) for x in far)
    kn, vn = (jax.lax.dynamic_slice_in_dim(x, start, block, axis=1).astype(jnp.float32) for x in near)
    query_pos = start + jnp.arange(block)  # [C]
    key_pos = start - reach + jnp.arange(block + reach)  # [C + R]
    ahead = query_pos[:, None] - key_pos[None, :]  # [C, C + R]
    visible = (key_pos[None, :] >= 0) & (ahead >= delay) & (ahead < reach)
    far_scores = jnp.einsum("bckgd,bskd->bkgcs", qb, kf)
    far_scores = jnp.where(visible[None, None, None], far_scores, _NEG_INF)
    near_scores = jnp.einsum("bckgd,bcukd->bkgcu", qb, kn)
    near_scores = jnp.where((query_pos[:, None] >= jnp.arange(kn.shape[2]))[None, None, None], near_scores, _NEG_INF)
    weights = jax.nn.softmax(jnp.concatenate([far_scores, near_scores], axis=-1), axis=-1)  # (itself always seen)
    split = far_scores.shape[-1]
    out = jnp.einsum("bkgcs,bskd->bckgd", weights[..., :split], vf)
    return out + jnp.einsum("bkgcu,bcukd->bckgd", weights[..., split:], vn)

  starts = jnp.arange(blocks) * block
  out = jax.lax.map(one_block, starts)  # [blocks, B, C, K, G, D]
  return jnp.moveaxis(out, 0, 1).reshape(batch, blocks * block, kv_heads, g, dim)[:, :length]


def _flash(q, k, v, **masks) -> jnp.ndarray:
  """`jax.nn.dot_product_attention`, causal, on our [B, T, K, G, D] queries (query head
  k * G + g reads key head k, its grouping): cuDNN on a GPU in 16-bit floats, XLA
  elsewhere."""
  b, t, kv, g, d = q.shape
  fused = backend.on_gpu() and q.dtype in (jnp.bfloat16, jnp.float16)
  out = jax.nn.dot_product_attention(
    q.reshape(b, t, kv * g, d), k, v, is_causal=True, implementation="cudnn" if fused else "xla", **masks
  )
  return out.reshape(b, t, kv, g, d)


def merge(out_a, lse_a, out_b, lse_b) -> tuple[jnp.ndarray, jnp.ndarray]:
  """Exact combination of two attention passes over disjoint key sets."""
  lse = jnp.logaddexp(lse_a, lse_b)
  safe = jnp.where(jnp.isfinite(lse), lse, 0.0)
  w_a = jnp.exp(lse_a - safe)[..., None]
  w_b = jnp.exp(lse_b - safe)[..., None]
  return out_a * w_a + out_b * w_b, lse


def hybrid_attention(
  q: jnp.ndarray,
  k_cache: jnp.ndarray,
  v_cache: jnp.ndarray,
  lengths: jnp.ndarray,
  k_new: jnp.ndarray,
  v_new: jnp.ndarray,
  mask: jnp.ndarray,
  q_positions: jnp.ndarray,
  window: int | None = None,
  *,
  layer=None,
  impl: Impl,
  invariance: Invariance = Invariance.NONE,
  kept: jnp.ndarray | None = None,
  chunk: int = 0,
  dtype=jnp.float32,
) -> jnp.ndarray:
  """Attention of new queries over the committed prefix (layer `layer` of a stacked
  cache, if given) plus the new block; returns out [B, T, K, G, D] in `dtype` (the
  kernels write it so: a model asking for its own dtype spares a rounding launch).

  `invariance` other than NONE runs the kernels whatever `impl` says (`Invariance`); FULL
  is for decoding rounds (`mask` then a tree's ancestor mask): each query's bits depend on
  its position, its path and the cache's contents only, so a tree node computes exactly
  what an AR step at its position does.

  With `kept` [B, K, ceil(S / chunk)], the prefix pass reads only the chunks of `chunk`
  slots it marks for each KV head (SpecAttn's sparse verification: lossy; no sliding
  window, no batch invariance)."""
  if kept is not None:
    if window is not None or invariance is not Invariance.NONE:
      raise ValueError("a sparse prefix pass has no sliding window and no batch-invariant numerics.")
    out_a, lse_a = sparse_prefix_attention(q, k_cache, v_cache, lengths, kept, chunk, layer=layer, impl=impl)
    out_b, lse_b = masked_attention(q, k_new, v_new, mask, impl=impl)
    return merge(out_a, lse_a, out_b, lse_b)[0].astype(dtype)
  if invariance is Invariance.FULL or impl is Impl.PALLAS or invariance is Invariance.CACHE:
    from pallas_kernels.hybrid import hybrid_attention as pallas_hybrid
    from pallas_kernels.hybrid import invariant_hybrid_attention
    from pallas_kernels.tuning import INVARIANT_SPLIT_KEYS

    if invariance is Invariance.FULL:
      kernel = functools.partial(invariant_hybrid_attention, window=window)
    else:
      split_keys = INVARIANT_SPLIT_KEYS if invariance is Invariance.CACHE else 0
      kernel = functools.partial(pallas_hybrid, window=window, split_keys=split_keys, dtype=dtype)
    operands = (q, k_cache, v_cache, lengths, k_new, v_new, mask, q_positions, layer)
    axes = (
      _QUERIES,
      *map(_keys, (k_cache, v_cache)),
      _rows(lengths),
      *map(_keys, (k_new, v_new)),
      _rows(mask),
      _rows(q_positions),
      _WHOLE,
    )
    out = sharding.per_device(lambda *args: kernel(*args[:-1], layer=args[-1]), operands, axes, _QUERIES)
    return out.astype(dtype)  # (the batch-invariant pass's float32; the others' written in dtype already)
  k_cache, v_cache = _layer(k_cache, v_cache, layer)
  out_a, lse_a = prefix_attention_reference(q, k_cache, v_cache, lengths, q_positions, window)
  out_b, lse_b = masked_attention_reference(q, k_new, v_new, mask)
  out, _ = merge(out_a, lse_a, out_b, lse_b)
  return out.astype(dtype)


def causal_block_mask(positions: jnp.ndarray, valid: jnp.ndarray, window: int | None = None) -> jnp.ndarray:
  """Mask [B, T, T] for a chunk of consecutive tokens: key j visible to query i when it is
  valid, not in the future, and (with `window`) fewer than `window` positions back."""
  delta = positions[:, :, None] - positions[:, None, :]  # [B, T, T] query pos - key pos
  mask = (delta >= 0) & valid[:, None, :]
  if window is not None:
    mask &= delta < window
  return mask
