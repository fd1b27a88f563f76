"""Timing helpers shared by the benchmarks: medians after warm-up, on-device loops that keep
host overhead out of kernel timings, and the device's measured bandwidth (the ceiling every
floor is taken against)."""

from __future__ import annotations

import dataclasses
import functools
import platform
import statistics
import time

import jax
import jax.numpy as jnp

from longspec_jax import backend
from longspec_jax.decoding.compiles import Compiles  # noqa: F401 (the benchmarks' import of it)


def environment() -> dict:
  """Where a result was measured, for the head of its JSON: the device, the JAX backend and
  version, and Python's."""
  return {
    "device": jax.devices()[0].device_kind,
    "backend": jax.default_backend(),
    "jax": jax.__version__,
    "python": platform.python_version(),
  }


def median_seconds(fn, warmup: int = 2, iters: int = 10) -> float:
  for _ in range(warmup):
    jax.block_until_ready(fn())
  times = []
  for _ in range(iters):
    t = time.perf_counter()
    jax.block_until_ready(fn())
    times.append(time.perf_counter() - t)
  return statistics.median(times)


WARM_UPS = 8  # at most: `auto` measuring its round prices may need more than one generation


def warmed_up(generate_once):
  """Calls `generate_once() -> GenerationResult` until a generation ran with nothing left
  to compile or measure (`auto` measures its round prices in its first generations, once
  per machine and shape: they are kept on disk), at most `WARM_UPS` times; the last
  result."""
  for _ in range(WARM_UPS):
    # (the previous generation's caches are freed first, as the timed generations' are:
    # a generation that runs while another's are held gets other buffers, and the next
    # one, back in the old ones, pays a rewrite of every CUDA graph of its loop)
    result = None
    result = generate_once()
    if result.stats.calibration_seconds == 0:
      break
  return result


