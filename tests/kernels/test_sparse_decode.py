"""Block-sparse flash decoding (SpecAttn's verification prefix pass) against its reference
twin: random queries and caches, GQA, odd lengths, chunk masks per KV head; every chunk
kept is the dense pass."""

import jax.numpy as jnp
import numpy as np
import pytest

from longspec_jax.ops.attention import prefix_attention_reference, sparse_prefix_attention_reference
from pallas_kernels.sparse_decode import compact, sparse_flash_decode


def inputs(rng, b, t, kv, g, d, s, layers=None):
  lead = () if layers is None else (layers,)
  q = jnp.asarray(rng.standard_normal((b, t, kv, g, d)), jnp.float32)
  k = jnp.asarray(rng.standard_normal((*lead, b, s, kv, d)), jnp.float32)
  v = jnp.asarray(rng.standard_normal((*lead, b, s, kv, d)), jnp.float32)
  return q, k, v


@pytest.mark.parametrize(
  "b, t, kv, g, d, s, chunk", [(2, 1, 2, 3, 16, 77, 16), (1, 5, 3, 2, 32, 200, 16), (3, 2, 1, 4, 16, 100, 32)]
)
def test_the_kernel_reads_the_kept_chunks_as_its_reference(b, t, kv, g, d, s, chunk):
  rng = np.random.default_rng(s + t)
  q, k, v = inputs(rng, b, t, kv, g, d, s)
  lengths = jnp.asarray(rng.integers(1, s + 1, size=b), jnp.int32)
  kept = jnp.asarray(rng.random((b, kv, -(-s // chunk))) < 0.5)
  kept = kept.at[0, 0].set(False)  # a head that reads nothing: out 0, lse -inf
  out, lse = sparse_flash_decode(q, k, v, lengths, kept, chunk=chunk, interpret=True)
  ref_out, ref_lse = sparse_prefix_attention_reference(q, k, v, lengths, kept, chunk)
  np.testing.assert_allclose(np.asarray(out), np.asarray(ref_out), rtol=2e-5, atol=2e-5)
  np.testing.assert_allclose(np.asarray(lse), np.asarray(ref_lse), rtol=2e-5, atol=2e-5)
  assert bool(jnp.all(out[0, :, 0] == 0)) and bool(jnp.all(jnp.isneginf(lse[0, :, 0])))


def test_every_chunk_kept_is_the_dense_prefix_pass_of_a_stacked_cache():
  rng = np.random.default_rng(7)
  q, k, v = inputs(rng, 2, 3, 2, 2, 16, 90, layers=3)
  lengths = jnp.asarray([90, 41], jnp.int32)
  kept = jnp.ones((2, 2, 6), bool)
  out, lse = sparse_flash_decode(q, k, v, lengths, kept, layer=1, interpret=True)
  ref_out, ref_lse = prefix_attention_reference(q, k[1], v[1], lengths)
  np.testing.assert_allclose(np.asarray(out), np.asarray(ref_out), rtol=2e-5, atol=2e-5)
  np.testing.assert_allclose(np.asarray(lse), np.asarray(ref_lse), rtol=2e-5, atol=2e-5)
  with pytest.raises(ValueError, match="kept must be"):
    sparse_flash_decode(q, k, v, lengths, kept[..., :5], layer=1, interpret=True)
  with pytest.raises(ValueError, match="a power of two >= 16"):
    sparse_flash_decode(q, k, v, lengths, kept, chunk=8, layer=1, interpret=True)


def test_the_kept_chunks_are_listed_in_order_without_a_sort():
  kept = jnp.asarray([[[True, False, True, True], [False, False, False, False]]])
  lists, counts = compact(kept)
  assert counts.tolist() == [[[3], [0]]]
  assert lists[0, 0, :3].tolist() == [0, 2, 3]
