"""`python -m train.corpus`: a training corpus from the text a machine has installed.

A draft trained on one language reads other text poorly (one trained on Python alone:
tau 4.2 on held-out Python, 1.4-2.3 on other code and documentation). Every machine this
project runs on holds sources of many languages, documentation and configuration: this walks the usual
places (`ROOTS`), keeps the text files it can place in a domain (`DOMAINS`, by name and
location), drops exact duplicates (the same file shipped by several packages), and
splits what is left into `train.jsonl` and `heldout.jsonl` by source unit (a package or
top directory: a held-out package shares no file with training, so its style is new to
the draft). Records are `{"text", "domain", "source"}`, read by `train.run --data`
(`train.data`). Man and info pages are read decompressed, HTML as its text.

Held out for the project's evaluation, and never written: `/usr/include` and Perl (its
library, modules and documentation), `EXCLUDED`.

  python -m train.corpus --out corpus/ --heldout-percent 5
"""

from __future__ import annotations

import collections
import gzip
import hashlib
import html.parser
import json
import os
import re
import sys
import sysconfig
from pathlib import Path

from longspec_jax.cli import ArgumentParser, output_path, positive_int, run_main
from longspec_jax.errors import UserError

ROOTS = (
  "/usr/share/doc",
  "/usr/share/man",
  "/usr/share/info",
  "/usr/share/common-licenses",
  "/usr/lib/python3",
  "/usr/lib/node_modules",
  "/usr/share/javascript",
  "/usr/src",
  "/usr/local/lib",
  "/usr/local/go",
  "/etc",
  "/opt",
)
# Held out for evaluation (the project's prompt sets): never training data.
EXCLUDED = re.compile(
  r"/usr/include/|/perl[0-9.]*/|/site_perl/|/libperl|/doc/perl[^/]*/|\.(pm|pl|pod|t)$"
  r"|\.[0-9]pm?(\.gz)?$|/man[0-9][^/]*/perl[^/]*$"
)
# Domain -> file name pattern (matched against the path, first match wins).
DOMAINS = {
  "man": r"/man/[^/]*man[0-9][^/]*/[^/]+\.[0-9][a-z]*(\.gz)?$",
  "info": r"/info/[^/]+\.info(-[0-9]+)?(\.gz)?$",
  "license": r"(/common-licenses/[^/]+|/(LICEN[CS]E|COPYING|NOTICE)[^/]*|/copyright)$",
  "python": r"\.pyi?$",
  "c_cpp": r"\.(c|h|cc|cpp|cxx|hpp|hh|hxx)$",
  "shell": r"\.(sh|bash|zsh)$",
  "javascript": r"\.(js|mjs|cjs|jsx|ts|tsx)$",
  "go": r"\.go$",
  "rust": r"\.rs$",
  "java": r"\.(java|kt|scala)$",
  "ruby": r"\.rb$",
  "lua": r"\.lua$",
  "sql": r"\.sql$",
  "markdown": r"\.(md|markdown)$",
  "rest": r"\.(rst|txt)$",
  "html": r"\.html?$",
  "config": r"(\.(conf|cfg|ini|toml|ya?ml)|/etc/[^/]+)$",
  "readme": r"/(README|NEWS|CHANGELOG|HISTORY|INSTALL|AUTHORS)[^/]*$",
}
_DOMAINS = [(name, re.compile(pattern)) for name, pattern in DOMAINS.items()]
MIN_CHARS = 200  # shorter files teach little and are mostly boilerplate
MAX_BYTES = 1 << 20  # larger ones are generated tables, bundles, minified code


def domain_of(path: str) -> str | None:
  """The domain of the file at `path` (`DOMAINS`), or None (not text we take, or held out)."""
  if EXCLUDED.search(path):
    return None
  return next((name for name, pattern in _DOMAINS if pattern.search(path)), None)


def source_unit(path: str, roots: list[str]) -> str:
  """The unit a file is held out with: its root plus the first directory below it (a
  package's documentation, a Python package, a man section's page name without its
  suffix), so that every file of one package falls on one side of the split."""
  root = max((r for r in roots if path.startswith(r.rstrip("/") + "/")), key=len, default="")
  rest = path[len(root) :].strip("/").split("/")
  if len(rest) > 1 and re.fullmatch(r"(site|dist)-packages|python3(\.[0-9]+)?|man[0-9][a-z]*|node_modules", rest[0]):
    rest = rest[1:]  # (the package is one level further down)
  head = rest[0] if len(rest) > 1 else re.sub(r"(\.[0-9][a-z]*)?(\.gz)?$", "", rest[0]).split(".")[0]
  return f"{root}/{head}"


def held_out(unit: str, percent: float) -> bool:
  """Whether the source unit is held out: a fixed hash of its name, so every run on every
  machine splits one unit the same way."""
  return int(hashlib.sha256(unit.encode()).hexdigest()[:8], 16) % 10_000 < percent * 100


class _HTMLText(html.parser.HTMLParser):
  """An HTML page's text: tags dropped, script and style skipped, blocks on lines."""

  BLOCKS = {"p", "div", "br", "li", "tr", "h1", "h2", "h3", "h4", "h5", "h6", "pre", "section", "table", "dt", "dd"}

  def __init__(self):
    super().__init__(convert_charrefs=True)
    self.parts, self.skip = [], 0

  def handle_starttag(self, tag, attrs):
    self.skip += tag in ("script", "style")
    if tag in self.BLOCKS:
      self.parts.append("\n")

  def handle_endtag(self, tag):
    self.skip -= tag in ("script", "style") and self.skip > 0

  def handle_data(self, data):
    if not self.skip:
      self.parts.append(data)


