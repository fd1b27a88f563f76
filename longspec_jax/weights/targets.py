"""Target loading by spec: `smollm2-135m` (the embedded default), a HF model dir, or a .gguf file."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING

from longspec_jax.errors import UserError
from longspec_jax.models.config import TargetConfig
from longspec_jax.models.target import Transformer
from longspec_jax.ops.numerics import Numerics
from longspec_jax.weights import default
from longspec_jax.weights.gguf_file import load_gguf, read_gguf_config
from longspec_jax.weights.hf import load_hf_dir, read_config
from longspec_jax.weights.tokenizer import load_tokenizer

if TYPE_CHECKING:
  import transformers


@dataclasses.dataclass(frozen=True)
class LoadedTarget:
  model: Transformer
  config: TargetConfig
  tokenizer: transformers.PreTrainedTokenizerBase
  name: str


def resolve_target(spec: str) -> Path:
  """The weights path a target spec names (a .gguf file or a model directory)."""
  if spec == default.NAME:
    return default.default_gguf_path()
  path = Path(spec).expanduser()
  if not path.exists():
    raise UserError(
      f"target {spec!r} does not exist; give {default.NAME!r}, a Hugging Face model directory or a .gguf file."
    )
  if path.suffix == ".gguf" or path.is_dir():
    return path
  raise UserError(f"target {spec!r} is neither a Hugging Face model directory nor a .gguf file.")


def read_target_config(path: Path) -> TargetConfig:
  """The config of the weights at `path`, without loading them."""
  return read_gguf_config(path) if path.suffix == ".gguf" else read_config(path)


def load_target(spec: str | Path, dtype, tokenizer=None, numerics: Numerics | None = None) -> LoadedTarget:
  """Loads the target a spec names (`resolve_target`); `tokenizer` skips loading it again;
  `numerics`: how it computes (default: `Numerics()`, the backend's fastest)."""
  path = spec if isinstance(spec, Path) else resolve_target(spec)
  if path.suffix == ".gguf":
    model, config = load_gguf(path, dtype)
  else:
    model, config = load_hf_dir(path, dtype)
  if numerics is not None:
    model = model.with_numerics(numerics)
  return LoadedTarget(model=model, config=config, tokenizer=tokenizer or load_tokenizer(path), name=str(spec))
