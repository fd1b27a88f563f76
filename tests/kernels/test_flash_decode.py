"""The flash-decoding kernel (interpret mode on CPU) against the jnp reference."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from longspec_jax.ops.attention import prefix_attention_reference
from pallas_kernels import blocks
from pallas_kernels.flash_decode import bounds, flash_decode, prefix_partials
from pallas_kernels.tuning import KernelParams

from helpers import (
  DTYPES,
  GROUPS,
  HEAD_DIMS,
  SEEDS,
  TOLERANCE,
  examples,
  interpret_outputs_start_as_nan,
  random_attention_inputs,
)


@examples(6)
@given(
  seed=SEEDS,
  steps=st.integers(1, 5),
  seq_len=st.integers(1, 150),
  group=GROUPS,
  head_dim=HEAD_DIMS,
  dtype=DTYPES,
  splits=st.integers(1, 4),
)
def test_matches_reference(seed, steps, seq_len, group, head_dim, dtype, splits):
  """Odd lengths, per-sequence lengths (empty ones too), GQA 1/4/8, several splits."""
  rng = np.random.default_rng(seed)
  q, k, v = random_attention_inputs(rng, 2, steps, seq_len, 2, group, head_dim, dtype)
  lengths = jnp.asarray(rng.integers(0, seq_len + 1, size=2), jnp.int32)
  params = KernelParams(block_rows=16, block_keys=16, num_warps=4, num_stages=2, splits=splits)
  # (jitted: one program each instead of every op compiled eagerly for this example's shapes)
  out, lse = jax.jit(functools.partial(flash_decode, params=params, interpret=True))(q, k, v, lengths)
  ref_out, ref_lse = jax.jit(prefix_attention_reference)(q, k, v, lengths)
  np.testing.assert_allclose(np.asarray(out), np.asarray(ref_out), atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])
  np.testing.assert_allclose(np.asarray(lse), np.asarray(ref_lse), atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


@pytest.mark.parametrize("block_keys", [16, None])  # 16: masked edge blocks around unmasked inner ones
def test_per_query_limits_and_window(block_keys):
  rng = np.random.default_rng(1)
  q, k, v = random_attention_inputs(rng, 2, 3, 97, 2, 4, 64, jnp.float32)
  params = block_keys and KernelParams(block_rows=16, block_keys=block_keys, num_warps=4, num_stages=2, splits=2)
  limits = jnp.asarray([[5, 60, 97], [1, 0, 33]], jnp.int32)  # the draft's delayed cross-attention
  out, lse = flash_decode(q, k, v, limits, params=params, interpret=True)
  ref_out, ref_lse = prefix_attention_reference(q, k, v, limits)
  np.testing.assert_allclose(np.asarray(out), np.asarray(ref_out), atol=2e-5)
  np.testing.assert_array_equal(np.isneginf(np.asarray(lse)), np.isneginf(np.asarray(ref_lse)))
  lengths, positions = jnp.asarray([90, 40]), jnp.asarray([[90, 91, 92], [40, 41, 42]])
  for window in (17, 60):
    out, _ = flash_decode(q, k, v, lengths, positions, window=window, params=params, interpret=True)
    ref_out, _ = prefix_attention_reference(q, k, v, lengths, positions, window=window)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref_out), atol=2e-5)
  full_lengths = jnp.asarray([97, 64])  # every row sees whole blocks
  out, _ = flash_decode(q, k, v, full_lengths, params=params, interpret=True)
  ref_out, _ = prefix_attention_reference(q, k, v, full_lengths)
  np.testing.assert_allclose(np.asarray(out), np.asarray(ref_out), atol=2e-5)


@pytest.mark.parametrize("splits", [1, 3])
def test_every_output_element_is_written(splits):
  """Interpreted, the outputs start as NaN (`interpret_outputs_start_as_nan`): any element
  left unwritten shows."""
  assert interpret_outputs_start_as_nan()
  rng = np.random.default_rng(2)
  q, k, v = random_attention_inputs(rng, 2, 2, 70, 2, 4, 64, jnp.float32)
  params = KernelParams(block_rows=16, block_keys=16, num_warps=4, num_stages=2, splits=splits)
  rows = blocks.to_rows(q, params.block_rows)
  lo, hi = (blocks.per_row(x, 4, rows.shape[2]) for x in bounds(jnp.asarray([70, 0]), None, None, 2))
  out, lse = prefix_partials(rows, k, v, lo, hi, params, interpret=True)
  assert not np.any(np.isnan(np.asarray(out))) and not np.any(np.isnan(np.asarray(lse)))


def test_layer_of_a_stacked_cache():
  """Layer `layer` of a stacked [L, B, S, K, D] cache, the index traced (as in the layer
  scan) or a negative int (the draft's cross layer -1), reads what that layer's slice reads."""
  rng = np.random.default_rng(3)
  q, _, _ = random_attention_inputs(rng, 2, 3, 1, 2, 4, 64, jnp.float32)
  k, v = (jnp.asarray(rng.standard_normal((3, 2, 45, 2, 64)), jnp.float32) for _ in "kv")
  lengths = jnp.asarray([45, 17], jnp.int32)
  params = KernelParams(block_rows=16, block_keys=16, num_warps=4, num_stages=2, splits=2)
  traced = jax.jit(lambda layer: flash_decode(q, k, v, lengths, layer=layer, params=params, interpret=True)[0])
  for layer in range(3):
    ref, _ = prefix_attention_reference(q, k[layer], v[layer], lengths)
    np.testing.assert_allclose(np.asarray(traced(jnp.int32(layer))), np.asarray(ref), atol=2e-5)
  out, _ = flash_decode(q, k, v, lengths, layer=-1, params=params, interpret=True)
  np.testing.assert_allclose(
    np.asarray(out), np.asarray(prefix_attention_reference(q, k[2], v[2], lengths)[0]), atol=2e-5
  )