def measure_bandwidth() -> float:
  """One device's memory bandwidth in bytes/s (read + written), the best of elementwise
  passes over 1 and 4 GiB in float32 and bfloat16: the ceiling our floors are measured
  against. (On the first device, also under a mesh, where arrays would be replicated.)"""
  step = jax.jit(lambda x: x * 2 + 1)
  best = 0.0
  for nbytes in (1 << 30, 1 << 32):
    for dtype in (jnp.float32, jnp.bfloat16):
      data = jnp.full((nbytes // jnp.dtype(dtype).itemsize,), 0.5, dtype, device=jax.devices()[0])
      best = max(best, 2 * nbytes / median_seconds(functools.partial(step, data), iters=20))
  return best


# The largest buffer `measure_read_bandwidth` reads: past a few GiB the rate no longer
# depends on the size, and a larger one leaves no room beside it for the autotuner's scratch
# copy of it (a 70B model's share of one device's memory would need twice that).
MAX_READ_BYTES = 8 << 30


def measure_read_bandwidth(nbytes: int) -> float:
  """One device's rate of reading memory in bytes/s, nothing written back: the best of
  a sum, of sums along each axis and of a vector's product with the matrix from either
  side (as a decode step reads its weights) over a bfloat16 buffer of `nbytes` (a model's
  weights' size; at most MAX_READ_BYTES). On an H200 each reads 8 GiB at 3.77-4.04 TB/s,
  the best of them changing by a few percent from one measurement to the next, so a
  floor over it moves as much. (`measure_bandwidth`'s copy moves each byte twice; a
  read-only pass runs at another rate.)"""
  rows = 8192
  nbytes = min(nbytes, MAX_READ_BYTES)
  device = jax.devices()[0]
  data = jnp.full((max(nbytes // 2 // rows, 1), rows), 0.5, jnp.bfloat16, device=device)
  left = jnp.full((data.shape[0],), 0.5, jnp.bfloat16, device=device)
  right = jnp.full((rows,), 0.5, jnp.bfloat16, device=device)
  passes = (
    (jax.jit(lambda x: jnp.sum(x, dtype=jnp.float32)), ()),
    (jax.jit(lambda x: jnp.sum(x, axis=1, dtype=jnp.float32)), ()),
    (jax.jit(lambda x: jnp.sum(x, axis=0, dtype=jnp.float32)), ()),
    (jax.jit(lambda x, v: jnp.einsum("n,nr->r", v, x, preferred_element_type=jnp.float32)), (left,)),
    (jax.jit(lambda x, v: jnp.einsum("nr,r->n", x, v, preferred_element_type=jnp.float32)), (right,)),
  )
  return max(
    data.nbytes / median_seconds(functools.partial(read, data, *vectors), iters=20) for read, vectors in passes
  )


def measure_peak_flops(dtype=jnp.bfloat16) -> float:
  """One device's matmul rate in FLOP/s: a square product in `dtype`, 8192 wide on a GPU
  (1024 elsewhere, where the wide one takes seconds)."""
  size = 8192 if backend.on_gpu() else 1024
  a = jax.device_put(jax.random.normal(jax.random.key(0), (size, size), dtype), jax.devices()[0])
  product = jax.jit(lambda a: a @ a)
  return 2 * size**3 / median_seconds(functools.partial(product, a), iters=20)


def loop_seconds(
  fn, x, *operands, iters: int = 40, unroll: int = 8, repeats: int = 5, compiler_options: dict | None = None
) -> float:
  """Seconds per call of fn(x, *operands) -> like x (an array or a pytree of them),
  `iters` chained calls in one jit: each call feeds the next, so nothing is hoisted out
  of the loop. The operands (caches, masks, parameters) enter as arguments, never as
  constants baked into the program. The loop is unrolled `unroll` times: an XLA while
  loop syncs with the host at every iteration, which would add ~10 us to each call of a
  kernel that itself takes tens. `compiler_options`: XLA's, for the loop's program (e.g.
  `gemm.Gemm.CUBLAS.compiler_options()`)."""

  def chained(_, y, ops):
    return jax.tree.map(lambda new, old: new.astype(old.dtype), fn(y, *ops), y)

  @functools.partial(jax.jit, compiler_options=compiler_options)
  def run(x, *ops):
    return jax.lax.fori_loop(0, iters, lambda i, y: chained(i, y, ops), x, unroll=unroll)

  jax.block_until_ready(run(x, *operands))
  times = []
  for _ in range(repeats):
    t = time.perf_counter()
    jax.block_until_ready(run(x, *operands))
    times.append((time.perf_counter() - t) / iters)
  return statistics.median(times)


def draft_seconds(model, decoding, proposer_params, state, iters: int = 16) -> float:
  """Seconds per round of drafting alone on a decode state (e.g. `GenerationResult.state`),
  fed its own proposer state and keeping its output live so that it is computed. Reads the
  state's cache in place (no copy: at 32k a batch's cache is most of the GPU's memory)."""
  from flax import nnx

  from longspec_jax.engine import propose

  graphdef, params = nnx.split(model)

  def draft_pass(carry, params, proposer_params, state):
    proposal, total = carry
    tree, proposal = propose(
      nnx.merge(graphdef, params), decoding.proposer, proposer_params, dataclasses.replace(state, proposal=proposal)
    )
    return proposal, total + tree.tokens.sum()

  return loop_seconds(
    draft_pass, (state.proposal, jnp.int32(0)), params, proposer_params, state, iters=iters, unroll=1, repeats=1
  )


def phase_seconds(model, decoding, proposer_params, state, iters: int = 16) -> tuple[float, float]:
  """Seconds per round of drafting and of verification, each timed alone on a decode
  state (e.g. `GenerationResult.state`): the rounds run fused on device, so the split of
  a run's time into phases is measured apart from it. Drafting is `draft_seconds`;
  verification is fed its own cache (a copy of the state's) and keeps its output live."""
  from flax import nnx

  from longspec_jax.decoding.verify import verify
  from longspec_jax.engine import propose

  graphdef, params = nnx.split(model)

  def verify_pass(carry, params, tree):
    cache, total = carry
    logits, _, cache = verify(nnx.merge(graphdef, params), tree, cache, decoding.sparse)
    return cache, total + logits[:, :, 0].sum()

  tree = jax.jit(
    lambda params, proposer_params, state: propose(
      nnx.merge(graphdef, params), decoding.proposer, proposer_params, state
    )[0]
  )(params, proposer_params, state)
  draft = draft_seconds(model, decoding, proposer_params, state, iters)
  check = loop_seconds(verify_pass, (state.cache, jnp.float32(0)), params, tree, iters=iters, unroll=1, repeats=1)
  return draft, check
