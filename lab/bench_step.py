"""`python -m lab.bench_step`: the draft's training step against its floor.

A draft's training step runs the frozen target forward (its K/V and, distilling, its
final states), the draft block forward and backward, and the shared LM head: the
teacher's logits, and the draft's logits with their gradient back to the draft's
hidden states. Only the draft block is the draft's own; the rest is there for any draft.
This times, per batch x length, in one run (medians after warm-up, random weights of the
model's real shape: the work is the real one):

  step    the full step as `train.run` jits it (AdamW update included), a fresh draft
  floor   the same step with a draft that costs nothing (its hidden states are the
          target's): the frozen target forward + the shared head's loss and input gradient
  target  the frozen target's forward alone

so "how far can a faster draft block take training" is step / floor. Prints a table,
writes JSON (`--out`) and a plot beside it.

  python -m lab.bench_step --sizes 16x1024 8x2048 2x8192 --out step.json
  python -m lab.bench_step --shape llama-3.1-8b --sizes 1x8192 --out step_8b.json
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import platform
import statistics
import sys
import time
from pathlib import Path

from lab.shapes import SHAPES
from longspec_jax.cli import ArgumentParser, output_path, positive_int, resolve_dtype, run_main


def batch_by_length(text: str) -> tuple[int, int]:
  """An argparse type: '16x1024' -> (16, 1024), sequences x tokens."""
  batch, _, length = text.partition("x")
  try:
    sizes = int(batch), int(length)
  except ValueError:
    sizes = (0, 0)
  if sizes[0] < 1 or sizes[1] < 2:
    raise argparse.ArgumentTypeError(f"expected BATCHxLENGTH like 16x1024, got {text!r}")
  return sizes


def rollout_spec(text: str) -> tuple[int, int]:
  """--rollout: D (the training-time test's passes) or DxR (the deeper ones over R rows)."""
  depth, _, rows = text.partition("x")
  try:
    parsed = int(depth), int(rows or 0)
  except ValueError:
    parsed = (0, -1)
  if parsed[0] < 2 or parsed[1] < 0:
    raise argparse.ArgumentTypeError(
      f"expected passes like 5 or 5x4 (5 passes, the deeper ones over 4 rows), got {text!r}"
    )
  return parsed


def parse_args(argv=None):
  p = ArgumentParser(prog="python -m lab.bench_step", description=__doc__.splitlines()[0])
  p.add_argument("--shape", choices=sorted(SHAPES), default="smollm2-135m", help="the target's shape (random weights)")
  p.add_argument(
    "--sizes",
    nargs="+",
    type=batch_by_length,
    default=[(16, 1024), (8, 2048), (2, 8192)],
    help="BATCHxLENGTH of each micro-batch to time (default: the recipe's three stages' sizes)",
  )
  p.add_argument("--draft-intermediate-size", type=positive_int, help="the draft's MLP width (default: the target's)")
  p.add_argument("--dtype", choices=("float32", "bfloat16"), help="compute dtype (default: bf16 on GPU)")
  p.add_argument(
    "--rollout",
    nargs="+",
    type=rollout_spec,
    default=[],
    help="also time the training-time test's step: D passes, or DxR with the deeper ones over R rows (one row each)",
  )
  p.add_argument("--iters", type=positive_int, default=10, help="timed calls of each, after two warm-ups")
  p.add_argument("--out", type=Path, help="JSON of the rows (and a PNG beside it)")
  args = p.parse_args(argv)
  context = SHAPES[args.shape].max_position_embeddings
  for batch, length in args.sizes:
    if length > context:
      p.error(f"--sizes: {batch}x{length} exceeds {args.shape}'s context of {context} tokens")
  return args


def floor_loss(delta, tokens, positions, target_params, *, target_graphdef, config):
  """The step's loss with a draft that costs nothing: the draft's hidden states are the
  target's own plus `delta` [E] (zeros), through the shared head against the target's
  distribution, as `step.draft_token_losses` computes it; its gradient w.r.t. `delta`
  is the head's input gradient, which every draft pays."""
  import jax
  import jax.numpy as jnp

  from train.loss import chunked_token_losses
  from train.step import frozen_target

  target = frozen_target(target_graphdef, target_params)
  hidden, _, _ = target.causal_hidden_and_kv(tokens, positions)
  hidden = jax.lax.stop_gradient(hidden[:, :-1])
  losses, _ = chunked_token_losses(
    hidden + delta.astype(hidden.dtype), target.logits, tokens[:, 1:], config.loss_chunk, hidden
  )
  return jnp.mean(losses)


def target_forward(tokens, positions, target_params, *, target_graphdef):
  """The frozen target's forward alone, as training runs it: final states and every
  layer's K/V."""
  from train.step import frozen_target

  return frozen_target(target_graphdef, target_params).causal_hidden_and_kv(tokens, positions)


def measure(args) -> dict:
  import jax
  import jax.numpy as jnp
  import numpy as np
  from flax import nnx

  from infer.timing import median_seconds
  from longspec_jax.models.draft import random_draft
  from longspec_jax.models.target import random_model
  from longspec_jax.ops.attention import Impl
  from longspec_jax.weights.drafts import new_draft_config
  from train.run import PEAK_FLOPS, model_flops_per_token
  from train.step import TrainConfig, make_optimizer, make_train_step, training_positions, tree_delays

  target_config = SHAPES[args.shape]
  dtype = jnp.dtype(resolve_dtype(args.dtype))
  target = random_model(target_config, dtype)
  draft_config = new_draft_config(
    target_config, intermediate_size=args.draft_intermediate_size or target_config.intermediate_size
  )
  target_graphdef, target_params = nnx.split(target)
  draft_graphdef, fresh = nnx.split(random_draft(draft_config, jnp.float32, attention=Impl.FLASH))
  config = TrainConfig(
    compute_dtype=dtype.name,
    max_position=target_config.max_position_embeddings,
    delay_weights=tree_delays(len(draft_config.tree_widths)),
  )
  optimizer = make_optimizer(config)
  steps = {  # the step by its passes a depth (0: one pass, delayed) and the rows the deeper ones take
    (depth, rows): make_train_step(
      draft_graphdef, target_graphdef, optimizer, dataclasses.replace(config, rollout_depth=depth, rollout_rows=rows)
    )
    for depth, rows in [(0, 0), *args.rollout]
  }
  floor = jax.jit(jax.grad(functools.partial(floor_loss, target_graphdef=target_graphdef, config=config)))
  forward = jax.jit(functools.partial(target_forward, target_graphdef=target_graphdef))
  peak = PEAK_FLOPS.get(jax.devices()[0].device_kind)
  rng = np.random.default_rng(0)
  rows = []
  for batch, length in args.sizes:
    tokens = jnp.asarray(rng.integers(0, target_config.vocab_size, (batch, length)), jnp.int32)
    mask = jnp.ones((batch, length), bool)
    positions = training_positions(jax.random.key(0), config, batch, length)

    def timed(step):
      state = {"params": jax.tree.map(jnp.copy, fresh)}
      state["opt"] = optimizer.init(state["params"])

      def one_step():  # (params and optimizer state are donated: thread them)
        state["params"], state["opt"], metrics = step(
          state["params"], state["opt"], jax.random.key(1), tokens, mask, target_params
        )
        return metrics["loss"]

      return median_seconds(one_step, iters=args.iters)

    delta = jnp.zeros((target_config.hidden_size,), jnp.float32)
    seconds = {
      "step": timed(steps[0, 0]),
      "floor": median_seconds(lambda: floor(delta, tokens, positions, target_params), iters=args.iters),
      "target": median_seconds(lambda: forward(tokens, positions, target_params), iters=args.iters),
    }
    for depth, deep in args.rollout:
      seconds[f"rollout_{depth}x{deep or batch}"] = timed(steps[depth, deep])
    per_token = model_flops_per_token(target_config, draft_config, length, config.labels)
    row = {
      "batch": batch,
      "length": length,
      **{f"{k}_ms": 1e3 * v for k, v in seconds.items()},
      **{f"{k}_tokens_per_second": batch * length / v for k, v in seconds.items()},
      "step_over_floor": seconds["step"] / seconds["floor"],
      **{f"{k}_throughput_vs_step": seconds["step"] / v for k, v in seconds.items() if k.startswith("rollout")},
      "mfu": batch * length / seconds["step"] * per_token / peak if peak else None,
    }
    rows.append(row)
    print(
      f"{batch:>5} x {length:<6} step {row['step_ms']:8.2f} ms {row['step_tokens_per_second']:>10,.0f} tok/s"
      f" | floor {row['floor_ms']:8.2f} ms {row['floor_tokens_per_second']:>10,.0f} tok/s"
      f" | target {row['target_ms']:8.2f} ms | step/floor {row['step_over_floor']:.2f}"
      + (f" | MFU {row['mfu']:.1%}" if peak else "")
      + "".join(f" | {k} {1e3 * v:.2f} ms" for k, v in seconds.items() if k.startswith("rollout")),
      flush=True,
    )
  return {
    "kind": "train_step",
    "shape": args.shape,
    "device": jax.devices()[0].device_kind,
    "platform": platform.platform(),
    "jax": jax.__version__,
    "dtype": dtype.name,
    "draft_intermediate_size": draft_config.intermediate_size,
    "iters": args.iters,
    "median_of": "seconds per call after 2 warm-ups",
    "timed_at": time.strftime("%Y-%m-%d %H:%M:%S"),
    "rows": rows,
    "summary": {"median_step_over_floor": statistics.median(r["step_over_floor"] for r in rows)},
  }


def main(argv=None) -> None:
  args = parse_args(argv)
  if args.out:
    output_path(args.out)
  result = measure(args)
  if args.out:
    from infer import plots

    plots.save(result, args.out)
    print(f"wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
  run_main(main, "python -m lab.bench_step")
