"""`python -m lab.bench_serve` end to end: the server in a process of its own against the
library in this one, on a tiny target with the real tokenizer."""

import json

import pytest

from lab.bench_serve import main

from helpers import run_cli


@pytest.mark.slow  # (the lab tool's whole run; the server: test_serve.py)
def test_the_server_writes_what_generate_writes_and_is_timed_beside_it(tiny_with_tokenizer, tmp_path, capsys):
  out = tmp_path / "serve.json"
  ours = ["--sets", "code", "--length", "48", "--num-prompts", "2", "--new-tokens", "5", "--concurrency", "1", "2"]
  server = ["--", "--target", str(tiny_with_tokenizer), "--method", "pld", "--dtype", "float32"]
  assert run_cli(main, [*ours, "--out", str(out), *server], "python -m lab.bench_serve") == 0, capsys.readouterr().err
  result = json.loads(out.read_text())
  assert result["kind"] == "serve" and result["method"] == "pld" and len(result["rows"]) == 2
  for row in result["rows"]:
    assert row["same_text"] and row["new_tokens"] == 5
    assert row["server_first_token_s"] > 0 and row["generate_prefill_s"] > 0 and row["decode_ratio"] > 0
    assert row["server_tau"] >= 1 and row["generate_tau"] >= 1 and row["slots_decode_tokens_per_second"] > 0
  (together,) = result["concurrent"]
  assert together["concurrency"] == 2 and together["server_tokens_per_second"] > 0
  assert out.with_suffix(".png").exists()
  log = out.with_suffix(".code.server.log").read_text()
  assert "admitted " in log and "chunk: 2 requests" in log and " done (length)" in log
  assert "ms after its body was read), " in log
  assert "Compiling" not in log  # (the libraries' debug lines stay out)


def test_bad_server_flags_are_refused_before_anything_runs(capsys):
  assert run_cli(main, ["--", "--method", "nope"], "python -m lab.bench_serve") == 2
  assert "invalid choice: 'nope'" in capsys.readouterr().err
