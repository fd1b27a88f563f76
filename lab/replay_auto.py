"""`python -m lab.replay_auto`: `auto`'s choices over known texts, at a GPU's prices, with no model.

Greedy decoding writes one text whatever the method, so a round's outcome is known from
that text alone: a tree emits the longest path of it that the text continues, and one
token more. This replays `auto` (without a draft: its copy kinds need no model) over the
AR texts of an `infer.benchmark --keep-texts` results JSON (its `ar` rows keep each prompt
and its text), round by round through the proposer's own `plan` and `observe`, each round
priced at that JSON's `auto` row's measured seconds per kind; and beside it every single
kind alone (every round of that kind), priced alike. So the policy is compared with each
kind on the very texts and prices of a GPU run, in seconds of CPU time: per prompt,
`auto`'s tokens per second at those prices over the best single kind's. Beside them, a
ceiling no policy that learns from earlier rounds reaches: each round the kind that emits
the most tokens per second there, known from the text (`replay`'s `hindsight`). What the
prices leave out (the cost of choosing, per-generation costs) is measured on the device
(`lab.bench_auto`).

  python -m infer.benchmark --methods ar auto --sets held-out --keep-texts --out results.json  # (a GPU)
  python -m lab.replay_auto --texts results.json
"""

from __future__ import annotations

import dataclasses
import functools
import json
import statistics
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from lab.trace_auto import read_prices
from longspec_jax import cli
from longspec_jax.decoding.tree import Tree
from longspec_jax.decoding.verify import accept_greedy
from longspec_jax.errors import UserError
from longspec_jax.methods.auto import CHOOSE, Adaptive
from longspec_jax.methods.factory import make_proposer
from longspec_jax.methods.registry import ProposerOptions


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Committed:
  """What `Adaptive.plan` and `propose` read of a cache: how many tokens it holds."""

  lengths: jax.Array  # [B] int32


def emitted(tree: Tree, text: jax.Array, lengths: jax.Array) -> jax.Array:
  """Tokens [B] a greedy round of `tree` emits where the target writes `text [B, S]` (the
  root at index `lengths [B]`): the engine's acceptance (`verify.accept_greedy`) with the
  text's next token as the target's after each node. Past the text's end that token is its
  last, so a count there runs over what the text holds (the caller bounds it)."""
  after = lengths[:, None] + tree.depths + 1  # [B, N]: the index of the token after each node
  target = jnp.take_along_axis(text, jnp.minimum(after, text.shape[1] - 1), axis=1)
  return accept_greedy(tree, target, tree.ancestor_mask()).count


@functools.partial(jax.jit, static_argnums=0)
def _plan(proposer: Adaptive, state, text, lengths):
  return proposer.plan(state, cache=Committed(lengths), history=text, done=jnp.zeros(lengths.shape, bool))


@functools.partial(jax.jit, static_argnums=(0, 1))
def _round(proposer: Adaptive, kind, state, plan, text, lengths, remaining):
  """One round of `kind`: the state after it and the tokens it emitted [B]."""
  root = jnp.take_along_axis(text, lengths[:, None], axis=1)[:, 0]
  tree, state = proposer.propose(
    kind, None, state, plan, target=None, cache=Committed(lengths), history=text, root=root
  )
  count = jnp.minimum(emitted(tree, text, lengths), remaining)
  state = proposer.observe(state, plan, count, jnp.ones(lengths.shape, bool), history=text, lengths=lengths + count)
  return state, count


def replay(
  proposer: Adaptive,
  prompt: list[int],
  text: list[int],
  seconds: list[float],
  learnt,
  force: int = CHOOSE,
  hindsight: bool = False,
):
  """`proposer`'s generation of `text` after `prompt`, starting from `learnt`: its rounds
  by kind, its seconds at `seconds` (per kind, then a change of kind) and what it learnt.
  `force`: every round of that kind (an index in `proposer.kinds`); `hindsight`: every
  round of the kind that emits the most tokens per second from there (each kind's round
  tried on the known text), a ceiling no policy that learns from earlier rounds reaches."""
  ids = jnp.asarray([prompt + text], jnp.int32)  # [1, S]
  lengths = jnp.asarray([len(prompt)], jnp.int32)  # the root: the token the prefill wrote
  end = len(prompt) + len(text) - 1
  state = proposer.start(
    None, target=None, cache=Committed(lengths), history=ids, learnt=learnt, seconds=np.asarray(seconds, np.float32)
  )
  if force != CHOOSE:
    state = proposer.forced(state, force)
  kinds, total, last = [], 0.0, None
  price = lambda kind: seconds[kind] + (seconds[-1] if last not in (None, kind) else 0.0)
  while int(lengths[0]) < end:
    plan = _plan(proposer, state, ids, lengths)
    if hindsight:
      rounds = [_round(proposer, kind, state, plan, ids, lengths, end - lengths) for kind in proposer.kinds]
      kind = max(range(len(rounds)), key=lambda i: int(rounds[i][1][0]) / price(i))
      state, count = rounds[kind]
    else:
      kind = int(plan.kind)
      state, count = _round(proposer, proposer.kinds[kind], state, plan, ids, lengths, end - lengths)
    lengths = lengths + count
    total += price(kind)
    kinds.append(kind)
    last = kind
  counts = {k.value: kinds.count(i) for i, k in enumerate(proposer.kinds)}
  return {"rounds_by_kind": counts, "seconds": total, "tau": (len(text) - 1) / len(kinds)}, proposer.learnt(state)


