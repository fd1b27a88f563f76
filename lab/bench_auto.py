"""`python -m lab.bench_auto`: what `auto`'s rounds cost against prompt lookup's, on real prompts.

`auto` (`longspec_jax.methods.auto`) runs the same trees as prompt lookup in its COPY rounds,
yet on copy-friendly text it was slower than `pld`: its loop carries a choice, gains and
a draft, and each of those may cost the host or the device something per round or per
generation. This tool puts numbers on each part: it decodes every prompt with `pld`
(with `auto`'s own continuations, `--copy-tokens`/`--copy-matches` or `auto`'s default:
the very trees of its COPY rounds) and with `auto` variants that take one part away at a
time,

  auto               with the draft's tree among the kinds (--draft; auto's own default runs none)
  auto, copy only    every round a COPY round (the draft's state carried, never run)
  auto, draft only   every round a DRAFT round (the draft's tree with the chain grafted in)
  auto, no draft     AR and COPY only (`--draft none` elsewhere)
  auto, no draft, copy only   prompt lookup's rounds through `auto`'s loop

interleaved (prompt by prompt, repeat by repeat, so that the machine's drift falls on all
alike), each warmed up first (`auto`'s prices measured). Each timed generation follows an
untimed one of the same variant and prompt: a generation right after another program's
finds its buffers moved and rewrites its loop's CUDA graphs (10-37 ms for SmolLM2 on an
H100), which interleaving alone laid on every timed generation. It reports per variant the
median milliseconds per round, its ratio to `pld` on the same prompt and repeat, tokens
per second, tau, and how far a generation's time exceeds what `auto`'s measured prices
say its rounds cost (the per-generation costs a round's price leaves out). Writes JSON
and a plot with `--out`.

  python -m lab.bench_auto --sets code pod-docs --length 4096 --repeats 2 --draft none --out auto_rounds.json
"""

from __future__ import annotations

import dataclasses
import statistics
import sys
from pathlib import Path

import jax.numpy as jnp

from infer import plots
from infer.cli import add_copy_flags
from infer.prompts import PROMPT_SETS
from infer.timing import environment, warmed_up
from longspec_jax import cli
from longspec_jax.engine import Decoding, check_capacity, generate
from longspec_jax.methods.auto import CHOOSE, Adaptive, Kind
from longspec_jax.methods.factory import make_proposer
from longspec_jax.methods.registry import ProposerOptions
from longspec_jax.weights import default, load_target, load_tokenizer, read_target_config, resolve_target
from longspec_jax.weights.drafts import load_draft, resolve_draft


@dataclasses.dataclass(frozen=True)
class OneKind(Adaptive):
  """`auto` whose every chosen round is of kind `only` (its prices are still measured
  kind by kind, as `auto`'s): the cost of `auto`'s loop when it never changes kind."""

  only: Kind = Kind.COPY

  def plan(self, state, **kwargs):
    plan = super().plan(state, **kwargs)
    return dataclasses.replace(plan, kind=jnp.where(state.force == CHOOSE, jnp.int32(self.index(self.only)), plan.kind))


def variants(
  draft, copy_tokens: int | None = None, copy_matches: int | None = None
) -> dict[str, tuple[object, object]]:
  """Label -> (proposer, its params) of every variant (module docstring)."""
  plain, _ = make_proposer("auto", None, ProposerOptions(copy_tokens=copy_tokens, copy_matches=copy_matches))
  auto, params = make_proposer(
    "auto", draft, ProposerOptions(copy_tokens=plain.lookup.num_tokens, copy_matches=plain.lookup.matches)
  )
  one = lambda proposer, kind: OneKind(proposer.lookup, proposer.draft, only=kind)
  chosen = {"pld": (plain.lookup, None)}
  if draft is not None:
    chosen |= {
      "auto": (auto, params),
      "auto, copy only": (one(auto, Kind.COPY), params),
      "auto, draft only": (one(auto, Kind.DRAFT), params),
    }
  return chosen | {"auto, no draft": (plain, None), "auto, no draft, copy only": (one(plain, Kind.COPY), None)}


def generation(result) -> dict:
  stats = result.stats
  prices = stats.round_seconds_by_kind
  record = {
    "seconds": stats.decode_seconds,
    "rounds": stats.rounds,
    "new_tokens": stats.num_new_tokens,
    "chunks": stats.chunks,
    "rounds_by_kind": stats.rounds_by_kind,
  }
  if prices and None not in prices.values():  # what its rounds cost at their measured prices
    record["priced_seconds"] = sum(count * prices[kind] for kind, count in stats.rounds_by_kind.items())
  return record


