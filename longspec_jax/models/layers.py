"""Primitives both models are built from: RMSNorm, the weight products, the decoder block
(attention projections with RoPE, output projection, SwiGLU MLP), layers stacked for
`lax.scan`, and random initialisation. The target (`target.py`) and the draft
(`draft.py`) import these; neither imports the other's model.

A stacked module's methods take `layer`, the index of the layer to run, for the
batch-invariant products: every weight is then read as that layer of its stack, in place
(a per-layer slice handed to a Pallas kernel is a copy of the layer's weights each call).
XLA's own products run on the layer scan's per-layer slices (`layer` None), which its
cuBLAS calls read in place.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from longspec_jax import backend
from longspec_jax.models.config import BlockConfig
from longspec_jax.models.rope import apply_rope
from longspec_jax.ops import sharding

init_weight = nnx.initializers.normal(0.02)


def rms_norm(
  x: jax.Array, weight: jax.Array, eps: float, *, layer=None, invariant: bool = False, kernel: bool = False
) -> jax.Array:
  """RMSNorm in float32, rounded to x.dtype before the gain (as HF does); with `layer`,
  weight is a stack [L, E] and `layer` names the one to use.

  `kernel`: through the Pallas kernel (`pallas_kernels/rms_norm.py`, interpreted off a
  GPU; not differentiable), one launch where XLA's reduction and scaling take two: a
  decoding pass's norms cost their launches. `invariant`: the same kernel for its other
  property: its rows sum their squares in one order whatever the number of rows; XLA
  picks its reduction's order from the shape."""
  if invariant or kernel:
    from pallas_kernels.rms_norm import rms_norm as kernel_rms_norm

    if layer is None:
      weight, layer = weight[None], 0
    run = lambda x, weight, layer: kernel_rms_norm(x, weight, eps, layer, interpret=not backend.on_gpu())
    rows = ("batch",) + (None,) * (x.ndim - 1)  # each device its own sequences, the gain whole
    return sharding.per_device(run, (x, weight, jnp.asarray(layer, jnp.int32)), (rows, None, None), rows)
  x32 = x.astype(jnp.float32)
  normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
  return (weight if layer is None else weight[layer]) * normed.astype(x.dtype)


def linear(x: jax.Array, w: jax.Array, contract: int = 1, *, layer=None, invariant: bool = False) -> jax.Array:
  """x [..., *C] @ w [*C, *O] -> [..., *O], contracting the last `contract` axes of x with
  the first of w; with `layer`, w is a stack [L, *C, *O] and `layer` names the one to use.

  `invariant`: through the batch-invariant Pallas matmul (`pallas_kernels/matmul.py`,
  interpreted off a GPU), whose rows compute the same bits whatever the number of rows;
  else XLA's dot (cuBLAS or a Triton fusion, per `gemm.Gemm`)."""
  stack = () if layer is None else w.shape[:1]
  weight_shape = w.shape[len(stack) :]
  c_shape, o_shape = weight_shape[:contract], weight_shape[contract:]
  if not invariant:
    return jnp.tensordot(x, w if layer is None else w[layer], axes=contract)
  from pallas_kernels.matmul import matmul

  lead = x.shape[: x.ndim - contract]
  flat = w.reshape(*stack, math.prod(c_shape), math.prod(o_shape))
  y = matmul(x.reshape(*lead, -1), flat, layer, interpret=not backend.on_gpu())
  return y.reshape(*lead, *o_shape)


def embed_tokens(table: jax.Array, tokens: jax.Array) -> jax.Array:
  """The rows of the embedding table [V, E] for tokens [...] -> [..., E]. With the
  vocabulary split over devices (`sharding`), each device looks up the tokens its rows
  hold, zeros for the others, and one sum across devices puts them together (Megatron's
  vocabulary-parallel embedding: exact, the table never gathered)."""
  devices = sharding.splits("vocab", table.shape[0])
  if devices == 1:
    return jnp.take(table, tokens, axis=0)
  axis = sharding.RULES["vocab"]

  def local(table, tokens):  # this device's rows [V / devices, E]
    rows = table.shape[0]
    index = tokens - jax.lax.axis_index(axis) * rows
    mine = (index >= 0) & (index < rows)
    found = jnp.take(table, jnp.clip(index, 0, rows - 1), axis=0)
    return jax.lax.psum(jnp.where(mine[..., None], found, jnp.zeros_like(found)), axis)

  return sharding.per_device(local, (table, tokens), (("vocab", "embed"), None), None)


def _at(param: nnx.Param, layer) -> jax.Array:
  """A parameter's array, or layer `layer` of it in a stacked module."""
  return param[...] if layer is None else param[layer]


