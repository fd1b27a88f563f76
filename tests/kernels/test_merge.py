"""The one-launch merge of attention partials (interpret mode on CPU) against its jnp twin."""

import jax.numpy as jnp
import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from pallas_kernels import blocks
from pallas_kernels.merge import merge

from helpers import SEEDS, examples


@examples(8)
@given(
  seed=SEEDS,
  parts=st.integers(1, 19),
  b=st.integers(1, 2),
  t=st.integers(1, 7),
  kv_heads=st.integers(1, 3),
  g=st.integers(1, 5),
  d=st.sampled_from([16, 64, 128]),
)
def test_matches_reference(seed, parts, b, t, kv_heads, g, d):
  """Odd part counts, positions and group sizes, rows padded past T * G as the kernels
  lay them out; some partials saw nothing (lse -inf, out 0), and some rows nothing at
  all: those come out 0 with lse -inf. One position a program (a GPU's launch) and all of
  them in one (the interpreter's)."""
  rng = np.random.default_rng(seed)
  r_pad = -(-(t * g) // 16) * 16
  lse = rng.normal(0.0, 4.0, (parts, b, kv_heads, r_pad)).astype(np.float32)
  lse[rng.random(lse.shape) < 0.3] = -np.inf
  lse[:, :, :, 0] = -np.inf  # row 0 of every head: no partial saw a key
  out = rng.standard_normal((parts, b, kv_heads, r_pad, d)).astype(np.float32)
  out[np.isinf(lse)] = 0.0
  want_out, want_lse = blocks.merge([(jnp.asarray(out), jnp.asarray(lse))], t, g)
  for dtype, positions in ((jnp.float32, 1), (jnp.bfloat16, None)):  # a GPU's launch, the interpreter's
    got_out, got_lse = merge(jnp.asarray(out), jnp.asarray(lse), t, g, dtype, interpret=True, positions=positions)
    assert got_out.shape == (b, t, kv_heads, g, d) and got_out.dtype == dtype
    tol = 1e-5 if dtype == jnp.float32 else 2.0**-7
    np.testing.assert_allclose(np.asarray(got_out, np.float32), np.asarray(want_out), rtol=tol, atol=tol)
    np.testing.assert_allclose(np.asarray(got_lse), np.asarray(want_lse), rtol=1e-5, atol=1e-5)
    assert np.all(np.isneginf(np.asarray(got_lse)[:, 0, :, 0]))
