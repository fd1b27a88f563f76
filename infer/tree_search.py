"""`python -m infer.tree_search`: the LongSpec tree that decodes fastest, found by measurement.

The best tree depends on what a verified node costs on this device and target, and on how
deep the draft's guesses hold: both are measured, not modelled. Each candidate tree (beam
widths per depth, and prompt-lookup tokens grafted in as a copy branch) decodes a
calibration prompt set with `longspec` and is scored by its decode tokens/s (a warm-up run
first, then every prompt `--repeats` times; the median pass's tokens over its seconds).
Timing noise is the limit: trees of equal tau were seen to differ by up to 22% in one
pass, hence the repeats. The search climbs from a start
tree (by default the draft's own): each step measures the neighbours of the
best tree so far (a step up or down the ladder `WIDTHS` for the first depth's width, for
every deeper depth's at once, and for the deepest one's alone; one depth more or less;
the copy branch a step along `COPY_TOKENS`: a compiled tree each, so few moves) and
moves to the fastest if it beats the current one by more than `--tolerance`; it stops
there or after `--max-evaluations` trees. The order in which neighbours are measured
(which ones a spent budget leaves out) comes from `--seed`: the same seed and the same
measurements give the same search.

With `--store`, the chosen tree is written into the draft's `draft_config.json`
(`tree_widths`, `copy_tokens`): `longspec` and `auto` use it from then on (for the
default target, that is the draft shipped in the package). Calibrate on prompts the
evaluation does not use: the default sets, `code` and `docs`, are the ones the draft's
training data resembles; the held-out sets (`infer.prompts.HELD_OUT`) stay for
`infer.benchmark`.

  python -m infer.tree_search --sets code docs --length 4096 --num-prompts 2 --new-tokens 128 \\
      --max-evaluations 12 --out search.json --store
"""

from __future__ import annotations

import dataclasses
import json
import platform
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np

from infer.cli import tree_widths
from longspec_jax import cli
from longspec_jax.errors import UserError

WIDTHS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)  # the ladder a depth's beam width moves along
COPY_TOKENS = (0, 5, 10, 15, 20)  # the ladder of the copy branch's length
MAX_DEPTH = 8


@dataclasses.dataclass(frozen=True, order=True)
class Candidate:
  """A tree: the draft's beam widths per depth and the prompt-lookup tokens grafted in."""

  widths: tuple[int, ...]
  copy_tokens: int

  @property
  def nodes(self) -> int:
    """Nodes a round verifies, the root included."""
    return 1 + sum(self.widths) + self.copy_tokens

  @property
  def label(self) -> str:
    return ",".join(map(str, self.widths)) + (f"+copy{self.copy_tokens}" if self.copy_tokens else "")


@dataclasses.dataclass(frozen=True)
class Measurement:
  tau: float  # tokens per round, the root's included
  tokens_per_second: float


def _step(ladder: tuple[int, ...], value: int, direction: int) -> int:
  """`value` one step down (-1) or up (+1) `ladder` (it need not be on it); itself past an end."""
  if direction < 0:
    return max((v for v in ladder if v < value), default=value)
  return min((v for v in ladder if v > value), default=value)


def _steps(ladder: tuple[int, ...], value: int) -> list[int]:
  """The values next to `value` on `ladder`, below then above."""
  return [v for v in dict.fromkeys(_step(ladder, value, d) for d in (-1, 1)) if v != value]


def neighbours(tree: Candidate, max_nodes: int, max_depth: int = MAX_DEPTH) -> list[Candidate]:
  """The trees one move away from `tree` (module docstring), within `max_nodes` nodes,
  without duplicates, in a fixed order."""
  widths = tree.widths
  first, rest, last = widths[0], widths[1:], widths[-1]
  moves = [(w,) + rest for w in _steps(WIDTHS, first)]
  if rest:  # the deeper depths together, and the deepest alone (a tapering tree)
    moves += [(first,) + tuple(_step(WIDTHS, w, step) for w in rest) for step in (-1, 1)]
    moves += [widths[:-1] + (w,) for w in _steps(WIDTHS, last)]
  if len(widths) < max_depth:
    moves.append(widths + (last,))
  if len(widths) > 1:
    moves.append(widths[:-1])
  found = [Candidate(w, tree.copy_tokens) for w in moves]
  found += [Candidate(widths, c) for c in _steps(COPY_TOKENS, tree.copy_tokens)]
  return [c for c in dict.fromkeys(found) if c != tree and c.nodes <= max_nodes]


