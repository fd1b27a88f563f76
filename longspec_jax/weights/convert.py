"""Hugging Face tensor names -> the target's parameter pytree.

Both loaders (safetensors directories and GGUF files) produce tensors under their HF
names in the HF `nn.Linear` layout `[out, in]`; this module stacks the layers, fuses
q/k/v and gate/up, and fills the model's abstract state, checking every shape.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from longspec_jax.errors import UserError
from longspec_jax.models.config import TargetConfig
from longspec_jax.models.target import Transformer, abstract_model
from longspec_jax.ops import sharding

# name -> float array [out, in] (or [n] for norms and biases), None if absent
TensorGetter = Callable[[str], "np.ndarray | None"]


def build_model(config: TargetConfig, get: TensorGetter, dtype, source: str) -> Transformer:
  """Fills a `Transformer` of `dtype` from HF-named tensors; `source` names the weights in errors."""

  def need(name: str) -> np.ndarray:
    tensor = get(name)
    if tensor is None:
      raise UserError(
        f"{source} has no tensor {name!r}; the weights are incomplete or not a {config.model_type} model."
      )
    return np.asarray(tensor)

  c = config
  e, d = c.hidden_size, c.head_dim

  def grouped(q: np.ndarray, k: np.ndarray, v: np.ndarray) -> np.ndarray:
    """q [H * D, ...], k and v [K * D, ...] (HF's rows: head-major) -> [K, G + 2, D, ...]:
    each KV head's query heads, then its key and value (`layers.DecoderLayer.qkv`)."""
    rest = q.shape[1:]
    q = q.reshape(c.num_kv_heads, c.group_size, d, *rest)
    return np.concatenate([q, k.reshape(c.num_kv_heads, 1, d, *rest), v.reshape(c.num_kv_heads, 1, d, *rest)], axis=1)

  def layer(i: int) -> dict[str, np.ndarray]:
    p = f"model.layers.{i}."
    qkv = grouped(*(need(p + f"self_attn.{x}_proj.weight") for x in "qkv"))  # [K, G + 2, D, E]
    params = {
      "attn_norm": need(p + "input_layernorm.weight"),
      "qkv": np.moveaxis(qkv, -1, 0),
      "o": need(p + "self_attn.o_proj.weight").reshape(e, c.num_heads, d).transpose(1, 2, 0),
      "mlp_norm": need(p + "post_attention_layernorm.weight"),
      "gate_up": np.stack([need(p + "mlp.gate_proj.weight").T, need(p + "mlp.up_proj.weight").T], axis=1),
      "down": need(p + "mlp.down_proj.weight").T,
    }
    if c.qkv_bias:
      params["qkv_bias"] = grouped(*(need(p + f"self_attn.{x}_proj.bias") for x in "qkv"))
    return params

  np_dtype = jnp.dtype(dtype)
  first = layer(0)
  stacked = {k: np.empty((c.num_layers, *v.shape), np_dtype) for k, v in first.items()}
  for i in range(c.num_layers):
    for k, v in (first if i == 0 else layer(i)).items():
      if v.shape != stacked[k].shape[1:]:
        raise UserError(f"{source}: layer {i} tensor {k} has shape {v.shape}, expected {stacked[k].shape[1:]}.")
      stacked[k][i] = v
  params = {
    "embed": need("model.embed_tokens.weight"),
    "layers": stacked,
    "final_norm": need("model.norm.weight"),
  }
  if not c.tie_word_embeddings:
    params["lm_head"] = need("lm_head.weight").T
  return _fill(config, params, dtype, source)


def _fill(config: TargetConfig, params: dict, dtype, source: str) -> Transformer:
  graphdef, state = nnx.split(abstract_model(config, dtype))
  expected = nnx.to_pure_dict(state)

  def place(path, want, got):
    name = jax.tree_util.keystr(path)
    if got is None:
      raise UserError(f"{source} is missing {name}.")
    if tuple(got.shape) != tuple(want.shape):
      raise UserError(f"{source}: {name} has shape {tuple(got.shape)}, expected {tuple(want.shape)}.")
    return np.asarray(got, dtype=want.dtype)

  filled = jax.tree_util.tree_map_with_path(
    place, expected, params, is_leaf=lambda x: x is None or isinstance(x, np.ndarray)
  )
  nnx.replace_by_pure_dict(state, sharding.put(filled))  # (under a mesh, each device its share)
  return nnx.merge(graphdef, state)
