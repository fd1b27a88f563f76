"""The backend this process runs on, decided once: every choice that depends on it (the
attention and GEMM code, whether Pallas kernels interpret, how the engine lays out its
loops, `auto`'s default continuations, the default dtype) asks `on_gpu` rather than
probing JAX itself. Also where compiled programs are kept between processes."""

from __future__ import annotations

import functools
from pathlib import Path

import jax

from longspec_jax.files import cache_root

# Programs that compile faster than this are compiled again rather than kept: the
# engine's decode loop takes 11-22 s on a CPU and its smaller programs ~0.1-2 s each.
MIN_COMPILE_SECONDS = 0.1


@functools.cache
def on_gpu() -> bool:
  """Whether JAX's default backend is a GPU."""
  return jax.default_backend() == "gpu"


def keep_compiled_programs(directory: Path | None = None) -> Path:
  """Keeps XLA's compiled programs on disk (JAX's persistent compilation cache), so that a
  later process running the same shapes loads them instead of compiling: in `directory`,
  by default `files.cache_root() / "xla"`. A cache already chosen (by the caller or by
  $JAX_COMPILATION_CACHE_DIR) stays. Returns the directory."""
  if not jax.config.jax_compilation_cache_dir:
    jax.config.update("jax_compilation_cache_dir", str(directory or cache_root() / "xla"))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", MIN_COMPILE_SECONDS)
  return Path(jax.config.jax_compilation_cache_dir)
