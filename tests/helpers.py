"""Helpers the tests share: random targets (torch-free), tiny Hugging Face models saved
with transformers (the parity tests), the kernels' random inputs, real local text, a CLI run
in-process, and Hypothesis example counts that follow the profile."""

from __future__ import annotations

import glob
import os
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import settings
from hypothesis import strategies as st

from longspec_jax.decoding.tree import Tree
from longspec_jax.models.config import RopeConfig, TargetConfig


def examples(n: int) -> settings:
  """Hypothesis settings for a test of `n` examples: `n` under the `ci` profile (the
  default), the `dev` profile's few where that is set (HYPOTHESIS_PROFILE=dev)."""
  return settings(max_examples=min(n, settings().max_examples), deadline=None)


# The tiny target every CPU test decodes with: the shapes of `save_tiny_hf_model`'s, by kind.
TINY_SHAPE = dict(
  vocab_size=211,
  hidden_size=64,
  intermediate_size=96,
  num_layers=3,
  num_heads=8,
  num_kv_heads=2,
  head_dim=8,
  max_position_embeddings=512,
  rms_norm_eps=1e-5,
  bos_token_id=1,
  eos_token_ids=(2,),
)
TINY_CONFIGS = {
  "llama": TargetConfig(
    **TINY_SHAPE,
    rope=RopeConfig(
      theta=500000.0,
      kind="llama3",
      factor=8.0,
      low_freq_factor=1.0,
      high_freq_factor=4.0,
      original_max_position_embeddings=64,
    ),
  ),
  "qwen2": TargetConfig(
    **TINY_SHAPE, rope=RopeConfig(theta=10000.0), tie_word_embeddings=True, qkv_bias=True, model_type="qwen2"
  ),
}


def tiny_target(kind: str = "llama", dtype=jnp.float32, seed: int = 0):
  """A tiny random target of `kind` (TINY_CONFIGS), built without torch: random weights,
  and norms and biases drawn around their usual values so that they are tested too."""
  from flax import nnx

  from longspec_jax.models.target import random_model

  model = random_model(TINY_CONFIGS[kind], dtype, seed=seed)
  graphdef, state = nnx.split(model)
  pure = nnx.to_pure_dict(state)
  rng = np.random.default_rng(seed)

  def perturb(path, leaf):
    name = "/".join(str(getattr(p, "key", p)) for p in path)
    if "norm" in name:
      return jnp.asarray(1.0 + 0.1 * rng.standard_normal(leaf.shape), leaf.dtype)
    if "bias" in name:
      return jnp.asarray(0.1 * rng.standard_normal(leaf.shape), leaf.dtype)
    return leaf

  nnx.replace_by_pure_dict(state, jax.tree_util.tree_map_with_path(perturb, pure))
  return nnx.merge(graphdef, state)


def random_tree(rng, batch, size, vocab):
  """Random trees (parent < child) with a random number of valid nodes and siblings of
  distinct tokens; also target choices that agree with some child 70% of the time."""
  parents = np.full((batch, size), -1)
  depths = np.zeros((batch, size), int)
  valid = np.zeros((batch, size), bool)
  tokens = np.stack([rng.permutation(vocab)[:size] for _ in range(batch)])
  target = rng.integers(0, vocab, size=(batch, size))
  for b in range(batch):
    used = rng.integers(1, size + 1)
    valid[b, :used] = True
    for i in range(1, used):
      parents[b, i] = rng.integers(0, i)
      depths[b, i] = depths[b, parents[b, i]] + 1
    for i in range(used):
      children = [j for j in range(used) if parents[b, j] == i]
      if children and rng.random() < 0.7:
        target[b, i] = tokens[b, rng.choice(children)]
  tree = Tree(
    tokens=jnp.asarray(tokens, jnp.int32),
    parents=jnp.asarray(parents, jnp.int32),
    depths=jnp.asarray(depths, jnp.int32),
    valid=jnp.asarray(valid),
  )
  return tree, parents, depths, valid, tokens, target


def interpret_outputs_start_as_nan() -> bool:
  """Whether Pallas's interpreter starts a kernel's float outputs as NaN (its uninitialized
  value), so that a test finds every element a kernel leaves unwritten."""
  from jax.experimental import pallas as pl

  def writes_nothing(out_ref):
    pass

  out = pl.pallas_call(writes_nothing, out_shape=jax.ShapeDtypeStruct((8,), jnp.float32), interpret=True)()
  return bool(np.all(np.isnan(np.asarray(out))))


# The kernels' random inputs (fresh normal values, never zeros) and tolerances.
TOLERANCE = {jnp.float32: 2e-5, jnp.bfloat16: 2e-2}
# The hypothesis strategies every kernel test draws from.
SEEDS = st.integers(0, 2**31 - 1)
GROUPS = st.sampled_from([1, 4, 8])  # query heads per KV head
HEAD_DIMS = st.sampled_from([64, 128])
DTYPES = st.sampled_from([jnp.float32, jnp.bfloat16])


def random_attention_inputs(rng, batch, steps, seq_len, kv_heads, group, head_dim, dtype):
  """q [B, T, K, G, D] and k, v [B, S, K, D] in `dtype`, as jnp arrays."""
  q = rng.standard_normal((batch, steps, kv_heads, group, head_dim))
  k, v = (rng.standard_normal((batch, seq_len, kv_heads, head_dim)) for _ in "kv")
  return tuple(jnp.asarray(x, dtype) for x in (q, k, v))


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
