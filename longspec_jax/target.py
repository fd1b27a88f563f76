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
from longspec_jax.attention import Impl
from longspec_jax.cache import KVCache, write_block
from longspec_jax.config import TargetConfig
from longspec_jax.gemm import Gemm
from longspec_jax.layers import DecoderLayer, build_random, init_weight, rms_norm, stacked_layers
from longspec_jax.rope import inverse_frequencies, rope_tables


class Transformer(nnx.Module):
  """The target model. Call it with tokens, positions, a block mask and (optionally) a
  cache. `attention` picks the code every attention of the model runs (`attention.Impl`;
  by default the Pallas kernels on a GPU, the jnp reference elsewhere); `gemm` the code of
  its matrix products in the engine's compiled functions (`gemm.Gemm`; cuBLAS on a GPU)."""

  def __init__(self, config: TargetConfig, dtype=jnp.float32, *, rngs: nnx.Rngs,
               attention: attention.Impl | None = None, gemm: Gemm | None = None):
    self.config = config
    self.attention = attention or Impl.default()
    self.gemm = gemm or Gemm.default()
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
  ) -> tuple[jax.Array, KVCache | None]:
    """tokens, positions [B, T]; mask [B, T, T] over this step's tokens.

    Returns the final hidden states [B, T, E] (normed; see `logits`) and the cache with
    this step's K/V written after each sequence's committed prefix (lengths unchanged).
    """
    x, k_new, v_new = self.hidden_and_kv(tokens, positions, mask, cache)
    if cache is not None:
      # The cache is only read inside the layer scan; all layers' new K/V are written
      # after it, in place, so no layer ever copies the cache.
      cache = KVCache(
          k=write_block(cache.k, cache.lengths, k_new),
          v=write_block(cache.v, cache.lengths, v_new),
          lengths=cache.lengths,
      )
    return x, cache

  def hidden_and_kv(self, tokens, positions, mask, cache: KVCache | None = None):
    """The forward pass: final hidden states [B, T, E] and every layer's K/V of these
    tokens, k and v [L, B, T, K, D] (what draft training cross-attends to). Without a
    cache the attention is the masked pass alone (not differentiable with pallas)."""
    c = self.config
    x = jnp.take(self.embed[...], tokens, axis=0)  # [B, T, E]
    inv_freq, scale = inverse_frequencies(c.rope, c.head_dim)
    cos, sin = rope_tables(positions, inv_freq, scale)  # [B, T, D/2]
    layer_def, layer_state = nnx.split(self.layers)

    def block(x, xs):
      state, index = xs  # this layer's params and its index in the stacked cache
      layer = nnx.merge(layer_def, state)
      q, k, v = layer.project_qkv(x, cos, sin)
      if cache is None:
        out, _ = attention.masked_attention(q, k, v, mask, impl=self.attention)
      else:
        # The whole stacked cache goes in with the layer's index, not a slice of it (which
        # XLA would copy before a kernel reads it).
        out = attention.hybrid_attention(
            q, cache.k, cache.v, cache.lengths, k, v, mask, positions,
            window=c.sliding_window, layer=index, impl=self.attention,
        )
      return layer.add_mlp(layer.add_attention(x, out)), (k, v)

    x, (k_new, v_new) = jax.lax.scan(block, x, (layer_state, jnp.arange(c.num_layers)))  # k_new [L, B, T, K, D]
    return rms_norm(x, self.final_norm[...], c.rms_norm_eps), k_new, v_new

  def logits(self, hidden: jax.Array) -> jax.Array:
    """hidden [..., E] -> float32 logits [..., V] through the (possibly tied) LM head.

    The product comes out in the model's dtype (float32 accumulation), as transformers
    computes it, and is widened after: asked for float32 out of bf16 operands, XLA's
    cuBLAS path first widens the whole [E, V] head to float32 (1.4 ms a step at 8B)."""
    if self.lm_head is None:
      logits = jnp.einsum("...e,ve->...v", hidden, self.embed[...])
    else:
      logits = jnp.einsum("...e,ev->...v", hidden, self.lm_head[...])
    return logits.astype(jnp.float32)


def abstract_model(config: TargetConfig, dtype, attention: Impl | None = None) -> Transformer:
  """The model's structure with shape/dtype placeholders instead of arrays (no memory)."""
  return nnx.eval_shape(lambda: Transformer(config, dtype, rngs=nnx.Rngs(0), attention=attention))


def random_model(config: TargetConfig, dtype, seed: int = 0, attention: Impl | None = None) -> Transformer:
  return build_random(lambda rngs: Transformer(config, dtype, rngs=rngs, attention=attention), seed)
