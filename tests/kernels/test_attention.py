"""The reference hybrid attention equals one plain masked softmax over prefix + new block."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from lab.inputs import random_ancestor_mask
from longspec_jax.ops import attention

from helpers import SEEDS, examples


def dense_attention(q, k, v, visible):
  """q [B,T,K,G,D]; k, v [B,S,K,D]; visible [B,T,S] -> out [B,T,K,G,D], float64 numpy."""
  q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
  scores = np.einsum("btkgd,bskd->bkgts", q, k) / np.sqrt(q.shape[-1])
  scores = np.where(visible[:, None, None], scores, -np.inf)
  weights = np.exp(scores - scores.max(-1, keepdims=True))
  weights /= weights.sum(-1, keepdims=True)
  return np.einsum("bkgts,bskd->btkgd", weights, v)


@examples(15)
@given(
  seed=SEEDS,
  batch=st.integers(1, 3),
  steps=st.integers(1, 9),
  cache_len=st.integers(1, 37),
  kv_heads=st.sampled_from([1, 2]),
  group=st.sampled_from([1, 4]),
  head_dim=st.sampled_from([8, 16]),
)
def test_hybrid_equals_dense(seed, batch, steps, cache_len, kv_heads, group, head_dim):
  rng = np.random.default_rng(seed)
  q = rng.standard_normal((batch, steps, kv_heads, group, head_dim)).astype(np.float32)
  k_cache, v_cache = (rng.standard_normal((batch, cache_len, kv_heads, head_dim)).astype(np.float32) for _ in "kv")
  k_new, v_new = (rng.standard_normal((batch, steps, kv_heads, head_dim)).astype(np.float32) for _ in "kv")
  lengths = rng.integers(0, cache_len + 1, size=batch)  # includes empty prefixes
  mask = random_ancestor_mask(rng, batch, steps)
  positions = lengths[:, None] + np.arange(steps)
  # (jitted: one program each instead of every op compiled eagerly for this example's shapes)
  out = jax.jit(attention.hybrid_attention, static_argnames="impl")(
    jnp.asarray(q),
    jnp.asarray(k_cache),
    jnp.asarray(v_cache),
    jnp.asarray(lengths, jnp.int32),
    jnp.asarray(k_new),
    jnp.asarray(v_new),
    jnp.asarray(mask),
    jnp.asarray(positions),
    impl=attention.Impl.REFERENCE,
  )
  prefix_visible = np.broadcast_to(
    (np.arange(cache_len)[None, :] < lengths[:, None])[:, None, :], (batch, steps, cache_len)
  )
  expected = dense_attention(
    q,
    np.concatenate([k_cache, k_new], 1),
    np.concatenate([v_cache, v_new], 1),
    np.concatenate([prefix_visible, mask], axis=2),
  )
  np.testing.assert_allclose(np.asarray(out), expected, atol=2e-5)


def test_sliding_window_hides_old_prefix_slots():
  rng = np.random.default_rng(3)
  q = rng.standard_normal((1, 2, 1, 2, 8)).astype(np.float32)
  k, v = (rng.standard_normal((1, 12, 1, 8)).astype(np.float32) for _ in "kv")
  positions = np.array([[10, 11]])
  out, lse = attention.prefix_attention_reference(
    jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), jnp.array([10]), jnp.asarray(positions), window=4
  )
  slots = np.arange(12)
  visible = (slots[None, :] < 10) & (positions[0][:, None] - slots[None, :] < 4)
  np.testing.assert_allclose(np.asarray(out), dense_attention(q, k, v, visible[None]), atol=1e-5)


def test_per_query_prefix_limits():
  """lengths [B, T]: each query sees its own number of slots (the draft's delayed cross-attention)."""
  rng = np.random.default_rng(4)
  q = rng.standard_normal((2, 3, 2, 2, 8)).astype(np.float32)
  k, v = (rng.standard_normal((2, 11, 2, 8)).astype(np.float32) for _ in "kv")
  limits = np.array([[1, 5, 11], [7, 0, 3]])
  out, lse = attention.prefix_attention_reference(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), jnp.asarray(limits))
  visible = np.arange(11)[None, None, :] < limits[:, :, None]
  with np.errstate(invalid="ignore"):  # the query with no visible slot
    expected = dense_attention(q, k, v, visible)
  out = np.array(out)
  np.testing.assert_allclose(out[1, 1], 0.0)  # no visible slot: zero output, lse -inf
  assert np.all(np.isneginf(np.asarray(lse)[1, 1]))
  out[1, 1] = expected[1, 1] = 0.0
  np.testing.assert_allclose(out, np.nan_to_num(expected), atol=1e-5)


def test_empty_passes_vanish_in_merge():
  out = jnp.ones((1, 1, 1, 1, 4))
  lse = jnp.zeros((1, 1, 1, 1))
  empty_out, empty_lse = jnp.zeros_like(out), jnp.full_like(lse, -jnp.inf)
  merged, merged_lse = attention.merge(empty_out, empty_lse, out, lse)
  np.testing.assert_array_equal(np.asarray(merged), np.asarray(out))
  both_empty, both_lse = attention.merge(empty_out, empty_lse, empty_out, empty_lse)
  assert np.all(np.isfinite(np.asarray(both_empty))) and np.all(np.isneginf(np.asarray(both_lse)))


