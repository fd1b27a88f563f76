"""The backend this process runs on, decided once: every choice that depends on it (the
attention and GEMM code, whether Pallas kernels interpret, how the engine lays out its
loops, `auto`'s default continuations, the default dtype) asks `on_gpu` rather than
probing JAX itself."""

from __future__ import annotations

import functools

import jax


@functools.cache
def on_gpu() -> bool:
  """Whether JAX's default backend is a GPU."""
  return jax.default_backend() == "gpu"