class DecoderLayer(nnx.Module):
  """One pre-norm decoder block; `Transformer` stacks L of them on a leading axis."""

  def __init__(self, config: BlockConfig, dtype, rngs: nnx.Rngs):
    e, d, f = config.hidden_size, config.head_dim, config.intermediate_size
    # q, k and v heads grouped by KV head: each KV head's G query heads, then its key, then
    # its value, so that splitting the KV-head axis gives each device whole groups (tensor
    # parallelism by heads, `sharding.py`).
    qkv = (config.num_kv_heads, config.group_size + 2)
    self.config = config
    self.attn_norm = nnx.Param(jnp.ones((e,), dtype))
    self.qkv = nnx.Param(init_weight(rngs.params(), (e, *qkv, d), dtype))
    self.qkv_bias = nnx.Param(jnp.zeros((*qkv, d), dtype)) if config.qkv_bias else None
    self.o = nnx.Param(init_weight(rngs.params(), (config.num_heads, d, e), dtype))
    self.mlp_norm = nnx.Param(jnp.ones((e,), dtype))
    self.gate_up = nnx.Param(init_weight(rngs.params(), (e, 2, f), dtype))
    self.down = nnx.Param(init_weight(rngs.params(), (f, e), dtype))

  def _norm(self, x: jax.Array, name: str, layer, invariant: bool, norms) -> jax.Array:
    """The norm `name` of x. `norms` (stack, index): the gain is layer `index` of that
    stacked module's, read in place by the Pallas kernel (`rms_norm`'s `kernel`): a
    layer's slice of the gains handed to the kernel would cost a launch of its own."""
    eps = self.config.rms_norm_eps
    if norms is not None:
      stack, index = norms
      return rms_norm(x, getattr(stack, name)[...], eps, layer=index, kernel=True)
    return rms_norm(x, getattr(self, name)[...], eps, layer=layer, invariant=invariant)

  def project_qkv(
    self, x: jax.Array, cos: jax.Array, sin: jax.Array, *, layer=None, invariant: bool = False, norms=None
  ):
    """x [B, T, E] -> q [B, T, K, G, D], k and v [B, T, K, D], RoPE applied to q and k.
    (`layer`, `invariant`: see the module docstring and `linear`; `norms`: `_norm`.)"""
    c = self.config
    h = self._norm(x, "attn_norm", layer, invariant, norms)
    qkv = linear(h, self.qkv[...], layer=layer, invariant=invariant)  # [B, T, K, G + 2, D]
    if self.qkv_bias is not None:
      qkv = qkv + _at(self.qkv_bias, layer)
    b, t = x.shape[:2]
    g = c.group_size
    q = apply_rope(qkv[:, :, :, :g].reshape(b, t, c.num_heads, c.head_dim), cos, sin)
    k = apply_rope(qkv[:, :, :, g], cos, sin)
    return q.reshape(b, t, c.num_kv_heads, g, c.head_dim), k, qkv[:, :, :, g + 1]

  def add_attention(
    self, x: jax.Array, attn_out: jax.Array, o: jax.Array | None = None, *, layer=None, invariant: bool = False
  ) -> jax.Array:
    """Residual plus the output projection `o [H, D, E]` (this layer's by default) of
    attn_out [B, T, K, G, D]."""
    c = self.config
    b, t = x.shape[:2]
    attn_out = attn_out.reshape(b, t, c.num_heads, c.head_dim).astype(x.dtype)
    if o is None:
      o = self.o[...]
    return x + linear(attn_out, o, 2, layer=layer, invariant=invariant)

  def add_mlp(self, x: jax.Array, *, layer=None, invariant: bool = False, norms=None) -> jax.Array:
    """Residual plus the SwiGLU MLP of the normed x [B, T, E] (`norms`: `_norm`)."""
    h = self._norm(x, "mlp_norm", layer, invariant, norms)
    gate_up = linear(h, self.gate_up[...], layer=layer, invariant=invariant)  # [B, T, 2, F]
    h = jax.nn.silu(gate_up[:, :, 0]) * gate_up[:, :, 1]
    return x + linear(h, self.down[...], layer=layer, invariant=invariant)


def stacked_layers(layer_class, config, dtype, rngs: nnx.Rngs) -> nnx.Module:
  """`config.num_layers` layers as one module whose parameters carry a leading L axis
  (each layer initialised from its own split of `rngs`), for `lax.scan`."""

  @nnx.split_rngs(splits=config.num_layers)
  @nnx.vmap(in_axes=(0,), out_axes=0)
  def make_layers(rngs: nnx.Rngs):
    return layer_class(config, dtype, rngs)

  return make_layers(rngs)


def build_random(make, seed: int = 0) -> nnx.Module:
  """The module `make(rngs)` builds, its arrays initialised in one jit: on the default
  device, or under a mesh each device making its own share (`sharding`)."""
  graphdef, abstract = nnx.split(nnx.eval_shape(lambda: make(nnx.Rngs(seed))))
  shardings = None if sharding.current_mesh() is None else sharding.param_shardings(jax.sharding.get_mesh(), abstract)
  return nnx.merge(graphdef, jax.jit(lambda: nnx.state(make(nnx.Rngs(seed))), out_shardings=shardings)())
