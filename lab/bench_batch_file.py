"""`python -m lab.bench_batch_file`: a batch file decoded by each method, its total rate.

Writes a JSON Lines file of real prompts (`--sets`, `--num-prompts` each, about `--length`
tokens), then decodes it as `python -m infer.generate --input ... --output ...` does, with
the flags after `--`, once per method of `--methods`: every record's tokens over the wall
time from the slots' opening to the last record (every prefill included: end to end), and
over that time less the prefills' (decode alone). Each method runs the whole file once to
compile, then `--repeats` times timed: its row is the run of median time (every run's
seconds beside it; one file's time moves by a few percent from run to run), and its
records are checked against AR's (same token ids: the batch file is lossless). With
`--past-tokens`, prompt lookup's methods run again searching the earlier records' outputs
(`infer.prompts`' sets of repeated answers, in fewer slots than records). With
`--file-per-set`, each set is a batch file of its own (rows by set, each against its own
set's AR: a past of one kind of answers). Writes JSON and a plot with `--out`.

  python -m lab.bench_batch_file --sets held-out --length 4096 --num-prompts 11 --records 64 \\
    --methods ar pld auto --out batch_file.json -- --max-new-tokens 256 --batch 64 --batch-invariant
"""

from __future__ import annotations

import functools
import itertools
import json
import sys
import tempfile
from pathlib import Path

from infer import batch_file, decoder, generate
from infer.cli import MethodSpec, method_spec
from infer.prompts import HELD_OUT_NAME, PROMPT_SETS, set_names
from longspec_jax import cli, engine
from longspec_jax.methods.registry import Method


def decode(flags: list[str], spec: MethodSpec, past: int, records, prompts, output: Path, path, tokenizer, loaded=None):
  """`records` (their token ids: `prompts`) through `generate.decode_file` with these flags
  and the method (with its own continuations, if `spec` names them, and searching `past`
  tokens of the earlier records' outputs) into `output`, from no outputs kept before: the
  output records by line, what it reports (tokens, seconds, `auto`'s rounds by kind) and
  what `decoder.load` loaded (reused when given)."""
  copies = ["--copy-tokens", str(spec.tokens), "--copy-matches", str(spec.matches)] if spec.tokens else []
  copies += ["--past-tokens", str(past)] if past else []
  args = generate.parse_args([*flags, "--method", spec.method.value, *copies, "--input", "-", "--output", str(output)])
  engine.MEMORY.past.clear()  # (a run's records draw on its own earlier ones alone)
  if loaded is None:
    from longspec_jax.weights import read_target_config

    together = min(args.batch or generate.BATCH, len(records))
    loaded = decoder.load(args, decoder.check_flags(args, read_target_config(path), together), path, tokenizer)
  decoder.fill_past(args, loaded)
  out = batch_file.Output(output)
  decoded = generate.decode_file(args, loaded.target, loaded.decoding, loaded.draft_params, records, prompts, out)
  done = {r["line"]: r for r in map(json.loads, output.read_text().splitlines())}
  return done, decoded, loaded


def batch_files(by_set: dict[str, list], records: int | None, per_set: bool) -> dict[str | None, list]:
  """The batch files' entries by set name: each set's first `records` (None: all) alone,
  or, keyed None, one file of the first `records` of the sets taken in turn."""
  if per_set:
    return {name: entries[:records] for name, entries in by_set.items()}
  interleaved = [entry for entries in itertools.zip_longest(*by_set.values()) for entry in entries if entry]
  return {None: interleaved[:records]}


def first_difference(a: list[int], b: list[int]) -> int:
  """The index of the first token where `a` and `b` differ (the shorter's length if one
  is the other's beginning)."""
  return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def row(label: str, loaded, done: dict, decoded: dict, reference: dict) -> dict:
  """One method's run over a file: its rates, tau, `auto`'s rounds and prices, and the
  records whose tokens differ from `reference`'s (AR's), each with where."""
  tokens, seconds, prefill = decoded["tokens"], decoded["seconds"], decoded["prefill_seconds"]
  differ = [
    {"id": done[line]["id"], "at": first_difference(done[line]["token_ids"], reference[line]["token_ids"])}
    for line in reference
    if done[line]["token_ids"] != reference[line]["token_ids"]
  ]
  return {
    "method": label,
    **loaded.proposer.describe(),  # (its tree and continuations)
    "records": len(done),
    "tokens": tokens,
    "seconds": seconds,
    "tokens_per_second": tokens / seconds,
    "prefill_seconds": prefill,
    "decode_tokens_per_second": tokens / (seconds - prefill),  # (the time between the prefills)
    "tau": sum(r["num_new_tokens"] - 1 for r in done.values()) / max(sum(r["steps"] for r in done.values()), 1),
    **({"rounds_by_kind": decoded["rounds_by_kind"]} if "rounds_by_kind" in decoded else {}),
    **(
      {"round_ms_by_kind": {k: 1e3 * v for k, v in decoded["round_seconds_by_kind"].items() if v is not None}}
      if decoded.get("round_seconds_by_kind")
      else {}
    ),
    "same_tokens_as_ar": not differ,
    "differing_records": differ,  # (each with the index of its first token unlike AR's)
  }


def same(row: dict) -> str:
  differ = row["differing_records"]
  if not differ:
    return "yes"
  return f"no: {len(differ)} records, the first unlike token at {min(d['at'] for d in differ)}"


def prices(row: dict) -> str:
  return ", ".join(f"{k} {v:.2f}" for k, v in row.get("round_ms_by_kind", {}).items())


