"""The Llama-family target decoder as Flax NNX modules.

embed -> L x (RMSNorm, attention with RoPE, RMSNorm, SwiGLU MLP) -> RMSNorm -> LM head
(tied to the embedding or separate). The L layers' parameters are stacked on a leading
axis and run with `lax.scan`, so compile time does not grow with depth. q/k/v share one
projection `[E, H + 2K, D]` and gate/up another `[E, 2, F]`: one matrix product each.

Every forward takes explicit positions and a mask over the step's own tokens, and
attends to the committed prefix of the KV cache through `attention.hybrid_attention`:
the same call serves prefill chunks, AR decode and tree verification.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from longspec_jax import attention
from longspec_jax.cache import KVCache, write_block
from longspec_jax.config import TargetConfig
from longspec_jax.rope import apply_rope, inverse_frequencies, rope_tables

init_weight = nnx.initializers.normal(0.02)


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
  """RMSNorm in float32, rounded to x.dtype before the gain (as HF does)."""
  x32 = x.astype(jnp.float32)
  normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
  return weight * normed.astype(x.dtype)


class DecoderLayer(nnx.Module):
  """One pre-norm decoder block; `Transformer` stacks L of them on a leading axis."""

  def __init__(self, config: TargetConfig, dtype, rngs: nnx.Rngs):
    e, d, f = config.hidden_size, config.head_dim, config.intermediate_size
    n_qkv = config.num_heads + 2 * config.num_kv_heads
    self.config = config
    self.attn_norm = nnx.Param(jnp.ones((e,), dtype))
    self.qkv = nnx.Param(init_weight(rngs.params(), (e, n_qkv, d), dtype))
    self.qkv_bias = nnx.Param(jnp.zeros((n_qkv, d), dtype)) if config.qkv_bias else None
    self.o = nnx.Param(init_weight(rngs.params(), (config.num_heads, d, e), dtype))
    self.mlp_norm = nnx.Param(jnp.ones((e,), dtype))
    self.gate_up = nnx.Param(init_weight(rngs.params(), (e, 2, f), dtype))
    self.down = nnx.Param(init_weight(rngs.params(), (f, e), dtype))

  def project_qkv(self, x: jax.Array, cos: jax.Array, sin: jax.Array):
    """x [B, T, E] -> q [B, T, K, G, D], k and v [B, T, K, D], RoPE applied to q and k."""
    c = self.config
    h = rms_norm(x, self.attn_norm[...], c.rms_norm_eps)
    qkv = jnp.einsum("bte,end->btnd", h, self.qkv[...])  # [B, T, H + 2K, D]
    if self.qkv_bias is not None:
      qkv = qkv + self.qkv_bias[...]
    q, k, v = jnp.split(qkv, [c.num_heads, c.num_heads + c.num_kv_heads], axis=2)
    q = apply_rope(q, cos, sin)
    k = apply_rope(k, cos, sin)
    b, t = x.shape[:2]
    return q.reshape(b, t, c.num_kv_heads, c.group_size, c.head_dim), k, v

  def add_attention(self, x: jax.Array, attn_out: jax.Array, o: jax.Array | None = None) -> jax.Array:
    """Residual plus the output projection `o [H, D, E]` (this layer's by default) of
    attn_out [B, T, K, G, D]."""
    c = self.config
    b, t = x.shape[:2]
    attn_out = attn_out.reshape(b, t, c.num_heads, c.head_dim).astype(x.dtype)
    return x + jnp.einsum("bthd,hde->bte", attn_out, self.o[...] if o is None else o)

  def add_mlp(self, x: jax.Array) -> jax.Array:
    """Residual plus the SwiGLU MLP of the normed x [B, T, E]."""
    h = rms_norm(x, self.mlp_norm[...], self.config.rms_norm_eps)
    gate_up = jnp.einsum("bte,ecf->btcf", h, self.gate_up[...])  # [B, T, 2, F]
    h = jax.nn.silu(gate_up[:, :, 0]) * gate_up[:, :, 1]
    return x + jnp.einsum("btf,fe->bte", h, self.down[...])


def stacked_layers(layer_class, config, dtype, rngs: nnx.Rngs) -> nnx.Module:
  """`config.num_layers` layers as one module whose parameters carry a leading L axis
  (each layer initialised from its own split of `rngs`), for `lax.scan`."""

  @nnx.split_rngs(splits=config.num_layers)
  @nnx.vmap(in_axes=(0,), out_axes=0)
  def make_layers(rngs: nnx.Rngs):
    return layer_class(config, dtype, rngs)

  return make_layers(rngs)


class Transformer(nnx.Module):
  """The target model. Call it with tokens, positions, a block mask and (optionally) a cache."""

  def __init__(self, config: TargetConfig, dtype=jnp.float32, *, rngs: nnx.Rngs):
    self.config = config
    self.embed = nnx.Param(init_weight(rngs.params(), (config.vocab_size, config.hidden_size), dtype))

    self.layers = stacked_layers(DecoderLayer, config, dtype, rngs)
    self.final_norm = nnx.Param(jnp.ones((config.hidden_size,), dtype))
    self.lm_head = (
        None
        if config.tie_word_embeddings
        else nnx.Param(init_weight(rngs.params(), (config.hidden_size, config.vocab_size), dtype))
    )

  @property
  def dtype(self):
    return self.embed[...].dtype

  def __call__(
      self,
      tokens: jax.Array,
      positions: jax.Array,
      mask: jax.Array,
      cache: KVCache | None = None,
      impl: str = "reference",
  ) -> tuple[jax.Array, KVCache | None]:
    """tokens, positions [B, T]; mask [B, T, T] over this step's tokens.

    Returns the final hidden states [B, T, E] (normed; see `logits`) and the cache with
    this step's K/V written after each sequence's committed prefix (lengths unchanged).
    """
    x, k_new, v_new = self.hidden_and_kv(tokens, positions, mask, cache, impl)
    if cache is not None:
      # The cache is only read inside the layer scan; all layers' new K/V are written
      # after it, in place, so no layer ever copies the cache.
      cache = KVCache(
          k=write_block(cache.k, cache.lengths, k_new),
          v=write_block(cache.v, cache.lengths, v_new),
          lengths=cache.lengths,
      )
    return x, cache

  def hidden_and_kv(self, tokens, positions, mask, cache: KVCache | None = None, impl: str = "reference"):
    """The forward pass: final hidden states [B, T, E] and every layer's K/V of these
    tokens, k and v [L, B, T, K, D] (what draft training cross-attends to). Without a
    cache the attention is the masked pass alone (not differentiable with pallas)."""
    c = self.config
    x = jnp.take(self.embed[...], tokens, axis=0)  # [B, T, E]
    inv_freq, scale = inverse_frequencies(c.rope, c.head_dim)
    cos, sin = rope_tables(positions, inv_freq, scale)  # [B, T, D/2]
    layer_def, layer_state = nnx.split(self.layers)

    def block(x, xs):
      state, k_prefix, v_prefix = xs  # this layer's params and committed cache [B, S, K, D]
      layer = nnx.merge(layer_def, state)
      q, k, v = layer.project_qkv(x, cos, sin)
      if cache is None:
        out, _ = attention.masked_attention(q, k, v, mask, impl)
      else:
        out = attention.hybrid_attention(
            q, k_prefix, v_prefix, cache.lengths, k, v, mask, positions,
            window=c.sliding_window, impl=impl,
        )
      return layer.add_mlp(layer.add_attention(x, out)), (k, v)

    prefix = (None, None) if cache is None else (cache.k, cache.v)
    x, (k_new, v_new) = jax.lax.scan(block, x, (layer_state, *prefix))  # k_new [L, B, T, K, D]
    return rms_norm(x, self.final_norm[...], c.rms_norm_eps), k_new, v_new

  def logits(self, hidden: jax.Array) -> jax.Array:
    """hidden [..., E] -> float32 logits [..., V] through the (possibly tied) LM head."""
    if self.lm_head is None:
      return jnp.einsum("...e,ve->...v", hidden, self.embed[...], preferred_element_type=jnp.float32)
    return jnp.einsum("...e,ev->...v", hidden, self.lm_head[...], preferred_element_type=jnp.float32)


def abstract_model(config: TargetConfig, dtype) -> Transformer:
  """The model's structure with shape/dtype placeholders instead of arrays (no memory)."""
  return nnx.eval_shape(lambda: Transformer(config, dtype, rngs=nnx.Rngs(0)))


def random_model(config: TargetConfig, dtype, seed: int = 0) -> Transformer:
  return build_random(lambda rngs: Transformer(config, dtype, rngs=rngs), seed)


def build_random(make, seed: int = 0) -> nnx.Module:
  """The module `make(rngs)` builds, its arrays initialised on the default device in one jit."""
  graphdef, _ = nnx.split(nnx.eval_shape(lambda: make(nnx.Rngs(seed))))
  return nnx.merge(graphdef, jax.jit(lambda: nnx.state(make(nnx.Rngs(seed))))())
