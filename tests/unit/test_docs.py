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
