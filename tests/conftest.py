"""Shared fixtures: tiny random HF models saved to disk, the real SmolLM2 GGUF, real text."""

from __future__ import annotations

import gc
import glob
import os
from pathlib import Path

import jax
import pytest

jax.config.update("jax_default_matmul_precision", "highest")
# The backend starts now, with one CPU device, whatever a test runs first: a CLI run
# in-process with `--devices N` then finds it started and cannot add devices (one that
# started it would give the rest of the worker's tests N devices).
jax.devices()

# Mapped memory regions past which `release_compiled_programs` frees compiled programs:
# under half the kernel's default limit, as one module was seen to add 23,000.
MAX_MAP_REGIONS = 30_000


@pytest.fixture(autouse=True, scope="module")
def release_compiled_programs():
  """Frees the compiled programs after a test module once they map many memory regions.
  XLA's CPU executables each map many, and one process running the whole suite would pass
  the kernel's limit on them (vm.max_map_count, 65530): the compiler then segfaults.
  Freeing them after every module would cost the later modules recompilations."""
  yield
  try:
    regions = sum(1 for _ in open("/proc/self/maps"))
  except OSError:  # not Linux
    return
  if regions > MAX_MAP_REGIONS:
    jax.clear_caches()
    gc.collect()


@pytest.fixture(autouse=True)
def fresh_round_costs(tmp_path, monkeypatch):
  """Every test measures `auto`'s round prices afresh and learns its gains afresh: none
  from earlier tests or runs."""
  from longspec_jax import engine
  from longspec_jax.methods import prices

  monkeypatch.setattr(prices, "_MEMORY", {})
  monkeypatch.setattr(engine, "_LEARNT", {})
  monkeypatch.setattr(prices, "cache_root", lambda: tmp_path / "cache")


def real_texts(min_chars: int = 4000, limit: int = 40) -> list[str]:
  """Real local documents: licenses, Python stdlib sources and Debian docs."""
  import sysconfig

  patterns = [
    "/usr/share/common-licenses/*",
    os.path.join(sysconfig.get_paths()["stdlib"], "*.py"),
  ]
  texts = []
  for pattern in patterns:
    for path in sorted(glob.glob(pattern)):
      try:
        text = Path(path).read_text()
      except (UnicodeDecodeError, IsADirectoryError, PermissionError):
        continue
      if len(text) >= min_chars:
        texts.append(text)
      if len(texts) >= limit:
        return texts
  return texts


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
  from longspec_jax.weights.default import default_gguf_path

  return default_gguf_path()


@pytest.fixture(scope="session")
def smollm2_float32(smollm2_gguf):
  import jax.numpy as jnp

  from longspec_jax.weights import load_target

  return load_target(str(smollm2_gguf), jnp.float32)


@pytest.fixture(scope="session")
def tiny_with_tokenizer(tmp_path_factory, smollm2_gguf) -> Path:
  """A tiny random Llama with the real SmolLM2 tokenizer (and its vocabulary size)."""
  from longspec_jax.weights import load_tokenizer

  path = save_tiny_hf_model("llama", tmp_path_factory.mktemp("m") / "tiny", vocab_size=49152, eos_token_id=2)
  load_tokenizer(smollm2_gguf).save_pretrained(path)
  return path


def run_cli(main, argv, prog: str) -> int:
  """Runs a CLI's main in-process as `python -m` would; returns its exit code."""
  from longspec_jax.cli import run_main

  try:
    run_main(lambda: main(argv), prog)
    return 0
  except SystemExit as e:
    return e.code


def save_tiny_hf_model(kind: str, path: Path, **overrides) -> Path:
  """A tiny randomly initialised transformers model saved with save_pretrained."""
  import torch
  import transformers

  common = dict(
    vocab_size=211,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=3,
    num_attention_heads=8,
    num_key_value_heads=2,
    max_position_embeddings=512,
    rms_norm_eps=1e-5,
    bos_token_id=1,
    eos_token_id=2,
    tie_word_embeddings=False,
  )
  configs = {
    "llama": lambda: transformers.LlamaConfig(
      **common,
      rope_theta=500000.0,
      rope_scaling={
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
      },
    ),
    "qwen2": lambda: transformers.Qwen2Config(**{**common, "tie_word_embeddings": True}, rope_theta=10000.0),
    "mistral": lambda: transformers.MistralConfig(**common, rope_theta=10000.0, sliding_window=None),
    "yarn": lambda: transformers.Qwen2Config(
      **common,
      rope_theta=10000.0,
      rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
    ),
    "linear": lambda: transformers.LlamaConfig(
      **common, rope_theta=10000.0, rope_scaling={"rope_type": "linear", "factor": 2.0}
    ),
  }
  config = configs[kind]()
  for key, value in overrides.items():
    setattr(config, key, value)
  torch.manual_seed(0)
  model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
  with torch.no_grad():  # HF zero-inits biases and ones norms; randomise so they are tested
    for name, p in model.named_parameters():
      if name.endswith("bias") or "norm" in name:
        p.copy_(torch.randn_like(p) * 0.1 + (1.0 if "norm" in name else 0.0))
  model.save_pretrained(path)
  return path
