"""`python -m lab.trace_auto` end to end on a tiny target with the real tokenizer."""

import json

import pytest

from lab.trace_auto import main
from longspec_jax import engine

from helpers import run_cli

PROG = "python -m lab.trace_auto"
PRICES_MS = {"ar": 1.0, "chain": 1.1, "copy": 1.25, "draft": 2.5, "switch": 0.01}


@pytest.mark.slow  # (the lab tool's whole run)
def test_traces_every_generation_at_the_given_prices(tiny_with_tokenizer, tmp_path, capsys):
  prices = tmp_path / "bench.json"
  auto = {"method": "auto", "round_ms_by_kind": PRICES_MS, "copy_tokens": 3, "copy_matches": 2}
  prices.write_text(json.dumps({"rows": [{"method": "ar"}, auto]}))
  out = tmp_path / "trace.json"
  args = [
    "--prices",
    str(prices),
    "--target",
    str(tiny_with_tokenizer),
    "--draft",
    "random",
    "--sets",
    "code",
    "docs",
    "--length",
    "64",
    "--num-prompts",
    "2",
    "--new-tokens",
    "6",
    "--dtype",
    "float32",
    "--out",
    str(out),
  ]
  assert run_cli(main, args, PROG) == 0, capsys.readouterr().err
  assert engine.MEMORY.prices.measured == {}  # (the given prices stay inside the tool)
  traced = json.loads(out.read_text())
  assert (traced["copy_tokens"], traced["copy_matches"]) == (3, 2)  # the priced row's continuations
  generations = traced["generations"]
  assert [(g["set"], g["prompt"]) for g in generations] == [
    ("code", "warm-up"),
    ("code", 0),
    ("code", 1),
    ("docs", "warm-up"),
    ("docs", 0),
    ("docs", 1),
  ]
  for g in generations:  # none measured prices: every round chosen, priced as given
    kinds = g["rounds_by_kind"]
    seconds = sum(count * PRICES_MS[kind] / 1e3 for kind, count in kinds.items())
    assert abs(g["priced_tokens_per_second"] - 5 / seconds) < 1e-6 * g["priced_tokens_per_second"]
    assert len(g["draft_gain_without_with_match"]) == 2 and len(g["explore_after"]) == 2
    assert len(g["chain_gain_by_ngram"]) == len(g["copy_gain_by_ngram"])
  assert "explore after" in capsys.readouterr().out


def test_prices_without_a_kind_of_the_proposer_are_one_sentence(tiny_with_tokenizer, tmp_path, capsys):
  prices = tmp_path / "bench.json"
  ms = {k: v for k, v in PRICES_MS.items() if k != "chain"}  # (a row of `auto` before CHAIN rounds)
  prices.write_text(
    json.dumps({"rows": [{"method": "auto", "round_ms_by_kind": ms, "copy_tokens": 3, "copy_matches": 2}]})
  )
  args = [
    "--prices",
    str(prices),
    "--target",
    str(tiny_with_tokenizer),
    "--draft",
    "none",
    "--length",
    "64",
    "--new-tokens",
    "6",
  ]
  assert run_cli(main, args, PROG) == 2
  assert capsys.readouterr().err.strip().endswith("--prices has no price for chain rounds.")


def test_prices_without_an_auto_row_are_one_sentence(tmp_path, capsys):
  prices = tmp_path / "bench.json"
  prices.write_text(json.dumps({"rows": [{"method": "pld"}]}))
  assert run_cli(main, ["--prices", str(prices)], PROG) == 2
  assert capsys.readouterr().err.strip().endswith("has no auto row with every round price measured.")
