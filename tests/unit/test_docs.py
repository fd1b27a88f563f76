"""The generated documentation is current: docs/results.md and the README's headline table
from the curated results and their manifest, docs/usage.md from the commands' `--help`."""

import json

from lab import docs


def test_the_generated_pages_are_current():
  manifest = json.loads((docs.RESULTS / "manifest.json").read_text())
  assert docs.stale(manifest) == [], "run `python -m lab.docs` and commit what it writes"


def test_every_manifest_entry_says_where_it_came_from():
  manifest = json.loads((docs.RESULTS / "manifest.json").read_text())
  for topic in manifest["topics"]:
    for entry in topic["entries"]:
      assert {"file", "title", "command", "commit", "device", "date", "columns"} <= set(entry), entry["file"]
      assert entry["command"].startswith("python -m ") or "python -m " in entry["command"], entry["file"]


def test_the_readme_stays_short_and_inside_the_repository():
  text = (docs.ROOT / "README.md").read_text()
  assert len(text.splitlines()) <= 120
  assert "](../" not in text and "../shared" not in text


def test_a_run_per_prompt_gives_ratios_to_the_baseline_and_to_the_best_kind():
  def row(set_name, method, *rates):
    return {"set": set_name, "prefill_tokens": 64, "method": method, "per_prompt": [{"r": r} for r in rates]}

  data = {"rows": [row("a", "ar", 1.0, 2.0), row("a", "x", 3.0, 4.0), row("a", "y", 2.0, 6.0), row("b", "ar", 1.0)]}
  data["rows"] += [row("b", "x", 5.0), row("b", "y", 4.0)]
  spec = {"baseline": "ar", "value": "r", "over_best": {"y_over_best": ["y", ["ar", "x"]]}}
  rows = docs.prompt_rows({"per_prompt": spec}, data)
  assert [(r["set"], r.get("prompt")) for r in rows] == [("a", 1), ("a", 2), ("b", 1), ("median", None)]
  assert [r["x"] for r in rows] == [3.0, 2.0, 5.0, 3.0] and [r["ar"] for r in rows] == [1.0] * 4
  assert [r["y_over_best"] for r in rows] == [2 / 3, 1.5, 0.8, 0.8]
