"""`python -m lab.bench_long`: long outputs, where TokenSwift is meant to pay.

Each method writes the same long continuation of one prompt, once to each output length
(`--lengths`, ascending): a run to a longer length repeats the shorter runs' rounds (the
same tokens, the same random draws), so the differences between consecutive lengths give
each segment's tau and speed, the shape of TokenSwift's Table 3 (speedup as the output
grows). Speedups are against AR at the same length and the same logit processors, in
the same run. Each run follows a warm-up generation of its own length (its own shapes:
on an H100 a TokenSwift run at a length not run before took ~12 s more than its rounds);
its JSON row gives the seconds XLA compiled in the warm-up and any it
compiled inside the timed decoding all the same (`decode_compile_seconds`).
`--penalties` repeats everything per contextual penalty (TokenSwift's theta, over the
last `--penalty-window` tokens), and the JSON gives the output's Distinct-n (distinct
n-grams over all n-grams, n = 1..4) under each: what the penalty is for. Greedy tokens
are checked against AR's. Writes JSON (and a PNG) with `--out`.

  python -m lab.bench_long --methods ar tokenswift --heads DIR --prompt-tokens 2048 \
      --lengths 1024 2048 4096 6000 --temperature 1.0 --min-p 0.1 --penalties 1.0 1.2 --out long.json
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import jax
import jax.numpy as jnp

from infer import plots
from infer.cli import MethodSpec, method_spec
from infer.prompts import PROMPT_SETS
from infer.timing import Compiles, environment, warmed_up
from longspec_jax import cli
from longspec_jax.decoding.sampling import SamplingConfig
from longspec_jax.engine import Decoding, check_capacity, generate
from longspec_jax.methods.factory import make_proposer
from longspec_jax.methods.registry import Method, ProposerOptions
from longspec_jax.weights import default, load_target, load_tokenizer, read_target_config, resolve_target
from longspec_jax.weights.drafts import load_draft, resolve_draft

DISTINCT_N = (1, 2, 3, 4)


def distinct(tokens: list[int], n: int) -> float:
  """Distinct-n: the share of the output's n-grams that are distinct (1: no repetition)."""
  grams = [tuple(tokens[i : i + n]) for i in range(len(tokens) - n + 1)]
  return len(set(grams)) / len(grams) if grams else 1.0


def segments(runs: list[dict]) -> list[dict]:
  """Each run's segment, from the run before it (the first: from the start): its tokens,
  rounds, decode seconds, tau and tokens/s."""
  out, before = [], {"new_tokens": 1, "rounds": 0, "decode_seconds": 0.0}  # (the first token is prefill's)
  for run in runs:
    tokens = run["new_tokens"] - before["new_tokens"]
    rounds = run["rounds"] - before["rounds"]
    seconds = run["decode_seconds"] - before["decode_seconds"]
    out.append(
      {
        "segment_tokens": tokens,
        "segment_tau": tokens / rounds if rounds else None,
        "segment_tokens_per_second": tokens / seconds if seconds > 0 else None,
      }
    )
    before = run
  return out


