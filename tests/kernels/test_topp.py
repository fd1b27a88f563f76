"""SpecAttn's sorting-free top-p over chunks: the kernel equals its reference, and the
chunks kept hold at least p of the mass, a superset of the fewest that do (a sort's)."""

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.topp import chunk_mass, select_chunks, select_chunks_reference, select_chunks_sorted


def fewest_chunks(row: np.ndarray, p: float) -> set[int]:
  """The sort-based nucleus, one chunk at a time: the fewest largest chunks whose mass
  reaches p of the row's."""
  order = np.argsort(-row, kind="stable")
  need = p * row.sum()
  total, kept = 0.0, set()
  for i in order:
    if total >= need:
      break
    kept.add(int(i))
    total += row[i]
  return kept


@pytest.mark.parametrize("chunks", [1, 7, 100, 513])
@pytest.mark.parametrize("p", [0.5, 0.9, 0.95, 1.0])
def test_the_kernel_keeps_what_its_reference_keeps(chunks, p):
  """Fresh random rows: attention-like (a softmax, a few heavy chunks) and dyadic ones
  (every sum exact, so any order of summation agrees)."""
  rng = np.random.default_rng(chunks)
  soft = np.exp(rng.standard_normal((5, chunks)) * 3)
  soft /= soft.sum(axis=-1, keepdims=True)
  dyadic = rng.integers(0, 64, size=(4, chunks)) / 1024
  for mass in (soft, dyadic):
    mass = jnp.asarray(mass, jnp.float32)
    expected = select_chunks_reference(mass, p)
    np.testing.assert_array_equal(np.asarray(select_chunks(mass, p, interpret=True)), np.asarray(expected))


@pytest.mark.parametrize("p", [0.3, 0.8, 0.95])
def test_the_chunks_kept_hold_p_of_the_mass_and_the_sorts_nucleus(p):
  rng = np.random.default_rng(int(p * 100))
  mass = np.exp(rng.standard_normal((6, 200)) * 2).astype(np.float32)
  for halvings, tight in ((10, False), (40, True)):
    kept = np.asarray(select_chunks_reference(jnp.asarray(mass), p, halvings))
    for row, keep in zip(mass, kept):
      assert row[keep].sum() >= p * row.sum() * (1 - 1e-6)
      nucleus = fewest_chunks(row, p)
      assert nucleus <= set(np.flatnonzero(keep).tolist())
      assert set(np.flatnonzero(np.asarray(select_chunks_sorted(jnp.asarray(row[None]), p))[0])) == nucleus
      if tight:  # (distinct values: enough halvings find the sort's own threshold)
        assert set(np.flatnonzero(keep).tolist()) == nucleus


def test_p_one_keeps_every_chunk_and_the_mass_is_summed_per_chunk():
  rng = np.random.default_rng(3)
  weights = jnp.asarray(rng.random((2, 3, 37)), jnp.float32)  # [.., S], S not a multiple of 16
  mass = chunk_mass(weights)
  assert mass.shape == (2, 3, 3)
  np.testing.assert_allclose(np.asarray(mass[..., 2]), np.asarray(weights[..., 32:].sum(-1)), rtol=1e-6)
  flat = mass.reshape(-1, 3).at[0, 1].set(0.0)  # a chunk with no mass is kept too: the dense pass
  assert bool(jnp.all(select_chunks(flat, 1.0, interpret=True)))
  with pytest.raises(ValueError, match="0 < p <= 1"):
    select_chunks(flat, 0.0, interpret=True)
