"""`python -m lab.trace_auto`: `auto`'s choices on any machine, at another machine's prices.

`auto` (`longspec_jax.methods.auto`) chooses each round's kind from measured round prices and
learnt gains, and carries what it learnt (the gains, the waits before exploring the
draft) from one generation to the next. Its choices depend on those prices and on the
tokens only, so a CPU makes the choices a GPU would, given the GPU's prices: this runs
`auto` over prompt sets in `infer.benchmark`'s order (a warm-up generation on each set's
first prompt, then every prompt; one process, so what is learnt carries on as it does
there) with the prices of a benchmark's results JSON (its `auto` row's
`round_ms_by_kind`) instead of measuring them, and prints for every generation its rounds
by kind, tau, what its rounds cost at those prices (tokens per second there), the
gains it leaves to the next and its waits before exploring the draft. Device time is
dear; a wrong choice found this way costs none.

  python -m lab.trace_auto --prices results.json --sets held-out
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import jax.numpy as jnp
import numpy as np

from infer.prompts import HELD_OUT_NAME, PROMPT_SETS, set_names
from infer.timing import environment, warmed_up
from lab.bench_auto import add_run_flags, load_run
from longspec_jax import cli
from longspec_jax.engine import Decoding, Memory, generate
from longspec_jax.errors import UserError
from longspec_jax.methods import prices as round_prices
from longspec_jax.methods.auto import Adaptive, Kind
from longspec_jax.methods.factory import make_proposer
from longspec_jax.methods.registry import ProposerOptions


@dataclasses.dataclass
class GivenPrices(round_prices.PriceBook):
  """Another machine's prices, for every key; nothing measured here is kept."""

  given: round_prices.Prices | None = None

  def known(self, key: str) -> round_prices.Prices | None:
    return self.given

  def remember(self, key: str, prices: round_prices.Prices) -> None:
    pass


def read_prices(path: Path) -> tuple[dict[str, float], dict]:
  """Seconds per round of each kind (and "switch") of the first `auto` row of an
  `infer.benchmark` results JSON, and that row's prompt-lookup continuations
  (`copy_tokens`, `copy_matches`; a row without `copy_matches` gives one, its length
  only)."""
  try:
    rows = json.loads(path.read_text())["rows"]
  except (OSError, ValueError, KeyError, TypeError) as e:
    raise UserError(f"--prices: {path} is not an infer.benchmark results JSON ({e}).") from None
  for row in rows:
    ms = row.get("round_ms_by_kind")
    if row.get("method", "").startswith("auto") and ms and None not in ms.values():
      copies = {"copy_tokens": row.get("copy_tokens"), "copy_matches": row.get("copy_matches", 1)}
      return {kind: value / 1e3 for kind, value in ms.items()}, copies
  raise UserError(f"--prices: {path} has no auto row with every round price measured.")


def generation(result, prices: dict[str, float], proposer: Adaptive) -> dict:
  """A generation's rounds by kind, tau, its tokens per second at `prices`, the gains it
  leaves to the next, and its waits before exploring the draft as they ended."""
  stats = result.stats
  seconds = sum(count * prices[kind] for kind, count in stats.rounds_by_kind.items())
  learnt = proposer.learnt(result.state.proposal)
  as_list = lambda x: [None if np.isnan(v) else round(float(v), 2) for v in np.asarray(x, np.float64)]
  return {
    "rounds_by_kind": stats.rounds_by_kind,
    "tau": stats.mean_accepted_length,
    "priced_tokens_per_second": (stats.num_new_tokens - 1) / seconds,
    "copy_gain_by_ngram": as_list(learnt.copy_gain),
    "chain_gain_by_ngram": as_list(learnt.chain_gain),
    "draft_gain_without_with_match": as_list(learnt.draft_gain),
    "explore_after": np.asarray(result.state.proposal.explore_after).tolist(),
  }


def main(argv=None):
  p = cli.ArgumentParser(prog="python -m lab.trace_auto", description=__doc__.splitlines()[0])
  p.add_argument("--prices", type=Path, required=True, help="an infer.benchmark results JSON with an auto row")
  p.add_argument("--sets", nargs="+", choices=[*sorted(PROMPT_SETS), HELD_OUT_NAME], default=[HELD_OUT_NAME])
  add_run_flags(p, num_prompts=2)
  p.add_argument(
    "--copy-tokens", type=cli.positive_int, help="auto's continuations' length (default: the --prices row's)"
  )
  p.add_argument("--copy-matches", type=cli.positive_int, help="auto's continuations (default: the --prices row's)")
  p.add_argument("--out", type=Path, help="results JSON")
  args = p.parse_args(argv)
  if args.out:
    cli.output_path(args.out)
  prices, copies = read_prices(args.prices)
  target, draft = load_run(args)
  proposer, params = make_proposer(
    "auto",
    draft,
    ProposerOptions(
      copy_tokens=args.copy_tokens or copies["copy_tokens"], copy_matches=args.copy_matches or copies["copy_matches"]
    ),
  )
  names = [kind.value for kind in proposer.kinds]
  if set(names) - set(prices):
    raise UserError(f"--prices has no price for {', '.join(sorted(set(names) - set(prices)))} rounds.")
  known = round_prices.Prices(seconds=(*(prices[n] for n in names), prices["switch"]), chunks=((),) * len(names))
  decoding = Decoding(proposer=proposer)
  memory = Memory(prices=GivenPrices(given=known))  # every generation takes these prices
  run = lambda prompt: generate(target.model, [prompt], args.new_tokens, decoding, params, memory=memory)
  result = {
    "kind": "auto_trace",
    **environment(),
    "argv": sys.argv[1:],
    "prices_from": str(args.prices),
    "round_seconds": prices,
    "dtype": jnp.dtype(target.model.dtype).name,
    "draft": args.draft,
    "copy_tokens": proposer.lookup.num_tokens,
    "copy_matches": proposer.lookup.matches,
    "generations": [],
  }
  print(f"prices (ms): {', '.join(f'{k} {1e3 * v:.3f}' for k, v in prices.items())}")
  print(
    "set          | prompt | rounds ar/chain/copy/draft | tau  | tok/s at prices | copy gain by n-gram"
    " | draft gain (no match, match) | explore after"
  )

  def record(set_name: str, prompt, generated) -> None:
    row = {"set": set_name, "prompt": prompt, **generation(generated, prices, proposer)}
    result["generations"].append(row)
    kinds = "/".join(str(row["rounds_by_kind"].get(k.value, 0)) for k in Kind)
    print(
      f"{set_name:12} | {prompt!s:>7} | {kinds:>26} | {row['tau']:4.2f} | {row['priced_tokens_per_second']:15.0f} |"
      f" {row['copy_gain_by_ngram']} | {row['draft_gain_without_with_match']} | {row['explore_after']}",
      flush=True,
    )
    if args.out:  # after every generation: a crash loses nothing traced
      args.out.write_text(json.dumps(result, indent=1))

  for set_name in set_names(args.sets):
    prompts = PROMPT_SETS[set_name](target.tokenizer, args.length, args.num_prompts)
    record(set_name, "warm-up", warmed_up(lambda: run(prompts[0])))
    for index, prompt in enumerate(prompts):
      record(set_name, index, run(prompt))


if __name__ == "__main__":
  cli.run_main(main, "python -m lab.trace_auto")
