"""`python -m lab.docs`: the generated documentation. docs/results.md and the README's
headline table come from the curated measurements in docs/results/ and their manifest;
docs/usage.md from the commands' own `--help`.

The manifest (`docs/results/manifest.json`) lists topics; each topic's entries name a JSON
file, the command that wrote it, the commit that recorded it, the device and the date, and
which of its rows and columns make the table. `--check` writes nothing and fails where a
page is stale, a file is missing, or a file in docs/results/ is in no entry.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import json
import os
import statistics
import sys
from pathlib import Path

from longspec_jax.cli import ArgumentParser, run_main
from longspec_jax.errors import UserError

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "docs" / "results"
PAGE = ROOT / "docs" / "results.md"
USAGE = ROOT / "docs" / "usage.md"
README = ROOT / "README.md"
HEADLINE = ("<!-- headline: written by python -m lab.docs -->", "<!-- end of headline -->")
# The commands docs/usage.md describes, in its order: what users run, then the lab's tools.
COMMANDS = {
  "Inference": ["infer.generate", "infer.serve", "infer.benchmark", "infer.tree_search", "infer.plots"],
  "Training": ["train.run", "train.corpus", "train.self_text", "train.rank_vocab"],
  "Lab tools": [
    "lab.bench_target",
    "lab.bench_kernels",
    "lab.bench_step",
    "lab.bench_auto",
    "lab.bench_long",
    "lab.bench_serve",
    "lab.bench_batch_file",
    "lab.bench_past",
    "lab.trace_auto",
    "lab.replay_auto",
    "lab.profile",
    "lab.profile_table",
    "lab.check_invariance",
    "lab.sparse_quality",
    "lab.docs",
  ],
}
WIDTH = "100"  # columns argparse wraps the help to


def rows_of(entry: dict, data: dict) -> list[dict]:
  """The entry's rows: the list under `rows` (None: the file's top level as one row; each
  nested list under `explode` spread into rows of their own, the parent's fields beside
  each), those matching `where`."""
  rows = [data] if entry["rows"] is None else data[entry["rows"]]
  if field := entry.get("explode"):
    rows = [{**row, **inner} for row in rows for inner in row[field]]
  for key, wanted in entry.get("where", {}).items():
    wanted = wanted if isinstance(wanted, list) else [wanted]
    rows = [row for row in rows if row.get(key) in wanted]
  return rows


def prompt_rows(entry: dict, data: dict) -> list[dict]:
  """A benchmark's rows turned per prompt (the entry's `per_prompt`): for each set and
  prompt, each method's `value` over the `baseline` method's on that prompt, and each of
  `over_best` (name -> [method, [kinds]]) the method's value over the best of the kinds on
  that prompt; a last row of medians."""
  spec = entry["per_prompt"]
  runs: dict[tuple, dict[str, dict]] = {}  # (set, prefill length) -> method -> row
  for row in data["rows"]:
    runs.setdefault((row["set"], row["prefill_tokens"]), {})[row["method"]] = row
  rows = []
  for (set_name, _), methods in runs.items():
    for i in range(len(methods[spec["baseline"]]["per_prompt"])):
      value = {method: row["per_prompt"][i][spec["value"]] for method, row in methods.items()}
      rows.append(
        {
          "set": set_name,
          "prompt": i + 1,
          **{method: value[method] / value[spec["baseline"]] for method in value},
          **{name: value[m] / max(value[k] for k in kinds) for name, (m, kinds) in spec.get("over_best", {}).items()},
        }
      )
  numeric = [key for key in rows[0] if key not in ("set", "prompt")]
  return rows + [{"set": "median", **{key: statistics.median(row[key] for row in rows) for key in numeric}}]


def cell(value, fmt: str) -> str:
  if value is None:
    return "-"
  if isinstance(value, list):
    return ", ".join(cell(v, fmt) for v in value)
  if isinstance(value, bool) or not fmt:
    return str(value).lower() if isinstance(value, bool) else str(value)
  return format(value, fmt)


def lookup(row: dict, key: str):
  """`row[key]`, a dotted key reaching into nested dicts ("ours.prefill_tokens_per_second");
  None where it is missing."""
  for part in key.split("."):
    row = row.get(part) if isinstance(row, dict) else None
  return row


def table(columns: list[list[str]], rows: list[dict]) -> list[str]:
  """A Markdown table: `columns` are [key, header, format]."""
  lines = ["| " + " | ".join(header for _, header, _ in columns) + " |", "|" + " --- |" * len(columns)]
  lines += ["| " + " | ".join(cell(lookup(row, key), fmt) for key, _, fmt in columns) + " |" for row in rows]
  return lines


# The README's columns: end to end (prefill included) first, then decoding alone and tau.
HEADLINE_KEYS = ("end_to_end_tokens_per_second", "end_to_end_speedup_vs_ar", "speedup_vs_ar", "tau")


def headline(manifest: dict) -> list[str]:
  """The README's table: per method, the median over prompt sets of an entry's rows."""
  spec = manifest["headline"]
  data = json.loads((RESULTS / spec["file"]).read_text())
  by_method: dict[str, list[dict]] = {}
  for row in data["rows"]:
    by_method.setdefault(row["method"], []).append(row)
  rows = [
    {
      "device": spec["device"],
      "target": spec["target"],
      "context": spec["context"],
      "method": method,
      **{key: statistics.median(r[key] for r in group) for key in HEADLINE_KEYS},
    }
    for method, group in by_method.items()
    if method in spec["methods"]
  ]
  columns = [
    ["device", "device", ""],
    ["target", "target", ""],
    ["context", "context", ""],
    ["method", "method", ""],
    ["end_to_end_tokens_per_second", "tokens/s end to end", ".0f"],
    ["end_to_end_speedup_vs_ar", "x AR end to end", ".2f"],
    ["speedup_vs_ar", "x AR decoding", ".2f"],
    ["tau", "tau", ".2f"],
  ]
  return [*table(columns, rows), "", spec["caption"], "", "```bash", spec["command"], "```"]


def page(manifest: dict) -> str:
  lines = [
    "# Results",
    "",
    "Written by `python -m lab.docs` from the measurements in [results/](results/) and their",
    "[manifest](results/manifest.json); a new measurement replaces the file it supersedes.",
    "Each table names the command that wrote its file, the commit that recorded it, the device",
    "and the date. `python -m infer.plots FILE` draws any of the files.",
    "",
  ]
  lines += [f"- [{topic['name']}](#{anchor(topic['name'])})" for topic in manifest["topics"]]
  for topic in manifest["topics"]:
    lines += ["", f"## {topic['name']}", "", *topic["text"]]
    for entry in topic["entries"]:
      data = json.loads((RESULTS / entry["file"]).read_text())
      lines += ["", f"### {entry['title']}", ""]
      lines += entry.get("text", [])
      if entry.get("text"):
        lines.append("")
      lines += table(entry["columns"], prompt_rows(entry, data) if "per_prompt" in entry else rows_of(entry, data))
      lines += [
        "",
        f"`{entry['command']}`",
        f"([{entry['file']}](results/{entry['file']}); {entry['device']}, commit {entry['commit']}, {entry['date']})",
      ]
  return "\n".join(lines) + "\n"


def anchor(title: str) -> str:
  return "".join(c for c in title.lower().replace(" ", "-") if c.isalnum() or c == "-")


def readme(manifest: dict, text: str) -> str:
  start, end = HEADLINE
  if start not in text or end not in text:
    raise UserError(f"README.md has no headline markers ({start} ... {end}).")
  before, rest = text.split(start, 1)
  after = rest.split(end, 1)[1]
  return before + start + "\n" + "\n".join(headline(manifest)) + "\n" + end + after


def help_text(module: str) -> str:
  """`python -m MODULE --help`, as printed at WIDTH columns."""
  out = io.StringIO()
  os.environ["COLUMNS"] = WIDTH
  with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):
    importlib.import_module(module).main(["--help"])
  return out.getvalue().rstrip()


def usage_page() -> str:
  lines = [
    "# Usage",
    "",
    "Every command's flags, as its `--help` prints them (written by `python -m lab.docs`). Bad",
    "input gets one sentence on stderr and exit code 2; Ctrl-C stops at once.",
    "",
    "The tests come in four tiers, by folder and marker: `pytest -m unit` (pure functions and",
    "small models, under a minute on 2 cores, no torch; `HYPOTHESIS_PROFILE=dev` draws fewer",
    "examples), `-m kernels` (the Pallas kernels against their jnp twins), `-m parity` (against",
    "PyTorch transformers) and `-m e2e` (the commands and the real model). `pytest` runs them all",
    "(`.ci/run` from a clean clone); `-m slow` adds the tests sized for a GPU and the longest",
    "runs of paths the others test in smaller runs.",
  ]
  for section, modules in COMMANDS.items():
    lines += ["", f"## {section}"]
    for module in modules:
      lines += ["", f"### `python -m {module}`", "", "```text", help_text(module), "```"]
  return "\n".join(lines) + "\n"


def stale(manifest: dict) -> list[str]:
  """What `--check` finds wrong: files named and missing, files present and unnamed, and
  pages that differ from what the manifest writes."""
  named = {entry["file"] for topic in manifest["topics"] for entry in topic["entries"]} | {manifest["headline"]["file"]}
  present = {p.name for p in RESULTS.iterdir() if p.name != "manifest.json"}
  problems = [f"docs/results/{name} is named in the manifest but missing" for name in sorted(named - present)]
  problems += [f"docs/results/{name} is in no manifest entry" for name in sorted(present - named)]
  if not problems:
    if PAGE.read_text() != page(manifest):
      problems.append("docs/results.md is stale")
    if README.read_text() != readme(manifest, README.read_text()):
      problems.append("README.md's headline table is stale")
  if USAGE.read_text() != usage_page():
    problems.append("docs/usage.md is stale")
  return problems


def main(argv=None) -> None:
  p = ArgumentParser(prog="python -m lab.docs", description=__doc__.splitlines()[0])
  p.add_argument("--check", action="store_true", help="write nothing; exit 1 where a page is stale")
  args = p.parse_args(argv)
  manifest = json.loads((RESULTS / "manifest.json").read_text())
  if args.check:
    if problems := stale(manifest):
      print("\n".join(problems), file=sys.stderr)
      raise SystemExit(1)
    return
  PAGE.write_text(page(manifest))
  README.write_text(readme(manifest, README.read_text()))
  USAGE.write_text(usage_page())
  print("wrote docs/results.md, docs/usage.md and README.md's headline table")


if __name__ == "__main__":
  run_main(main, "python -m lab.docs")
