"""`python -m lab.bench_past`: what the ring of past outputs costs, operation by operation.

Prompt lookup and `auto` with `--past-tokens N` search the outputs of earlier requests
(`longspec_jax.methods.past`). A request pays for that ring in four places, timed here
apart on a ring filled with random outputs (medians, the device waited for each time):

  index    the first search after the ring is made: every key sorted and uploaded
  release  a request's output written: appended on the host, its positions' entries merged
           into the device's index (`Past.on_device`), the copy a decoding state reads
  copy     that copy alone (decoding states donate their buffers)
  search   a round's search (`match_past`) for a batch of contexts

so that a batch file's time with the ring beside its time without it can be set against
release x records + search x rounds. `--trace DIR` also traces releases into the largest
ring with the JAX profiler and lists the kernels their device time goes to.

  python -m lab.bench_past --sizes 262144 1048576 --output-tokens 256 --batch 2 --out past.json
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path

from longspec_jax.cli import ArgumentParser, output_path, positive_int, run_main

VOCAB = 49152  # SmolLM2's: the keys' spread is what a real target's outputs give
TRACED = 5  # releases traced with --trace


def measure(
  size: int, output_tokens: int, batch: int, context: int, matches: int, iters: int, seed: int, trace: Path | None
) -> dict:
  """The four costs (module docstring) for a ring of `size` tokens, in ms; with `trace` (a
  folder), also the kernels of `TRACED` releases (`traced_kernels`)."""
  import jax
  import jax.numpy as jnp
  import numpy as np

  from infer.timing import median_seconds
  from longspec_jax.methods.past import Past, match_past

  rng = np.random.default_rng(seed)
  output = lambda: rng.integers(0, VOCAB, output_tokens).tolist()
  past = Past.empty(size)
  for _ in range(-(-size // (output_tokens + 1))):  # (full: every position holds an output's token)
    past.append(output())

  def index():
    fresh = Past(past.tokens.copy(), past.keys.copy(), past.written)
    jax.block_until_ready(fresh.on_device())

  def release():
    past.append(output())
    jax.block_until_ready(past.on_device())

  device = past.on_device()
  copy = lambda: jax.block_until_ready(past.on_device())  # (nothing written since: the copy alone)
  # Contexts that end in an n-gram of the ring, so that every search finds and ranks candidates.
  history = np.asarray(rng.integers(0, VOCAB, (batch, context)), np.int32)
  for row in range(batch):
    at = int(rng.integers(16, size - 16))
    history[row, -8:] = past.tokens[(at - 8 + np.arange(8)) % size]
  search_fn = jax.jit(functools.partial(match_past, num_tokens=24, matches=matches))
  history, end = jnp.asarray(history), jnp.full((batch,), context - 1, jnp.int32)
  search = lambda: jax.block_until_ready(search_fn(device, history, end))
  row = {
    "size": size,
    "output_tokens": output_tokens,
    "batch": batch,
    "matches": matches,
    **{f"{name}_ms": 1e3 * median_seconds(fn, 1, iters) for name, fn in (("index", index), ("release", release))},
    **{f"{name}_ms": 1e3 * median_seconds(fn, 1, 5 * iters) for name, fn in (("copy", copy), ("search", search))},
  }
  return {**row, **traced_kernels(release, trace)} if trace else row


def traced_kernels(release, folder: Path, top: int = 12) -> dict:
  """The device time of a call of `release` and the `top` kernels it goes to, the most
  first ({kernel, ms, share}), from `TRACED` calls under the JAX profiler (the trace
  written under `folder`)."""
  import collections

  import jax

  from lab.profile import device_events, read_trace

  with jax.profiler.trace(str(folder)):
    for _ in range(TRACED):
      release()
  by_kernel = collections.Counter()
  for _, duration, _, kernel in device_events(read_trace(folder), module=""):
    by_kernel[kernel] += duration
  total = sum(by_kernel.values()) or 1
  kernels = [{"kernel": name, "ms": ns / 1e6 / TRACED, "share": ns / total} for name, ns in by_kernel.most_common(top)]
  return {"release_device_ms": total / 1e6 / TRACED, "release_kernels": kernels}


def main(argv=None) -> None:
  p = ArgumentParser(prog="python -m lab.bench_past", description=__doc__.splitlines()[0])
  p.add_argument("--sizes", type=positive_int, nargs="+", default=[262144, 1048576], help="ring sizes, tokens")
  p.add_argument("--output-tokens", type=positive_int, default=256, help="tokens an output writes")
  p.add_argument("--batch", type=positive_int, default=2, help="contexts a search looks up")
  p.add_argument("--context", type=positive_int, default=4096, help="tokens a context holds")
  p.add_argument("--matches", type=positive_int, default=4, help="continuations a search returns")
  p.add_argument("--iters", type=positive_int, default=10, help="timed calls per operation (searches: 5x)")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--trace", type=Path, help="also trace releases into the largest ring under this folder")
  p.add_argument("--out", type=Path, help="results JSON")
  args = p.parse_args(argv)
  if args.out:
    output_path(args.out)
  if any(size < args.output_tokens + 16 for size in args.sizes):
    p.error(f"each --sizes must hold an output and a context's n-gram: at least {args.output_tokens + 16} tokens")

  from infer.timing import environment

  rows = []
  for size in args.sizes:
    print(f"ring of {size:,} tokens ...", file=sys.stderr, flush=True)
    trace = args.trace if size == max(args.sizes) else None
    rows.append(measure(size, args.output_tokens, args.batch, args.context, args.matches, args.iters, args.seed, trace))
  result = {"kind": "past", **environment(), "argv": sys.argv[1:] if argv is None else argv, "rows": rows}
  print("ring tokens | index ms | release ms | copy ms | search ms")
  for r in rows:
    times = " | ".join(
      f"{r[f'{part}_ms']:{width}.3f}" for part, width in (("index", 8), ("release", 10), ("copy", 7), ("search", 9))
    )
    print(f"{r['size']:>11,} | {times}")
  for r in (r for r in rows if "release_kernels" in r):
    print(f"a release into {r['size']:,} tokens: {r['release_device_ms']:.3f} ms of device time; by kernel:")
    for k in r["release_kernels"]:
      print(f"  {k['ms']:8.3f} | {k['share']:6.1%} | {k['kernel']}")
  if args.out:
    from infer import plots

    plots.save(result, args.out)
    print(f"wrote {args.out} and {args.out.with_suffix('.png')}", file=sys.stderr)


if __name__ == "__main__":
  run_main(main, "python -m lab.bench_past")