def summary(runs: dict[str, list[dict]]) -> dict[str, dict]:
  """Per variant: medians over generations, ratios to PLD's generation of the same prompt
  and repeat."""
  ms = lambda g: 1e3 * g["seconds"] / g["rounds"]
  out = {}
  for label, generations in runs.items():
    priced = [1e3 * (g["seconds"] - g["priced_seconds"]) / g["rounds"] for g in generations if "priced_seconds" in g]
    kinds = [g["rounds_by_kind"] for g in generations if g["rounds_by_kind"]]
    out[label] = {
      "ms_per_round": statistics.median(map(ms, generations)),
      "ms_per_round_vs_pld": statistics.median(ms(g) / ms(p) for g, p in zip(generations, runs["pld"])),
      "tokens_per_second": statistics.median((g["new_tokens"] - 1) / g["seconds"] for g in generations),
      "tau": sum(g["new_tokens"] - 1 for g in generations) / sum(g["rounds"] for g in generations),
      "ms_per_round_over_prices": statistics.median(priced) if priced else None,
      "rounds_by_kind": {k: sum(c[k] for c in kinds) for k in kinds[0]} if kinds else None,
    }
  return out


def add_run_flags(p, num_prompts: int) -> None:
  """The flags of the generations both `auto` tools run (this one and
  `lab.trace_auto`): prompt length and count, new tokens, target, draft, dtype."""
  p.add_argument("--length", type=cli.positive_int, default=4096, help="prefill tokens")
  p.add_argument("--num-prompts", type=cli.positive_int, default=num_prompts)
  p.add_argument("--new-tokens", type=cli.positive_int, default=256)
  p.add_argument("--target", default=default.NAME)
  p.add_argument("--draft", default="default", help="'default', 'random', a checkpoint dir, or 'none'")
  p.add_argument("--dtype", choices=("float32", "bfloat16"))


def load_run(args):
  """The target and the draft (None for 'none') that `add_run_flags`'s flags name, every
  input checked before the weights load."""
  path = resolve_target(args.target)
  check_capacity(read_target_config(path), [[0] * args.length], args.new_tokens)
  if args.draft != "none":
    resolve_draft(args.draft, args.target)
  target = load_target(path, cli.resolve_dtype(args.dtype), load_tokenizer(path))
  draft = None if args.draft == "none" else load_draft(args.draft, target.config, target.model.dtype, args.target)
  return target, draft


def main(argv=None):
  p = cli.ArgumentParser(prog="python -m lab.bench_auto", description=__doc__.splitlines()[0])
  p.add_argument("--sets", nargs="+", choices=sorted(PROMPT_SETS), default=["code"])
  add_run_flags(p, num_prompts=3)
  add_copy_flags(p)
  p.add_argument("--repeats", type=cli.positive_int, default=2, help="timed generations of each prompt")
  p.add_argument("--out", type=Path, help="results JSON (a PNG of them is written beside it)")
  args = p.parse_args(argv)
  if args.out:
    cli.output_path(args.out)
  target, draft = load_run(args)
  chosen = variants(draft, args.copy_tokens, args.copy_matches)
  lookup = chosen["pld"][0]
  result = {
    "kind": "auto_rounds",
    **environment(),
    "argv": sys.argv[1:],
    "target": args.target,
    "dtype": jnp.dtype(target.model.dtype).name,
    "draft": args.draft,
    "length": args.length,
    "new_tokens": args.new_tokens,
    "copy_tokens": lookup.num_tokens,
    "copy_matches": lookup.matches,
    "sets": {},
  }
  print(
    f"device: {result['device']}, target {args.target}, {result['dtype']}, {args.length} prefill tokens,"
    f" {args.new_tokens} new, continuations {lookup.matches} x {lookup.num_tokens}"
  )
  for set_name in args.sets:
    prompts = PROMPT_SETS[set_name](target.tokenizer, args.length, args.num_prompts)
    run = lambda proposer, params, prompt: generate(
      target.model, [prompt], args.new_tokens, Decoding(proposer=proposer), params
    )
    for proposer, params in chosen.values():  # (compiled, and `auto`'s prices measured)
      warmed_up(lambda: run(proposer, params, prompts[0]))
    runs = {label: [] for label in chosen}
    for _ in range(args.repeats):
      for prompt in prompts:
        for label, (proposer, params) in chosen.items():
          run(proposer, params, prompt)  # (untimed: module docstring)
          runs[label].append(generation(run(proposer, params, prompt)))
    result["sets"][set_name] = {"generations": runs, "summary": summary(runs)}
    result["rows"] = [  # (the summaries as one table)
      {"set": name, "variant": label, **row}
      for name, one in result["sets"].items()
      for label, row in one["summary"].items()
    ]
    print(
      f"{set_name}: variant                | ms/round | vs pld | tokens/s | tau  | ms/round over prices"
      " | rounds by kind"
    )
    for label, row in result["sets"][set_name]["summary"].items():
      over = row["ms_per_round_over_prices"]
      print(
        f"{label:30} | {row['ms_per_round']:8.3f} | {row['ms_per_round_vs_pld']:5.3f}x |"
        f" {row['tokens_per_second']:8.0f} | {row['tau']:4.2f} | {'-' if over is None else f'{over:.3f}':>20} |"
        f" {row['rounds_by_kind'] or '-'}",
        flush=True,
      )
    if args.out:  # after every set: a crash loses nothing measured
      plots.save(result, args.out)


if __name__ == "__main__":
  cli.run_main(main, "python -m lab.bench_auto")
