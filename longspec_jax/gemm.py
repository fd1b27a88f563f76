"""Which GEMM code runs a model's matrix products on a GPU: the one choice, made here.

On NVIDIA GPUs XLA emits a dot either as one of its own Triton GEMM fusions (its default)
or as a cuBLAS call, and it takes that choice per compilation (a compiler option), not
per product. For decoding the choice sets the step's speed. A model's layers are stacked
on a leading axis and run by `lax.scan`, so each layer's weights are a dynamic slice of the
stacked array; a Triton fusion cannot read that slice where it lies, so XLA copies every
layer's weights before its products (a decode step reads the weights twice and writes
them once), while cuBLAS reads the slice in place.

Measured on an H100, bf16, in the same runs (docs/benchmarks.md, "GEMM choice"):

| model shape | context | AR step, XLA | AR step, cuBLAS | prefill tok/s, XLA | cuBLAS |
| --- | ---: | ---: | ---: | ---: | ---: |
| Llama-3.1-8B | 4,096 | 15.9 ms | 6.9 ms | 21.3k | 32.8k |
| Llama-3.1-8B | 32,768 | 17.2 ms | 8.2 ms | 15.0k | 20.0k |
| SmolLM2-135M | 2,048 | 1.42 ms | 1.41 ms | 145k | 150k |
| SmolLM2-135M | 4,096 | 1.43 ms | 1.45 ms | 149k | 170k |

cuBLAS is as fast or faster for every shape and row count measured (1-row steps, 69-row
verification, 512-row prefill chunks), so it is the default on a GPU. The engine's
jitted functions that run a model are compiled once per choice (`jit`) and called with
their model's `Transformer.gemm`.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from typing import Any

import jax


class Gemm(enum.Enum):
  """XLA: XLA's own choice (Triton GEMM fusions on a GPU). CUBLAS: every dot as a cuBLAS
  call. Off a GPU both compile the same."""

  XLA = "xla"
  CUBLAS = "cublas"

  @classmethod
  def default(cls) -> Gemm:
    """CUBLAS on a GPU, XLA elsewhere (where the option means nothing)."""
    return cls.CUBLAS if jax.default_backend() == "gpu" else cls.XLA

  def compiler_options(self) -> dict[str, Any] | None:
    return {"xla_gpu_enable_triton_gemm": False} if self is Gemm.CUBLAS else None


def jit(**jit_kwargs) -> Callable[[Callable], dict[Gemm, Callable]]:
  """Decorator: the function jitted once per `Gemm` (`jax.jit` keywords as given), as a
  mapping; call `f[model.gemm](...)`."""

  def wrap(fn: Callable) -> dict[Gemm, Callable]:
    return {gemm: jax.jit(fn, compiler_options=gemm.compiler_options(), **jit_kwargs) for gemm in Gemm}

  return wrap
