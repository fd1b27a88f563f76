"""KV cache: chunked prefill + decode through the cache equals one full forward."""

import jax.numpy as jnp
import numpy as np
import pytest

from longspec_jax.attention import causal_block_mask
from longspec_jax.cache import KVCache, RingCache, write_block
from longspec_jax.config import DraftConfig
from longspec_jax.engine import prefill
from longspec_jax.weights.hf import load_hf_dir

from conftest import save_tiny_hf_model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
  model, _ = load_hf_dir(save_tiny_hf_model("llama", tmp_path_factory.mktemp("m") / "llama"), jnp.float32)
  return model


def full_forward_hidden(model, tokens):
  positions = jnp.arange(tokens.shape[1])[None]
  hidden, _ = model(jnp.asarray(tokens), positions, causal_block_mask(positions, jnp.ones(tokens.shape, bool)))
  return np.asarray(hidden)


def test_chunked_prefill_equals_full_forward(tiny):
  """Prompts of different lengths, chunks smaller than the prompts, per-sequence lengths."""
  rng = np.random.default_rng(0)
  prompts = [rng.integers(0, 211, size=n).tolist() for n in (45, 17, 32)]
  cache, last_hidden = prefill(tiny, prompts, max_len=64, chunk=16)
  np.testing.assert_array_equal(np.asarray(cache.lengths), [45, 17, 32])
  for b, prompt in enumerate(prompts):
    expected = full_forward_hidden(tiny, np.asarray([prompt]))[0, -1]
    np.testing.assert_allclose(np.asarray(last_hidden[b]), expected, atol=1e-5)
    # The cache holds the same K/V as a single prefill of this prompt alone.
    alone, _ = prefill(tiny, [prompt], max_len=64, chunk=64)
    n = len(prompt)
    np.testing.assert_allclose(np.asarray(cache.k[:, b, :n]), np.asarray(alone.k[:, 0, :n]), atol=1e-5)


def test_decode_through_cache_equals_full_forward(tiny):
  rng = np.random.default_rng(1)
  tokens = rng.integers(0, 211, size=(1, 30))
  cache, _ = prefill(tiny, [tokens[0, :21].tolist()], max_len=40, chunk=8)
  for t in range(21, 30):
    hidden, cache = tiny(jnp.asarray(tokens[:, t : t + 1]), cache.lengths[:, None], jnp.ones((1, 1, 1), bool), cache)
    cache = cache.advance(1)
  np.testing.assert_allclose(np.asarray(hidden[0, 0]), full_forward_hidden(tiny, tokens)[0, -1], atol=1e-5)


def test_write_block_places_each_sequence_after_its_prefix():
  layers = jnp.zeros((2, 3, 8, 1, 1))
  block = jnp.arange(1, 2 * 3 * 2 + 1, dtype=jnp.float32).reshape(2, 3, 2, 1, 1)
  out = np.asarray(write_block(layers, jnp.array([0, 5, 6]), block))[..., 0, 0]
  np.testing.assert_array_equal(out[:, 0, 0:2], np.asarray(block[:, 0, :, 0, 0]))
  np.testing.assert_array_equal(out[:, 1, 5:7], np.asarray(block[:, 1, :, 0, 0]))
  np.testing.assert_array_equal(out[:, 2, 6:8], np.asarray(block[:, 2, :, 0, 0]))
  assert np.count_nonzero(out) == block.size


def test_cache_bytes_and_advance(tiny):
  cache = KVCache.create(tiny.config, 2, 16, jnp.bfloat16)
  c = tiny.config
  assert cache.k.shape == (c.num_layers, 2, 16, c.num_kv_heads, c.head_dim)
  assert cache.nbytes() == 2 * cache.k.size * 2 + 2 * 4
  np.testing.assert_array_equal(np.asarray(cache.advance(jnp.array([3, 1])).lengths), [3, 1])


def test_commit_path_moves_accepted_nodes_into_the_prefix():
  rng = np.random.default_rng(5)
  layers, batch, size = 2, 3, 20
  k = rng.standard_normal((layers, batch, size, 1, 2)).astype(np.float32)
  cache = KVCache(k=jnp.asarray(k), v=jnp.asarray(-k), lengths=jnp.array([3, 0, 9]))
  path = np.array([[0, 2, 5, 0, 0, 0], [0, 1, 0, 0, 0, 0], [0, 3, 4, 5, 0, 0]])
  count = np.array([3, 1, 4])
  out = cache.commit_path(jnp.asarray(path), jnp.asarray(count))
  np.testing.assert_array_equal(np.asarray(out.lengths), [6, 1, 13])
  expected = k.copy()
  for b, length in enumerate([3, 0, 9]):
    for d in range(count[b]):
      expected[:, b, length + d] = k[:, b, length + path[b, d]]
  np.testing.assert_array_equal(np.asarray(out.k), expected)
  np.testing.assert_array_equal(np.asarray(out.v), -expected)


def test_ring_keeps_the_latest_window_positions():
  config = DraftConfig(vocab_size=10, hidden_size=8, intermediate_size=8, num_heads=2, num_kv_heads=1,
                       head_dim=4, num_layers=2, window=5)
  ring = RingCache.create(config, 2, jnp.float32, config.window)
  rng = np.random.default_rng(0)
  written = {}  # (b, position) -> k
  for start, count in [(0, 3), (3, 4), (7, 1), (8, 4)]:
    positions = jnp.asarray(np.broadcast_to(start + np.arange(4), (2, 4)))
    valid = jnp.asarray([[i < count for i in range(4)], [i < min(count, 2) for i in range(4)]])
    k = rng.standard_normal((2, 2, 4, 1, 4)).astype(np.float32)
    ring = ring.write(jnp.asarray(k), jnp.asarray(k) + 1, positions, valid)
    for b in range(2):
      for i in range(4):
        if valid[b, i]:
          written[(b, start + i)] = k[:, b, i]
  for b in range(2):
    length = max(p for (bb, p) in written if bb == b) + 1
    assert int(ring.length[b]) == length
    recent = lambda ps: sorted(p for p in ps if length - 5 <= p < length)
    assert recent(np.asarray(ring.positions[b])) == recent(p for (bb, p) in written if bb == b)
    for slot, p in enumerate(np.asarray(ring.positions[b])):
      if p >= 0:
        np.testing.assert_array_equal(np.asarray(ring.k[:, b, slot]), written[(b, p)])
        np.testing.assert_array_equal(np.asarray(ring.v[:, b, slot]), written[(b, p)] + 1)
  # A query at position 12 sees positions 8..11 below a limit of 12 (window 5, itself excluded).
  visible = np.asarray(ring.visible(jnp.array([[12], [12]]), jnp.array([12, 12])))
  assert sorted(np.asarray(ring.positions[0])[visible[0, 0]]) == [8, 9, 10, 11]
