"""Shared fixtures (the real SmolLM2 GGUF, a tiny target with the real tokenizer), the test
tiers by folder, and the Hypothesis profiles. Helpers the tests import are in helpers.py."""

from __future__ import annotations

import gc
import importlib.util
import os
import shutil
import tempfile
from pathlib import Path

# Off a GPU the suite compiles hundreds of small programs and runs each briefly: LLVM's
# optimizations cost more compile time than they save in run time (the verification tests
# take 28% less without them on 2 cores), and so do XLA:CPU's MLIR fusion emitters against
# its older ones (the verification tests 182 -> 148 s, auto's lossless tests 88 -> 55 s, the
# real model's as before). Tests marked `optimized` or `training` have them back
# (`MARKED_OPTIONS`). Set before JAX starts its backend, once: by the process pytest starts
# in, whose choice its xdist workers inherit (in a worker, the flags already hold it).
if "LONGSPEC_TESTS_UNOPTIMIZED" not in os.environ:
  flags = os.environ.get("XLA_FLAGS", "")
  unoptimized = "optimization_level" not in flags and not any(
    importlib.util.find_spec(p) for p in ("jax_cuda12_plugin", "jax_cuda13_plugin")
  )
  os.environ["LONGSPEC_TESTS_UNOPTIMIZED"] = "1" if unoptimized else ""
  if unoptimized:
    os.environ["XLA_FLAGS"] = f"{flags} --xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false".strip()
UNOPTIMIZED = os.environ["LONGSPEC_TESTS_UNOPTIMIZED"] == "1"

import jax  # noqa: E402
import pytest  # noqa: E402
from hypothesis import settings  # noqa: E402

from helpers import save_tiny_hf_model  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")


def pytest_configure(config):
  """One compilation cache on disk for the whole run, shared by the xdist workers and the
  processes the tests start (they inherit the variable): many tests compile the same
  programs (the same tiny targets, methods and shapes, each in jit wrappers of its own),
  and XLA's compiles are most of the suite's time. A run starts with an empty cache
  ($JAX_COMPILATION_CACHE_DIR set beforehand: that one, kept). Tests that count
  compilations take `compiling`."""
  if "JAX_COMPILATION_CACHE_DIR" not in os.environ:  # (the controller; workers find it set)
    os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="longspec-xla-")
    config.add_cleanup(lambda: shutil.rmtree(os.environ.pop("JAX_COMPILATION_CACHE_DIR"), ignore_errors=True))
  jax.config.update("jax_compilation_cache_dir", os.environ["JAX_COMPILATION_CACHE_DIR"])
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)


@pytest.fixture
def compiling(monkeypatch):
  """XLA compiles for this test whatever the run compiled before it: the compilation
  cache is off while it runs (for tests of what a first run compiles)."""
  from jax._src import compilation_cache

  monkeypatch.setattr(compilation_cache, "is_cache_used", lambda backend: False)


# The backend starts now, with one CPU device, whatever a test runs first: a CLI run
# in-process with `--devices N` then finds it started and cannot add devices (one that
# started it would give the rest of the worker's tests N devices).
jax.devices()

# Hypothesis: `ci` (the default) draws each test's own count of examples, `dev` a few.
settings.register_profile("ci", deadline=None)
settings.register_profile("dev", max_examples=3, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

# The tiers: each test's folder is its marker (`pytest -m unit`).
TIERS = ("unit", "kernels", "parity", "e2e")


def pytest_ignore_collect(collection_path, config):
  """Skips a tier's folder that the `-m` expression cannot select whatever a test's other
  marks are (`pytest -m unit` then imports no other tier's modules: no torch)."""
  from _pytest.mark.expression import Expression

  tier = collection_path.name if collection_path.is_dir() else None
  if tier not in TIERS or not config.option.markexpr:
    return None
  expression = Expression.compile(config.option.markexpr)
  if any(
    expression.evaluate(lambda name, other=other: name == tier if name in TIERS else other) for other in (False, True)
  ):
    return None
  return True


def pytest_collection_modifyitems(config, items):
  """Marks each test with its tier, and starts the `optimized` tests (the longest) first, so
  that the two workers share them rather than one finishing them alone at the end."""
  for item in items:
    tier = Path(str(item.fspath)).parent.name
    if tier in TIERS:
      item.add_marker(getattr(pytest.mark, tier))
  items.sort(key=lambda item: item.get_closest_marker("optimized") is None)


# What a marked test's programs (its fixtures' too) compile with, whatever the suite's flags:
# `optimized` tests run theirs long enough to pay for LLVM's optimizations (the real
# SmolLM2's prefill of 1,280 tokens takes 7 s optimized, 17 s not); `training` tests run
# train steps, which XLA:CPU's MLIR fusion emitters run faster (a TokenSwift heads run
# 49 -> 32 s, 2 cores).
MARKED_OPTIONS = {
  "optimized": {"xla_backend_optimization_level": "2"},
  "training": {"xla_cpu_use_fusion_emitters": True},
}


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
  """A marked test's programs compile with its marks' options (`MARKED_OPTIONS`)."""
  options = {
    key: value
    for mark, marked in MARKED_OPTIONS.items()
    if item.get_closest_marker(mark) is not None
    for key, value in marked.items()
  }
  if not options or not UNOPTIMIZED:
    return (yield)
  from jax._src import compiler

  suite_options = compiler.get_compile_options

  def marked_options(*args, env_options_overrides=None, **kwargs):
    return suite_options(*args, env_options_overrides={**options, **(env_options_overrides or {})}, **kwargs)

  compiler.get_compile_options = marked_options
  try:
    return (yield)
  finally:
    compiler.get_compile_options = suite_options


# Mapped memory regions past which `release_compiled_programs` frees compiled programs:
# under half the kernel's default limit, as one module was seen to add 23,000.
MAX_MAP_REGIONS = 30_000


@pytest.fixture(autouse=True, scope="module")
def release_compiled_programs():
  """Frees the compiled programs after a test module once they map many memory regions.
  XLA's CPU executables each map many, and one process running the whole suite would pass
  the kernel's limit on them (vm.max_map_count, 65530): the compiler then segfaults.
  Freeing them after every module would cost the later modules recompilations."""
  yield
  try:
    regions = sum(1 for _ in open("/proc/self/maps"))
  except OSError:  # not Linux
    return
  if regions > MAX_MAP_REGIONS:
    jax.clear_caches()
    gc.collect()


@pytest.fixture(autouse=True)
def fresh_round_costs(tmp_path, monkeypatch):
  """Every test measures `auto`'s round prices afresh and learns its gains afresh: none
  from earlier tests or runs."""
  from longspec_jax import engine
  from longspec_jax.methods.prices import PriceBook

  monkeypatch.setattr(engine, "MEMORY", engine.Memory(prices=PriceBook(tmp_path / "cache")))


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
  from longspec_jax.weights.default import default_gguf_path

  return default_gguf_path()


@pytest.fixture(scope="session")
def smollm2_float32(smollm2_gguf):
  import jax.numpy as jnp

  from longspec_jax.weights import load_target

  return load_target(str(smollm2_gguf), jnp.float32)


@pytest.fixture(scope="session")
def tiny_with_tokenizer(tmp_path_factory, smollm2_gguf) -> Path:
  """A tiny random Llama with the real SmolLM2 tokenizer (and its vocabulary size)."""
  from longspec_jax.weights import load_tokenizer

  path = save_tiny_hf_model("llama", tmp_path_factory.mktemp("m") / "tiny", vocab_size=49152, eos_token_id=2)
  load_tokenizer(smollm2_gguf).save_pretrained(path)
  return path
