"""`python -m train.run`: train a LongSpec draft for a target.

Stages (the paper's recipe, Section 4.1): `pretrain` (short sequences with anchor-offset
positions), `long` (long sequences, vanilla positions), `sft` (chat data, loss on the
assistant's tokens). Each writes to --out: orbax checkpoints (periodic and final;
--resume continues from the newest with the same data order), `metrics.jsonl` (one line
per optimizer step), `loss.png`, the draft in `draft/` (what `--draft` loads; also when
--time-limit stopped the run), `complete` once the run has taken all --steps (what a
recipe that resumes across calls checks) and, with --eval, `eval.json`: the held-out
loss and top-1 agreement by position, and the step the draft reached.

  python -m train.run --stage pretrain --data 'site-packages/**/*.py' 'site-packages/**/*.md' \
      --eval '/usr/lib/python3.12/*.py' --steps 2000 --out runs/pretrain
  python -m train.run --stage sft --data sft.jsonl --init-draft runs/pretrain/draft --out runs/sft

Multi-host (or several processes on one host): run the same command in every process,
either with --distributed under a cluster JAX detects (SLURM, Open MPI, Kubernetes,
mpi4py: `jax.distributed.initialize()` reads the process count and index from it), or
naming them: --coordinator HOST:PORT --num-processes N --process-id I (I = 0 .. N - 1;
process 0 serves the coordinator at that address). The mesh spans every process's
devices, each process reads its share of the data, and process 0 writes the metrics,
plots and the exported draft (checkpoints are written by all, to the same --out).

  python -m train.run ... --coordinator 10.0.0.1:7777 --num-processes 2 --process-id 0  # host A
  python -m train.run ... --coordinator 10.0.0.1:7777 --num-processes 2 --process-id 1  # host B
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import sys
import time
from pathlib import Path
from typing import Any

from longspec_jax.cli import (
  ArgumentParser,
  any_int,
  nonnegative_int,
  number_type,
  output_path,
  positive_float,
  positive_int,
  resolve_dtype,
  run_main,
)
from longspec_jax.errors import UserError
from longspec_jax.models.config import DraftKind, HeadsConfig, default_feature_layers
from train import Labels, Positions


@dataclasses.dataclass(frozen=True)
class Stage:
  """A stage's defaults (the paper's recipe, Section 4.1); flags override each."""

  positions: Positions
  learning_rate: float
  length: int  # tokens per sequence (capped by the target's context)
  batch: int  # sequences per micro-batch


STAGES = {
  "pretrain": Stage(Positions.ANCHOR_OFFSET, 5e-4, 1024, 16),
  "long": Stage(Positions.VANILLA, 5e-6, 8192, 2),
  "sft": Stage(Positions.VANILLA, 5e-6, 2048, 8),
}
# Dense bf16 peak FLOP/s per device kind, for MFU.
PEAK_FLOPS = {"NVIDIA H100 80GB HBM3": 989e12, "NVIDIA H200": 989e12}
# What a run writes into --out (an --overwrite removes exactly these).
RUN_FILES = ("checkpoints", "metrics.jsonl", "eval_curve.jsonl", "loss.png", "draft", "eval.json", "complete")
at_least_two = number_type(int, lambda x: x >= 2, "an integer >= 2")


def delay_weights(text: str) -> tuple[float, ...]:
  """--delays: comma-separated weights of the delays 1, 2, ... ('0' alone: no delay)."""
  try:
    weights = tuple(float(w) for w in text.split(","))
  except ValueError:
    weights = ()
  if weights == (0.0,) or (weights and all(w >= 0 and w < float("inf") for w in weights) and any(weights)):
    return weights
  raise argparse.ArgumentTypeError(f"expected weights of delays 1, 2, ... like 1,1,1 (or 0 for none), got {text!r}")


def feature_layers(text: str) -> tuple[int, ...] | str:
  """--feature-layers: comma-separated target layers, or 'default'."""
  if text == "default":
    return text
  try:
    return tuple(int(x) for x in text.split(","))
  except ValueError:
    raise argparse.ArgumentTypeError(f"expected target layers like 2,15,27 (or 'default'), got {text!r}") from None


def requested_features(value: tuple[int, ...] | str, target_config) -> tuple[int, ...]:
  """--feature-layers' target layers ('default': EAGLE-3's), checked against the target."""
  layers = default_feature_layers(target_config.num_layers) if value == "default" else value
  if not all(-target_config.num_layers <= layer < target_config.num_layers for layer in layers):
    raise UserError(
      f"--feature-layers {','.join(map(str, layers))}: the target has layers 0 .. {target_config.num_layers - 1}."
    )
  return tuple(layer % target_config.num_layers for layer in layers)


def add_features(draft, layers: tuple[int, ...], parents: bool):
  """--init-draft's draft reading `layers`' fused features and, with `parents`, its
  parents' outputs: what it reads already stays, what it lacks comes with a zero
  projection."""
  from longspec_jax.models.draft import with_features

  held = draft.config.feature_layers
  if held and layers and held != layers:
    raise UserError(
      f"--init-draft reads features of target layers {','.join(map(str, held))}, not"
      f" {','.join(map(str, layers))}; leave out --feature-layers to keep its own."
    )
  return with_features(draft, layers, parents)


def parse_args(argv=None):
  p = ArgumentParser(prog="python -m train.run", description=__doc__.splitlines()[0])
  p.add_argument(
    "--stage", choices=sorted(STAGES), required=True, help="the stage, whose defaults the other flags override"
  )
  p.add_argument("--data", nargs="+", required=True, help="globs of text/code files, JSONL files, or hub dataset names")
  p.add_argument(
    "--max-tokens", type=positive_int, help="train on at most this many tokens (a seeded sample of documents)"
  )
  p.add_argument("--eval", nargs="+", help="held-out data, evaluated after training (eval.json)")
  p.add_argument("--eval-length", type=at_least_two, help="tokens per eval sequence (default: the target's context)")
  p.add_argument("--eval-rows", type=positive_int, default=8, help="eval sequences")
  p.add_argument(
    "--eval-every",
    type=positive_int,
    help="also evaluate every this many steps (eval_curve.jsonl, plotted beside the loss)",
  )
  p.add_argument(
    "--out", type=Path, required=True, help="the run's directory: checkpoints, metrics, the exported draft"
  )
  p.add_argument("--overwrite", action="store_true", help="replace the run already in --out")
  p.add_argument("--resume", action="store_true", help="continue the run in --out from its newest intact checkpoint")
  p.add_argument(
    "--target",
    default="smollm2-135m",
    help="'smollm2-135m' (the embedded default), a Hugging Face model directory, or a .gguf file",
  )
  p.add_argument("--init-draft", help="start from this draft checkpoint (e.g. the previous stage's draft/)")
  p.add_argument("--steps", type=positive_int, default=1000, help="optimizer steps")
  p.add_argument(
    "--length", type=at_least_two, help="tokens per sequence (default: the stage's, capped by the context)"
  )
  p.add_argument("--batch", type=positive_int, help="sequences per micro-batch, all hosts together")
  p.add_argument("--accumulate", type=positive_int, default=1, help="micro-batches per optimizer step")
  p.add_argument("--learning-rate", type=positive_float, help="peak learning rate (default: the stage's)")
  p.add_argument("--warmup-steps", type=nonnegative_int, default=100, help="linear warm-up before the cosine decay")
  p.add_argument(
    "--delays",
    type=delay_weights,
    help="flash noisy training: weights of the cross-attention delays 1, 2, ... drawn per sequence"
    " (e.g. 1,1,1; '1': always one token; '0': none, the draft reads the target's K/V at its own"
    " position); default: uniform over 1 .. the draft's tree depth, as inference meets them",
  )
  p.add_argument(
    "--rollout-depth",
    type=nonnegative_int,
    default=0,
    help="training-time test (a LongSpec draft): one pass per tree depth 1 .. N, each position the query of"
    " that depth's pass as inference runs it (the ring up to its round's root, its ancestors' own K/V, the"
    " target delayed by the depth), the loss at every depth; N passes a step. 0: one pass with --delays",
  )
  p.add_argument(
    "--labels",
    choices=[k.value for k in Labels],
    default=Labels.TARGET.value,
    help="learn the target's next-token distribution (default) or the data's next token",
  )
  p.add_argument("--positions", choices=[k.value for k in Positions], help="default: the stage's")
  p.add_argument(
    "--draft-kind",
    choices=[k.value for k in DraftKind],
    default=DraftKind.LONGSPEC.value,
    help="the draft's kind (a new one's, or --init-draft's): LongSpec's (a sliding window, flash"
    " noisy training) or GLIDE's (full self-attention, layer m reading target layer N_T - N_D + m,"
    " trained with its block-wise cross mask, vanilla positions unless --positions says otherwise)"
    " or TokenSwift's heads (3 residual linear heads on the frozen target's final state, vanilla"
    " positions; the block flags below do not apply)",
  )
  p.add_argument(
    "--cross-block",
    type=positive_int,
    default=5,
    help="GLIDE: tokens per block of the training cross mask (each sees the blocks before its own)",
  )
  p.add_argument(
    "--cross-layer",
    type=any_int,
    help="a new draft's cross-attended target layer (GLIDE: its first layer's, each next one the layer"
    " above; 0: the bottom ones, the paper's Figure 7); default: the last (LongSpec), the top"
    " N_D (GLIDE)",
  )
  p.add_argument(
    "--no-cross-attention",
    action="store_true",
    help="a new draft without cross-attention: the ablation of GLIDE's section 5.2",
  )
  p.add_argument(
    "--feature-layers",
    type=feature_layers,
    help="fused target features (a block draft): each token's input also gets the target's cached values of"
    " these layers at the position before it, where committed, through a learned projection (e.g. 2,15,27;"
    " 'default': layers 2, L/2 and L-3, EAGLE-3's). With --init-draft, added to a draft without them, their"
    " projection zero so that training starts from what the draft computes",
  )
  p.add_argument(
    "--rollout-rows",
    type=positive_int,
    help="with --rollout-depth: the passes beyond the first run over only this many rows of each micro-batch"
    " (default: all), trading deep samples a step for throughput",
  )
  p.add_argument(
    "--parent-features",
    action="store_true",
    help="a LongSpec draft trained with --rollout-depth: a tree node's input also gets its parent's own output"
    " through a learned projection, where the target's features do not exist (EAGLE-3's training-time test)."
    " With --init-draft, added to a draft without it, the projection zero",
  )
  p.add_argument("--window", type=positive_int, default=512, help="LongSpec: the self-attention's window")
  p.add_argument("--draft-layers", type=positive_int, default=1, help="a new draft's blocks")
  p.add_argument("--draft-intermediate-size", type=positive_int, help="a new draft's MLP width (default: the target's)")
  p.add_argument("--model-parallel", type=positive_int, default=1, help="devices that share each parameter")
  p.add_argument("--dtype", choices=("float32", "bfloat16"), help="compute dtype (default: bf16 on GPU)")
  p.add_argument("--save-every", type=positive_int, default=200, help="optimizer steps between checkpoints")
  p.add_argument(
    "--time-limit",
    type=positive_float,
    help="seconds: stop after the first optimizer step past this (then save, export, evaluate)",
  )
  p.add_argument("--seed", type=any_int, default=0, help="initialization, data order and noise draws")
  p.add_argument(
    "--distributed",
    action="store_true",
    help="one process of a multi-process run: jax.distributed.initialize() first, which finds the"
    " others from the cluster (SLURM, Open MPI, Kubernetes), or from the next three flags",
  )
  p.add_argument("--coordinator", metavar="HOST:PORT", help="multi-process run: process 0's address (--distributed)")
  p.add_argument("--num-processes", type=positive_int, help="multi-process run: how many (--distributed)")
  p.add_argument("--process-id", type=nonnegative_int, help="multi-process run: this one's, 0 .. N - 1 (--distributed)")
  args = p.parse_args(argv)
  named = [args.coordinator, args.num_processes, args.process_id]
  if any(x is not None for x in named):
    if any(x is None for x in named):
      p.error("a multi-process run named by hand needs all of --coordinator, --num-processes and --process-id")
    if args.process_id >= args.num_processes:
      p.error(f"--process-id {args.process_id} is not below --num-processes {args.num_processes}")
    args.distributed = True
  if args.resume and args.overwrite:
    p.error("--resume continues the run in --out and --overwrite replaces it; give one")
  if args.eval_every and not args.eval:
    p.error("--eval-every evaluates the --eval data; give --eval too")
  if args.warmup_steps >= args.steps and args.warmup_steps:
    p.error(f"--warmup-steps ({args.warmup_steps}) must be fewer than --steps ({args.steps})")
  if args.rollout_depth and args.delays:
    p.error("--rollout-depth delays each pass's cross-attention by its depth; give it or --delays, not both")
  if args.rollout_depth and args.draft_kind != DraftKind.LONGSPEC.value:
    p.error("--rollout-depth trains a LongSpec draft (--draft-kind longspec)")
  if args.rollout_rows and not args.rollout_depth:
    p.error("--rollout-rows sets how many rows the training-time test's deeper passes take: give --rollout-depth")
  if args.parent_features and args.rollout_depth < 2:
    p.error("--parent-features is learned from the training-time test's passes: give --rollout-depth 2 or more")
  if args.feature_layers and args.draft_kind == DraftKind.TOKENSWIFT.value:
    p.error("--feature-layers is a block draft's input; TokenSwift's heads read the target's final state")
  return args


def check_out_dir(args) -> None:
  """--out is a directory this run may write: a new one, the run it resumes, or one it
  replaces with --overwrite; never a first run's folder unasked."""
  out = output_path(args.out, "directory")
  held = [name for name in RUN_FILES if (out / name).exists()]
  if args.resume:
    if not (out / "checkpoints").is_dir():
      raise UserError(
        f"--resume: {out} holds no checkpoints to resume from; leave out --resume to start a run there"
        " (--overwrite replaces what it holds)."
      )
  elif held and not args.overwrite:
    raise UserError(
      f"{out} already holds a run ({', '.join(held)}); pass --resume to continue it or --overwrite to replace it."
    )


