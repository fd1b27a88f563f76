"""`python -m lab.bench_batch_file` end to end on a tiny target with the real tokenizer."""

import json

import pytest

from lab.bench_batch_file import batch_files, main

from helpers import run_cli


@pytest.mark.slow  # (the lab tool's whole run; batch files: test_generate.py)
def test_each_method_decodes_the_file_with_ars_tokens_and_is_timed(tiny_with_tokenizer, tmp_path, capsys):
  out = tmp_path / "batch_file.json"
  ours = ["--sets", "code", "docs", "--length", "48", "--num-prompts", "3", "--records", "3", "--file-per-set"]
  ours += ["--methods", "auto:3x1", "ar", "--past-tokens", "523", "--repeats", "2", "--out", str(out)]
  flags = ["--", "--target", str(tiny_with_tokenizer), "--max-new-tokens", "5", "--batch", "2", "--dtype", "float32"]
  assert run_cli(main, [*ours, *flags], "python -m lab.bench_batch_file") == 0, capsys.readouterr().err
  result = json.loads(out.read_text())
  assert result["kind"] == "batch_file" and result["batch"] == 2
  labels = [(r["set"], r["method"]) for r in result["rows"]]
  assert labels == [(s, m) for s in ("code", "docs") for m in ("ar", "auto:3x1", "auto:3x1+past")]  # (AR first)
  assert result["file_per_set"] and [r["speedup_vs_ar"] for r in result["rows"]][::3] == [1.0, 1.0]
  for row in result["rows"]:
    assert row["records"] == 3 and row["tokens"] == 15 and row["same_tokens_as_ar"] and row["tokens_per_second"] > 0
    assert 0 < row["prefill_seconds"] < row["seconds"] and row["decode_tokens_per_second"] > row["tokens_per_second"]
    assert len(row["seconds_by_run"]) == 2 and row["seconds"] == max(row["seconds_by_run"])  # (of two, the slower)
  auto = result["rows"][1]  # (its continuations, its rounds by kind, those of its calibration left out, and prices)
  assert (auto["copy_tokens"], auto["copy_matches"], auto["past_tokens"]) == (3, 1, 0)
  assert result["rows"][2]["past_tokens"] == 523
  assert sum(auto["rounds_by_kind"].values()) >= 5 and set(auto["round_ms_by_kind"]) >= set(auto["rounds_by_kind"])
  assert out.with_suffix(".png").exists()


def test_the_sets_make_one_file_in_turn_or_one_file_each():
  by_set = {"a": ["a0", "a1", "a2"], "b": ["b0"], "c": ["c0", "c1"]}
  assert batch_files(by_set, None, False) == {None: ["a0", "b0", "c0", "a1", "c1", "a2"]}
  assert batch_files(by_set, 4, False) == {None: ["a0", "b0", "c0", "a1"]}
  assert batch_files(by_set, 2, True) == {"a": ["a0", "a1"], "b": ["b0"], "c": ["c0", "c1"]}


def test_bad_generate_flags_are_refused_before_anything_runs(capsys):
  assert run_cli(main, ["--", "--method", "nope"], "python -m lab.bench_batch_file") == 2
  assert "invalid choice: 'nope'" in capsys.readouterr().err
