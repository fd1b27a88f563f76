"""`python -m lab.bench_long` end to end on a tiny target with the real tokenizer."""

import json

import pytest

from lab.bench_long import distinct, main, segments

from helpers import run_cli

PROG = "python -m lab.bench_long"


def test_segments_and_distinct_n():
  runs = [
    {"new_tokens": 9, "rounds": 4, "decode_seconds": 0.5},
    {"new_tokens": 17, "rounds": 6, "decode_seconds": 0.75},
  ]
  assert segments(runs) == [
    {"segment_tokens": 8, "segment_tau": 2.0, "segment_tokens_per_second": 16.0},
    {"segment_tokens": 8, "segment_tau": 4.0, "segment_tokens_per_second": 32.0},
  ]
  assert distinct([1, 2, 1, 2, 1], 1) == 2 / 5 and distinct([1, 2, 1, 2, 1], 2) == 2 / 4 and distinct([1], 2) == 1.0


@pytest.mark.slow  # (the lab tool's whole run)
def test_long_outputs_by_length_and_penalty(tiny_with_tokenizer, tmp_path, capsys):
  """AR and TokenSwift (random heads) to two output lengths under two penalties: greedy
  tokens equal AR's at each, each row's segment follows from the run before, Distinct-n
  per method and penalty, and a plot."""
  out = tmp_path / "long.json"
  assert (
    run_cli(
      main,
      [
        "--target",
        str(tiny_with_tokenizer),
        "--methods",
        "ar",
        "tokenswift",
        "--heads",
        "random",
        "--prompt-tokens",
        "48",
        "--lengths",
        "6",
        "12",
        "--penalties",
        "1",
        "1.5",
        "--penalty-window",
        "8",
        "--dtype",
        "float32",
        "--out",
        str(out),
      ],
      PROG,
    )
    == 0
  ), capsys.readouterr().err
  result = json.loads(out.read_text())
  rows = result["rows"]
  assert [(r["penalty"], r["method"], r["output_tokens"]) for r in rows] == [
    (p, m, n) for p in (1.0, 1.5) for m in ("ar", "tokenswift") for n in (6, 12)
  ]
  assert all(r["same_tokens_as_ar"] for r in rows)
  assert all(r["speedup_vs_ar"] == 1.0 for r in rows if r["method"] == "ar")
  for first, second in zip(rows[::2], rows[1::2]):
    assert first["segment_tokens"] == 5 and second["segment_tokens"] == 6  # (the first token is prefill's)
    assert second["segment_tau"] == 6 / (second["rounds"] - first["rounds"])
  assert [(d["penalty"], d["method"]) for d in result["distinct"]] == [
    (1.0, "ar"),
    (1.0, "tokenswift"),
    (1.5, "ar"),
    (1.5, "tokenswift"),
  ]
  assert all(0 < d["distinct_4"] <= 1 for d in result["distinct"])
  assert out.with_suffix(".png").stat().st_size > 0


def test_lengths_must_rise(capsys):
  assert run_cli(main, ["--lengths", "8", "4"], PROG) == 2
  assert "--lengths must rise, each once" in capsys.readouterr().err
