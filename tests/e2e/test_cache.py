"""KV cache: chunked prefill + decode through the cache equals one full forward."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from longspec_jax.engine import prefill
from longspec_jax.models.cache import KVCache, PartialCache, RingCache, select_layer, write_block
from longspec_jax.models.config import DraftConfig, TargetConfig
from longspec_jax.ops.attention import causal_block_mask

from helpers import tiny_target


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
  model = tiny_target("llama")
  return model


def full_forward_hidden(model, tokens):
  positions = jnp.arange(tokens.shape[1])[None]
  hidden, _ = model(jnp.asarray(tokens), positions, causal_block_mask(positions, jnp.ones(tokens.shape, bool)))
  return np.asarray(hidden)


@pytest.mark.parametrize("chunk", [16, 40], ids=["equal-passes", "narrower-last-pass"])
def test_chunked_prefill_equals_full_forward(tiny, chunk):
  """Prompts of different lengths, chunks smaller than the prompts (45 tokens in passes of
  40 end with one of 16), per-sequence lengths; one pass over the whole batch (causal over
  its own tokens, the cache still empty) the same."""
  rng = np.random.default_rng(0)
  prompts = [rng.integers(0, 211, size=n).tolist() for n in (45, 17, 32)]
  cache, last_hidden = prefill(tiny, prompts, max_len=64, chunk=chunk)
  np.testing.assert_array_equal(np.asarray(cache.lengths), [45, 17, 32])
  one, one_last = prefill(tiny, prompts, max_len=64)  # (the default: one pass for these)
  np.testing.assert_array_equal(np.asarray(one.lengths), [45, 17, 32])
  np.testing.assert_allclose(np.asarray(one_last), np.asarray(last_hidden), atol=1e-5)
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
  config = DraftConfig(
    vocab_size=10, hidden_size=8, intermediate_size=8, num_heads=2, num_kv_heads=1, head_dim=4, num_layers=2, window=5
  )
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


def reference_selection(q, k, lengths, budget, sink):
  """Per sequence and KV head, the positions a selection keeps, slot by slot: 0 .. sink - 1
  (those below the length), then the others below the length by Eq. 2's importance
  (the group's queries dotted with the key, summed), largest first, earlier first among
  equals; None for an empty slot."""
  batch, size, heads = k.shape[:3]
  kept = []
  for b in range(batch):
    per_head = []
    for h in range(heads):
      score = [float(np.sum(q[b, h] @ k[b, s, h])) for s in range(size)]
      others = sorted(range(sink, lengths[b]), key=lambda s: (-score[s], s))[: budget - sink]
      slots = [s if s < lengths[b] else None for s in range(sink)] + others
      per_head.append(slots + [None] * (budget - len(slots)))
    kept.append(per_head)
  return kept


@pytest.mark.parametrize("size, budget, sink", [(40, 12, 4), (9, 12, 4), (30, 8, 0)])
def test_a_selection_keeps_the_sink_and_the_most_important_positions(size, budget, sink):
  """TokenSwift's Eq. 2 and Algorithm 1's selection against a plain ranking, GQA groups
  of 3, sequences shorter and longer than the budget; integer-valued keys and queries make
  ties, broken toward the earlier position."""
  rng = np.random.default_rng(size)
  batch, heads, group, dim = 3, 2, 3, 4
  q = rng.integers(-2, 3, size=(batch, heads, group, dim)).astype(np.float32)
  k = rng.integers(-2, 3, size=(batch, size, heads, dim)).astype(np.float32)
  v = rng.standard_normal((batch, size, heads, dim)).astype(np.float32)
  lengths = np.array([size, max(size - 5, 1), min(size, 3)])
  got_k, got_v = select_layer(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), jnp.asarray(lengths), budget, sink)
  assert got_k.shape == got_v.shape == (batch, budget, heads, dim)
  for b, per_head in enumerate(reference_selection(q, k, lengths, budget, sink)):
    for slots in per_head:  # the held slots are a prefix, as many as the positions or the budget
      assert [s is not None for s in slots] == [i < min(lengths[b], budget) for i in range(budget)]
    for h, slots in enumerate(per_head):
      for slot, position in enumerate(slots):
        if position is not None:
          np.testing.assert_array_equal(np.asarray(got_v[b, slot, h]), v[b, position, h])
          np.testing.assert_array_equal(np.asarray(got_k[b, slot, h]), k[b, position, h])


def test_the_partial_cache_fills_its_empty_slots_then_the_least_important_at_a_fixed_size():
  """Rounds append the committed positions once each: into the slots after a selection's
  where it left some empty, then over the least important selected ones from the last
  slot down; the held slots stay a prefix; a selection is due when the appended would
  reach the sink; the cache's bytes never change."""
  config = TargetConfig(
    vocab_size=11, hidden_size=8, intermediate_size=8, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=4
  )
  full = KVCache.create(config, 2, 64, jnp.float32)
  values = jnp.arange(64, dtype=jnp.float32)[None, None, :, None, None] + jnp.zeros(full.k.shape)
  full = KVCache(k=values, v=-values, lengths=jnp.asarray([20, 6], jnp.int32))  # longer and shorter than the budget
  partial = PartialCache.create(config, 2, budget=10, sink=2, dtype=jnp.float32)
  size = partial.nbytes()
  assert bool(jnp.all(partial.needs_selection(full.lengths)))  # nothing selected yet
  select = lambda k, v: select_layer(jnp.ones((2, 1, 2, 4)), k, v, full.lengths, 10, 2)
  slot_k, slot_v = jax.vmap(select)(full.k, full.v)
  partial = partial.reselected(slot_k, slot_v, full.lengths, jnp.asarray([True, True]))
  assert not bool(jnp.any(partial.needs_selection(full.lengths)))
  np.testing.assert_array_equal(np.asarray(partial.count), [10, 6])
  np.testing.assert_array_equal(np.asarray(partial.k[0, 1, :6, 0, 0]), [0, 1, 5, 4, 3, 2])  # the later, the larger q.k
  for added in ([3, 1], [2, 4]):
    full = full.advance(jnp.asarray(added, jnp.int32))
    partial = partial.append(full, most=4)
  np.testing.assert_array_equal(np.asarray(partial.k[1, 0, 5:, 0, 0]), [24, 23, 22, 21, 20])  # newest lowest
  np.testing.assert_array_equal(np.asarray(partial.v[0, 1, :, 0, 0]), [0, -1, -5, -4, -3, -10, -6, -7, -8, -9])
  np.testing.assert_array_equal(np.asarray(partial.copied), [25, 11])
  np.testing.assert_array_equal(np.asarray(partial.count), [10, 10])
  cache = partial.as_cache()
  assert cache.k is partial.k and cache.lengths.tolist() == [10, 10]
  np.testing.assert_array_equal(np.asarray(partial.needs_selection(full.lengths + jnp.asarray([3, 4]))), [False, True])
  assert partial.nbytes() == size == 2 * (2 * 2 * 10 * 1 * 4 * 4) + 3 * 2 * 4
