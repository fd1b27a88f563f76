"""Random inputs for the attention kernel tests (fresh normal values, never zeros)."""

import jax.numpy as jnp
from hypothesis import strategies as st

TOLERANCE = {jnp.float32: 2e-5, jnp.bfloat16: 2e-2}
# The hypothesis strategies every kernel test draws from.
SEEDS = st.integers(0, 2**31 - 1)
GROUPS = st.sampled_from([1, 4, 8])  # query heads per KV head
HEAD_DIMS = st.sampled_from([64, 128])
DTYPES = st.sampled_from([jnp.float32, jnp.bfloat16])


def random_attention_inputs(rng, batch, steps, seq_len, kv_heads, group, head_dim, dtype):
  """q [B, T, K, G, D] and k, v [B, S, K, D] in `dtype`, as jnp arrays."""
  q = rng.standard_normal((batch, steps, kv_heads, group, head_dim))
  k, v = (rng.standard_normal((batch, seq_len, kv_heads, head_dim)) for _ in "kv")
  return tuple(jnp.asarray(x, dtype) for x in (q, k, v))
