"""Pallas hybrid tree attention (interpret mode on CPU) against the reference hybrid (the
engine with either implementation: tests/test_engine.py)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from lab.inputs import random_ancestor_mask
from longspec_jax.ops.attention import Impl, Invariance, hybrid_attention

from helpers import (
  DTYPES,
  GROUPS,
  SEEDS,
  TOLERANCE,
  examples,
  interpret_outputs_start_as_nan,
  random_attention_inputs,
)


@examples(4)
@given(seed=SEEDS, nodes=st.integers(1, 24), cache_len=st.integers(1, 200), group=GROUPS, dtype=DTYPES)
def test_pallas_hybrid_matches_reference(seed, nodes, cache_len, group, dtype):
  rng = np.random.default_rng(seed)
  q, k_cache, v_cache = random_attention_inputs(rng, 2, nodes, cache_len, 2, group, 64, dtype)
  _, k_new, v_new = random_attention_inputs(rng, 2, 1, nodes, 2, 1, 64, dtype)
  lengths = jnp.asarray(rng.integers(0, cache_len + 1, size=2), jnp.int32)
  mask = random_ancestor_mask(rng, 2, nodes)
  positions = lengths[:, None] + jnp.arange(nodes)[None]
  args = (q, k_cache, v_cache, lengths, k_new, v_new, mask, positions)
  # (jitted: one program each instead of every op compiled eagerly for this example's shapes)
  out = jax.jit(hybrid_attention, static_argnames="impl")(*args, impl=Impl.PALLAS)
  ref = jax.jit(hybrid_attention, static_argnames="impl")(*args, impl=Impl.REFERENCE)
  np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


@pytest.mark.parametrize(
  "slots, lengths, window", [(70, (63, 20), None), (1100, (1031, 0), None), (1100, (1031, 0), 300)]
)
def test_layer_of_a_stacked_cache(slots, lengths, window):
  """The target's layer scan hands the kernel the whole stacked cache and a traced layer
  index; a cache long enough for several split-K programs beside the tree's (the launch a
  GPU runs at long context), with and without a sliding window. Every partial is written
  (interpreted outputs start as NaN)."""
  assert interpret_outputs_start_as_nan()
  rng = np.random.default_rng(5)
  q, _, _ = random_attention_inputs(rng, 2, 9, 1, 2, 4, 64, jnp.float32)
  _, k_new, v_new = random_attention_inputs(rng, 2, 1, 9, 2, 1, 64, jnp.float32)
  k, v = (jnp.asarray(rng.standard_normal((4, 2, slots, 2, 64)), jnp.float32) for _ in "kv")
  lengths = jnp.asarray(lengths, jnp.int32)
  mask = random_ancestor_mask(rng, 2, 9)
  positions = lengths[:, None] + _depths(mask)
  args = (lengths, k_new, v_new, mask, positions, window)
  run = jax.jit(lambda layer, impl: hybrid_attention(q, k, v, *args, layer=layer, impl=impl), static_argnums=1)
  for layer in (0, 3):
    ref = hybrid_attention(q, k[layer], v[layer], *args, impl=Impl.REFERENCE)
    for impl in Impl:
      out = np.asarray(run(jnp.int32(layer), impl))
      assert not np.any(np.isnan(out))
      np.testing.assert_allclose(out, np.asarray(ref), atol=2e-5)


def _depths(mask):
  return jnp.sum(mask, axis=-1, dtype=jnp.int32) - 1  # [B, N]: ancestors other than the node itself


@examples(4)
@given(
  seed=SEEDS,
  nodes=st.integers(1, 24),
  cache_len=st.integers(1, 300),
  group=GROUPS,
  dtype=DTYPES,
  window=st.sampled_from([None, 40]),
)
def test_invariant_hybrid_matches_reference(seed, nodes, cache_len, group, dtype, window):
  """The batch-invariant pass computes the hybrid attention: the far prefix, the near
  lanes gathered from cache and ancestors, a sliding window."""
  rng = np.random.default_rng(seed)
  q, k_cache, v_cache = random_attention_inputs(rng, 2, nodes, cache_len, 2, group, 64, dtype)
  _, k_new, v_new = random_attention_inputs(rng, 2, 1, nodes, 2, 1, 64, dtype)
  lengths = jnp.asarray(rng.integers(0, cache_len + 1, size=2), jnp.int32)
  mask = random_ancestor_mask(rng, 2, nodes)
  positions = lengths[:, None] + _depths(mask)
  args = (q, k_cache, v_cache, lengths, k_new, v_new, mask, positions, window)
  # (jitted, as above; the window is static)
  run = jax.jit(hybrid_attention, static_argnums=8, static_argnames=("impl", "invariance"))
  out = run(*args, impl=Impl.PALLAS, invariance=Invariance.FULL)
  ref = run(*args, impl=Impl.REFERENCE)
  np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


@pytest.mark.parametrize("lengths", [(650, 9), (542, 94)])
def test_invariant_node_computes_the_bits_of_its_ar_step(lengths):
  """Each node of a random tree gets, bit for bit, what an AR step at its position
  computes alone: its ancestors committed to the cache, one query, one new key. The
  cache spans two split-K ranges; one sequence's far part is long, the other's empty;
  then the far limits (position - 31) of the root and of depth 1 straddle a key block's edge (512, 64), so
  a block is whole for some rows and cut for others."""
  rng = np.random.default_rng(11)
  nodes, group = 14, 4
  q, k_cache, v_cache = random_attention_inputs(rng, 2, nodes, 700, 2, group, 64, jnp.bfloat16)
  _, k_new, v_new = random_attention_inputs(rng, 2, 1, nodes, 2, 1, 64, jnp.bfloat16)
  lengths = jnp.asarray(lengths, jnp.int32)
  mask = random_ancestor_mask(rng, 2, nodes)
  depths = _depths(mask)
  positions = lengths[:, None] + depths
  run = jax.jit(lambda *args: hybrid_attention(*args, impl=Impl.PALLAS, invariance=Invariance.FULL))
  many = np.asarray(run(q, k_cache, v_cache, lengths, k_new, v_new, mask, positions))
  for n in range(nodes):
    k_ar, v_ar = k_cache, v_cache
    for b in range(2):  # commit the node's ancestors, root first
      path = sorted((int(depths[b, a]), a) for a in np.flatnonzero(np.asarray(mask[b, n])) if a != n)
      for depth, a in path:
        k_ar = k_ar.at[b, lengths[b] + depth].set(k_new[b, a])
        v_ar = v_ar.at[b, lengths[b] + depth].set(v_new[b, a])
    alone = run(
      q[:, n : n + 1],
      k_ar,
      v_ar,
      lengths + depths[:, n],
      k_new[:, n : n + 1],
      v_new[:, n : n + 1],
      jnp.ones((2, 1, 1), bool),
      positions[:, n : n + 1],
    )
    np.testing.assert_array_equal(np.asarray(alone)[:, 0], many[:, n])
  # The same cache contents allocated longer (a speculative run leaves room for its tree).
  longer = [jnp.pad(x, ((0, 0), (0, 333), (0, 0), (0, 0))) for x in (k_cache, v_cache)]
  np.testing.assert_array_equal(np.asarray(run(q, *longer, lengths, k_new, v_new, mask, positions)), many)
