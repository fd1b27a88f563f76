"""The target suites' pieces that run anywhere (the suites themselves are sized for a GPU)."""

import jax.numpy as jnp
import numpy as np
from flax import nnx

from lab.bench_target import draft_pass_ms
from longspec_jax.engine import Decoding, decode_chunk, start
from longspec_jax.methods.tokenswift import TokenSwift
from longspec_jax.models.config import HeadsConfig, TargetConfig
from longspec_jax.models.heads import random_heads
from longspec_jax.models.target import random_model

TARGET = TargetConfig(
  vocab_size=97,
  hidden_size=32,
  intermediate_size=48,
  num_layers=2,
  num_heads=4,
  num_kv_heads=2,
  head_dim=8,
  max_position_embeddings=512,
)


def test_tokenswifts_drafting_pass_is_timed_steady_and_selecting():
  model = random_model(TARGET, jnp.float32)
  graphdef, params = nnx.split(random_heads(HeadsConfig.for_target(TARGET), jnp.float32))
  decoding = Decoding(proposer=TokenSwift(graphdef, budget=24, sink=4, lag=0))
  prompts = np.random.default_rng(0).integers(0, 97, (2, 40)).tolist()
  state = start(model, prompts, 32, decoding, params).state
  state, _, _ = decode_chunk(model, state, decoding, params, max_new_tokens=32, rounds=3)
  timed = draft_pass_ms(model, state, decoding.proposer.depth + 1)
  assert timed["draft_pass_ms"] > 0 and timed["draft_pass_selecting_ms"] > 0 and timed["partial_cache_slots"] == 24
