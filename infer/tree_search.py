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

With `--prices FILE`, the trees are priced at another target's shape instead: the file is
`lab.bench_target --suite floor --trees ...`'s, the round of each of its trees (and an AR
step) timed at that shape, per context and batch size. Each tree's tau is measured here
(the draft's acceptance depends neither on the device's speed nor on the batch) and the
tree's projected tokens/s at that shape is tau over its round there; the search is over
the file's trees, and the best at `--price-context` is chosen for each batch size priced.
`--store` then writes them into the table of trees by target shape and batch size
(`longspec_jax/drafts/trees.json`): new drafts for a target of that shape start from the
batch-1 tree (`weights.drafts.new_draft_config`), so that a large target does not inherit
the small target's tree, and decoding a batch takes the tree priced for it
(`weights.drafts.batch_tree`). The JSON is the projection: per context and batch, each
tree's projected tokens/s beside an AR step's at that shape.

  python -m lab.bench_target --suite floor --shape llama-3.1-8b --methods ar longspec \\
      --trees 4,16,16,16,16 4,8,8,8,8 2,4,4,4 --batches 1 4 16 --out prices.json
  python -m infer.tree_search --prices prices.json --dtype float32 --out projection.json --store
"""

from __future__ import annotations

import argparse
import dataclasses
import json
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

  @classmethod
  def parse(cls, text: str) -> Candidate:
    """The tree a `label` names: `4,8,8`, or `4,8,8+copy10` with a copy branch."""
    from longspec_jax.models.config import check_tree_widths

    widths, _, copies = text.partition("+copy")
    try:
      tree = cls(tuple(int(w) for w in widths.split(",")), int(copies) if copies else 0)
    except ValueError:
      raise UserError(f"a tree is beam widths like 4,8,8, optionally +copyN, got {text!r}.") from None
    check_tree_widths(tree.widths, copy_tokens=tree.copy_tokens)
    return tree


def tree_spec(text: str) -> Candidate:
  """argparse type for a tree (`Candidate.parse`)."""
  try:
    return Candidate.parse(text)
  except UserError as e:
    raise argparse.ArgumentTypeError(str(e)) from None


@dataclasses.dataclass(frozen=True)
class Measurement:
  tau: float  # tokens per round, the root's included
  tokens_per_second: float
  acceptance_by_depth: tuple[float | None, ...] = ()  # `engine.acceptance_by_depth`


@dataclasses.dataclass(frozen=True)
class Prices:
  """Rounds timed at a target's shape (`lab.bench_target --suite floor --trees`, at one
  batch size or several): per (context, batch), an AR step's and each tree's round, in ms."""

  shape: str  # the shape's name
  target_shape: dict  # its dimensions (`weights.drafts.target_shape`)
  ar_ms: dict[tuple[int, int], float]
  round_ms: dict[tuple[int, int], dict[Candidate, float]]

  @classmethod
  def read(cls, path: Path) -> Prices:
    """The prices in a floor suite's JSON. Raises UserError for another file, or a tree
    timed twice at one context and batch."""
    try:
      data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
      raise UserError(f"--prices {path} is not a readable JSON file ({e}).") from None
    if not isinstance(data, dict) or data.get("suite") != "floor" or "target_shape" not in data:
      raise UserError(f"--prices {path} is not the JSON of `python -m lab.bench_target --suite floor`.")
    ar, rounds = {}, {}
    for row in data["rows"]:
      if row["numerics"] != "fast":
        continue
      key = (row["context"], row["batch"])
      if row["method"] == "ar":
        ar[key] = row["round_ms"]
      elif "tree_widths" in row:
        tree, at = Candidate(tuple(row["tree_widths"]), row["copy_tokens"]), rounds.setdefault(key, {})
        if tree in at:
          raise UserError(
            f"--prices {path} times the tree {tree.label} twice at context {key[0]}, batch {key[1]}"
            " (under two --draft-vocab sizes?): price one draft."
          )
        at[tree] = row["round_ms"]
    keys = sorted(set(ar) & set(rounds))
    if not keys:
      raise UserError(f"--prices {path} has no context and batch with both an AR step and a LongSpec round.")
    return cls(data["shape"], data["target_shape"], {k: ar[k] for k in keys}, {k: rounds[k] for k in keys})

  @property
  def trees(self) -> list[Candidate]:
    """Every tree timed at some context and batch, in the file's order."""
    return list(dict.fromkeys(tree for rounds in self.round_ms.values() for tree in rounds))

  @property
  def contexts(self) -> list[int]:
    return sorted({context for context, _ in self.round_ms})

  @property
  def batches(self) -> list[int]:
    return sorted({batch for _, batch in self.round_ms})


def project(prices: Prices, measured: dict[Candidate, Measurement]) -> list[dict]:
  """The projection's rows: per context and batch, an AR step's tokens/s (per sequence) at
  the priced shape, and each tree's, its tau measured here over its round there (a draft's
  acceptance does not depend on the batch it runs in)."""
  rows = []
  for (context, batch), rounds in prices.round_ms.items():
    ar_ms = prices.ar_ms[context, batch]
    at = {"context": context, "batch": batch}
    rows.append(
      at
      | {"tree": "ar", "nodes": 1, "tau": 1.0, "round_ms": ar_ms, "ar_steps_per_round": 1.0}
      | {"projected_tokens_per_second": 1e3 / ar_ms, "projected_speedup": 1.0}
    )
    for tree, ms in rounds.items():
      tau = measured[tree].tau
      rows.append(
        at
        | {
          "tree": tree.label,
          "tree_widths": list(tree.widths),
          "copy_tokens": tree.copy_tokens,
          "nodes": tree.nodes,
          "tau": tau,
          "acceptance_by_depth": list(measured[tree].acceptance_by_depth),
          "round_ms": ms,
          "ar_steps_per_round": ms / ar_ms,
          "projected_tokens_per_second": tau * 1e3 / ms,
          "projected_speedup": tau * ar_ms / ms,
        }
      )
  return rows


