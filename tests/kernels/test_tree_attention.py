"""The masked tree-attention kernel (interpret mode on CPU) against the jnp reference."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from lab.inputs import random_ancestor_mask
from longspec_jax.ops.attention import masked_attention_reference
from pallas_kernels import blocks
from pallas_kernels.tree_attention import tree_attention, tree_partial
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
  nodes=st.integers(1, 40),
  group=GROUPS,
  head_dim=HEAD_DIMS,
  dtype=DTYPES,
  splits=st.integers(1, 3),
)
def test_random_trees_match_reference(seed, nodes, group, head_dim, dtype, splits):
  """Odd node counts, GQA 1/4/8, the keys in one range or split over several programs."""
  rng = np.random.default_rng(seed)
  q, k, v = random_attention_inputs(rng, 2, nodes, nodes, 2, group, head_dim, dtype)
  mask = random_ancestor_mask(rng, 2, nodes)
  params = KernelParams(block_rows=16, block_keys=16, num_warps=4, num_stages=2, splits=splits)
  # (jitted: one program each instead of every op compiled eagerly for this example's shapes)
  out, lse = jax.jit(functools.partial(tree_attention, params=params, interpret=True))(q, k, v, mask)
  ref_out, ref_lse = jax.jit(masked_attention_reference)(q, k, v, mask)
  np.testing.assert_allclose(np.asarray(out), np.asarray(ref_out), atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])
  np.testing.assert_allclose(np.asarray(lse), np.asarray(ref_lse), atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


def test_every_output_element_is_written():
  """Interpreted, the outputs start as NaN: any element left unwritten shows."""
  assert interpret_outputs_start_as_nan()
  rng = np.random.default_rng(3)
  q, k, v = random_attention_inputs(rng, 1, 21, 21, 2, 4, 64, jnp.float32)
  mask = random_ancestor_mask(rng, 1, 21).at[0, 20].set(False)  # a row with nothing visible
  params = KernelParams(block_rows=32, block_keys=16, num_warps=4, num_stages=2)
  rows = blocks.to_rows(q, params.block_rows)
  out, lse = tree_partial(rows, k, v, blocks.per_row(mask, 4, rows.shape[2]), params, True)
  assert not np.any(np.isnan(np.asarray(out))) and not np.any(np.isnan(np.asarray(lse)))
  assert np.all(np.isneginf(np.asarray(lse)[0, 0, :, 80:84]))  # the empty row (node 20, 4 heads)


@examples(4)
@given(seed=SEEDS, keys=st.integers(100, 300), splits=st.integers(2, 5), group=GROUPS)
def test_many_keys_under_any_mask_split_over_programs(seed, keys, splits, group):
  """A ring-like pass: a few queries over hundreds of keys under an arbitrary mask (rows
  that see nothing included), its keys split over programs."""
  rng = np.random.default_rng(seed)
  q, _, _ = random_attention_inputs(rng, 2, 5, 1, 2, group, 64, jnp.float32)
  _, k, v = random_attention_inputs(rng, 2, 1, keys, 2, 1, 64, jnp.float32)
  mask = jnp.asarray(rng.random((2, 5, keys)) < 0.3).at[1, 2].set(False)
  params = KernelParams(block_rows=32, block_keys=32, num_warps=4, num_stages=2, splits=splits)
  out, lse = jax.jit(functools.partial(tree_attention, params=params, interpret=True))(q, k, v, mask)
  ref_out, ref_lse = masked_attention_reference(q, k, v, mask)
  np.testing.assert_allclose(np.asarray(out), np.asarray(ref_out), atol=2e-5, rtol=2e-5)
  np.testing.assert_array_equal(np.isneginf(np.asarray(lse)), np.isneginf(np.asarray(ref_lse)))
  seen = np.isfinite(np.asarray(ref_lse))
  np.testing.assert_allclose(np.asarray(lse)[seen], np.asarray(ref_lse)[seen], atol=2e-5, rtol=2e-5)
