"""`python -m lab.profile_table`: several `lab.profile` runs as one table of a round's
device time by part (`lab.profile.PARTS`), in microseconds a round, one row a run.

Each run's `profile.json` holds its device time by part over every op of the decode loop
(`by_part_ms`); a run from before it did holds only its listed top ops, whose parts are
summed from them, and what the list leaves out is its `not_listed_us`.

  python -m lab.profile_table prof/ar-4k prof/longspec-4k --out table.json
"""

from __future__ import annotations

import json
from pathlib import Path

from lab.profile import PARTS, part_of
from longspec_jax.cli import ArgumentParser, output_path, run_main
from longspec_jax.errors import UserError


def row(report: dict) -> dict:
  """A run's row: its label, context, batch, rounds, kernel time and time by part, each
  in microseconds a round."""
  rounds = max(report["rounds"], 1)
  if "by_part_ms" in report:
    parts, listed = report["by_part_ms"], report["kernel_ms"]
  else:
    parts = dict.fromkeys(PARTS, 0.0)
    for op in report["top_ops"]:
      parts[part_of(op["hlo_op"], op["op_name"])] += op["ms"]
    listed = sum(parts.values())
  return {
    "method": report.get("label", report["method"]),
    "context": report["prefill_tokens"],
    "batch": report["batch"],
    "rounds": report["rounds"],
    "kernel_us": 1e3 * report["kernel_ms"] / rounds,
    **{f"{part}_us": 1e3 * parts[part] / rounds for part in PARTS},
    "not_listed_us": max(0.0, 1e3 * (report["kernel_ms"] - listed) / rounds),
  }


def main(argv=None):
  p = ArgumentParser(prog="python -m lab.profile_table", description=__doc__.splitlines()[0])
  p.add_argument("runs", nargs="+", type=Path, help="lab.profile output directories")
  p.add_argument("--labels", nargs="+", help="a row's method as the table names it (default: the run's own label)")
  p.add_argument("--out", type=Path, required=True)
  args = p.parse_args(argv)
  output_path(args.out)
  if args.labels and len(args.labels) != len(args.runs):
    p.error(f"give one label a run: {len(args.runs)} runs, {len(args.labels)} labels")
  reports = []
  for run in args.runs:
    path = run / "profile.json"
    if not path.is_file():
      raise UserError(f"{run} holds no profile.json: give directories `python -m lab.profile --out` wrote.")
    reports.append(json.loads(path.read_text()))
  rows = [row(report) for report in reports]
  for label, entry in zip(args.labels or (), rows):
    entry["method"] = label
  table = {"device": reports[0]["device"], "jax": reports[0]["jax"], "rows": rows}
  args.out.write_text(json.dumps(table, indent=1))
  for entry in rows:
    parts = ", ".join(f"{part} {entry[f'{part}_us']:.0f}" for part in PARTS if entry[f"{part}_us"])
    print(f"{entry['method']} at {entry['context']}: {entry['kernel_us']:.0f} us a round ({parts})")
  print(f"wrote {args.out}")


if __name__ == "__main__":
  run_main(main, "python -m lab.profile_table", interruptible=False)
