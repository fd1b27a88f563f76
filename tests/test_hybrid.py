"""Pallas hybrid tree attention (interpret mode on CPU) against the reference hybrid (the
engine with either implementation: tests/test_engine.py)."""

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from longspec_jax.attention import Impl, hybrid_attention
from longspec_jax.tree import random_ancestor_mask

from kernel_inputs import DTYPES, GROUPS, SEEDS, TOLERANCE, random_attention_inputs


@settings(max_examples=4, deadline=None)
@given(seed=SEEDS, nodes=st.integers(1, 24), cache_len=st.integers(1, 200), group=GROUPS, dtype=DTYPES)
def test_pallas_hybrid_matches_reference(seed, nodes, cache_len, group, dtype):
  rng = np.random.default_rng(seed)
  q, k_cache, v_cache = random_attention_inputs(rng, 2, nodes, cache_len, 2, group, 64, dtype)
  _, k_new, v_new = random_attention_inputs(rng, 2, 1, nodes, 2, 1, 64, dtype)
  lengths = jnp.asarray(rng.integers(0, cache_len + 1, size=2), jnp.int32)
  mask = random_ancestor_mask(rng, 2, nodes)
  positions = lengths[:, None] + jnp.arange(nodes)[None]
  args = (q, k_cache, v_cache, lengths, k_new, v_new, mask, positions)
  out = hybrid_attention(*args, impl=Impl.PALLAS)
  ref = hybrid_attention(*args, impl=Impl.REFERENCE)
  np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


def test_layer_of_a_stacked_cache():
  """The target's layer scan hands the kernel the whole stacked cache and a traced layer index."""
  rng = np.random.default_rng(5)
  q, _, _ = random_attention_inputs(rng, 2, 7, 1, 2, 4, 64, jnp.float32)
  _, k_new, v_new = random_attention_inputs(rng, 2, 1, 7, 2, 1, 64, jnp.float32)
  k, v = (jnp.asarray(rng.standard_normal((4, 2, 70, 2, 64)), jnp.float32) for _ in "kv")
  lengths = jnp.asarray([63, 20], jnp.int32)
  mask = random_ancestor_mask(rng, 2, 7)
  positions = lengths[:, None] + jnp.arange(7)[None]
  run = jax.jit(lambda layer, impl: hybrid_attention(q, k, v, lengths, k_new, v_new, mask, positions, layer=layer,
                                                     impl=impl), static_argnums=1)
  for layer in (0, 3):
    ref = hybrid_attention(q, k[layer], v[layer], lengths, k_new, v_new, mask, positions, impl=Impl.REFERENCE)
    for impl in Impl:
      np.testing.assert_allclose(np.asarray(run(jnp.int32(layer), impl)), np.asarray(ref), atol=2e-5)