@dataclasses.dataclass(frozen=True)
class Search:
  evaluations: list[tuple[Candidate, Measurement]]  # in the order measured
  best: Candidate


def search(
  start: Candidate,
  measure: Callable[[Candidate], Measurement],
  *,
  max_nodes: int,
  seed: int,
  max_evaluations: int,
  tolerance: float = 0.02,
) -> Search:
  """Hill-climbs from `start` by `measure`d tokens/s (module docstring)."""
  if max_evaluations < 1:
    raise UserError(f"the search needs at least one evaluation, got {max_evaluations}.")
  rng = np.random.default_rng(seed)
  scores: dict[Candidate, Measurement] = {start: measure(start)}
  best = start
  while len(scores) < max_evaluations:
    around = neighbours(best, max_nodes)
    fresh = [c for c in around if c not in scores]
    if not fresh:
      break
    for index in rng.permutation(len(fresh))[: max_evaluations - len(scores)]:
      scores[fresh[index]] = measure(fresh[index])
    challenger = max(around, key=lambda c: scores[c].tokens_per_second if c in scores else 0.0)
    if challenger not in scores or (
      scores[challenger].tokens_per_second <= (1 + tolerance) * scores[best].tokens_per_second
    ):
      break
    best = challenger
  return Search(list(scores.items()), best)


def measure_on(
  target, draft, prompts: list[list[int]], new_tokens: int, seed: int, repeats: int
) -> Callable[[Candidate], Measurement]:
  """The measurement of a tree on `prompts`: `longspec` with it, greedy, after one warm-up
  run; tokens/s is the median over `repeats` passes over the prompts (a pass: its tokens
  over its decode seconds)."""
  from longspec_jax.engine import Decoding, generate
  from longspec_jax.methods.factory import make_proposer
  from longspec_jax.methods.registry import ProposerOptions

  def measure(tree: Candidate) -> Measurement:
    proposer, params = make_proposer(
      "longspec", draft, ProposerOptions(tree_widths=tree.widths, copy_tokens=tree.copy_tokens)
    )
    decoding = Decoding(proposer=proposer)
    generate(target.model, prompts[:1], new_tokens, decoding, params, seed=seed)  # compiles
    passes = [
      [generate(target.model, [p], new_tokens, decoding, params, seed=seed).stats for p in prompts]
      for _ in range(repeats)
    ]
    tokens = sum(s.num_new_tokens - 1 for s in passes[0])  # (greedy: every pass emits the same)
    measured = Measurement(
      tau=tokens / sum(s.rounds for s in passes[0]),
      tokens_per_second=statistics.median(tokens / sum(s.decode_seconds for s in stats) for stats in passes),
    )
    print(f"{tree.label:28} | {tree.nodes:5} | {measured.tau:5.2f} | {measured.tokens_per_second:8.1f}", flush=True)
    return measured

  return measure