def main(argv=None):
  argv = sys.argv[1:] if argv is None else argv
  ours, flags = (argv[: argv.index("--")], argv[argv.index("--") + 1 :]) if "--" in argv else (argv, [])
  p = cli.ArgumentParser(prog="python -m lab.bench_batch_file", description=__doc__.splitlines()[0])
  p.add_argument(
    "--sets", nargs="+", choices=[*sorted(PROMPT_SETS), HELD_OUT_NAME], default=[HELD_OUT_NAME], help="prompt sets"
  )
  p.add_argument("--length", type=cli.positive_int, default=4096, help="prompt tokens")
  p.add_argument("--num-prompts", type=cli.positive_int, default=4, help="prompts a set")
  p.add_argument(
    "--records", type=cli.positive_int, help="the file's records, the sets' prompts taken in turn (default: all)"
  )
  p.add_argument(
    "--file-per-set",
    action="store_true",
    help="each set a batch file of its own (each of --records), decoded by every method; rows by set",
  )
  p.add_argument(
    "--past-tokens",
    type=cli.nonnegative_int,
    default=0,
    help="pld and auto run again searching this many tokens of the file's earlier records' outputs (rows"
    " `+past`; with fewer slots than records, so that later records start after earlier ones end)",
  )
  p.add_argument(
    "--methods",
    nargs="+",
    type=method_spec,
    default=[MethodSpec(Method.AR), MethodSpec(Method.AUTO)],
    help="methods, each maybe with its own continuations (e.g. auto:10x1: one of 10 tokens)",
  )
  p.add_argument(
    "--repeats", type=cli.positive_int, default=3, help="timed runs of the file per method (the median's row)"
  )
  p.add_argument("--out", type=Path, help="results JSON (a PNG of them is written beside it)")
  args = p.parse_args(ours)
  if args.out:
    cli.output_path(args.out)
  ar = MethodSpec(Method.AR)
  methods = [ar, *(m for m in args.methods if m != ar)]  # (AR first: the others' text is checked against it)
  runs = [  # (label, method, past tokens): with --past-tokens each method that looks up runs twice
    (f"{spec}{suffix}", spec, past)
    for spec in methods
    for suffix, past in (("", 0), ("+past", args.past_tokens))
    if not suffix or (args.past_tokens and spec.method in (Method.PLD, Method.AUTO))
  ]
  base = generate.parse_args([*flags, "--input", "-", "--output", "-"])  # (its own checks, before anything runs)

  from infer import plots
  from infer.timing import environment
  from longspec_jax.weights import load_tokenizer, resolve_target

  path = resolve_target(base.target)
  tokenizer = load_tokenizer(path)
  by_set = {
    name: [
      (f"{name}/{index}", ids) for index, ids in enumerate(PROMPT_SETS[name](tokenizer, args.length, args.num_prompts))
    ]
    for name in set_names(args.sets)
  }
  files = batch_files(by_set, args.records, args.file_per_set)
  rows = []
  with tempfile.TemporaryDirectory() as tmp:
    for number, (name, entries) in enumerate(files.items()):
      records_path = Path(tmp) / f"prompts_{number}.jsonl"
      with records_path.open("w") as f:
        for ident, ids in entries:
          f.write(json.dumps({"id": ident, "prompt": tokenizer.decode(ids)}) + "\n")
      records = batch_file.read_records(records_path)  # (read back as infer.generate reads them)
      prompts = [generate.encode_prompt(tokenizer, r.prompt, r.chat(base.chat)) for r in records]
      run = functools.partial(decode, flags, records=records, prompts=prompts, path=path, tokenizer=tokenizer)
      reference = None
      for label, method, past in runs:
        print(f"[{name or 'file'} {label}] compiling ...", file=sys.stderr, flush=True)
        *_, loaded = run(method, past, output=Path(tmp) / f"{number}_{label}_warm.jsonl")
        print(f"[{name or 'file'} {label}] timed ...", file=sys.stderr, flush=True)
        timed = [
          run(method, past, output=Path(tmp) / f"{number}_{label}_{repeat}.jsonl", loaded=loaded)
          for repeat in range(args.repeats)
        ]
        done, decoded, _ = sorted(timed, key=lambda result: result[1]["seconds"])[len(timed) // 2]
        reference = reference or done
        seconds = [result[1]["seconds"] for result in timed]
        rows.append(
          {**({"set": name} if name else {}), **row(label, loaded, done, decoded, reference), "seconds_by_run": seconds}
        )
  for r in rows:  # (against AR's row of the same file)
    ar_row = next(a for a in rows if a.get("set") == r.get("set"))
    r["speedup_vs_ar"] = r["tokens_per_second"] / ar_row["tokens_per_second"]
    r["decode_speedup_vs_ar"] = r["decode_tokens_per_second"] / ar_row["decode_tokens_per_second"]
  result = {
    "kind": "batch_file",
    **environment(),
    "argv": argv,
    "target": base.target,
    "sets": set_names(args.sets),
    "file_per_set": args.file_per_set,
    "length": args.length,
    "batch": base.batch or generate.BATCH,
    "rows": rows,
  }
  print("method | records | tokens | seconds | prefill s | tokens/s | x AR | decode x AR | tau | AR's text")
  for r in rows:
    label = f"{r['set']} {r['method']}" if "set" in r else r["method"]
    print(
      f"{label} | {r['records']} | {r['tokens']} | {r['seconds']:.2f} | {r['prefill_seconds']:.2f}"
      f" | {r['tokens_per_second']:.1f} | {r['speedup_vs_ar']:.2f} | {r['decode_speedup_vs_ar']:.2f} | {r['tau']:.2f}"
      f" | {same(r)}" + (f" | rounds {r['rounds_by_kind']}, ms {prices(r)}" if "rounds_by_kind" in r else "")
    )
  if args.out:
    plots.save(result, args.out)


if __name__ == "__main__":
  cli.run_main(main, "python -m lab.bench_batch_file")