def main(argv=None):
  p = cli.ArgumentParser(prog="python -m lab.bench_long", description=__doc__.splitlines()[0])
  p.add_argument(
    "--methods",
    nargs="+",
    type=method_spec,
    default=[MethodSpec(Method.AR), MethodSpec(Method.TOKENSWIFT)],
    help=f"of {', '.join(m.value for m in Method)} (AR always runs: the baseline)",
  )
  p.add_argument("--heads", help="TokenSwift's heads: 'default' (the default), 'random' or a checkpoint dir")
  p.add_argument("--draft", help="the draft of longspec, glide and auto (as infer.benchmark's)")
  p.add_argument("--set", choices=sorted(PROMPT_SETS), default="code", help="where the prompt comes from")
  p.add_argument("--prompt-tokens", type=cli.positive_int, default=2048)
  p.add_argument(
    "--lengths",
    type=cli.positive_int,
    nargs="+",
    default=[1024, 2048, 4096, 6000],
    help="output lengths in tokens, each a run of its own (ascending)",
  )
  p.add_argument(
    "--penalties",
    type=cli.number_type(float, lambda x: x >= 1, "a finite number >= 1"),
    nargs="+",
    default=[1.0, 1.2],
    help="contextual penalties theta, each a run of every method (1: off)",
  )
  p.add_argument("--penalty-window", type=cli.positive_int, default=1024)
  p.add_argument("--temperature", type=cli.nonnegative_float, default=0.0, help="0 (default): greedy")
  p.add_argument("--top-p", type=cli.number_type(float, lambda x: 0 < x <= 1, "a number in (0, 1]"), default=1.0)
  p.add_argument("--min-p", type=cli.number_type(float, lambda x: 0 <= x < 1, "a number in [0, 1)"), default=0.0)
  p.add_argument("--seed", type=cli.any_int, default=0)
  p.add_argument("--target", default=default.NAME)
  p.add_argument("--dtype", choices=("float32", "bfloat16"))
  cli.add_attention_flag(p)
  p.add_argument("--out", type=Path, help="results JSON (a PNG of them is written beside it)")
  args = p.parse_args(argv)
  if args.lengths != sorted(set(args.lengths)):
    p.error(f"--lengths must rise, each once, got {' '.join(map(str, args.lengths))}")
  methods = [MethodSpec(Method.AR)] + [m for m in args.methods if m[0] is not Method.AR]
  names = [m for m, _, _ in methods]
  specs = {m: m.draft_spec(args.heads if m is Method.TOKENSWIFT else args.draft) for m in names}
  if args.out:
    cli.output_path(args.out)
  path = resolve_target(args.target)
  config = read_target_config(path)
  check_capacity(config, [[0] * args.prompt_tokens], args.lengths[-1])
  for method, spec in specs.items():
    if spec is not None:
      resolve_draft(spec, args.target, method.draft_kind)
  impl = cli.attention_impl(args.attention)
  target = load_target(path, cli.resolve_dtype(args.dtype), load_tokenizer(path), numerics=cli.numerics(args))
  dtype = target.model.dtype
  drafts = {
    m: load_draft(spec, target.config, dtype, args.target, attention=impl, kind=m.draft_kind)
    for m, spec in specs.items()
    if spec is not None
  }
  prompt = PROMPT_SETS[args.set](target.tokenizer, args.prompt_tokens, 1)[0]
  device = jax.devices()[0].device_kind
  print(f"device: {device}, target {args.target}, {jnp.dtype(dtype).name}, {len(prompt)}-token prompt ({args.set})")
  print(
    "penalty | method         | output | tau  | tokens/s | vs AR | segment tau | segment tokens/s | same as AR",
    flush=True,
  )
  rows, diversity = [], []

  def save() -> None:  # after every row: a crash loses nothing measured
    if args.out:
      result = {
        "kind": "long_generation",
        **environment(),
        "argv": sys.argv[1:],
        "target": args.target,
        "dtype": jnp.dtype(dtype).name,
        "attention": impl.value,
        "set": args.set,
        "prompt_tokens": len(prompt),
        "sampling": dataclasses.asdict(sampling),
        "drafts": {m.value: spec for m, spec in specs.items()},
        "seed": args.seed,
        "rows": rows,
        "distinct": diversity,
      }
      plots.save(result, args.out)

  for penalty in args.penalties:
    sampling = SamplingConfig(
      temperature=args.temperature,
      top_p=args.top_p,
      min_p=args.min_p,
      penalty=penalty,
      penalty_window=args.penalty_window,
    )
    baseline, ar_tokens = {}, {}  # AR's runs and tokens by output length
    for (method, copies, matches), name in zip(methods, names):
      proposer, params = make_proposer(
        method, drafts.get(name), ProposerOptions(copy_tokens=copies, copy_matches=matches, sampling=sampling)
      )
      decoding = Decoding(proposer=proposer, sampling=sampling)  # (no EOS: every run writes its whole length)
      runs = []
      for length in args.lengths:  # (each length its own shapes: warmed up each)
        with Compiles() as compiled:
          warmed_up(lambda: generate(target.model, [prompt], length, decoding, params, seed=args.seed))
        result = generate(target.model, [prompt], length, decoding, params, seed=args.seed)
        stats = result.stats
        runs.append(
          {
            "penalty": penalty,
            "method": method.value,
            "output_tokens": length,
            "new_tokens": stats.num_new_tokens,
            "rounds": stats.rounds,
            "decode_seconds": stats.decode_seconds,
            "tau": stats.mean_accepted_length,
            "tokens_per_second": stats.tokens_per_second,
            "compile_seconds": compiled.seconds,
            "decode_compile_seconds": stats.decode_compile_seconds,
            "draft_state_mib": stats.proposer_state_bytes / 2**20,
            "token_ids": result.token_ids[0],
          }
        )
        del result  # (its caches)
      for run, segment in zip(runs, segments(runs)):
        run.update(segment)
        ar = baseline.get(run["output_tokens"], run)  # (AR's own rows: themselves)
        run["speedup_vs_ar"] = run["tokens_per_second"] / ar["tokens_per_second"]
        ours, theirs = run["segment_tokens_per_second"], ar["segment_tokens_per_second"]
        run["segment_speedup_vs_ar"] = ours / theirs if ours and theirs else None
        tokens = run.pop("token_ids")
        if method is Method.AR:
          baseline[run["output_tokens"]], ar_tokens[run["output_tokens"]] = run, tokens
        run["same_tokens_as_ar"] = tokens == ar_tokens[run["output_tokens"]] if sampling.greedy else None
        rows.append(run)
        same = "n/a" if run["same_tokens_as_ar"] is None else "yes" if run["same_tokens_as_ar"] else "no"
        print(
          f"{penalty:7.2f} | {method.value:14} | {run['output_tokens']:6} | {run['tau']:4.2f} |"
          f" {run['tokens_per_second']:8.1f} | {run['speedup_vs_ar']:4.2f}x |"
          f" {run['segment_tau'] or 0:11.2f} | {run['segment_tokens_per_second'] or 0:16.1f} | {same}",
          flush=True,
        )
      diversity.append(
        {
          "penalty": penalty,
          "method": method.value,
          "output_tokens": len(tokens),
          **{f"distinct_{n}": distinct(tokens, n) for n in DISTINCT_N},
        }
      )
      save()
  for entry in diversity:
    print(
      f"penalty {entry['penalty']:.2f}, {entry['method']}: Distinct-1..4 "
      + " / ".join(f"{entry[f'distinct_{n}']:.3f}" for n in DISTINCT_N)
    )


if __name__ == "__main__":
  cli.run_main(main, "python -m lab.bench_long")
