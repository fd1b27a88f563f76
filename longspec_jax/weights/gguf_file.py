"""Loads a llama.cpp GGUF file: config from its metadata, tensors dequantized in numpy.

llama.cpp's converter permutes the rows of the Llama q/k projections so that each head's
rotary pairs are interleaved; we undo that, so the tensors come out in Hugging Face
layout and the shared converter and RoPE code apply unchanged.
"""

from __future__ import annotations

import functools
from pathlib import Path

import gguf
import numpy as np

from longspec_jax.errors import UserError
from longspec_jax.models.config import RopeConfig, TargetConfig
from longspec_jax.models.target import Transformer
from longspec_jax.weights.convert import build_model

# GGUF architecture -> HF model_type. Mistral GGUFs use the "llama" architecture.
ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2"}

_LAYER_NAMES = {
  "attn_norm.weight": "input_layernorm.weight",
  "attn_q.weight": "self_attn.q_proj.weight",
  "attn_k.weight": "self_attn.k_proj.weight",
  "attn_v.weight": "self_attn.v_proj.weight",
  "attn_q.bias": "self_attn.q_proj.bias",
  "attn_k.bias": "self_attn.k_proj.bias",
  "attn_v.bias": "self_attn.v_proj.bias",
  "attn_output.weight": "self_attn.o_proj.weight",
  "ffn_norm.weight": "post_attention_layernorm.weight",
  "ffn_gate.weight": "mlp.gate_proj.weight",
  "ffn_up.weight": "mlp.up_proj.weight",
  "ffn_down.weight": "mlp.down_proj.weight",
}
_GLOBAL_NAMES = {
  "token_embd.weight": "model.embed_tokens.weight",
  "output_norm.weight": "model.norm.weight",
  "output.weight": "lm_head.weight",
}


def _hf_name(gguf_name: str) -> str | None:
  if gguf_name in _GLOBAL_NAMES:
    return _GLOBAL_NAMES[gguf_name]
  parts = gguf_name.split(".", 2)
  if parts[0] == "blk" and len(parts) == 3 and parts[2] in _LAYER_NAMES:
    return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}"
  return None


def unpermute_rows(w: np.ndarray, num_heads: int) -> np.ndarray:
  """Inverse of llama.cpp's q/k permutation: per head, rows (pair, half) -> (half, pair)."""
  head_rows = w.shape[0] // num_heads
  return w.reshape(num_heads, head_rows // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


@functools.lru_cache(maxsize=2)
def open_gguf(path: Path) -> gguf.GGUFReader:
  """The parsed file (memory-mapped; parsing a large vocabulary takes seconds, so the
  config, the tokenizer and the weights share one reader)."""
  if not path.exists():
    raise UserError(f"GGUF file {path} does not exist.")
  if not path.is_file():
    raise UserError(f"{path} is not a file; expected a .gguf file.")
  try:
    return gguf.GGUFReader(str(path))
  except Exception as e:  # the reader raises ValueError/IndexError/struct errors on bad bytes
    raise UserError(
      f"{path} is not a readable GGUF file; it may be truncated or corrupt ({type(e).__name__}: {e});"
      " download it again."
    ) from None


def _field(reader: gguf.GGUFReader, key: str, default=None):
  field = reader.fields.get(key)
  return default if field is None else field.contents()


def config_from_gguf(reader: gguf.GGUFReader, path: Path) -> TargetConfig:
  arch = _field(reader, "general.architecture")
  if arch not in ARCHITECTURES:
    raise UserError(f"{path}: GGUF architecture {arch!r} is not supported; supported are {', '.join(ARCHITECTURES)}.")

  def meta(key, default=None):
    value = _field(reader, f"{arch}.{key}", default)
    if value is None:
      raise UserError(f"{path}: GGUF metadata lacks {arch}.{key}.")
    return value

  hidden = meta("embedding_length")
  num_heads = meta("attention.head_count")
  tokens = reader.fields.get("tokenizer.ggml.tokens")
  vocab = _field(reader, f"{arch}.vocab_size", len(tokens.data) if tokens is not None else None)
  if vocab is None:
    raise UserError(f"{path}: GGUF metadata gives no vocabulary size.")
  rope_kind = _field(reader, f"{arch}.rope.scaling.type", "none")
  rope_kind = {"none": "default", "linear": "linear", "yarn": "yarn"}.get(rope_kind)
  if rope_kind is None:
    raise UserError(f"{path}: RoPE scaling {_field(reader, f'{arch}.rope.scaling.type')!r} is not supported.")
  tensor_names = {t.name for t in reader.tensors}
  freq_factors = None
  if "rope_freqs.weight" in tensor_names:
    freq_factors = tuple(float(x) for x in _tensor(reader, "rope_freqs.weight").ravel())
  rope = RopeConfig(
    theta=float(meta("rope.freq_base", 10000.0)),
    kind=rope_kind,
    factor=float(_field(reader, f"{arch}.rope.scaling.factor", 1.0)),
    original_max_position_embeddings=int(_field(reader, f"{arch}.rope.scaling.original_context_length", 8192)),
    freq_factors=freq_factors,
  )
  eos = _field(reader, "tokenizer.ggml.eos_token_id")
  return TargetConfig(
    vocab_size=int(vocab),
    hidden_size=int(hidden),
    intermediate_size=int(meta("feed_forward_length")),
    num_layers=int(meta("block_count")),
    num_heads=int(num_heads),
    num_kv_heads=int(meta("attention.head_count_kv", num_heads)),
    head_dim=int(_field(reader, f"{arch}.attention.key_length", hidden // num_heads)),
    rope=rope,
    rms_norm_eps=float(meta("attention.layer_norm_rms_epsilon")),
    max_position_embeddings=int(meta("context_length")),
    tie_word_embeddings="output.weight" not in tensor_names,
    qkv_bias="blk.0.attn_q.bias" in tensor_names,
    sliding_window=_field(reader, f"{arch}.attention.sliding_window"),
    model_type=ARCHITECTURES[arch],
    bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id"),
    eos_token_ids=() if eos is None else (int(eos),),
  )


def _tensor(reader: gguf.GGUFReader, name: str) -> np.ndarray:
  tensor = next(t for t in reader.tensors if t.name == name)
  try:
    return gguf.quants.dequantize(tensor.data, tensor.tensor_type)
  except NotImplementedError:
    raise UserError(
      f"GGUF tensor {name} uses quantization {tensor.tensor_type.name}, which cannot be dequantized."
    ) from None


def read_gguf_config(path: Path) -> TargetConfig:
  return config_from_gguf(open_gguf(path), path)


def load_gguf(path: str | Path, dtype) -> tuple[Transformer, TargetConfig]:
  path = Path(path)
  reader = open_gguf(path)
  config = config_from_gguf(reader, path)
  hf_to_gguf = {_hf_name(t.name): t.name for t in reader.tensors if _hf_name(t.name)}
  permuted_heads = {"self_attn.q_proj": config.num_heads, "self_attn.k_proj": config.num_kv_heads}

  def get(name: str) -> np.ndarray | None:
    gguf_name = hf_to_gguf.get(name)
    if gguf_name is None:
      return None
    w = _tensor(reader, gguf_name)
    if config.model_type == "llama":
      for proj, heads in permuted_heads.items():
        if f".{proj}." in name:
          w = unpermute_rows(w, heads)
    return w

  return build_model(config, get, dtype, str(path)), config
