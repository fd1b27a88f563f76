"""Kernel launch parameters per shape, in one table.

Rows per block, keys per block, warps and pipeline stages come from the measurements of
`python -m lab.bench_kernels --suites sweep` on an H100 (docs/results.md, "Kernels"); the
prefix pass's split count is derived from the shape so that the grid is one wave.
"""

from __future__ import annotations

import dataclasses
import enum
import functools

import jax
from jax.experimental import pallas as pl

MIN_KEYS_PER_SPLIT = 256
# The masked pass splits its keys too where they are many (the draft's 512-slot ring), in
# ranges of at least this many; a verification tree's few keys stay one range.
MIN_TREE_KEYS_PER_SPLIT = 128
# Batch-invariant decoding's split-K range (a fixed length, never derived from the cache's
# allocated size): 8 programs per KV head at 4k keys, 64 at 32k.
INVARIANT_SPLIT_KEYS = 512
# Programs in one wave where the device does not say (interpreted on a CPU): an H100's SMs.
DEFAULT_WAVE = 132


@functools.cache
def wave_programs() -> int:
  """Programs that fill the GPU once: its SM count (132 on an H100 SXM). A sweep of
  the launch parameters (docs/results.md, "Kernels") found one wave of long splits faster than ~4
  waves of short ones for every shape (less partial output to write and merge, fewer
  pipeline warm-ups)."""
  return getattr(jax.devices()[0], "core_count", None) or DEFAULT_WAVE


class Pass(enum.Enum):
  """The two attention passes: over the committed prefix (split-K flash decoding) and over
  the step's own tokens under a mask (the tree)."""

  PREFIX = "prefix"
  TREE = "tree"


@dataclasses.dataclass(frozen=True)
class KernelParams:
  block_rows: int
  block_keys: int
  num_warps: int
  num_stages: int
  splits: int = 1
  split_keys: int = 0  # keys per split-K range, when fixed (then `splits` is ignored): see `split_length`


# (pass, largest query rows per KV head, head_dim) -> (block_rows, block_keys, warps, stages).
# Measured on an H100 with bf16 K/V (docs/results.md, "Kernels"); the first row
# whose row limit is >= the shape's rows wins. The head_dim-128 rows for <= 16 and for
# 256+ query rows per KV head were swept at 16k-32k (T = 1 and 64 with G = 4); the others
# hold the defaults the first grid ran with.
TABLE: dict[Pass, list[tuple[int, int, tuple[int, int, int, int]]]] = {
  Pass.PREFIX: [
    (16, 64, (16, 128, 4, 3)),
    (16, 128, (16, 64, 4, 3)),  # T = 1: (16, 128, 4, 3) within 3%
    (64, 64, (64, 64, 4, 3)),
    (64, 128, (64, 64, 4, 3)),
    (1 << 30, 64, (64, 64, 4, 3)),
    (1 << 30, 128, (128, 64, 8, 3)),  # sweeps at 16k-32k, T = 64 (G = 4): (128, 128, 8, 3) within 1%
  ],
  Pass.TREE: [
    (1 << 30, 64, (32, 32, 4, 2)),
    (1 << 30, 128, (32, 32, 4, 2)),
  ],
}


def params_for(
  kind: Pass, rows: int, head_dim: int, seq_len: int, batch_heads: int, extra_parts: int = 0
) -> KernelParams:
  """Launch parameters of pass `kind` for `rows` query rows per KV head over `seq_len`
  keys, with batch * kv_heads independent heads; a prefix pass that shares its launch
  with `extra_parts` more programs per row block (the tree's) takes that many fewer
  splits, so the launch stays one wave."""
  block_rows, block_keys, warps, stages = next(
    (launch for max_rows, dim, launch in TABLE[kind] if rows <= max_rows and head_dim == dim), (32, 32, 4, 2)
  )
  block_rows = max(16, min(block_rows, pl.next_power_of_2(rows)))
  programs = batch_heads * pl.cdiv(rows, block_rows)
  min_keys = MIN_KEYS_PER_SPLIT if kind is Pass.PREFIX else MIN_TREE_KEYS_PER_SPLIT
  splits = max(1, min(wave_programs() // programs - extra_parts, seq_len // min_keys))
  return KernelParams(block_rows, block_keys, warps, stages, splits)


def invariant_prefix_params() -> KernelParams:
  """The prefix pass's launch for batch-invariant decoding: one row tile, key block and
  split range for every call, so a query's sums run in the same order whatever else is in
  the call and however long the cache is allocated (a speculative run allocates room for
  its tree; AR does not). Splits are INVARIANT_SPLIT_KEYS keys from slot 0; those past a
  query's keys add exact zeros. 64 x 64 tiles are the sweep's choice for 64+ rows and cost
  an AR step little (its few rows are padded)."""
  return KernelParams(block_rows=64, block_keys=64, num_warps=4, num_stages=3, split_keys=INVARIANT_SPLIT_KEYS)
