"""Rotary position embeddings for arbitrary integer positions.

Positions are always explicit arrays, never implied by a token's index: prefill, decode,
tree verification (prefix length + depth) and anchor-offset training share this code.
The rotation uses the Hugging Face "rotate half" layout (first half of each head paired
with the second half); GGUF weights are un-permuted into that layout when loaded.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from longspec_jax.models.config import RopeConfig


def inverse_frequencies(rope: RopeConfig, head_dim: int) -> tuple[np.ndarray, float]:
  """Returns (inv_freq [head_dim // 2] float32, attention scaling of cos/sin)."""
  exponents = np.arange(0, head_dim, 2, dtype=np.float64) / head_dim
  inv_freq = 1.0 / rope.theta**exponents  # [D/2]
  scale = 1.0
  if rope.freq_factors is not None:
    inv_freq = inv_freq / np.asarray(rope.freq_factors, np.float64)
  elif rope.kind == "linear":
    inv_freq = inv_freq / rope.factor
  elif rope.kind == "llama3":
    inv_freq = _llama3(inv_freq, rope)
  elif rope.kind == "yarn":
    inv_freq, scale = _yarn(inv_freq, rope, head_dim)
  return inv_freq.astype(np.float32), scale


def _llama3(inv_freq: np.ndarray, rope: RopeConfig) -> np.ndarray:
  """Llama 3.1 scaling: long wavelengths divided by `factor`, short kept, a smooth ramp between."""
  old_len = rope.original_max_position_embeddings
  wavelen = 2 * math.pi / inv_freq
  smooth = (old_len / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
  smooth = np.clip(smooth, 0.0, 1.0)
  return (1 - smooth) * inv_freq / rope.factor + smooth * inv_freq


def _yarn(inv_freq: np.ndarray, rope: RopeConfig, head_dim: int) -> tuple[np.ndarray, float]:
  """YaRN (Peng et al. 2024): NTK-by-parts interpolation plus an attention temperature."""

  def mscale(scale, m=1.0):
    return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

  if rope.attention_factor is not None:
    attention_factor = rope.attention_factor
  elif rope.mscale and rope.mscale_all_dim:
    attention_factor = mscale(rope.factor, rope.mscale) / mscale(rope.factor, rope.mscale_all_dim)
  else:
    attention_factor = mscale(rope.factor)

  def correction_dim(rotations):
    return (
      head_dim
      * math.log(rope.original_max_position_embeddings / (rotations * 2 * math.pi))
      / (2 * math.log(rope.theta))
    )

  low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
  if rope.truncate:
    low, high = math.floor(low), math.ceil(high)
  low, high = max(low, 0), min(high, head_dim - 1)
  if low == high:
    high += 0.001
  ramp = np.clip((np.arange(head_dim // 2) - low) / (high - low), 0.0, 1.0)
  extrapolation_weight = 1.0 - ramp
  inv_freq = inv_freq / rope.factor * (1 - extrapolation_weight) + inv_freq * extrapolation_weight
  return inv_freq, attention_factor


def rope_tables(positions: jnp.ndarray, inv_freq: np.ndarray, scale: float) -> tuple[jnp.ndarray, jnp.ndarray]:
  """cos and sin for integer `positions` [...] -> two float32 arrays [..., D/2]."""
  angles = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)
  return jnp.cos(angles) * scale, jnp.sin(angles) * scale


def apply_rope(x: jnp.ndarray, cos: jnp.ndarray, sin: jnp.ndarray) -> jnp.ndarray:
  """Rotates x [B, T, H, D] by the tables [B, T, D/2]; computed in float32, returned in x.dtype."""
  x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
  cos, sin = cos[:, :, None, :], sin[:, :, None, :]
  rotated = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return rotated.astype(x.dtype)


ANCHORS = 4  # positions kept at 0..3 by anchor-offset indexing (attention sinks)


def anchor_offset_positions(
  key: jax.Array, batch: int, length: int, max_len: int, anchors: int = ANCHORS
) -> jnp.ndarray:
  """Training positions [B, T] that reach deep into the context with short sequences
  (LongSpec, Algorithm 1): the first `anchors` tokens keep positions 0..anchors-1, the
  rest continue from anchors + o, with o uniform in [0, max_len - length] per sequence."""
  offsets = jax.random.randint(key, (batch, 1), 0, max_len - length + 1)
  index = jnp.arange(length)[None, :]
  return (index + jnp.where(index >= anchors, offsets, 0)).astype(jnp.int32)