@pytest.mark.parametrize("window", [None, 3])
def test_causal_block_mask(window):
  positions = jnp.array([[5, 6, 7, 8, 9]])
  valid = jnp.array([[True, True, True, True, False]])
  mask = np.asarray(attention.causal_block_mask(positions, valid, window))
  i, j = np.meshgrid(np.arange(5), np.arange(5), indexing="ij")
  expected = (j <= i) & (j < 4) & ((i - j < window) if window else True)
  np.testing.assert_array_equal(mask[0], expected)


@examples(6)
@given(
  seed=SEEDS,
  batch=st.integers(1, 3),
  length=st.integers(1, 29),
  kv_heads=st.sampled_from([1, 2]),
  group=st.sampled_from([1, 3]),
  window=st.sampled_from([None, 1, 5, 64]),
  max_delay=st.integers(0, 6),
  block=st.integers(1, 6),
)
def test_flash_training_passes_equal_the_reference(seed, batch, length, kv_heads, group, window, max_delay, block):
  """The draft's structured training passes (causal within a window; a per-sequence delay;
  GLIDE's blocks) by `Impl.FLASH`: the reference's outputs and gradients, GQA and odd
  sizes."""
  import jax

  rng = np.random.default_rng(seed)
  q = jnp.asarray(rng.standard_normal((batch, length, kv_heads, group, 8)), jnp.float32)
  k, v = (jnp.asarray(rng.standard_normal((batch, length, kv_heads, 8)), jnp.float32) for _ in "kv")
  delay = jnp.asarray(rng.integers(0, max_delay + 1, batch), jnp.int32)
  passes = {
    "causal": lambda q, k, v, impl: attention.causal_attention(q, k, v, window, impl=impl),
    "delayed": lambda q, k, v, impl: attention.delayed_attention(q, k, v, delay, impl=impl),
    "blockwise": lambda q, k, v, impl: attention.blockwise_attention(q, k, v, block, impl=impl),
  }
  for name, fn in passes.items():
    loss = lambda q, k, v, impl: jnp.sum(jnp.sin(fn(q, k, v, impl).astype(jnp.float32)))
    # (jitted: one program each instead of every op compiled eagerly for this example's shapes)
    grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)), static_argnums=3)
    want, want_grads = grads(q, k, v, attention.Impl.REFERENCE)
    got, got_grads = grads(q, k, v, attention.Impl.FLASH)
    np.testing.assert_allclose(float(got), float(want), rtol=1e-4, atol=1e-4, err_msg=name)
    for g, w in zip(got_grads, want_grads):
      np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-4, atol=1e-5, err_msg=name)


