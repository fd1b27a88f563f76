"""Batch-invariant RMSNorm: y = gain * round(x * rsqrt(mean(x^2) + eps)), each row's sum of
squares taken in one fixed order whatever the number of rows.

XLA runs a [M, K] row reduction with a strategy it picks from the shape (threads per row,
vectorisation, rows per block), so a row's float32 sum of squares runs in another order
among 11 or 69 rows than alone. For bf16 values of similar magnitude the sum is exact and
the order does not show; a real model's hidden states carry a few outlier dimensions that
make it inexact, and then a tree node's norm differs from the AR step's in the last bit
(measured on SmolLM2: verification left AR's bits at the MLP norm of layer 13,
`python -m lab.check_invariance --target smollm2-135m`). Here each program normalises
one row, loaded whole (a power-of-two tile, the lanes past K loading zeros), its sum
in the fixed order of that tile: a row's bits depend on its own values only. One load,
one reduction and one store per row keep the kernel at its launch latency, which
matters: it runs twice per layer.

The gain may be a layer of a stack [L, K] named by an index read at run time, read in
place (as the batch-invariant matmul reads its weights).

Reference twin: `longspec_jax.models.layers.rms_norm` (not invariant).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu


def _kernel(layer_ref, x_ref, gain_ref, out_ref, *, k: int, width: int, eps: float):
  # x_ref, out_ref [M, K]; gain_ref [L, K]; this program's row, as a tile of the power of two width >= K.
  row, cols = pl.program_id(0), pl.ds(0, width)
  valid = jnp.arange(width) < k  # the padding lanes load zeros, which add nothing to the sum
  x = plgpu.load(x_ref.at[row, cols], mask=valid, other=0.0).astype(jnp.float32)  # [W]
  inverse = jax.lax.rsqrt(jnp.sum(x * x) / k + eps)
  gain = plgpu.load(gain_ref.at[layer_ref[0], cols], mask=valid, other=0.0).astype(jnp.float32)
  normed = (x * inverse).astype(out_ref.dtype)
  plgpu.store(out_ref.at[row, cols], (gain * normed.astype(jnp.float32)).astype(out_ref.dtype), mask=valid)


@functools.partial(jax.jit, static_argnames=("eps", "interpret"))
def rms_norm(x: jax.Array, gain: jax.Array, eps: float, layer=None, *, interpret: bool = False) -> jax.Array:
  """RMSNorm of x [..., K] with gain [K] (or, with `layer`, layer `layer` of a stack
  [L, K]), in x's dtype: float32 statistics, the normalised row rounded to x's dtype
  before the gain (as transformers does), every row's sum in one order (module
  docstring)."""
  if layer is None:
    gain, layer = gain[None], 0
  *lead, k = x.shape
  rows = x.reshape(-1, k)
  out = pl.pallas_call(
    functools.partial(_kernel, k=k, width=pl.next_power_of_2(k), eps=eps),
    grid=(rows.shape[0],),
    in_specs=[
      pl.BlockSpec((1,), lambda r: (0,)),
      pl.BlockSpec(rows.shape, lambda r: (0, 0)),
      pl.BlockSpec(gain.shape, lambda r: (0, 0)),
    ],
    out_specs=pl.BlockSpec(rows.shape, lambda r: (0, 0)),
    out_shape=jax.ShapeDtypeStruct(rows.shape, x.dtype),
    compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1),
    interpret=interpret,
    name="rms_norm",
  )(jnp.asarray(layer, jnp.int32).reshape(1), rows, gain)
  return out.reshape(*lead, k)