def main(argv=None):
  from infer.prompts import PROMPT_SETS
  from longspec_jax.weights import default

  p = cli.ArgumentParser(prog="python -m infer.tree_search", description=__doc__.splitlines()[0])
  p.add_argument(
    "--target",
    default=default.NAME,
    help="'smollm2-135m' (the embedded default), a Hugging Face model directory, or a .gguf file",
  )
  p.add_argument("--draft", default="default", help="'default' (the shipped draft) or a draft checkpoint dir")
  p.add_argument("--start", type=tree_widths, help="beam widths per depth to start from (default: the draft's)")
  p.add_argument(
    "--start-copy-tokens", type=cli.nonnegative_int, help="copy branch to start from (default: the draft's)"
  )
  p.add_argument("--sets", nargs="+", choices=sorted(PROMPT_SETS), default=["code", "docs"], help="prompt sets")
  p.add_argument("--length", type=cli.positive_int, default=4096, help="prefill tokens")
  p.add_argument("--num-prompts", type=cli.positive_int, default=2, help="per set")
  p.add_argument("--new-tokens", type=cli.positive_int, default=128, help="tokens each run decodes")
  p.add_argument("--repeats", type=cli.positive_int, default=3, help="timed passes over the prompts per tree")
  p.add_argument("--max-evaluations", type=cli.positive_int, default=12, help="trees measured at most")
  p.add_argument(
    "--tolerance",
    type=cli.nonnegative_float,
    default=0.02,
    help="how much faster (a fraction) a neighbour must be to move to it",
  )
  p.add_argument(
    "--dtype", choices=("float32", "bfloat16"), help="compute dtype (default: bfloat16 on a GPU, float32 elsewhere)"
  )
  p.add_argument("--seed", type=cli.any_int, default=0, help="orders the hill climb's neighbours")
  p.add_argument("--out", type=Path, help="results JSON (a PNG of them is written beside it)")
  p.add_argument("--store", action="store_true", help="write the chosen tree into the draft's config")
  args = p.parse_args(argv)
  if args.draft == "random":
    p.error("--draft random proposes noise: a tree measured with it says nothing about a trained draft")
  if args.out:
    cli.output_path(args.out)

  import jax
  import jax.numpy as jnp

  from infer.plots import plot
  from longspec_jax.decoding.tree import node_budget
  from longspec_jax.engine import check_capacity
  from longspec_jax.weights import load_target, load_tokenizer, read_target_config, resolve_target
  from longspec_jax.weights.drafts import load_draft, resolve_draft, store_tree

  path = resolve_target(args.target)
  config = read_target_config(path)
  draft_dir = resolve_draft(args.draft, args.target)
  max_nodes = node_budget(config.vocab_size)
  check_capacity(config, [[0] * args.length], args.new_tokens)
  target = load_target(path, cli.resolve_dtype(args.dtype), load_tokenizer(path))
  draft = load_draft(args.draft, target.config, target.model.dtype, args.target)
  start = Candidate(
    args.start or draft.config.tree_widths,
    draft.config.copy_tokens if args.start_copy_tokens is None else args.start_copy_tokens,
  )
  if start.nodes > max_nodes:
    raise UserError(f"the start tree {start.label} has {start.nodes} nodes, over the limit of {max_nodes}.")
  prompts = [
    prompt for name in args.sets for prompt in PROMPT_SETS[name](target.tokenizer, args.length, args.num_prompts)
  ]
  device = jax.devices()[0].device_kind
  print(f"device: {device}, target {args.target}, {jnp.dtype(target.model.dtype).name}, {len(prompts)} prompts")
  print("tree                         | nodes |  tau  | tokens/s", flush=True)
  measure_tree = measure_on(target, draft, prompts, args.new_tokens, args.seed, args.repeats)
  evaluations: list[tuple[Candidate, Measurement]] = []

  def save(best: Candidate | None) -> None:  # after every tree: a crash loses nothing measured
    if not args.out:
      return
    result = {
      "kind": "tree_search",
      "device": device,
      "backend": jax.default_backend(),
      "jax": jax.__version__,
      "python": platform.python_version(),
      "argv": sys.argv[1:],
      "target": args.target,
      "dtype": jnp.dtype(target.model.dtype).name,
      "draft": args.draft,
      "sets": args.sets,
      "length": args.length,
      "num_prompts": args.num_prompts,
      "new_tokens": args.new_tokens,
      "repeats": args.repeats,
      "seed": args.seed,
      "evaluations": [
        {
          "tree_widths": list(c.widths),
          "copy_tokens": c.copy_tokens,
          "nodes": c.nodes,
          "tau": m.tau,
          "tokens_per_second": m.tokens_per_second,
        }
        for c, m in evaluations
      ],
      "best": None if best is None else {"tree_widths": list(best.widths), "copy_tokens": best.copy_tokens},
    }
    args.out.write_text(json.dumps(result, indent=1))
    plot(result, args.out.with_suffix(".png"))

  def measure(tree: Candidate) -> Measurement:
    measured = measure_tree(tree)
    evaluations.append((tree, measured))
    save(None)
    return measured

  found = search(
    start, measure, max_nodes=max_nodes, seed=args.seed, max_evaluations=args.max_evaluations, tolerance=args.tolerance
  )
  save(found.best)
  best = dict(found.evaluations)[found.best]
  print(
    f"best: {found.best.label} ({found.best.nodes} nodes): tau {best.tau:.2f}, {best.tokens_per_second:.1f} tokens/s"
  )
  if args.store:
    store_tree(draft_dir, found.best.widths, found.best.copy_tokens)
    print(f"stored in {draft_dir}")


if __name__ == "__main__":
  cli.run_main(main, "python -m infer.tree_search")