def read_texts(path: Path) -> list[tuple[str, list[tuple[list[int], list[int]]]]]:
  """(set, each prompt and its AR text) of every `ar` row of a benchmark JSON."""
  try:
    rows = json.loads(path.read_text())["rows"]
  except (OSError, ValueError, KeyError, TypeError) as e:
    raise UserError(f"--texts: {path} is not an infer.benchmark results JSON ({e}).") from None
  found = [
    (row["set"], [(p["prompt_ids"], p["token_ids"]) for p in row["per_prompt"]])
    for row in rows
    if row.get("method") == "ar"
    and row.get("per_prompt")
    and all("prompt_ids" in p and "token_ids" in p for p in row["per_prompt"])
  ]
  if not found:
    raise UserError(f"--texts: {path} has no ar row with its texts (infer.benchmark --keep-texts).")
  return found


def main(argv=None):
  p = cli.ArgumentParser(prog="python -m lab.replay_auto", description=__doc__.splitlines()[0])
  p.add_argument("--texts", type=Path, required=True, help="an infer.benchmark results JSON with ar rows' texts")
  p.add_argument(
    "--prices", type=Path, help="an infer.benchmark results JSON whose auto row gives the prices (default: --texts)"
  )
  p.add_argument("--out", type=Path, help="results JSON")
  args = p.parse_args(argv)
  if args.out:
    cli.output_path(args.out)
  texts = read_texts(args.texts)
  prices, copies = read_prices(args.prices or args.texts)
  proposer, _ = make_proposer("auto", None, ProposerOptions(**copies))
  names = [kind.value for kind in proposer.kinds]
  seconds = [prices[n] for n in names] + [prices["switch"]]
  result = {"kind": "auto_replay", "argv": sys.argv[1:], "round_seconds": prices, **copies, "prompts": []}
  print(f"prices (ms): {', '.join(f'{k} {1e3 * v:.3f}' for k, v in prices.items())}")
  print(
    f"set          | prompt | auto rounds {'/'.join(names):13} | tau  | auto tok/s | "
    + " | ".join(names)
    + " | auto/best | hindsight/best"
  )
  learnt = proposer.nothing_learnt()
  for set_name, pairs in texts:
    _, learnt = replay(proposer, *pairs[0], seconds, learnt)  # (the benchmark's warm-up)
    for index, (prompt, text) in enumerate(pairs):
      auto, learnt = replay(proposer, prompt, text, seconds, learnt)
      alone = {n: replay(proposer, prompt, text, seconds, learnt, force=i)[0] for i, n in enumerate(names)}
      rate = lambda run: (len(text) - 1) / run["seconds"]
      best = max(rate(run) for run in alone.values())
      row = {
        "set": set_name,
        "prompt": index,
        "auto": {**auto, "tokens_per_second": rate(auto)},
        **{n: {**run, "tokens_per_second": rate(run)} for n, run in alone.items()},
        "auto_over_best_kind": rate(auto) / best,
        "hindsight_over_best_kind": rate(replay(proposer, prompt, text, seconds, learnt, hindsight=True)[0]) / best,
      }
      result["prompts"].append(row)
      kinds = "/".join(str(auto["rounds_by_kind"][n]) for n in names)
      print(
        f"{set_name:12} | {index:6} | {kinds:>25} | {auto['tau']:4.2f} | {rate(auto):10.0f} | "
        + " | ".join(f"{rate(alone[n]):5.0f}" for n in names)
        + f" | {row['auto_over_best_kind']:9.3f} | {row['hindsight_over_best_kind']:.3f}",
        flush=True,
      )
  for name, label in (("auto", "auto"), ("hindsight", "each round's best kind in hindsight")):
    ratios = [row[f"{name}_over_best_kind"] for row in result["prompts"]]
    result[f"{name}_over_best_kind"] = {"median": statistics.median(ratios), "min": min(ratios)}
    print(f"{label} / the best single kind: median {statistics.median(ratios):.3f}, worst {min(ratios):.3f}")
  if args.out:
    args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
  cli.run_main(main, "python -m lab.replay_auto")