def best_priced(rows: list[dict], context: int, batch: int = 1) -> Candidate:
  """The tree of the projection's `rows` with the most tokens/s at `context` and `batch`."""
  row = max(
    (r for r in rows if (r["context"], r["batch"]) == (context, batch) and r["tree"] != "ar"),
    key=lambda r: r["projected_tokens_per_second"],
  )
  return Candidate(tuple(row["tree_widths"]), row["copy_tokens"])


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
  from longspec_jax.engine import Decoding, acceptance_by_depth, generate
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
      acceptance_by_depth=tuple(acceptance_by_depth(np.sum([s.rounds_by_length for s in passes[0]], axis=0))),
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
  p.add_argument(
    "--prices",
    type=Path,
    help="round prices timed at a target's shape (`lab.bench_target --suite floor --trees ...`): search its trees"
    " by their projected tokens/s there (module docstring) instead of climbing by tokens/s here",
  )
  p.add_argument(
    "--price-context",
    type=cli.positive_int,
    help="with --prices: the context whose prices choose (default: the longest)",
  )
  p.add_argument(
    "--store",
    action="store_true",
    help="write the chosen tree into the draft's config (with --prices: into the table of trees by target shape)",
  )
  args = p.parse_args(argv)
  if args.draft == "random":
    p.error("--draft random proposes noise: a tree measured with it says nothing about a trained draft")
  if args.price_context and not args.prices:
    p.error("--price-context chooses among the contexts of --prices")
  prices = None
  if args.prices:
    prices = Prices.read(args.prices)
    args.price_context = args.price_context or max(prices.contexts)
    if args.price_context not in prices.contexts:
      p.error(
        f"--price-context {args.price_context}: {args.prices} prices contexts {', '.join(map(str, prices.contexts))}"
      )
  if args.out:
    cli.output_path(args.out)

  import jax
  import jax.numpy as jnp

  from infer import plots
  from infer.timing import environment
  from longspec_jax.decoding.tree import node_budget
  from longspec_jax.engine import check_capacity
  from longspec_jax.weights import load_target, load_tokenizer, read_target_config, resolve_target
  from longspec_jax.weights.drafts import load_draft, resolve_draft, store_priced_tree, store_tree

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
  for tree in prices.trees if prices else [start]:
    if tree.nodes > max_nodes:
      raise UserError(f"the tree {tree.label} has {tree.nodes} nodes, over the limit of {max_nodes}.")
  prompts = [
    prompt for name in args.sets for prompt in PROMPT_SETS[name](target.tokenizer, args.length, args.num_prompts)
  ]
  device = jax.devices()[0].device_kind
  print(f"device: {device}, target {args.target}, {jnp.dtype(target.model.dtype).name}, {len(prompts)} prompts")
  print("tree                         | nodes |  tau  | tokens/s", flush=True)
  measure_tree = measure_on(target, draft, prompts, args.new_tokens, args.seed, args.repeats)
  evaluations: list[tuple[Candidate, Measurement]] = []

  def save(best: Candidate | None, projection: list[dict] | None = None, by_batch: dict | None = None) -> None:
    """Writes what is measured so far (after every tree: a crash loses nothing measured);
    with prices, `best` is the smallest batch's choice and `by_batch` every batch's."""
    if not args.out:
      return
    result = {
      "kind": "tree_prices" if prices else "tree_search",
      **environment(),
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
          "acceptance_by_depth": list(m.acceptance_by_depth),
        }
        for c, m in evaluations
      ],
      "best": None if best is None else {"tree_widths": list(best.widths), "copy_tokens": best.copy_tokens},
    }
    if prices:
      result |= {"prices": str(args.prices), "shape": prices.shape, "price_context": args.price_context}
      result["rows"] = projection or []
      result["best_by_batch"] = [
        {"batch": batch, "tree_widths": list(tree.widths), "copy_tokens": tree.copy_tokens}
        for batch, tree in (by_batch or {}).items()
      ]
    plots.save(result, args.out)

  def measure(tree: Candidate) -> Measurement:
    measured = measure_tree(tree)
    evaluations.append((tree, measured))
    save(None)
    return measured

  if prices:
    projection = project(prices, {tree: measure(tree) for tree in prices.trees})
    at_context = [b for c, b in prices.round_ms if c == args.price_context]
    chosen = {batch: best_priced(projection, args.price_context, batch) for batch in at_context}
    save(chosen[min(chosen)], projection, chosen)
    print(f"\nprojected at {prices.shape}'s prices ({args.prices})")
    print("context | batch | tree                         | nodes |  tau  | round ms | AR steps | tokens/s | x AR")
    for r in projection:
      print(
        f"{r['context']:7} | {r['batch']:5} | {r['tree']:28} | {r['nodes']:5} | {r['tau']:5.2f} | {r['round_ms']:8.2f}"
        f" | {r['ar_steps_per_round']:8.2f} | {r['projected_tokens_per_second']:8.1f} | {r['projected_speedup']:4.2f}"
      )
    for batch, tree in chosen.items():
      print(f"best at {args.price_context}, batch {batch}: {tree.label} ({tree.nodes} nodes)")
    if args.store:
      for batch, tree in chosen.items():
        store_priced_tree(
          prices.shape, prices.target_shape, args.price_context, tree.widths, tree.copy_tokens, batch=batch
        )
      print(f"stored for {prices.shape}-shaped targets in the table of trees by target shape and batch size")
    return
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