def check_inputs(args):
  """Everything the flags name, checked before the target loads: the data and eval
  sources, the initial draft, the output folder. Returns the resolved data sources."""
  from longspec_jax.weights.drafts import resolve_draft
  from train.data import resolve_sources

  check_out_dir(args)
  sources = resolve_sources(args.data)
  if args.stage == "sft" and sources.only_text:
    raise UserError(
      "--stage sft trains on chat records (JSONL with 'messages' or 'prompt'/'response'), but --data"
      " holds only plain text files."
    )
  eval_sources = resolve_sources(args.eval) if args.eval else None
  if args.init_draft:
    try:
      resolve_draft(args.init_draft, args.target, DraftKind(args.draft_kind))
    except UserError as e:
      raise UserError(f"--init-draft: {e}") from None
  return sources, eval_sources


def prepare_out_dir(args) -> None:
  import shutil

  if args.overwrite:
    for name in RUN_FILES:
      path = args.out / name
      shutil.rmtree(path) if path.is_dir() else path.unlink(missing_ok=True)
  args.out.mkdir(parents=True, exist_ok=True)


def keep_metrics_until(path: Path, step: int) -> None:
  """Drops the metric lines after `step` (written after the checkpoint a run resumes
  from), so that metrics.jsonl (and eval_curve.jsonl) hold each step once."""
  if path.exists():
    lines = [line for line in path.read_text().splitlines() if line.strip() and json.loads(line)["step"] <= step]
    path.write_text("".join(line + "\n" for line in lines))


