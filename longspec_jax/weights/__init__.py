"""Target loading by spec: `smollm2-135m` (the embedded default), a HF model dir, or a .gguf file."""

from __future__ import annotations

import dataclasses
import hashlib
import os
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from longspec_jax.config import TargetConfig
from longspec_jax.errors import UserError
from longspec_jax.target import Transformer
from longspec_jax.weights import default
from longspec_jax.weights.gguf_file import load_gguf
from longspec_jax.weights.hf import load_hf_dir

if TYPE_CHECKING:
  import transformers


@dataclasses.dataclass(frozen=True)
class LoadedTarget:
  model: Transformer
  config: TargetConfig
  tokenizer: "transformers.PreTrainedTokenizerBase"
  name: str


def resolve_target(spec: str) -> Path:
  """The weights path a target spec names (a .gguf file or a model directory)."""
  if spec == default.NAME:
    return default.default_gguf_path()
  path = Path(spec).expanduser()
  if path.suffix == ".gguf" or path.is_dir():
    return path
  raise UserError(
      f"target {spec!r} is neither {default.NAME!r}, a Hugging Face model directory, nor a .gguf file."
  )


def load_target(spec: str, dtype) -> LoadedTarget:
  path = resolve_target(spec)
  if path.suffix == ".gguf":
    model, config = load_gguf(path, dtype)
  else:
    model, config = load_hf_dir(path, dtype)
  return LoadedTarget(model=model, config=config, tokenizer=load_tokenizer(path), name=spec)


def load_tokenizer(path: Path):
  """The transformers tokenizer of a model dir or GGUF file (chat template included).

  Converting a GGUF vocabulary takes seconds, so the converted tokenizer is kept in the
  user cache, keyed by the file's path, size and modification time.
  """
  from transformers import AutoTokenizer  # heavy import, only when a tokenizer is needed

  if path.suffix != ".gguf":
    return AutoTokenizer.from_pretrained(str(path))
  stat = path.stat()
  key = hashlib.sha1(f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}".encode()).hexdigest()[:16]
  cached = default.cache_root() / "tokenizers" / key
  if cached.is_dir():
    return AutoTokenizer.from_pretrained(str(cached))
  try:
    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
  except Exception as e:
    raise UserError(f"could not read the tokenizer from {path} ({type(e).__name__}: {e}).") from None
  cached.parent.mkdir(parents=True, exist_ok=True)
  tmp = Path(tempfile.mkdtemp(dir=cached.parent))
  tokenizer.save_pretrained(str(tmp))
  try:
    os.replace(tmp, cached)
  except OSError:  # another process cached it first
    shutil.rmtree(tmp, ignore_errors=True)
  return tokenizer
