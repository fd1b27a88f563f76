"""Primitives both models are built from: RMSNorm, the decoder block (attention
projections with RoPE, output projection, SwiGLU MLP), layers stacked for `lax.scan`,
and random initialisation. The target (`target.py`) and the draft (`draft.py`) import
these; neither imports the other's model.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from longspec_jax.config import BlockConfig
from longspec_jax.rope import apply_rope

init_weight = nnx.initializers.normal(0.02)


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
  """RMSNorm in float32, rounded to x.dtype before the gain (as HF does)."""
  x32 = x.astype(jnp.float32)
  normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
  return weight * normed.astype(x.dtype)


class DecoderLayer(nnx.Module):
  """One pre-norm decoder block; `Transformer` stacks L of them on a leading axis."""

  def __init__(self, config: BlockConfig, dtype, rngs: nnx.Rngs):
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


def build_random(make, seed: int = 0) -> nnx.Module:
  """The module `make(rngs)` builds, its arrays initialised on the default device in one jit."""
  graphdef, _ = nnx.split(nnx.eval_shape(lambda: make(nnx.Rngs(seed))))
  return nnx.merge(graphdef, jax.jit(lambda: nnx.state(make(nnx.Rngs(seed))))())
