"""SpecAttn's sorting-free top-p selection (specattn.md, section 3.4 and Algorithm 2), over
chunks of the context.

Each row is a distribution of attention mass over the context's chunks (the draft's
attention of one head at one step, summed per chunk of 16 positions, the paper's
granularity: `chunk_mass`). The selection keeps the chunks whose mass reaches a
threshold, the threshold found by bisection on [0, max] instead of a sort: after each
halving, the kept mass at the midpoint is compared with p of the row's total. A fixed
number of halvings (the paper's implementation: 10) leaves a bracket [low, high]; the
chunks kept are those at or above `low`, whose mass is at least p of the total by
construction (deviation: Algorithm 2 keeps those above its last midpoint, which can hold
less). p = 1 keeps every chunk, those the draft gave no mass too: the dense pass.

The kernel runs one program per row, the row's chunk masses loaded whole (a power-of-two
tile, padding lanes zero: they add nothing to a sum and are never stored), so every
halving is one masked reduction over registers and the row is read from memory once.

Reference twin: `select_chunks_reference` (the same halvings in jnp over the same padded
tile, so the sums, and the chunks kept, are the same).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import blocks

CHUNK = 16  # positions per chunk (the paper's, as Quest's pages)
HALVINGS = 10  # bisection steps (the paper's implementation)


def chunk_mass(weights: jax.Array, chunk: int = CHUNK) -> jax.Array:
  """weights [..., S] -> [..., ceil(S / chunk)] float32: each chunk's summed weight (the
  last chunk's missing positions count as zero)."""
  *lead, size = weights.shape
  chunks = -(-size // chunk)
  padded = jnp.pad(weights.astype(jnp.float32), [(0, 0)] * len(lead) + [(0, chunks * chunk - size)])
  return padded.reshape(*lead, chunks, chunk).sum(axis=-1)


def _bracket_low(mass: jax.Array, p: float, halvings: int) -> jax.Array:
  """The lower end of the bisection bracket for rows mass [..., W] (zeros past the row);
  p = 1: zero, every chunk (one the draft gave no mass may hold the target's)."""
  target = p * jnp.sum(mass, axis=-1, keepdims=True)
  low, high = jnp.zeros_like(target), jnp.max(mass, axis=-1, keepdims=True)
  if p >= 1:
    return low

  def halve(_, bracket):
    low, high = bracket
    middle = (low + high) / 2
    kept = jnp.sum(jnp.where(mass >= middle, mass, 0.0), axis=-1, keepdims=True)
    enough = kept >= target  # (the kept mass only grows as the threshold falls)
    return jnp.where(enough, middle, low), jnp.where(enough, high, middle)

  low, _ = jax.lax.fori_loop(0, halvings, halve, (low, high))
  return low


def select_chunks_reference(mass: jax.Array, p: float, halvings: int = HALVINGS) -> jax.Array:
  """mass [R, C] (non-negative) -> [R, C] bool: the chunks each row keeps (module docstring)."""
  rows, chunks = mass.shape
  width = pl.next_power_of_2(chunks)
  tile = jnp.pad(mass.astype(jnp.float32), ((0, 0), (0, width - chunks)))
  return (tile >= _bracket_low(tile, p, halvings))[:, :chunks]


def select_chunks_sorted(mass: jax.Array, p: float) -> jax.Array:
  """The sort-based nucleus the bisection avoids (the paper's Figure 3 baseline): mass
  [R, C] -> [R, C] bool, each row's fewest largest chunks whose mass reaches p of the
  row's (a sort, a running sum, a scatter back to the chunks' places)."""
  order = jnp.argsort(-mass, axis=-1, stable=True)  # [R, C]
  ranked = jnp.take_along_axis(mass, order, axis=-1)
  before = jnp.cumsum(ranked, axis=-1) - ranked  # mass of the larger chunks ahead of each
  keep = before < p * jnp.sum(mass, axis=-1, keepdims=True)
  if p >= 1:
    keep = jnp.ones_like(keep)
  return jnp.zeros_like(keep).at[jnp.arange(mass.shape[0])[:, None], order].set(keep)


def _kernel(mass_ref, out_ref, *, chunks: int, width: int, p: float, halvings: int):
  row, cols = pl.program_id(0), pl.ds(0, width)
  valid = jnp.arange(width) < chunks
  mass = plgpu.load(mass_ref.at[row, cols], mask=valid, other=0.0).astype(jnp.float32)  # [W]
  low = _bracket_low(mass, p, halvings)
  plgpu.store(out_ref.at[row, cols], (mass >= low).astype(out_ref.dtype), mask=valid)


@functools.partial(jax.jit, static_argnames=("p", "halvings", "interpret"))
def select_chunks(mass: jax.Array, p: float, halvings: int = HALVINGS, *, interpret: bool | None = None) -> jax.Array:
  """`select_chunks_reference` as a Pallas kernel: mass [R, C] -> [R, C] bool
  (interpreted off a GPU unless told)."""
  if not 0 < p <= 1:
    raise ValueError(f"top-p needs 0 < p <= 1, got {p}.")
  interpret = blocks.interpret_off_gpu(interpret)
  rows, chunks = mass.shape
  kept = pl.pallas_call(
    functools.partial(_kernel, chunks=chunks, width=pl.next_power_of_2(chunks), p=p, halvings=halvings),
    grid=(rows,),
    in_specs=[pl.BlockSpec(mass.shape, lambda r: (0, 0))],
    out_specs=pl.BlockSpec(mass.shape, lambda r: (0, 0)),
    out_shape=jax.ShapeDtypeStruct(mass.shape, jnp.int32),
    compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1),
    interpret=interpret,
    name="topp_select",
  )(mass.astype(jnp.float32))
  return kept.astype(bool)