@dataclasses.dataclass
class Run:
  """Everything a run trains with, loaded and placed on the mesh."""

  target: Any  # weights.LoadedTarget
  draft_graphdef: Any
  target_graphdef: Any
  params: Any  # the draft's, float32, sharded
  opt_state: Any
  target_params: Any
  config: Any  # step.TrainConfig
  step_fn: Any
  batch_sharding: Any
  data: Any  # data.Packed
  held_out: Any  # [N, eval_length] tokens, or None
  length: int
  batch: int
  flops_per_token: float
  # of the draft's tree: held-out agreement is reported at each depth's delay (TokenSwift's
  # heads: gamma, each head's agreement)
  tree_depth: int
  eval_fn: Any = None  # the jitted held-out pass (`depth_report`), built at its first use


def prepare(args, sources, eval_sources) -> Run:
  """Loads the target, the data and the draft, and builds the sharded, jitted step. The
  checks that need the target's config come first, before the weights load."""
  import jax
  import jax.numpy as jnp
  from flax import nnx

  from longspec_jax.models.draft import random_draft
  from longspec_jax.models.heads import random_heads
  from longspec_jax.ops.attention import Impl
  from longspec_jax.ops.sharding import batch_sharding, make_mesh, param_shardings
  from longspec_jax.weights import load_target, read_target_config, resolve_target
  from longspec_jax.weights.drafts import load_draft, new_draft_config
  from train.data import has_chat_records, load_records, pack
  from train.step import TrainConfig, make_optimizer, make_train_step, tree_delays

  stage = STAGES[args.stage]
  target_path = resolve_target(args.target)
  context = read_target_config(target_path).max_position_embeddings
  for flag, value in (("--length", args.length), ("--eval-length", args.eval_length)):
    if value is not None and value > context:
      raise UserError(f"{flag} {value} exceeds the target's context of {context} tokens.")
  length = min(args.length or stage.length, context)
  batch = args.batch or stage.batch
  mesh = make_mesh(args.model_parallel)
  if batch % mesh.shape["data"]:
    raise UserError(f"--batch {batch} does not split over {mesh.shape['data']} data-parallel devices.")
  records = load_records(sources)
  if args.stage == "sft" and not has_chat_records(records):
    raise UserError(
      "--stage sft trains on chat records ('messages' or 'prompt'/'response'), but the data has"
      f" only the columns {', '.join(records.column_names)}."
    )
  prepare_out_dir(args)

  compute = jnp.dtype(resolve_dtype(args.dtype))
  target = load_target(target_path, compute)  # its forward on the Pallas kernels on a GPU
  # The draft trains on differentiable attention: flash passes with structured masks.
  kind = DraftKind(args.draft_kind)
  if args.init_draft:
    # (every parameter trains, over the whole vocabulary: no subset; `train.rank_vocab` ranks the result)
    subset = None if kind is DraftKind.TOKENSWIFT else 0
    draft = load_draft(
      args.init_draft, target.config, jnp.float32, args.target, attention=Impl.FLASH, kind=kind, vocab_subset=subset
    )
    if args.feature_layers or args.parent_features:
      layers = requested_features(args.feature_layers, target.config) if args.feature_layers else ()
      draft = add_features(draft, layers, args.parent_features)
  elif kind is DraftKind.TOKENSWIFT:
    draft = random_heads(HeadsConfig.for_target(target.config), jnp.float32, seed=args.seed)
  else:
    width = args.draft_intermediate_size or target.config.intermediate_size
    draft = random_draft(
      new_draft_config(
        target.config,
        num_layers=args.draft_layers,
        window=args.window,
        kind=kind,
        cross_layer=args.cross_layer,
        cross_attention=not args.no_cross_attention,
        intermediate_size=width,
        feature_layers=requested_features(args.feature_layers, target.config) if args.feature_layers else (),
        parent_features=args.parent_features,
      ),
      jnp.float32,
      seed=args.seed,
      attention=Impl.FLASH,
    )
    draft.config.check_matches(target.config)  # (e.g. a --cross-layer past the target's layers)
  heads = kind is DraftKind.TOKENSWIFT
  # GLIDE's paper trains at plain positions; TokenSwift's heads read the target's own
  # states, at the positions inference gives them.
  plain = kind in (DraftKind.GLIDE, DraftKind.TOKENSWIFT)
  config = TrainConfig(
    learning_rate=stage.learning_rate if args.learning_rate is None else args.learning_rate,
    positions=Positions(args.positions) if args.positions else Positions.VANILLA if plain else stage.positions,
    cross_block=args.cross_block,
    labels=Labels(args.labels),
    total_steps=args.steps,
    warmup_steps=args.warmup_steps,
    accumulate=args.accumulate,
    compute_dtype=compute.name,
    max_position=context,
    delay_weights=args.delays or tree_delays(len(draft.config.tree_widths)),
    rollout_depth=args.rollout_depth,
    rollout_rows=args.rollout_rows or 0,
  )
  print(f"data: tokenizing {args.data} ...", file=sys.stderr, flush=True)
  eos = (target.config.eos_token_ids or (target.tokenizer.eos_token_id,))[0]
  data = pack(records, target.tokenizer, length, eos, args.max_tokens, args.seed)
  print(f"data: {data.tokens.shape[0]} rows of {length} tokens", file=sys.stderr, flush=True)
  held_out = None
  if eval_sources:
    eval_length = args.eval_length or context
    held_out = pack(
      load_records(eval_sources), target.tokenizer, eval_length, eos, args.eval_rows * eval_length, args.seed
    ).tokens

  draft_graphdef, params = nnx.split(draft)
  target_graphdef, target_params = nnx.split(target.model)
  optimizer = make_optimizer(config)
  opt_state = optimizer.init(params)
  shardings = (
    param_shardings(mesh, params),
    param_shardings(mesh, opt_state),
    batch_sharding(mesh),
    param_shardings(mesh, target_params),
  )
  params, opt_state, target_params = (
    jax.device_put(x, s) for x, s in zip((params, opt_state, target_params), (shardings[0], shardings[1], shardings[3]))
  )
  return Run(
    target=target,
    draft_graphdef=draft_graphdef,
    target_graphdef=target_graphdef,
    params=params,
    opt_state=opt_state,
    target_params=target_params,
    config=config,
    step_fn=make_train_step(draft_graphdef, target_graphdef, optimizer, config, shardings),
    batch_sharding=shardings[2],
    data=data,
    held_out=held_out,
    length=length,
    batch=batch,
    flops_per_token=model_flops_per_token(target.config, draft.config, length, config.labels),
    tree_depth=draft.config.gamma if heads else len(draft.config.tree_widths),
  )