def read_text(path: str, domain: str) -> str | None:
  """The file's text (decompressed, HTML as text), or None for binary or undecodable data."""
  try:
    raw = gzip.open(path).read(MAX_BYTES + 1) if path.endswith(".gz") else Path(path).read_bytes()
  except (OSError, EOFError, gzip.BadGzipFile):
    return None
  if len(raw) > MAX_BYTES or b"\0" in raw[:8192]:
    return None
  try:
    text = raw.decode("utf-8")
  except UnicodeDecodeError:
    return None
  if domain == "html":
    parser = _HTMLText()
    parser.feed(text)
    text = re.sub(r"\n\s*\n+", "\n\n", "".join(parser.parts)).strip()
  return text if len(text) >= MIN_CHARS else None


def walk(roots: list[str]):
  """Every regular file under the roots (symbolic links not followed), in sorted order."""
  for root in roots:
    for directory, dirs, files in os.walk(root, followlinks=False):
      dirs.sort()
      for name in sorted(files):
        path = os.path.join(directory, name)
        if os.path.isfile(path) and not os.path.islink(path):
          yield path


def build(roots: list[str], out: Path, heldout_percent: float, max_chars_per_domain: int | None = None) -> dict:
  """Writes `train.jsonl`, `heldout.jsonl` and `manifest.json` (files and characters per
  domain and split) under `out`; returns the manifest."""
  roots = [str(Path(r).resolve()) for r in roots if Path(r).is_dir()]
  if not roots:
    raise UserError("none of the corpus roots is a directory on this machine.")
  seen, counts = set(), collections.defaultdict(lambda: collections.Counter())
  out.mkdir(parents=True, exist_ok=True)
  with open(out / "train.jsonl", "w") as train, open(out / "heldout.jsonl", "w") as heldout:
    for path in walk(roots):
      domain = domain_of(path)
      if domain is None or (max_chars_per_domain and counts["train"][domain + ":chars"] >= max_chars_per_domain):
        continue
      text = read_text(path, domain)
      if text is None:
        continue
      digest = hashlib.sha256(text.encode()).digest()
      if digest in seen:  # (the same file shipped twice)
        counts["duplicates"][domain] += 1
        continue
      seen.add(digest)
      unit = source_unit(path, roots)
      split = "heldout" if held_out(unit, heldout_percent) else "train"
      (heldout if split == "heldout" else train).write(
        json.dumps({"text": text, "domain": domain, "source": path}) + "\n"
      )
      counts[split][domain + ":files"] += 1
      counts[split][domain + ":chars"] += len(text)
  manifest = {
    "roots": roots,
    "heldout_percent": heldout_percent,
    "excluded": EXCLUDED.pattern,
    "max_chars_per_domain": max_chars_per_domain,
  }
  for split in ("train", "heldout"):
    domains = sorted({key.split(":")[0] for key in counts[split]})
    manifest[split] = {d: {"files": counts[split][d + ":files"], "chars": counts[split][d + ":chars"]} for d in domains}
  manifest["duplicates_dropped"] = dict(counts["duplicates"])
  (out / "manifest.json").write_text(json.dumps(manifest, indent=1))
  return manifest


def default_roots() -> list[str]:
  """`ROOTS`, the running Python's standard library and installed packages, and the
  versioned Python directories beside /usr/lib/python3."""
  paths = sysconfig.get_paths()
  extra = [paths["stdlib"], paths["purelib"], *map(str, Path("/usr/lib").glob("python3.*"))]
  return sorted(set(ROOTS) | set(extra))


def main(argv=None):
  p = ArgumentParser(prog="python -m train.corpus", description=__doc__.splitlines()[0])
  p.add_argument("--out", type=Path, required=True, help="a directory: train.jsonl, heldout.jsonl, manifest.json")
  p.add_argument("--roots", nargs="+", help="directories to walk (default: the usual places, ROOTS)")
  p.add_argument("--heldout-percent", type=float, default=5.0, help="share of source units held out")
  p.add_argument(
    "--max-chars-per-domain",
    type=positive_int,
    help="stop taking a domain's files past this many"
    " characters of training text (the rest of a big domain would crowd out the others)",
  )
  args = p.parse_args(argv)
  if not 0 <= args.heldout_percent < 100:
    p.error("--heldout-percent must be in [0, 100)")
  output_path(args.out, "directory")
  manifest = build(args.roots or default_roots(), args.out, args.heldout_percent, args.max_chars_per_domain)
  print("domain       | train files | train Mchars | held-out files | held-out Mchars")
  for domain in sorted(set(manifest["train"]) | set(manifest["heldout"])):
    t, h = manifest["train"].get(domain, {}), manifest["heldout"].get(domain, {})
    print(
      f"{domain:12} | {t.get('files', 0):11} | {t.get('chars', 0) / 1e6:12.2f} | {h.get('files', 0):14} |"
      f" {h.get('chars', 0) / 1e6:15.2f}"
    )
  print(f"written to {args.out}", file=sys.stderr)


if __name__ == "__main__":
  run_main(main, "python -m train.corpus")
