"""`python -m lab.bench_kernels`: the attention kernels on the GPU, checked and timed.

  --suite check   kernels vs the jnp reference on the device (odd lengths, GQA, trees)
  --suite grid    hybrid tree attention over S x T x head shapes x batch, side by side
                  with jax.nn.dot_product_attention (xla, cudnn; the tree as a mask),
                  JAX's bundled Pallas decode_attention (prefix only) and the reference;
                  the prefix pass's achieved bytes/s against a measured copy bandwidth
  --suite verify  one verification step of an 8B-shaped random target at 32k context
  --suite sweep   block/warp/stage candidates for the tuning table
  --suite floor   what reading the prefix's K/V costs at the same size, without attention:
                  an XLA reduction, a Pallas read on the prefix pass's grid, a same-size copy
  --suite sparse  SpecAttn's two kernels: the top-p chunk selection and the block-sparse
                  prefix pass checked against their references on the device, then the
                  sparse pass timed beside the dense one at kept fractions of the chunks
                  (scattered at random: no two kept chunks need be adjacent), chunk sizes
                  and lengths, with the selection's own cost beside a sort's
  --suite matmul  the few-row weight-streaming matmul on Llama-3.1-8B's projections at
                  1-128 rows, beside XLA's dot (its own GEMMs and cuBLAS) and torch's, against the weight bytes over
                  the measured bandwidth; and whether a row's bits depend on the row count
  --suite matmul-sweep  the few-row matmul's launch candidates (row tile, column block,
                  contraction step, warps, stages) on the same projections and row counts,
                  beside cuBLAS

Timings are medians of on-device loops where each call feeds the next (no host overhead,
nothing hoisted), after a warm-up; every implementation of a row runs in the same process.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import statistics
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from infer import plots
from infer.timing import loop_seconds, measure_bandwidth, median_seconds
from lab.inputs import random_ancestor_mask
from lab.shapes import LLAMA_31_8B
from longspec_jax.cli import ArgumentParser, output_path, positive_int, run_main
from longspec_jax.ops import attention
from longspec_jax.ops.attention import Impl
from longspec_jax.ops.gemm import Gemm
from pallas_kernels import blocks
from pallas_kernels.flash_decode import bounds, flash_decode, prefix_partials, split_length
from pallas_kernels.hybrid import hybrid_attention
from pallas_kernels.matmul import MatmulParams, default_params, matmul
from pallas_kernels.sparse_decode import sparse_flash_decode
from pallas_kernels.topp import select_chunks, select_chunks_reference, select_chunks_sorted
from pallas_kernels.tree_attention import tree_attention
from pallas_kernels.tuning import KernelParams, Pass, params_for

HEADS = {"llama-3.1-8b": (32, 8, 128), "vicuna-7b": (32, 32, 128)}
INTERPRET = jax.default_backend() != "gpu"  # off the GPU only to try the script
SKIP_ABOVE_BYTES = 8 << 30  # implementations that materialize [B, H, T, S] scores skip larger shapes
MAX_BLOCK_ROWS = 128  # 256-row blocks with head_dim 128 run out of shared memory on the H100


def inputs(batch, steps, seq_len, heads, kv_heads, head_dim, dtype, seed=0):
  rng = np.random.default_rng(seed)
  keys = jax.random.split(jax.random.key(seed), 5)
  group = heads // kv_heads
  q = jax.random.normal(keys[0], (batch, steps, kv_heads, group, head_dim), dtype)
  k, v = (jax.random.normal(key, (batch, seq_len, kv_heads, head_dim), dtype) for key in keys[1:3])
  k_new, v_new = (jax.random.normal(key, (batch, steps, kv_heads, head_dim), dtype) for key in keys[3:5])
  lengths = jnp.full((batch,), seq_len, jnp.int32)
  return q, k, v, k_new, v_new, lengths, random_ancestor_mask(rng, batch, steps)


def suite_check(args) -> list[dict]:
  rows = []  # (run under float32 matmul precision: an exact float32 reference, no TF32)
  for (heads, kv_heads, head_dim), dtype, steps, seq_len in [
    ((32, 8, 128), jnp.bfloat16, 1, 4099),
    ((32, 8, 128), jnp.bfloat16, 69, 4099),
    ((32, 32, 128), jnp.bfloat16, 16, 1000),
    ((9, 3, 64), jnp.float32, 69, 777),
    ((9, 3, 64), jnp.bfloat16, 128, 2051),
    ((8, 1, 64), jnp.float32, 5, 300),
  ]:
    q, k, v, k_new, v_new, lengths, mask = inputs(2, steps, seq_len, heads, kv_heads, head_dim, dtype, seed=steps)
    lengths = jnp.asarray([seq_len, seq_len // 3 + 1], jnp.int32)  # per-sequence lengths
    positions = lengths[:, None] + jnp.arange(steps)
    tol = 2e-5 if dtype == jnp.float32 else 2e-2
    errors = {
      "flash_decode": _max_error(
        flash_decode(q, k, v, lengths)[0], attention.prefix_attention_reference(q, k, v, lengths)[0]
      ),
      "tree_attention": _max_error(
        tree_attention(q, k_new, v_new, mask)[0], attention.masked_attention_reference(q, k_new, v_new, mask)[0]
      ),
      "hybrid": _max_error(
        hybrid_attention(q, k, v, lengths, k_new, v_new, mask, positions),
        attention.hybrid_attention(q, k, v, lengths, k_new, v_new, mask, positions, impl=Impl.REFERENCE),
      ),
    }
    row = {
      "heads": [heads, kv_heads, head_dim],
      "dtype": jnp.dtype(dtype).name,
      "T": steps,
      "S": seq_len,
      "max_abs_error": errors,
      "tolerance": tol,
      "ok": all(e <= tol for e in errors.values()),
    }
    rows.append(row)
    print(
      f"check {row['heads']} {row['dtype']:8} T={steps:3} S={seq_len:5}: "
      + ", ".join(f"{k} {e:.1e}" for k, e in errors.items())
      + ("  ok" if row["ok"] else "  FAIL"),
      flush=True,
    )
  return rows


def _max_error(a, b) -> float:
  return float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32))))


def suite_grid(args) -> list[dict]:

  bandwidth = measure_bandwidth()
  print(f"copy bandwidth {bandwidth / 1e12:.2f} TB/s", flush=True)
  print(
    "heads        | B | S      | T   | prefix us | kernel us | prefix TB/s (% copy) | hybrid us | cudnn us |"
    " xla us | decode_attn us | reference us | cudnn/hybrid",
    flush=True,
  )
  rows = []
  for shape in shapes(args):
    rows.append(_grid_row(*shape, bandwidth))
    save(args, "grid", rows)  # a run cut short keeps the rows it finished
  return rows


def shapes(args):
  """(heads name, heads, kv_heads, head_dim, batch, S, T) for every shape the flags name."""
  for name, batch, seq_len, steps in itertools.product(args.heads, args.batches, args.lengths, args.steps):
    yield (name, *HEADS[name], batch, seq_len, steps)


def prefix_timings(q, k, v, lengths) -> tuple[KernelParams, float, float]:
  """The table's launch parameters for this shape, and microseconds per call of the
  prefix pass as the engine calls it (query layout, bounds, kernel, merge) and of the
  kernel alone (chained through its first split's output, so approximate)."""
  b, t, kv_heads, group, head_dim = q.shape
  params = params_for(Pass.PREFIX, t * group, head_dim, k.shape[1], b * kv_heads)
  rows_q = blocks.to_rows(q, params.block_rows)
  lo, hi = (blocks.per_row(x, group, rows_q.shape[2]) for x in bounds(lengths, None, None, t))
  pass_us = 1e6 * loop_seconds(lambda x, k, v, n: flash_decode(x, k, v, n)[0], q, k, v, lengths)
  kernel_us = 1e6 * loop_seconds(
    lambda r, k, v, lo, hi: prefix_partials(r, k, v, lo, hi, params, INTERPRET)[0][0], rows_q, k, v, lo, hi
  )
  return params, pass_us, kernel_us


def _fmt(x) -> str:
  return "     -" if x is None else f"{x:9.1f}"


def _grid_row(name, heads, kv_heads, head_dim, batch, seq_len, steps, bandwidth) -> dict:
  q, k, v, k_new, v_new, lengths, mask = inputs(batch, steps, seq_len, heads, kv_heads, head_dim, jnp.bfloat16)
  positions = lengths[:, None] + jnp.arange(steps)
  kv_bytes = 2 * k.nbytes
  scores_bytes = 4 * batch * heads * steps * (seq_len + steps)
  row = {"heads": name, "batch": batch, "S": seq_len, "T": steps}
  _, row["prefix_us"], row["prefix_kernel_us"] = prefix_timings(q, k, v, lengths)
  row["prefix_bytes_per_second"] = kv_bytes / (row["prefix_us"] * 1e-6)
  row["prefix_fraction_of_copy"] = row["prefix_bytes_per_second"] / bandwidth
  operands = (k, v, lengths, k_new, v_new, mask, positions)
  row["hybrid_us"] = 1e6 * loop_seconds(hybrid_attention, q, *operands)

  # jax.nn.dot_product_attention over prefix + tree with the tree as a mask ([B, T, H, D] layout).
  k_all, v_all = jnp.concatenate([k, k_new], 1), jnp.concatenate([v, v_new], 1)
  full_mask = jnp.concatenate([jnp.ones((batch, steps, seq_len), bool), mask], axis=2)[:, None]
  flat = q.reshape(batch, steps, heads, head_dim)
  for impl in ("cudnn", "xla"):
    if impl == "xla" and scores_bytes > SKIP_ABOVE_BYTES:
      row[f"{impl}_us"] = None
      continue
    fn = functools.partial(jax.nn.dot_product_attention, implementation=impl)
    try:
      row[f"{impl}_us"] = 1e6 * loop_seconds(lambda x, k, v, m: fn(x, k, v, mask=m), flat, k_all, v_all, full_mask)
    except Exception as e:  # cudnn rejects some shapes; say so in the table
      row[f"{impl}_us"] = None
      row[f"{impl}_error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"

  # JAX's bundled Pallas decode attention: the prefix pass only, T folded into the heads.
  from jax.experimental.pallas.ops.gpu import decode_attention

  folded = q.reshape(batch, steps, heads, head_dim).transpose(0, 2, 1, 3).reshape(batch, heads * steps, head_dim)
  try:
    row["decode_attention_us"] = 1e6 * loop_seconds(
      lambda x, k, v, n: decode_attention.gqa(x, k, v, kv_seq_len=n, k_splits=16), folded, k, v, lengths
    )
  except Exception as e:
    row["decode_attention_us"] = None
    row["decode_attention_error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"

  row["reference_us"] = None
  if scores_bytes <= SKIP_ABOVE_BYTES:
    row["reference_us"] = 1e6 * loop_seconds(attention.hybrid_attention, q, *operands)
  row["cudnn_over_hybrid"] = row["cudnn_us"] / row["hybrid_us"] if row["cudnn_us"] else None
  print(
    f"{name:12} | {batch} | {seq_len:6} | {steps:3} | {row['prefix_us']:9.1f} | {row['prefix_kernel_us']:9.1f} |"
    f" {row['prefix_bytes_per_second'] / 1e12:5.2f} ({100 * row['prefix_fraction_of_copy']:3.0f}%)        |"
    f" {row['hybrid_us']:9.1f} | {_fmt(row['cudnn_us'])} | {_fmt(row['xla_us'])} |"
    f" {_fmt(row['decode_attention_us'])} | {_fmt(row['reference_us'])} |"
    f" {_fmt(row['cudnn_over_hybrid'])}",
    flush=True,
  )
  return row


def suite_verify(args) -> list[dict]:
  """One tree verification (64 nodes) of a random bf16 Llama-3.1-8B-shaped target at each
  context: dense (the kernels; the jnp reference up to 32k), and sparse (SpecAttn) at
  each kept fraction of the 64-slot chunks (`--kept`, scattered at random, the first 2
  layers dense), with what sparse verification adds to a round beside it: the draft's
  chunk mass over one target layer for the 16 nodes of a draft pass
  (`attention.prefix_chunk_mass`) and the selection over the chunks (`select_chunks`)."""
  from flax import nnx

  from longspec_jax.decoding.tree import Tree
  from longspec_jax.decoding.verify import verify
  from longspec_jax.models.cache import KVCache
  from longspec_jax.models.config import SparseVerify
  from longspec_jax.models.target import random_model

  model = random_model(LLAMA_31_8B, jnp.bfloat16)
  params, graphdefs = nnx.state(model), {}
  for impl in (Impl.PALLAS, Impl.REFERENCE):  # the same weights under each attention code
    model = model.with_numerics(attention=impl)
    graphdefs[impl] = nnx.graphdef(model)
  sparse = SparseVerify(0.95)  # (its p is the draft's business: the kept chunks are given here)
  kv_heads, head_dim = LLAMA_31_8B.num_kv_heads, LLAMA_31_8B.head_dim
  rng = np.random.default_rng(0)
  parents = [-1] + [int(rng.integers(0, i)) for i in range(1, 64)]
  depths = [0]
  for i in range(1, 64):
    depths.append(depths[parents[i]] + 1)
  tree = Tree(
    tokens=jnp.asarray(rng.integers(0, 1000, (1, 64)), jnp.int32),
    parents=jnp.asarray([parents], jnp.int32),
    depths=jnp.asarray([depths], jnp.int32),
    valid=jnp.ones((1, 64), bool),
  )
  rows = []
  for context in args.verify_contexts:
    key_k, key_v, key_q = jax.random.split(jax.random.key(context), 3)
    shape = (LLAMA_31_8B.num_layers, 1, context + 128, kv_heads, head_dim)
    cache = KVCache(
      k=jax.random.normal(key_k, shape, jnp.bfloat16),
      v=jax.random.normal(key_v, shape, jnp.bfloat16),
      lengths=jnp.full((1,), context, jnp.int32),
    )
    chunks = -(-shape[2] // sparse.chunk)
    row = {"context": context, "nodes": 64, "chunk": sparse.chunk, "dense_layers": sparse.dense_layers}
    for impl, graphdef in graphdefs.items():
      if impl is Impl.REFERENCE and context > 32768:  # (its [B, H, T, S] scores: slow, and not the point)
        continue
      step = jax.jit(lambda params, cache, graphdef=graphdef: verify(nnx.merge(graphdef, params), tree, cache)[0])
      row[f"{impl.value}_ms"] = 1e3 * median_seconds(functools.partial(step, params, cache), warmup=1, iters=10)
    if "reference_ms" in row:
      row["reference_over_pallas"] = row["reference_ms"] / row["pallas_ms"]
    step = jax.jit(
      lambda params, cache, kept: verify(
        nnx.merge(graphdefs[Impl.PALLAS], params), dataclasses.replace(tree, kept=kept), cache, sparse
      )[0]
    )
    row["sparse"] = []
    for fraction in args.kept:
      kept = jnp.asarray(rng.random((1, kv_heads, chunks)) < fraction)
      ms = 1e3 * median_seconds(functools.partial(step, params, cache, kept), warmup=1, iters=10)
      row["sparse"].append({"kept": fraction, "ms": ms, "dense_over_sparse": row["pallas_ms"] / ms})
    q = jax.random.normal(key_q, (1, 16, kv_heads, LLAMA_31_8B.num_heads // kv_heads, head_dim), jnp.bfloat16)
    lse = jnp.zeros(q.shape[:-1], jnp.float32)
    mass = jax.jit(lambda q, k, lse, n: attention.prefix_chunk_mass(q, k, lse, n, sparse.chunk, layer=0))
    row["chunk_mass_us"] = 1e6 * median_seconds(
      functools.partial(mass, q, cache.k, lse, cache.lengths), warmup=1, iters=10
    )
    weights = jax.random.uniform(key_q, (kv_heads, chunks)) ** 8
    select = jax.jit(lambda m: attention.select_chunks(m, sparse.p, impl=Impl.PALLAS))
    row["select_us"] = 1e6 * median_seconds(functools.partial(select, weights), warmup=1, iters=10)
    rows.append(row)
    print(
      f"verify 8B-shape, 64 nodes at {context}: pallas {row['pallas_ms']:.2f} ms"
      + (
        f", reference {row['reference_ms']:.2f} ms ({row['reference_over_pallas']:.2f}x)"
        if "reference_ms" in row
        else ""
      )
      + "; sparse "
      + ", ".join(f"{r['kept']:.0%} kept {r['ms']:.2f} ms ({r['dense_over_sparse']:.2f}x)" for r in row["sparse"])
      + f"; a draft pass's chunk mass {row['chunk_mass_us']:.0f} us, selection {row['select_us']:.0f} us",
      flush=True,
    )
    save(args, "verify", rows)
    del cache
  return rows


SWEEP_BLOCKS = [
  (64, 4, 3),
  (128, 4, 3),
  (128, 4, 4),
  (64, 8, 3),
  (128, 8, 3),
  (256, 4, 2),
  (256, 8, 2),
  (64, 2, 4),
]  # (block_keys, warps, stages)
SWEEP_SPLITS = (0.5, 1, 2, 4)  # times the split count the table derives


def launch_us(label: str, fn, *args) -> float | None:
  """Microseconds per call of a sweep's candidate launch (`loop_seconds`), or None, said
  in a line, where it does not compile (e.g. out of shared memory)."""
  try:
    return 1e6 * loop_seconds(fn, *args)
  except Exception as e:
    print(f"{label}: {type(e).__name__}", flush=True)
    return None


def suite_sweep(args) -> list[dict]:
  """Times the prefix pass under candidate launch parameters around the table's choice:
  key blocks, warps and stages, the split count, and the next row block sizes down and up
  (a smaller block can pay when the rows pad the table's block, e.g. a 69-node tree's 276
  rows per KV head fill three 128-row blocks, 384 rows)."""
  rows = []
  for name, heads, kv_heads, head_dim, batch, seq_len, steps in shapes(args):
    group = heads // kv_heads
    q, k, v, _, _, lengths, _ = inputs(batch, steps, seq_len, heads, kv_heads, head_dim, jnp.bfloat16)
    base = params_for(Pass.PREFIX, steps * group, head_dim, seq_len, batch * kv_heads)
    larger = min(2 * base.block_rows, MAX_BLOCK_ROWS, max(16, pl.next_power_of_2(steps * group)))
    block_rows = {max(16, base.block_rows // 2), base.block_rows, larger}
    candidates = {
      KernelParams(br, bk, warps, stages, max(1, min(round(base.splits * f), seq_len // bk)))
      for br in block_rows
      for bk, warps, stages in SWEEP_BLOCKS
      for f in SWEEP_SPLITS
    }
    timed = []
    for params in sorted(candidates, key=lambda p: dataclasses.astuple(p)):
      run = lambda x, k, v, n, p=params: flash_decode(x, k, v, n, params=p)[0]
      us = launch_us(f"sweep {name} B={batch} S={seq_len} T={steps} {params}", run, q, k, v, lengths)
      if us is None:
        continue
      timed.append((us, params))
      rows.append(
        {
          "heads": name,
          "batch": batch,
          "S": seq_len,
          "T": steps,
          "params": dataclasses.asdict(params),
          "table": params == base,
          "prefix_us": us,
        }
      )
    save(args, "sweep", rows)
    table_us = next((us for us, p in timed if p == base), None)
    best_us, best = min(timed, key=lambda x: x[0])
    print(
      f"sweep {name} B={batch} S={seq_len} T={steps}: table {base} {table_us:.1f} us;"
      f" best {best} {best_us:.1f} us; K/V at {2 * k.nbytes / best_us / 1e6:.2f} TB/s",
      flush=True,
    )
  return rows


def _read_kernel(x_ref, k_ref, v_ref, out_ref, *, block_keys, split_len):
  start = pl.program_id(1) * split_len

  def step(i, acc):
    keys = pl.ds(start + i * block_keys, block_keys)
    return acc + jnp.sum(k_ref[keys, :].astype(jnp.float32) + v_ref[keys, :].astype(jnp.float32), axis=0)

  out_ref[...] = jax.lax.fori_loop(0, split_len // block_keys, step, x_ref[...])


def pallas_read(x, k, v, params: KernelParams):
  """Sums k + v [B, S, K, D] over each split of the prefix pass's grid into x [B * K,
  splits, D]: the pass's loads and launch without its attention math."""
  b, seq_len, kv_heads, d = k.shape
  split_len = seq_len // x.shape[1]
  head = lambda bh: (bh // kv_heads, bh % kv_heads)
  kv_spec = pl.BlockSpec((None, seq_len, None, d), lambda bh, s: (head(bh)[0], 0, head(bh)[1], 0))
  return pl.pallas_call(
    functools.partial(_read_kernel, block_keys=params.block_keys, split_len=split_len),
    grid=x.shape[:2],
    in_specs=[pl.BlockSpec((None, None, d), lambda bh, s: (bh, s, 0)), kv_spec, kv_spec],
    out_specs=pl.BlockSpec((None, None, d), lambda bh, s: (bh, s, 0)),
    out_shape=jax.ShapeDtypeStruct(x.shape, jnp.float32),
    compiler_params=plgpu.CompilerParams(num_warps=params.num_warps, num_stages=params.num_stages),
    interpret=INTERPRET,
    name="prefix_read",
  )(x, k, v)


def suite_floor(args) -> list[dict]:
  """The prefix pass next to what merely reading its K/V costs at the same size, in the
  same timing loop: where a shape's distance from the copy bandwidth comes from."""

  bandwidth = measure_bandwidth()
  print(f"copy bandwidth {bandwidth / 1e12:.2f} TB/s", flush=True)
  print(
    "heads        | B | S      | T   | K/V MB | pass us | kernel us | pallas read us | xla read us |"
    " same-size copy us | copy-bandwidth us",
    flush=True,
  )
  rows = []
  for name, heads, kv_heads, head_dim, batch, seq_len, steps in shapes(args):
    q, k, v, _, _, lengths, _ = inputs(batch, steps, seq_len, heads, kv_heads, head_dim, jnp.bfloat16)
    kv_bytes = 2 * k.nbytes
    params, pass_us, kernel_us = prefix_timings(q, k, v, lengths)
    split_len = split_length(seq_len, params)
    row = {
      "heads": name,
      "batch": batch,
      "S": seq_len,
      "T": steps,
      "kv_bytes": kv_bytes,
      "params": dataclasses.asdict(params),
      "pass_us": pass_us,
      "kernel_us": kernel_us,
    }
    row["pallas_read_us"] = None
    if seq_len % split_len == 0:
      sums = jnp.zeros((batch * kv_heads, seq_len // split_len, head_dim), jnp.float32)
      row["pallas_read_us"] = 1e6 * loop_seconds(lambda x, k, v: pallas_read(x, k, v, params), sums, k, v)
    row["xla_read_us"] = 1e6 * loop_seconds(
      lambda x, k, v: jnp.tanh(jnp.sum(k * x, dtype=jnp.float32) + jnp.sum(v * x, dtype=jnp.float32)),
      jnp.float32(0.5),
      k,
      v,
    )
    # A copy of the same bytes, each call fenced so that XLA cannot fuse the chain.
    row["same_size_copy_us"] = 1e6 * loop_seconds(
      lambda x: jax.lax.optimization_barrier(x * 2 + 1), jnp.ones((kv_bytes // 2,), jnp.bfloat16)
    )
    row["copy_bandwidth_us"] = 1e6 * kv_bytes / bandwidth
    rows.append(row)
    save(args, "floor", rows)
    print(
      f"{name:12} | {batch} | {seq_len:6} | {steps:3} | {kv_bytes / 1e6:6.0f} | {row['pass_us']:7.1f} |"
      f" {row['kernel_us']:9.1f} | {_fmt(row['pallas_read_us'])}      | {row['xla_read_us']:11.1f} |"
      f" {row['same_size_copy_us']:17.1f} | {row['copy_bandwidth_us']:9.1f}",
      flush=True,
    )
  return rows


def suite_sparse(args) -> list[dict]:
  """SpecAttn's selection and sparse prefix pass: each checked against its reference on
  the device, then timed beside `flash_decode` over the same cache."""
  rows = []
  rng = np.random.default_rng(0)
  for (heads, kv_heads, head_dim), dtype, steps, seq_len, chunk in [
    ((32, 8, 128), jnp.bfloat16, 1, 4099, 16),
    ((32, 8, 128), jnp.bfloat16, 69, 4099, 64),
    ((9, 3, 64), jnp.float32, 5, 777, 16),
  ]:
    q, k, v, _, _, _, _ = inputs(2, steps, seq_len, heads, kv_heads, head_dim, dtype, seed=steps)
    lengths = jnp.asarray([seq_len, seq_len // 3 + 1], jnp.int32)
    kept = jnp.asarray(rng.random((2, kv_heads, -(-seq_len // chunk))) < 0.3)
    with jax.default_matmul_precision("highest"):
      error = _max_error(
        sparse_flash_decode(q, k, v, lengths, kept, chunk=chunk)[0],
        attention.sparse_prefix_attention_reference(q, k, v, lengths, kept, chunk)[0],
      )
    mass = jnp.asarray(rng.random((16, seq_len // chunk)) ** 8, jnp.float32)  # peaked rows, as attention is
    mismatch = int(jnp.sum(select_chunks(mass, 0.9, interpret=INTERPRET) != select_chunks_reference(mass, 0.9)))
    tol = 2e-5 if dtype == jnp.float32 else 2e-2
    row = {
      "check": True,
      "heads": [heads, kv_heads, head_dim],
      "dtype": jnp.dtype(dtype).name,
      "T": steps,
      "S": seq_len,
      "chunk": chunk,
      "max_abs_error": error,
      "select_mismatches": mismatch,
      "ok": error <= tol and mismatch == 0,
    }
    rows.append(row)
    print(
      f"check sparse {row['heads']} {row['dtype']:8} T={steps:3} S={seq_len:5} chunk {chunk}: error {error:.1e},"
      f" selection mismatches {mismatch}" + ("  ok" if row["ok"] else "  FAIL"),
      flush=True,
    )
  save(args, "sparse", rows)
  print(
    "heads        | S      | T   | chunk | kept  | dense us | sparse us | dense/sparse | select us | sort us",
    flush=True,
  )
  for name, _, kv_heads, _, batch, seq_len, steps in shapes(args):
    q, k, v, _, _, lengths, _ = inputs(batch, steps, seq_len, *HEADS[name], jnp.bfloat16)
    dense_us = 1e6 * loop_seconds(lambda x, k, v, n: flash_decode(x, k, v, n)[0], q, k, v, lengths)
    for chunk in args.chunks:
      chunks = -(-seq_len // chunk)
      mass = jax.random.uniform(jax.random.key(chunk), (batch * kv_heads, chunks)) ** 8
      select_us = 1e6 * loop_seconds(lambda m: m + select_chunks(m, 0.9, interpret=INTERPRET), mass)
      sort_us = 1e6 * loop_seconds(lambda m: m + select_chunks_sorted(m, 0.9), mass)
      for fraction in args.kept:
        kept = jnp.asarray(rng.random((batch, kv_heads, chunks)) < fraction)
        sparse_us = 1e6 * loop_seconds(
          lambda x, k, v, n, kept: sparse_flash_decode(x, k, v, n, kept, chunk=chunk)[0], q, k, v, lengths, kept
        )
        rows.append(
          {
            "heads": name,
            "batch": batch,
            "S": seq_len,
            "T": steps,
            "chunk": chunk,
            "kept": fraction,
            "dense_us": dense_us,
            "sparse_us": sparse_us,
            "dense_over_sparse": dense_us / sparse_us,
            "select_us": select_us,
            "sort_select_us": sort_us,
          }
        )
        save(args, "sparse", rows)
        print(
          f"{name:12} | {seq_len:6} | {steps:3} | {chunk:5} | {fraction:5.2f} | {dense_us:8.1f} |"
          f" {sparse_us:9.1f} | {dense_us / sparse_us:12.2f} | {select_us:9.1f} | {sort_us:7.1f}",
          flush=True,
        )
  return rows


def projections() -> dict[str, tuple[int, int]]:
  """The 8B shape's weight products by name: (K, N)."""
  c = LLAMA_31_8B
  return {
    "qkv": (c.hidden_size, (c.num_heads + 2 * c.num_kv_heads) * c.head_dim),
    "o": (c.num_heads * c.head_dim, c.hidden_size),
    "gate_up": (c.hidden_size, 2 * c.intermediate_size),
    "down": (c.intermediate_size, c.hidden_size),
    "lm_head": (c.hidden_size, c.vocab_size),
  }


def chained(fn):
  """fn(x, w) as a step of `loop_seconds`' chain: x plus a vanishing share of the product."""
  return lambda x, w: x + 1e-30 * fn(x, w)[:, :1].astype(x.dtype)


def suite_matmul(args) -> list[dict]:
  """Few-row products y [M, N] = x [M, K] @ w [K, N] of the 8B shape's projections, bf16:
  our Pallas kernel (default parameters), XLA's dot with its own GEMMs and with cuBLAS, and
  torch's, each against the floor of reading w once at the measured bandwidth; plus the
  largest difference between a row computed alone and the same row among 69 (0 for a
  batch-invariant product)."""
  shapes = projections()
  bandwidth = measure_bandwidth()
  try:
    import torch
  except ImportError:
    torch = None
  rows_out = []
  for name, (k, n) in shapes.items():
    w = jax.random.normal(jax.random.key(k + n), (k, n), jnp.bfloat16) * k**-0.5
    floor_us = 1e6 * k * n * 2 / bandwidth
    x69 = jax.random.normal(jax.random.key(1), (69, k), jnp.bfloat16)
    product = functools.partial(matmul, interpret=INTERPRET)
    many = product(x69, w)
    invariance = max(float(jnp.max(jnp.abs(product(x69[i : i + 1], w)[0] - many[i]))) for i in (0, 33, 68))
    xla_invariance = max(
      float(jnp.max(jnp.abs(jnp.dot(x69[i : i + 1], w)[0] - jnp.dot(x69, w)[i]))) for i in (0, 33, 68)
    )
    for m in args.matmul_rows:
      x = jax.random.normal(jax.random.key(m), (m, k), jnp.bfloat16)
      row = {
        "name": name,
        "K": k,
        "N": n,
        "rows": m,
        "floor_us": floor_us,
        "pallas_us": 1e6 * loop_seconds(chained(product), x, w),
        "xla_us": 1e6 * loop_seconds(chained(jnp.dot), x, w),
        "cublas_us": 1e6 * loop_seconds(chained(jnp.dot), x, w, compiler_options=Gemm.CUBLAS.compiler_options()),
        "pallas_max_diff_alone_vs_69": invariance,
        "xla_max_diff_alone_vs_69": xla_invariance,
      }
      if torch is not None and torch.cuda.is_available():
        tx = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
        tw = torch.randn(k, n, dtype=torch.bfloat16, device="cuda")
        row["torch_us"] = 1e3 * _torch_ms(lambda: tx @ tw)
      row.update(
        {
          f"{impl}_of_floor": floor_us / row[f"{impl}_us"]
          for impl in ("pallas", "xla", "cublas", "torch")
          if f"{impl}_us" in row
        }
      )
      rows_out.append(row)
      print(
        f"matmul {name:8} {k:>6}x{n:<6} rows {m:>3}: floor {floor_us:7.1f} us | pallas {row['pallas_us']:7.1f}"
        f" | xla {row['xla_us']:7.1f} | cublas {row['cublas_us']:7.1f}"
        f" | torch {row.get('torch_us', float('nan')):7.1f} | bits alone vs 69:"
        f" pallas {invariance:.3g}, xla {xla_invariance:.3g}",
        flush=True,
      )
  return rows_out


# The matmul sweep's candidates: row tiles, column blocks, contraction steps, (warps, stages).
MATMUL_SWEEP = ((16, 64), (64, 128, 256), (64, 128), ((4, 3), (8, 4)))


def suite_matmul_sweep(args) -> list[dict]:
  """Times the few-row matmul under each candidate launch (MATMUL_SWEEP; the contraction
  split from the column block as `default_params` derives it) for the 8B shape's
  projections at each row count, beside cuBLAS and the default launch; candidates that do
  not compile (shared memory) are skipped with a line."""
  rows_out = []
  for name, (k, n) in projections().items():
    w = jax.random.normal(jax.random.key(k + n), (k, n), jnp.bfloat16) * k**-0.5
    floor_us = 1e6 * k * n * 2 / measure_bandwidth()
    for m in args.matmul_rows:
      x = jax.random.normal(jax.random.key(m), (m, k), jnp.bfloat16)
      cublas_us = 1e6 * loop_seconds(chained(jnp.dot), x, w, compiler_options=Gemm.CUBLAS.compiler_options())
      default = default_params(k, n)
      timed = []
      for block_rows, block_n, block_k, (warps, stages) in itertools.product(*MATMUL_SWEEP):
        splits = default_params(k, n, block_n=block_n).splits
        params = MatmulParams(block_rows, block_n, block_k, splits, warps, stages)
        product = chained(functools.partial(matmul, params=params, interpret=INTERPRET))
        us = launch_us(f"matmul-sweep {name} rows {m} {params}", product, x, w)
        if us is None:
          continue
        timed.append((us, params))
        rows_out.append(
          {
            "name": name,
            "K": k,
            "N": n,
            "rows": m,
            "params": dataclasses.asdict(params),
            "pallas_us": us,
            "cublas_us": cublas_us,
            "floor_us": floor_us,
          }
        )
      best_us, best = min(timed, key=lambda t: t[0])
      for row in rows_out[len(rows_out) - len(timed) :]:  # the rows a table shows: the default and the best
        labels = [name for name, p in (("default", default), ("best", best)) if row["params"] == dataclasses.asdict(p)]
        row["choice"] = ", ".join(labels) or None
      save(args, "matmul-sweep", rows_out)
      print(
        f"matmul-sweep {name:8} rows {m:>3}: floor {floor_us:6.1f} us | cublas {cublas_us:6.1f}"
        f" | best {best_us:6.1f} {dataclasses.astuple(best)}",
        flush=True,
      )
  return rows_out


def _torch_ms(fn, iters: int = 50) -> float:
  """Median milliseconds per call of a torch CUDA op, by CUDA events, after a warm-up."""
  import torch

  for _ in range(5):
    fn()
  times = []
  for _ in range(5):
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
      fn()
    end.record()
    torch.cuda.synchronize()
    times.append(start.elapsed_time(end) / iters)
  return statistics.median(times)


SUITES = {
  "check": suite_check,
  "grid": suite_grid,
  "verify": suite_verify,
  "sweep": suite_sweep,
  "floor": suite_floor,
  "matmul": suite_matmul,
  "matmul-sweep": suite_matmul_sweep,
  "sparse": suite_sparse,
}


def main(argv=None):
  p = ArgumentParser(prog="python -m lab.bench_kernels", description=__doc__.splitlines()[0])
  p.add_argument("--suites", nargs="+", choices=sorted(SUITES), default=["check", "grid", "verify"])
  p.add_argument("--heads", nargs="+", choices=sorted(HEADS), default=sorted(HEADS))
  p.add_argument("--batches", type=positive_int, nargs="+", default=[1, 8])
  p.add_argument("--lengths", type=positive_int, nargs="+", default=[4096, 16384, 65536, 131072])
  p.add_argument("--steps", type=positive_int, nargs="+", default=[1, 16, 64, 128], help="tree tokens T")
  p.add_argument("--verify-contexts", type=positive_int, nargs="+", default=[32768])
  p.add_argument("--chunks", type=positive_int, nargs="+", default=[16, 64], help="sparse suite: slots per chunk")
  p.add_argument(
    "--kept",
    type=float,
    nargs="+",
    default=[0.05, 0.1, 0.25, 0.5, 1.0],
    help="sparse and verify suites: fractions of the chunks kept",
  )
  p.add_argument("--matmul-rows", type=positive_int, nargs="+", default=[1, 16, 69, 128])
  p.add_argument("--out", type=Path, help="results JSON (a PNG of them is written beside it)")
  args = p.parse_args(argv)
  if args.out:
    output_path(args.out)
  print(f"device: {jax.devices()[0].device_kind}, jax {jax.__version__}", flush=True)
  args.result = {"device": jax.devices()[0].device_kind, "jax": jax.__version__}
  for suite in args.suites:
    with jax.default_matmul_precision("highest" if suite == "check" else "default"):
      save(args, suite, SUITES[suite](args))


def save(args, suite: str, rows: list[dict]) -> None:
  """Writes everything measured so far: a later failure loses nothing."""
  args.result[suite] = rows
  if args.out:
    plots.save(args.result, args.out)


if __name__ == "__main__":
  run_main(main, "python -m lab.bench_kernels")
