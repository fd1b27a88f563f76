"""The draft models: LongSpec's (constant memory at any context length) and GLIDE's.

One block (or a few, stacked and scanned like the target's layers) of
RMSNorm -> self-attention over the draft's own cache -> RMSNorm -> cross-attention whose
keys and values are the target's cached K/V of one layer -> RMSNorm -> SwiGLU MLP, then a
final RMSNorm. The input embedding and the LM head are the target's arrays, passed in,
never copied: the draft's parameters are only its blocks, and its state only its cache.
With `feature_layers`, each token's embedding also gets the target's cached values of a
few layers at the position before it, where that position is committed, fused by a
learned projection (EAGLE-3's multi-layer features, read from the cache, not recomputed);
with `parent_features`, where that position is a drafted parent, the parent's own output.
The two kinds differ only in what the attentions see (`config.DraftKind`): LongSpec's
self-attention the latest `window` positions (a ring buffer) and every layer the same
target layer; GLIDE's every earlier position (a cache as long as the target's) and
layer m the target layer `cross_layer` + m.

Cross-attention is delayed as at inference: a query at position p sees target slots below
a per-query limit (the committed length, never p itself), which is what flash noisy
training simulates.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from longspec_jax.models.cache import RingCache
from longspec_jax.models.config import DraftConfig
from longspec_jax.models.layers import DecoderLayer, build_random, embed_tokens, init_weight, rms_norm, stacked_layers
from longspec_jax.models.rope import apply_rope, inverse_frequencies, rope_tables
from longspec_jax.models.target import Transformer
from longspec_jax.ops import attention
from longspec_jax.ops.attention import Impl


@dataclasses.dataclass(frozen=True)
class Rollout:
  """Training-time test: what the self-attention of the draft's pass at one tree depth sees,
  for every position of a sequence as the query of such a pass (`attention.rollout_attention`):
  the first pass's K/V at every position (the ring, [L, B, T, K, D]), the K/V each query's
  ancestors got from their own passes (`near`, [L, B, T, U, K, D]: near[:, :, i, u - 1] is
  the key of position i - u), and how far back the ring's positions end (`delay`: the
  query's depth, the ring holding its tree's root and what was committed before it)."""

  far_k: jax.Array
  far_v: jax.Array
  near_k: jax.Array
  near_v: jax.Array
  delay: int


@dataclasses.dataclass(frozen=True)
class SelfAttend:
  """What the draft's self-attention sees: the ring's positions below `ring_limit` within
  the window (no ring: nothing before this call), and the block's keys under `mask`. The
  block is this call's own tokens (N = T), or, with `buffer = (k, v [L, B, N, K, D],
  slots [B, T])`, a buffer of earlier tree nodes into which this call's K/V are first
  written at `slots`. Training passes no mask: the block is a whole sequence, each token
  seeing itself and the `window` - 1 before it (structured, so `Impl.FLASH` never builds
  the [T, T] mask). With `rollout`, every query sees what a tree node at one depth sees
  at inference instead (training-time test; `Rollout`)."""

  mask: jax.Array | None  # [B, T, N] bool; None: causal within `window`
  window: int | None = None
  ring: RingCache | None = None
  ring_limit: jax.Array | None = None  # [B] int32
  buffer: tuple[jax.Array, jax.Array, jax.Array] | None = None
  rollout: Rollout | None = None


@dataclasses.dataclass(frozen=True)
class CrossAttend:
  """The target's cached keys/values of every layer [L, B, S, K, D] (each draft layer
  reads the one its config names, in place: the attention kernel takes the layer's index,
  no copy per pass) and, per query, how many slots it may see (the committed length,
  delayed as flash noisy training simulates). Training gives a `delay` per sequence, or
  a `block` length, instead of limits: the K/V are those of the same tokens, and query i
  sees slots 0 .. i - delay (LongSpec's flash noisy training), or those of the blocks
  before its own (GLIDE's; both structured, for `Impl.FLASH`)."""

  k: jax.Array  # [L, B, S, K, D]
  v: jax.Array  # [L, B, S, K, D]
  limits: jax.Array | None  # [B, T] int32; None: by `delay` or `block`
  delay: jax.Array | None = None  # [B] int32
  block: int | None = None
  # False where no query's previous position can be committed (a tree's nodes): the
  # fused target features (`Draft.target_features`), all zero there, are not computed.
  fuse: bool = True

  def seen(self, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Each query's slot in k/v [B, T] (its position at inference; in training, with
    `delay` or `block`, its index in the sequence, the K/V being those of the same tokens)
    and how many slots from 0 it sees [B, T]."""
    if self.limits is not None:
      return positions, self.limits
    slots = jnp.broadcast_to(jnp.arange(positions.shape[1], dtype=jnp.int32), positions.shape)
    if self.block is not None:
      return slots, slots // self.block * self.block
    return slots, slots - self.delay[:, None] + 1


class DraftLayer(DecoderLayer):
  """A decoder layer with a cross-attention over the target's K/V between its
  self-attention and its MLP (none where the config ablates it)."""

  def __init__(self, config: DraftConfig, dtype, rngs: nnx.Rngs):
    super().__init__(config, dtype, rngs)
    if not config.cross_attention:
      return
    e, h, d = config.hidden_size, config.num_heads, config.head_dim
    self.cross_norm = nnx.Param(jnp.ones((e,), dtype))
    self.cross_q = nnx.Param(init_weight(rngs.params(), (e, h, d), dtype))
    self.cross_o = nnx.Param(init_weight(rngs.params(), (h, d, e), dtype))

  def add_cross_attention(self, x, cos, sin, cross: CrossAttend, layer, impl: attention.Impl, chunk: int = 0):
    """x [B, T, E] attends to the target's cached keys/values of `layer` (an int, or an
    int32 scalar inside the layer scan) at the slots `cross` allows; queries get RoPE at
    their own positions (cos/sin). Returns the new x and, with `chunk`, the attention's
    mass per chunk of the cache and KV head [B, K, C] (`attention.prefix_chunk_mass`)."""
    c = self.config
    b, t = x.shape[:2]
    h = rms_norm(x, self.cross_norm[...], c.rms_norm_eps)
    q = apply_rope(jnp.einsum("bte,ehd->bthd", h, self.cross_q[...]), cos, sin)
    q = q.reshape(b, t, c.num_kv_heads, c.group_size, c.head_dim)  # [B, T, K, G, D]
    mass = None
    if cross.block is not None:
      out = attention.blockwise_attention(q, cross.k[layer], cross.v[layer], cross.block, impl=impl)
    elif cross.delay is not None:
      out = attention.delayed_attention(q, cross.k[layer], cross.v[layer], cross.delay, impl=impl)
    else:
      out, lse = attention.prefix_attention(q, cross.k, cross.v, cross.limits, layer=layer, impl=impl)
      if chunk:
        mass = attention.prefix_chunk_mass(q, cross.k, lse, cross.limits, chunk, layer=layer)
    return self.add_attention(x, out, self.cross_o[...]), mass


class VocabSubset(nnx.Variable):
  """The tokens a draft scores (FR-Spec), [N] int32, the most frequent in its training
  text first. Not trained."""


class Draft(nnx.Module):
  """The draft's own parameters; the target supplies embedding, LM head and K/V.
  `attention` picks the code of all its attention, self and cross (`attention.Impl`; a
  draft being trained needs FLASH or REFERENCE, which are differentiable). With
  `config.vocab_subset`, it scores the first that many tokens of `ranking` (ids, the
  most frequent first; default: the first ids, as a random draft does)."""

  def __init__(
    self,
    config: DraftConfig,
    dtype=jnp.float32,
    *,
    rngs: nnx.Rngs,
    attention: attention.Impl | None = None,
    ranking: jax.Array | None = None,
  ):
    self.config = config
    self.attention = attention or Impl.default()

    self.layers = stacked_layers(DraftLayer, config, dtype, rngs)
    self.final_norm = nnx.Param(jnp.ones((config.hidden_size,), dtype))
    if config.vocab_subset:
      n = config.vocab_subset
      self.vocab = VocabSubset(
        jnp.arange(n, dtype=jnp.int32) if ranking is None else jnp.asarray(ranking[:n], jnp.int32)
      )
    if config.feature_layers:
      n, k, d = len(config.feature_layers), config.num_kv_heads, config.head_dim
      self.feature_norm = nnx.Param(jnp.ones((n, k, d), dtype))
      self.feature_proj = nnx.Param(init_weight(rngs.params(), (n, k, d, config.hidden_size), dtype))
    if config.parent_features:
      e = config.hidden_size
      self.parent_proj = nnx.Param(init_weight(rngs.params(), (e, e), dtype))

  @property
  def vocab_rows(self) -> int | None:
    """How many tokens the draft scores; None: the whole vocabulary."""
    return self.config.vocab_subset or None

  def subset_tokens(self) -> jax.Array | None:
    """The tokens the draft scores, ascending ids [N] (None: every token)."""
    return None if self.vocab_rows is None else jnp.sort(self.vocab[...])

  def committed_before(self, positions: jax.Array, cross: CrossAttend) -> jax.Array:
    """Whether each query's previous position is committed [B, T]: its cross-attention
    sees that slot (never so for a tree's nodes, `cross.fuse` False)."""
    if not cross.fuse:
      return jnp.zeros(positions.shape, bool)
    slots, seen = cross.seen(positions)
    return (slots >= 1) & (seen >= slots)

  def target_features(self, target: Transformer, positions: jax.Array, cross: CrossAttend) -> jax.Array:
    """The fused target features [B, T, E] each query adds to its token's embedding: the
    target's cached values at the slot before its own in `config.feature_layers`, each
    layer's RMS-normed, projected together, where the query's cross-attention sees that
    slot (a committed position), else zero (a tree node's parent is never committed). At
    inference they are a few rows of the cache the cross-attention reads anyway."""
    c = self.config
    slots, _ = cross.seen(positions)  # [B, T]
    layers = jnp.asarray(c.feature_indices(target.config.num_layers), jnp.int32)
    rows = jnp.arange(slots.shape[0])[None, :, None]
    before = jnp.clip(slots - 1, 0, cross.v.shape[2] - 1)[None]
    values = cross.v[layers[:, None, None], rows, before].astype(self.feature_proj.dtype)  # [N, B, T, K, D]
    v32 = values.astype(jnp.float32)
    normed = v32 * jax.lax.rsqrt(jnp.mean(v32 * v32, axis=(-2, -1), keepdims=True) + c.rms_norm_eps)
    normed = normed.astype(values.dtype) * self.feature_norm[...][:, None, None]
    fused = jnp.einsum("nbtkd,nkde->bte", normed, self.feature_proj[...])
    return jnp.where(self.committed_before(positions, cross)[..., None], fused, 0)

  def inputs(self, target: Transformer, tokens, positions, cross: CrossAttend, parents: jax.Array | None):
    """The first layer's input [B, T, E]: each token's embedding, plus what the config
    adds about its previous position: the target's fused features where that position is
    committed, the draft's own output there (`parents` [B, T, E], final-normed) where it
    is a drafted parent."""
    c = self.config
    x = embed_tokens(target.embed[...], tokens).astype(self.final_norm.dtype)  # [B, T, E]
    if c.feature_layers and cross.fuse:
      x = x + self.target_features(target, positions, cross).astype(x.dtype)
    if c.parent_features and parents is not None:
      drafted = ~self.committed_before(positions, cross)
      own = jnp.einsum("bte,ef->btf", parents.astype(x.dtype), self.parent_proj[...])
      x = x + jnp.where(drafted[..., None], own, 0).astype(x.dtype)
    return x

  def __call__(
    self,
    target: Transformer,
    tokens: jax.Array,
    positions: jax.Array,
    own: SelfAttend,
    cross: CrossAttend,
    parents: jax.Array | None = None,
  ) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
    """tokens, positions [B, T] -> (hidden [B, T, E] final-normed, block K/V [L, B, N, K, D],
    this call's included). The self-attention sees what `own` names, the
    cross-attention what `cross` names; `parents` [B, T, E]: each query's parent's
    output, read with `config.parent_features` where the parent is drafted."""
    hidden, block_kv, _ = self.forward(target, tokens, positions, own, cross, parents=parents)
    return hidden, block_kv

  def forward(
    self,
    target: Transformer,
    tokens: jax.Array,
    positions: jax.Array,
    own: SelfAttend,
    cross: CrossAttend,
    chunk: int = 0,
    parents: jax.Array | None = None,
  ):
    """`__call__`, and with `chunk` also where its cross-attention looked (cross.limits
    given): its mass per chunk of `chunk` slots of the target's cache and per KV head, [B,
    K, ceil(S / chunk)], summed over this call's queries, the heads of each group and the
    draft's layers (SpecAttn's signal for which chunks the target reads; a one-layer
    draft's stands for every target layer); None without."""
    c = self.config
    x = self.inputs(target, tokens, positions, cross, parents)  # [B, T, E]
    inv_freq, scale = inverse_frequencies(c.rope, c.head_dim)
    cos, sin = rope_tables(positions, inv_freq, scale)  # [B, T, D/2]
    ring = own.ring
    ring_visible = None if ring is None else ring.visible(positions, own.ring_limit)  # [B, T, W]
    rows = jnp.arange(tokens.shape[0])[:, None]
    layer_def, layer_state = nnx.split(self.layers)
    block_k, block_v, slots = (None, None, None) if own.buffer is None else own.buffer
    # Each layer's cross-attended target layer: one static index when all are one
    # (LongSpec's), else scanned with the layers (GLIDE's).
    cross_layers = c.target_layers(target.config.num_layers)
    scanned_layers = None if len(set(cross_layers)) == 1 else jnp.asarray(cross_layers, jnp.int32)

    def step(x, xs):
      state, ring_k, ring_v, buffer_k, buffer_v, cross_layer, rollout = xs
      layer = nnx.merge(layer_def, state)
      q, k, v = layer.project_qkv(x, cos, sin)
      if buffer_k is not None:
        k = buffer_k.at[rows, slots].set(k.astype(buffer_k.dtype))
        v = buffer_v.at[rows, slots].set(v.astype(buffer_v.dtype))
      if rollout is not None:  # (itself first among its near keys: u = 0)
        far_k, far_v, near_k, near_v = rollout
        near_k = jnp.concatenate([k[:, :, None], near_k], axis=2)
        near_v = jnp.concatenate([v[:, :, None], near_v], axis=2)
        out, lse = attention.rollout_attention(q, far_k, far_v, near_k, near_v, own.rollout.delay, own.window), None
      elif own.mask is None:
        out, lse = attention.causal_attention(q, k, v, own.window, impl=self.attention), None
      else:
        out, lse = attention.masked_attention(q, k, v, own.mask, impl=self.attention)
      if ring_k is not None:
        ring_out, ring_lse = attention.masked_attention(q, ring_k, ring_v, ring_visible, impl=self.attention)
        out, _ = attention.merge(ring_out, ring_lse, out, lse)
      x = layer.add_attention(x, out)
      mass = None
      if c.cross_attention:
        x, mass = layer.add_cross_attention(
          x, cos, sin, cross, cross_layers[0] if cross_layer is None else cross_layer, self.attention, chunk
        )
      return layer.add_mlp(x), (k, v, mass)

    ring_kv = (None, None) if ring is None else (ring.k, ring.v)
    r = own.rollout
    rollout = None if r is None else (r.far_k, r.far_v, r.near_k, r.near_v)
    x, (k, v, mass) = jax.lax.scan(step, x, (layer_state, *ring_kv, block_k, block_v, scanned_layers, rollout))
    return rms_norm(x, self.final_norm[...], c.rms_norm_eps), (k, v), None if mass is None else mass.sum(axis=0)


def with_features(draft: Draft, layers: tuple[int, ...] = (), parents: bool = False) -> Draft:
  """`draft` reading fused target features of `layers` (and, with `parents`, its parents'
  own outputs) besides: what it lacks comes with a zero projection, so that it computes
  what `draft` does until training moves it; what it reads already stays as it is."""
  config = dataclasses.replace(
    draft.config,
    feature_layers=tuple(layers) or draft.config.feature_layers,
    parent_features=parents or draft.config.parent_features,
  )
  fused = Draft(config, draft.final_norm.dtype, rngs=nnx.Rngs(0), attention=draft.attention)
  nnx.update(fused, nnx.state(draft))
  for name, added in (
    ("feature_proj", layers and not draft.config.feature_layers),
    ("parent_proj", parents and not draft.config.parent_features),
  ):
    if added:
      getattr(fused, name)[...] = jnp.zeros_like(getattr(fused, name)[...])
  return fused


def random_draft(config: DraftConfig, dtype, seed: int = 0, attention: Impl | None = None) -> Draft:
  """A random-init draft (with `config.vocab_subset`, over the vocabulary's first tokens)."""
  return build_random(lambda rngs: Draft(config, dtype, rngs=rngs, attention=attention), seed)
