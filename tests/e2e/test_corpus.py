"""The machine's text as a training corpus: domains, what is held out for evaluation, the
split by source unit, duplicates."""

import gzip
import json

from train.corpus import domain_of, held_out, main, source_unit

from helpers import run_cli

TEXT = "\n".join(f"line {i} of some documentation about a tool and how to use it well" for i in range(12))


def test_domains_and_what_is_never_training_data():
  assert domain_of("/usr/lib/python3/dist-packages/a/b.py") == "python"
  assert domain_of("/usr/share/man/man1/ls.1.gz") == "man"
  assert domain_of("/usr/share/doc/x/copyright") == "license"
  assert domain_of("/usr/share/doc/x/README.md") == "markdown"
  assert domain_of("/usr/share/info/bash.info.gz") == "info"
  assert domain_of("/opt/x/main.go") == "go" and domain_of("/opt/x/lib.rs") == "rust"
  for held in (
    "/usr/include/stdio.h",
    "/usr/share/perl5/Foo/Bar.pm",
    "/usr/lib/x86_64-linux-gnu/perl/5.36/x.py",
    "/usr/share/man/man3/Foo::Bar.3pm.gz",
    "/usr/share/man/man1/perlfunc.1.gz",
    "/usr/share/doc/perl/x.md",
    "/opt/t/script.pl",
    "/opt/t/Doc.pod",
  ):
    assert domain_of(held) is None, held
  assert domain_of("/opt/x/image.png") is None


def test_source_units_keep_a_package_together():
  roots = ["/usr/share/doc", "/usr/share/man", "/usr/lib/python3"]
  assert source_unit("/usr/share/doc/git/a/b.md", roots) == source_unit("/usr/share/doc/git/README", roots)
  assert source_unit("/usr/lib/python3/dist-packages/numpy/a.py", roots) == "/usr/lib/python3/numpy"
  assert source_unit("/usr/share/man/man1/ls.1.gz", roots) == source_unit("/usr/share/man/man8/ls.8.gz", roots)
  assert held_out("/usr/share/doc/git", 50.0) == held_out("/usr/share/doc/git", 50.0)
  assert not held_out("/usr/share/doc/git", 0.0) and held_out("/usr/share/doc/git", 99.99 + 0.01)


def test_corpus_of_a_tree(tmp_path, capsys):
  root = tmp_path / "m"
  files = {
    "usr/share/doc/pkga/README.md": "# pkga\n" + TEXT,
    "usr/share/doc/pkga/copyright": "Copyright notice\n" + TEXT.upper(),
    "usr/share/doc/pkga/manual.html": "<html><style>p {}</style><p>Manual</p><script>x()</script><p>"
    + TEXT
    + "</p></html>",
    "usr/share/doc/pkgb/README.md": "# pkga\n" + TEXT,  # a duplicate of pkga's
    "usr/share/doc/pkgb/short.md": "too short",
    "usr/include/stdio.h": "int printf(const char *, ...);\n" + TEXT,
    "usr/share/perl5/Foo.pm": "package Foo;\n" + TEXT,
  }
  for i in range(30):  # many units, so that both sides of a 50% split hold some
    files[f"lib/python3/dist-packages/p{i}/mod.py"] = f"# module {i}\n" + TEXT
  for name, text in files.items():
    (root / name).parent.mkdir(parents=True, exist_ok=True)
    (root / name).write_text(text)
  (root / "usr/share/man/man1").mkdir(parents=True)
  with gzip.open(root / "usr/share/man/man1/tool.1.gz", "wt") as f:
    f.write(".TH TOOL 1\n" + TEXT)
  (root / "usr/share/doc/pkga/blob.md").write_bytes(b"\0\1\2" * 200)
  out = tmp_path / "corpus"
  roots = [str(root / d) for d in ("usr/share/doc", "usr/share/man", "lib/python3", "usr/include", "usr/share/perl5")]
  assert run_cli(main, ["--out", str(out), "--roots", *roots, "--heldout-percent", "50"], "python -m train.corpus") == 0
  records = {
    split: [json.loads(line) for line in (out / f"{split}.jsonl").read_text().splitlines()]
    for split in ("train", "heldout")
  }
  everything = records["train"] + records["heldout"]
  sources = {r["source"] for r in everything}
  assert not any("/usr/include/" in s or "perl5" in s or s.endswith(("short.md", "blob.md")) for s in sources)
  assert len(everything) == 1 + 1 + 1 + 1 + 30  # README once, copyright, manual, the man page, the modules
  assert {r["domain"] for r in everything} == {"markdown", "license", "html", "man", "python"}
  html = next(r["text"] for r in everything if r["domain"] == "html")
  assert "<p>" not in html and "x()" not in html and html.startswith("Manual")
  assert records["train"] and records["heldout"]
  units = lambda split: {
    source_unit(r["source"], [str((root / d).resolve()) for d in ("usr/share/doc", "usr/share/man", "lib/python3")])
    for r in records[split]
  }
  assert not units("train") & units("heldout")  # a unit lies on one side only
  manifest = json.loads((out / "manifest.json").read_text())
  assert sum(d["files"] for split in ("train", "heldout") for d in manifest[split].values()) == len(everything)
  assert manifest["duplicates_dropped"] == {"markdown": 1} and "python" in capsys.readouterr().out


def test_bad_input_is_one_line(tmp_path, capsys):
  assert run_cli(main, ["--out", str(tmp_path / "c"), "--heldout-percent", "100"], "python -m train.corpus") == 2
  assert capsys.readouterr().err.count("\n") == 1
  assert run_cli(main, ["--out", str(tmp_path / "c"), "--roots", str(tmp_path / "none")], "python -m train.corpus") == 2
  assert "none of the corpus roots" in capsys.readouterr().err
