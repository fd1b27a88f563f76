"""Loads a Hugging Face model directory (config.json + single or sharded safetensors).

No torch: tensors are read with safetensors' numpy-compatible reader.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from safetensors import safe_open

from longspec_jax.errors import UserError
from longspec_jax.models.config import TargetConfig
from longspec_jax.models.target import Transformer
from longspec_jax.weights.convert import build_model

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"


def read_config(model_dir: Path) -> TargetConfig:
  path = model_dir / "config.json"
  try:
    hf = json.loads(path.read_text())
  except FileNotFoundError:
    raise UserError(f"{model_dir} has no config.json; pass a Hugging Face model directory or a .gguf file.") from None
  except (json.JSONDecodeError, UnicodeDecodeError) as e:
    raise UserError(f"{path} is not valid JSON ({e}).") from None
  generation = model_dir / "generation_config.json"
  if generation.exists() and "eos_token_id" in (gen := json.loads(generation.read_text())):
    hf = {**hf, "eos_token_id": gen["eos_token_id"]}
  try:
    return TargetConfig.from_hf(hf)
  except KeyError as e:
    raise UserError(f"{path} lacks the field {e.args[0]!r}.") from None


def _shard_files(model_dir: Path) -> dict[str, Path]:
  """tensor name -> file holding it."""
  index = model_dir / INDEX_NAME
  if index.exists():
    weight_map = json.loads(index.read_text())["weight_map"]
    return {name: model_dir / file for name, file in weight_map.items()}
  single = model_dir / SINGLE_NAME
  if not single.exists():
    raise UserError(f"{model_dir} has no {SINGLE_NAME} or {INDEX_NAME}; only safetensors weights are supported.")
  with _open(single) as f:
    return {name: single for name in f.keys()}


def _open(path: Path):
  try:
    # "flax" returns jax arrays for every dtype safetensors knows, bfloat16 included.
    return safe_open(str(path), framework="flax")
  except FileNotFoundError:
    raise UserError(f"weights file {path} is missing.") from None
  except Exception as e:  # safetensors raises its own SafetensorError for bad headers
    raise UserError(f"weights file {path} is truncated or corrupt ({e}).") from None


def load_hf_dir(model_dir: str | Path, dtype) -> tuple[Transformer, TargetConfig]:
  model_dir = Path(model_dir)
  config = read_config(model_dir)
  files = _shard_files(model_dir)
  handles = {}

  def get(name: str) -> np.ndarray | None:
    path = files.get(name)
    if path is None:
      return None
    if path not in handles:
      handles[path] = _open(path)
    try:
      return np.asarray(handles[path].get_tensor(name), np.float32)
    except Exception as e:
      raise UserError(f"tensor {name} in {path} could not be read; the file is truncated or corrupt ({e}).") from None

  return build_model(config, get, dtype, str(model_dir)), config
