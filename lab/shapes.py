"""Real models' shapes, for random-weight runs of the benchmarks and the profiler at the
sizes users run (the weights are random; the shapes, and so the bytes and the work, are
the real ones). Free of JAX, so that flags naming them are checked before JAX starts."""

from __future__ import annotations

from longspec_jax.models.config import RopeConfig, TargetConfig

SMOLLM2_135M = TargetConfig(
  vocab_size=49152,
  hidden_size=576,
  intermediate_size=1536,
  num_layers=30,
  num_heads=9,
  num_kv_heads=3,
  head_dim=64,
  rope=RopeConfig(theta=100000.0),
  max_position_embeddings=8192,
  tie_word_embeddings=True,
)
LLAMA_31_8B = TargetConfig(
  vocab_size=128256,
  hidden_size=4096,
  intermediate_size=14336,
  num_layers=32,
  num_heads=32,
  num_kv_heads=8,
  head_dim=128,
  rms_norm_eps=1e-5,
  max_position_embeddings=131072,
  rope=RopeConfig(
    theta=500000.0,
    kind="llama3",
    factor=8.0,
    low_freq_factor=1.0,
    high_freq_factor=4.0,
    original_max_position_embeddings=8192,
  ),
)

LLAMA_31_70B = TargetConfig(
  vocab_size=128256,
  hidden_size=8192,
  intermediate_size=28672,
  num_layers=80,
  num_heads=64,
  num_kv_heads=8,
  head_dim=128,
  rms_norm_eps=1e-5,
  max_position_embeddings=131072,
  rope=LLAMA_31_8B.rope,
)


SHAPES = {"llama-3.1-8b": LLAMA_31_8B, "llama-3.1-70b": LLAMA_31_70B, "smollm2-135m": SMOLLM2_135M}
