"""Which GEMM code runs a model's matrix products on a GPU: the one choice, made here.

On NVIDIA GPUs XLA emits a dot either as one of its own Triton GEMM fusions (its default)
or as a cuBLAS call, and it takes that choice per compilation (a compiler option), not
per product. For decoding the choice sets the step's speed. A model's layers are stacked
on a leading axis and run by `lax.scan`, so each layer's weights are a dynamic slice of the
stacked array; a Triton fusion cannot read that slice where it lies, so XLA copies every
layer's weights before its products (a decode step reads the weights twice and writes
them once), while cuBLAS reads the slice in place.

Measured on an H100, bf16, in the same runs (docs/results.md, "Rounds against the bandwidth
floor"):

| model shape | context | AR step, XLA | AR step, cuBLAS | prefill tok/s, XLA | cuBLAS |
| --- | ---: | ---: | ---: | ---: | ---: |
| Llama-3.1-8B | 4,096 | 15.9 ms | 6.9 ms | 21.3k | 32.8k |
| Llama-3.1-8B | 32,768 | 17.2 ms | 8.2 ms | 15.0k | 20.0k |
| SmolLM2-135M | 2,048 | 1.42 ms | 1.41 ms | 145k | 150k |
| SmolLM2-135M | 4,096 | 1.43 ms | 1.45 ms | 149k | 170k |

cuBLAS is as fast or faster for every shape and row count measured (1-row steps, 69-row
verification, 512-row prefill chunks), so it is the default on a GPU. The engine's
jitted functions that run a model are compiled once per `Compilation` (`jit`: the GEMM
choice and whether bf16 rounding is exact) and called with their model's
`Transformer.compilation()`.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable
from typing import Any

import jax

from longspec_jax import backend


class Gemm(enum.Enum):
  """XLA: XLA's own choice (Triton GEMM fusions on a GPU). CUBLAS: every dot as a cuBLAS
  call. Off a GPU both compile the same."""

  XLA = "xla"
  CUBLAS = "cublas"

  @classmethod
  def default(cls) -> Gemm:
    """CUBLAS on a GPU, XLA elsewhere (where the option means nothing)."""
    return cls.CUBLAS if backend.on_gpu() else cls.XLA

  def compiler_options(self) -> dict[str, Any] | None:
    return {"xla_gpu_enable_triton_gemm": False} if self is Gemm.CUBLAS else None


@dataclasses.dataclass(frozen=True)
class Compilation:
  """How the engine compiles a model's functions: the GEMM code, and `exact`: XLA rounds
  every bf16 intermediate as the program writes it. By default XLA may keep some in
  float32 inside a fusion (`xla_allow_excess_precision`), and which ones depends on its
  fusion decisions, which change with the call's shape: a row's bits then depend on how
  many rows the call has (measured: `python -m lab.check_invariance`), so
  batch-invariant decoding compiles exact."""

  gemm: Gemm
  exact: bool = False

  def compiler_options(self) -> dict[str, Any] | None:
    options = {**(self.gemm.compiler_options() or {}), **({"xla_allow_excess_precision": False} if self.exact else {})}
    return options or None


# cuBLAS wants a bf16/f16 product's dimensions in multiples of this; XLA pads any other
# row count itself, with a pad and a slice around every product (per layer and per round).
_ROW_MULTIPLE = 8


def aligned_rows(rows: int) -> int:
  """How many rows a many-row decoding pass (a tree's verification, the draft's passes)
  should run with: on a GPU, `rows` rounded up to cuBLAS's multiple, so that its products
  need no padding copies (measured: a 69-node tree's verification on SmolLM2 spent ~0.2 ms
  of a 2.8 ms round in them); one row stays one (a GEMV). Elsewhere `rows`: the padding
  rows would be work for nothing."""
  if rows == 1 or not backend.on_gpu():
    return rows
  return -(-rows // _ROW_MULTIPLE) * _ROW_MULTIPLE


def jit(**jit_kwargs) -> Callable[[Callable], dict[Compilation, Callable]]:
  """Decorator: the function jitted once per `Compilation` (`jax.jit` keywords as given),
  as a mapping; call `f[model.compilation()](...)`."""

  def wrap(fn: Callable) -> dict[Compilation, Callable]:
    return {
      c: jax.jit(fn, compiler_options=c.compiler_options(), **jit_kwargs)
      for c in (Compilation(gemm, exact) for gemm in Gemm for exact in (False, True))
    }

  return wrap