def test_blockwise_cross_attention_is_glides_mask():
  """glide-cape.md section 4.1, block length 5: a token of block i attends to the target
  K/V of blocks < i only (the first block to none: 0)."""
  rng = np.random.default_rng(4)
  q = jnp.asarray(rng.standard_normal((1, 12, 1, 2, 8)), jnp.float32)
  k, v = (jnp.asarray(rng.standard_normal((1, 12, 1, 8)), jnp.float32) for _ in "kv")
  out = np.asarray(attention.blockwise_attention(q, k, v, 5, impl=attention.Impl.REFERENCE))
  i, j = np.meshgrid(np.arange(12), np.arange(12), indexing="ij")
  mask = jnp.asarray(j < (i // 5) * 5)[None]
  expected, _ = attention.masked_attention_reference(q, k, v, mask)
  np.testing.assert_allclose(out[:, 5:], np.asarray(expected)[:, 5:], atol=1e-6)
  np.testing.assert_array_equal(out[:, :5], 0)


@pytest.mark.parametrize("impl", [attention.Impl.REFERENCE, attention.Impl.PALLAS])
def test_a_sparse_prefix_sees_only_the_kept_chunks(impl):
  """Hybrid attention with kept chunks = the dense pass over the kept slots and the block
  (GQA, odd lengths, a random tree); every chunk kept = the dense hybrid pass."""
  rng = np.random.default_rng(11)
  batch, steps, kv_heads, group, dim, cache_len, chunk = 2, 5, 2, 3, 16, 83, 16
  q = rng.standard_normal((batch, steps, kv_heads, group, dim)).astype(np.float32)
  k_cache, v_cache = (rng.standard_normal((batch, cache_len, kv_heads, dim)).astype(np.float32) for _ in "kv")
  k_new, v_new = (rng.standard_normal((batch, steps, kv_heads, dim)).astype(np.float32) for _ in "kv")
  lengths = np.asarray([83, 40])
  mask = random_ancestor_mask(rng, batch, steps)
  kept = rng.random((batch, kv_heads, 6)) < 0.5
  args = [jnp.asarray(x) for x in (q, k_cache, v_cache, lengths, k_new, v_new, mask, lengths[:, None] + np.arange(5))]
  out = attention.hybrid_attention(*args, impl=impl, kept=jnp.asarray(kept), chunk=chunk)
  for head in range(kv_heads):
    visible = (np.arange(cache_len)[None] < lengths[:, None]) & kept[:, head, np.arange(cache_len) // chunk]
    expected = dense_attention(
      q[:, :, head : head + 1],
      np.concatenate([k_cache, k_new], 1)[:, :, head : head + 1],
      np.concatenate([v_cache, v_new], 1)[:, :, head : head + 1],
      np.concatenate([np.broadcast_to(visible[:, None], (batch, steps, cache_len)), mask], 2),
    )
    np.testing.assert_allclose(np.asarray(out[:, :, head : head + 1]), expected, atol=2e-5)
  every = attention.hybrid_attention(*args, impl=impl, kept=jnp.ones((batch, kv_heads, 6), bool), chunk=chunk)
  dense = attention.hybrid_attention(*args, impl=attention.Impl.REFERENCE)
  np.testing.assert_allclose(np.asarray(every), np.asarray(dense), atol=2e-5)
  with pytest.raises(ValueError, match="no sliding window"):
    attention.hybrid_attention(*args, window=8, impl=impl, kept=jnp.asarray(kept), chunk=chunk)


def test_the_chunk_mass_is_the_prefix_passs_attention_summed_per_chunk():
  rng = np.random.default_rng(12)
  q = jnp.asarray(rng.standard_normal((2, 3, 2, 2, 8)), jnp.float32)
  k, v = (jnp.asarray(rng.standard_normal((4, 2, 50, 2, 8)), jnp.float32) for _ in "kv")  # a stacked cache
  limits = jnp.asarray([[50, 49, 48], [0, 20, 21]], jnp.int32)  # per query; one saw nothing
  _, lse = attention.prefix_attention(q, k, v, limits, layer=2, impl=attention.Impl.REFERENCE)
  mass = attention.prefix_chunk_mass(q, k, lse, limits, 16, layer=2)  # [B, K, 4]
  assert mass.shape == (2, 2, 4)
  np.testing.assert_allclose(np.asarray(mass.sum(-1)), [[6, 6], [4, 4]], rtol=1e-5)  # T * G (minus empty rows)
  for b, t in ((0, 1), (1, 2)):  # one query's weights, summed per chunk by hand
    visible = np.zeros((2, 3, 50), bool)
    visible[b, t, : int(limits[b, t])] = True
    scores = np.einsum("kgd,skd->kgs", np.asarray(q[b, t], np.float64), np.asarray(k[2, b], np.float64)) / np.sqrt(8)
    weights = np.exp(scores - scores.max(-1, keepdims=True)) * visible[b, t]
    weights /= weights.sum(-1, keepdims=True)
    alone = attention.prefix_chunk_mass(
      q[b : b + 1, t : t + 1], k[:, b : b + 1], lse[b : b + 1, t : t + 1], limits[b : b + 1, t : t + 1], 16, layer=2
    )
    expected = np.pad(weights.sum(1), ((0, 0), (0, 14))).reshape(2, 4, 16).sum(-1)
    np.testing.assert_allclose(np.asarray(alone[0]), expected, rtol=1e-5, atol=1e-7)


@examples(8)
@given(
  seed=SEEDS,
  length=st.integers(1, 23),
  near=st.integers(1, 4),
  delay=st.integers(0, 4),
  window=st.sampled_from([None, 3, 7]),
  block=st.sampled_from([4, 8, 32]),
  group=st.sampled_from([1, 3]),
)
def test_rollout_attention_is_one_softmax_over_the_ring_band_and_the_near_keys(
  seed, length, near, delay, window, block, group
):
  """Training-time test's self-attention against one dense softmax over every position's
  far keys (window and delay) and its own near keys side by side: odd lengths, blocks
  shorter and longer than the sequence, GQA."""
  rng = np.random.default_rng(seed)
  q = rng.standard_normal((2, length, 2, group, 8)).astype(np.float32)
  far_k, far_v = (rng.standard_normal((2, length, 2, 8)).astype(np.float32) for _ in "kv")
  near_k, near_v = (rng.standard_normal((2, length, near, 2, 8)).astype(np.float32) for _ in "kv")
  out = attention.rollout_attention(*map(jnp.asarray, (q, far_k, far_v, near_k, near_v)), delay, window, block=block)
  i, j = np.arange(length)[:, None], np.arange(length)[None, :]
  far_seen = (i - j >= delay) & (window is None or i - j < (window or 0))  # [T, T]
  near_seen = i >= np.arange(near)[None, :]  # [T, U]: position i - u exists
  for b in range(2):
    for t in range(length):
      keys = np.concatenate([far_k[b], near_k[b, t]])[None]  # [1, T + U, K, D]
      values = np.concatenate([far_v[b], near_v[b, t]])[None]
      seen = np.concatenate([far_seen[t], near_seen[t]])[None, None]  # [1, 1, T + U]
      expected = dense_attention(q[b : b + 1, t : t + 1], keys, values, seen)
      np.testing.assert_allclose(np.asarray(out[b, t]), expected[0, 0], atol=1e-5)