def train(args, run: Run) -> int:
  """The loop: resumes from the newest intact checkpoint with --resume, writes a metrics
  line per optimizer step, checkpoints periodically and at the end (or at --time-limit).
  Leaves the trained parameters in `run.params`; returns the optimizer steps taken."""
  import jax
  from tqdm import tqdm

  from train.checkpoint import Checkpoints
  from train.data import batches

  checkpoints = Checkpoints(args.out / "checkpoints", every=args.save_every * args.accumulate)
  micro = 0
  if args.resume:
    restored = checkpoints.restore_latest(run.params, run.opt_state)
    if restored is None:
      raise UserError(f"--resume: no checkpoint in {args.out / 'checkpoints'}.")
    run.params, run.opt_state, loop = restored
    micro = loop["micro_step"]
    if jax.process_index() == 0:
      for name in ("metrics.jsonl", "eval_curve.jsonl"):
        keep_metrics_until(args.out / name, micro // args.accumulate)
    print(f"resumed from step {micro // args.accumulate} ({args.out / 'checkpoints'}).", file=sys.stderr, flush=True)
  hosts, host = jax.process_count(), jax.process_index()
  stream = batches(run.data, run.batch // hosts, args.seed, start=micro, host=host, hosts=hosts)
  peak = PEAK_FLOPS.get(jax.devices()[0].device_kind)
  metrics_file = (args.out / "metrics.jsonl").open("a") if host == 0 else None
  total_micro = args.steps * args.accumulate
  bar = tqdm(total=args.steps, initial=micro // args.accumulate, desc=args.stage, file=sys.stderr)
  window_tokens, window_start = 0.0, time.perf_counter()
  deadline = time.perf_counter() + (args.time_limit or float("inf"))
  # An optimizer step's metrics are read back once the next step is queued: reading them
  # at once left the GPU idle while the host fed the next batch (8% of an H100's SFT
  # step). None, or (step, its metrics, the tokens since the last record).
  pending = None

  def write_pending():
    nonlocal pending, window_start
    if pending is None:
      return
    step, metrics, tokens = pending
    pending = None
    record = {
      "step": step,
      "loss": float(metrics["loss"]),
      "hit_rate": float(metrics["hit_rate"]),
      "grad_norm": float(metrics["grad_norm"]),
    }
    # (timed once the step's results are on the host: before, it timed the step's
    # dispatch alone, 6x the true rate on an H100)
    now = time.perf_counter()
    record["tokens_per_second"] = tokens / (now - window_start)
    window_start = now
    if peak:
      record["mfu"] = record["tokens_per_second"] * run.flops_per_token / (peak * jax.device_count())
    if metrics_file:
      metrics_file.write(json.dumps(record) + "\n")
      metrics_file.flush()
    bar.set_postfix(
      loss=f"{record['loss']:.3f}",
      hit=f"{record['hit_rate']:.2f}",
      tok_s=f"{record['tokens_per_second']:.0f}",
      **({"mfu": f"{record['mfu']:.1%}"} if peak else {}),
    )
    bar.update(1)

  try:
    while micro < total_micro:
      tokens, mask = (jax.make_array_from_process_local_data(run.batch_sharding, x) for x in next(stream))
      run.params, run.opt_state, metrics = run.step_fn(
        run.params, run.opt_state, jax.random.fold_in(jax.random.key(args.seed), micro), tokens, mask, run.target_params
      )
      micro += 1
      window_tokens += run.batch * run.length
      if micro % args.accumulate == 0:
        write_pending()  # (the step before this one)
        step = micro // args.accumulate
        pending, window_tokens = (step, metrics, window_tokens), 0.0
        if args.eval_every and step % args.eval_every == 0 and step < args.steps:  # (the last: in `finish`)
          write_pending()
          report = depth_report(run)
          if host == 0:
            append_to_curve(args.out / "eval_curve.jsonl", step, report)
          window_start = time.perf_counter()  # (the evaluation's time is not the steps')
      out_of_time = micro % args.accumulate == 0 and time.perf_counter() > deadline
      if hosts > 1:  # every host stops at the same step
        from jax.experimental import multihost_utils

        out_of_time = bool(multihost_utils.broadcast_one_to_all(out_of_time))
      checkpoints.maybe_save(
        micro, run.params, run.opt_state, {"micro_step": micro}, final=micro == total_micro or out_of_time
      )
      if out_of_time:
        print(f"\n--time-limit: stopping after step {micro // args.accumulate}", file=sys.stderr)
        break
    write_pending()
  finally:
    bar.close()
    if metrics_file:
      metrics_file.close()
    checkpoints.close()
  return micro // args.accumulate


def finish(args, run: Run, step: int) -> None:
  """Exports the draft (what `--draft` loads) as it is after `step` optimizer steps,
  plots the loss, evaluates on the held-out data, and marks the run `complete` if it
  took all --steps."""
  import jax
  from flax import nnx

  from longspec_jax.weights.drafts import save_draft

  host = jax.process_index()
  report = None if run.held_out is None else depth_report(run)
  if host == 0:
    save_draft(args.out / "draft", nnx.merge(run.draft_graphdef, jax.device_get(run.params)))
    if report is not None and args.eval_every:  # the curve's last point: the draft as exported
      append_to_curve(args.out / "eval_curve.jsonl", step, report)
    plot_loss(args.out / "metrics.jsonl", args.out / "loss.png", args.stage, args.out / "eval_curve.jsonl")
  print(f"wrote {args.out / 'draft'} and {args.out / 'loss.png'}", file=sys.stderr)
  if report is not None:
    if host == 0:
      (args.out / "eval.json").write_text(json.dumps({"sources": args.eval, "step": step, **report}, indent=1))
    print(
      f"eval: loss {report['loss']:.3f}, top-1 agreement {report['hit_rate']:.3f} on {report['tokens']} held-out"
      " tokens; by position: "
      + ", ".join(f"[{b['from']}, {b['to']}) {b['loss']:.3f}/{b['hit_rate']:.3f}" for b in report["by_position"])
      + "; by tree depth: "
      + ", ".join(f"{b['depth']}: {b['hit_rate']:.3f}" for b in report["by_depth"]),
      file=sys.stderr,
    )
  if host == 0:  # (last: a run that stopped before it is resumed, not taken as done)
    if step >= args.steps:
      (args.out / "complete").write_text(f"{step}\n")
    else:  # (e.g. resumed for more steps, then stopped by --time-limit)
      (args.out / "complete").unlink(missing_ok=True)


def main(argv=None) -> None:
  args = parse_args(argv)
  sources, eval_sources = check_inputs(args)
  if args.distributed:
    import jax

    # (CPU devices of several processes sum their gradients through gloo; a GPU's use NCCL)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(args.coordinator, args.num_processes, args.process_id)
  run = prepare(args, sources, eval_sources)
  finish(args, run, train(args, run))


def model_flops_per_token(target, draft, length: int, labels: Labels) -> float:
  """Matmul FLOPs per trained token (no recomputation counted): the frozen target's
  forward, the draft block's (or each of TokenSwift's heads') forward and backward, the
  shared LM head's forward and input gradient for the draft (each head), and, when
  distilling, its forward for the target; causal attention at the mean context
  length/2."""

  def block(c, cross=False):
    attention = c.hidden_size * (2 * c.num_heads + 2 * c.num_kv_heads) * c.head_dim  # q, o, k, v
    if cross:
      attention += 2 * c.hidden_size * c.num_heads * c.head_dim  # the cross-attention's q and o
    return attention + 3 * c.hidden_size * c.intermediate_size, 2 * length * c.num_heads * c.head_dim * (1 + cross)

  target_params, target_attention = block(target)
  head = target.hidden_size * target.vocab_size
  frozen = target.num_layers * (2 * target_params + target_attention)
  if isinstance(draft, HeadsConfig):  # each head: its linear map, and the LM head (+ the teacher's)
    return frozen + draft.gamma * (
      3 * 2 * draft.hidden_size**2 + 4 * head + (2 * head if labels is Labels.TARGET else 0)
    )
  draft_params, draft_attention = block(draft, cross=True)
  return (
    frozen
    + draft.num_layers * 3 * (2 * draft_params + draft_attention)
    + 4 * head
    + (2 * head if labels is Labels.TARGET else 0)
  )


def evaluate(token_losses, rows, edges=(0, 1024, 2048, 4096, 8192, 16384, 32768)) -> dict:
  """Held-out loss and top-1 agreement, overall and by the predicting token's position
  (where anchor-offset training should help: past the training length)."""
  import numpy as np

  results = [token_losses(rows[i : i + 1]) for i in range(len(rows))]
  loss = np.concatenate([np.asarray(r[0]) for r in results])  # [N, L - 1]
  hit = np.concatenate([np.asarray(r[1]) for r in results])
  length = loss.shape[1]
  bounds = [e for e in edges if e < length] + [length]
  return {
    "loss": float(loss.mean()),
    "hit_rate": float(hit.mean()),
    "tokens": int(loss.size),
    "by_position": [
      {"from": a, "to": b, "loss": float(loss[:, a:b].mean()), "hit_rate": float(hit[:, a:b].mean())}
      for a, b in zip(bounds, bounds[1:])
    ],
  }


def depth_report(run: Run) -> dict:
  """Held-out loss and top-1 agreement of the draft as it is, at each depth d of its tree
  with the delay d has at inference (d tokens past the cache); the whole report
  (`evaluate`) at depth 1, the root's prediction, plus `by_depth`. For TokenSwift's
  heads, "depth" d is head d (its tree's depth d + 1), each scored where it predicts a
  token inside the row."""
  import jax
  import jax.numpy as jnp
  from flax import nnx

  from longspec_jax.models.heads import Heads
  from train.step import eval_rollout_step, eval_step

  model = nnx.merge(run.draft_graphdef, run.params)
  heads = isinstance(model, Heads)
  # A draft reading its parents' outputs is scored by the training-time test's passes, which
  # give them; every other by one pass delayed by the depth (traced: one compilation).
  rollout = not heads and model.config.parent_features
  if run.eval_fn is None:
    step, static = (eval_rollout_step, {"depth": run.tree_depth}) if rollout else (eval_step, {})
    run.eval_fn = jax.jit(
      functools.partial(
        step, draft_graphdef=run.draft_graphdef, target_graphdef=run.target_graphdef, config=run.config, **static
      )
    )

  def token_losses(rows, d):
    if rollout:
      loss, hit = run.eval_fn(run.params, rows, run.target_params)
      return loss[:, d - 1], hit[:, d - 1]
    loss, hit = run.eval_fn(run.params, rows, run.target_params, delay=jnp.int32(d))
    return (loss[:, : loss.shape[1] - d], hit[:, : hit.shape[1] - d]) if heads else (loss, hit)

  depths = [evaluate(functools.partial(token_losses, d=d), run.held_out) for d in range(1, run.tree_depth + 1)]
  return {
    **depths[0],
    "by_depth": [{"depth": d, "loss": r["loss"], "hit_rate": r["hit_rate"]} for d, r in enumerate(depths, 1)],
  }


def append_to_curve(path: Path, step: int, report: dict) -> None:
  """One point of eval_curve.jsonl: `depth_report`'s loss and agreement at `step`."""
  with path.open("a") as curve:
    curve.write(json.dumps({"step": step, **{k: report[k] for k in ("loss", "hit_rate", "by_depth")}}) + "\n")


def plot_loss(metrics: Path, out: Path, title: str, curve: Path | None = None) -> None:
  """The loss against the step, and beside it, when `curve` (eval_curve.jsonl) exists,
  held-out agreement at each tree depth against the step."""
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  read = lambda path: [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
  records = read(metrics)
  evals = read(curve) if curve is not None and curve.exists() else []
  fig, axes = plt.subplots(1, 2 if evals else 1, figsize=(11 if evals else 6, 3.5), squeeze=False)
  ax = axes[0, 0]
  ax.plot([r["step"] for r in records], [r["loss"] for r in records])
  ax.set(xlabel="optimizer step", ylabel="draft cross-entropy", title=title)
  ax.grid(alpha=0.3)
  if evals:
    ax = axes[0, 1]
    for depth in range(len(evals[-1]["by_depth"])):
      ax.plot(
        [e["step"] for e in evals],
        [e["by_depth"][depth]["hit_rate"] for e in evals],
        marker="o",
        label=f"depth {depth + 1}",
      )
    ax.set(xlabel="optimizer step", ylabel="held-out top-1 agreement", title="by tree depth (its delay)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(out, dpi=120)
  plt.close(fig)


if __name__ == "__main__":
  run_main(main, "python -m train.run", interruptible=False)
