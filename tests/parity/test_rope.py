"""RoPE frequencies and rotation against transformers' own implementations."""

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from longspec_jax.errors import UserError
from longspec_jax.models.config import RopeConfig, TargetConfig
from longspec_jax.models.rope import apply_rope, inverse_frequencies, rope_tables

HEAD_DIM = 64
SCALINGS = {
  "linear": {"rope_type": "linear", "factor": 4.0},
  "llama3": {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
  },
  "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768},
  "yarn_mscale": {
    "rope_type": "yarn",
    "factor": 40.0,
    "mscale": 1.0,
    "mscale_all_dim": 0.707,
    "original_max_position_embeddings": 4096,
    "beta_fast": 16.0,
  },
}


def hf_config(scaling):
  return transformers.LlamaConfig(
    hidden_size=HEAD_DIM * 4,
    num_attention_heads=4,
    rope_theta=500000.0,
    rope_scaling=dict(scaling),
    max_position_embeddings=131072,
  )


@pytest.mark.parametrize("name", sorted(SCALINGS))
def test_inverse_frequencies_match_transformers(name):
  hf = hf_config(SCALINGS[name])
  expected, expected_scale = ROPE_INIT_FUNCTIONS[SCALINGS[name]["rope_type"]](hf, "cpu")
  ours = TargetConfig.from_hf({**hf.to_dict(), "intermediate_size": 1, "vocab_size": 1}).rope
  inv_freq, scale = inverse_frequencies(ours, HEAD_DIM)
  np.testing.assert_allclose(inv_freq, expected.numpy(), rtol=1e-6)
  assert scale == pytest.approx(expected_scale, rel=1e-6)


def test_default_frequencies_and_gguf_freq_factors():
  inv_freq, scale = inverse_frequencies(RopeConfig(theta=10000.0), 8)
  np.testing.assert_allclose(inv_freq, 1.0 / 10000.0 ** (np.arange(0, 8, 2) / 8), rtol=1e-6)
  assert scale == 1.0
  factors = (1.0, 2.0, 4.0, 8.0)
  scaled, _ = inverse_frequencies(dataclasses.replace(RopeConfig(theta=10000.0), freq_factors=factors), 8)
  np.testing.assert_allclose(scaled, inv_freq / np.array(factors), rtol=1e-6)


def test_rotation_matches_transformers_at_arbitrary_positions():
  from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

  rng = np.random.default_rng(0)
  positions = rng.integers(0, 100_000, size=(2, 5))  # explicit, non-contiguous positions
  q = rng.standard_normal((2, 5, 3, HEAD_DIM)).astype(np.float32)
  inv_freq, scale = inverse_frequencies(RopeConfig(theta=500000.0), HEAD_DIM)
  cos, sin = rope_tables(jnp.asarray(positions), inv_freq, scale)
  ours = np.asarray(apply_rope(jnp.asarray(q), cos, sin))
  # Angles in float32, as transformers' rotary embedding computes them.
  angles = torch.tensor(positions, dtype=torch.float32)[..., None] * torch.tensor(inv_freq)
  emb = torch.cat([angles, angles], dim=-1)
  heads_first = torch.tensor(q).transpose(1, 2)
  expected, _ = apply_rotary_pos_emb(heads_first, heads_first, emb.cos(), emb.sin())
  np.testing.assert_allclose(ours, expected.transpose(1, 2).numpy(), atol=1e-5)


def test_unsupported_scaling_is_a_user_error():
  with pytest.raises(UserError, match="dynamic"):
    TargetConfig.from_hf(
      {
        **hf_config({"rope_type": "linear", "factor": 2.0}).to_dict(),
        "rope_scaling": {"rope_type": "dynamic", "factor": 2.0},
        "intermediate_size": 1,
        "vocab_size": 1,
      }
    )


def test_anchor_offset_positions():
  import jax

  from longspec_jax.models.rope import anchor_offset_positions

  positions = np.asarray(anchor_offset_positions(jax.random.key(0), 64, 10, 1000))
  np.testing.assert_array_equal(positions[:, :4], np.broadcast_to(np.arange(4), (64, 4)))  # the sinks
  offsets = positions[:, 4] - 4
  assert offsets.min() >= 0 and positions.max() <= 999 and len(set(offsets)) > 30  # random per sequence
  np.testing.assert_array_equal(np.diff(positions[:, 4:], axis=1), 1)  # consecutive after the sinks
