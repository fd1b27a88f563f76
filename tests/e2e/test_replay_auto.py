"""`python -m lab.replay_auto` on a benchmark JSON's texts and prices."""

import json

from lab.replay_auto import main

from helpers import run_cli

PROG = "python -m lab.replay_auto"
PRICES_MS = {"ar": 1.0, "chain": 1.1, "copy": 1.25, "switch": 0.01}


def test_replays_each_prompt_beside_every_kind_and_refuses_a_json_without_texts(tmp_path, capsys):
  block = list(range(10, 70))
  ar = {
    "method": "ar",
    "set": "code",
    "per_prompt": [
      {"prompt_ids": block + block[:8], "token_ids": block[8:40]},
      {"prompt_ids": list(range(100, 140)), "token_ids": list(range(140, 160))},
    ],
  }
  auto = {"method": "auto", "round_ms_by_kind": PRICES_MS, "copy_tokens": 6, "copy_matches": 2}
  texts = tmp_path / "bench.json"
  texts.write_text(json.dumps({"rows": [ar, auto]}))
  out = tmp_path / "replay.json"
  assert run_cli(main, ["--texts", str(texts), "--out", str(out)], PROG) == 0, capsys.readouterr().err
  result = json.loads(out.read_text())
  first, second = result["prompts"]
  assert first["auto"]["tau"] > 4 and first["chain"]["tau"] > 4  # (the text repeats the prompt)
  assert second["auto"]["rounds_by_kind"] == {"ar": 19, "chain": 0, "copy": 0}  # (nothing to copy)
  assert second["auto_over_best_kind"] == 1.0 and second["hindsight_over_best_kind"] == 1.0  # (AR: the best)
  assert first["hindsight_over_best_kind"] >= 1.0  # (each round's best kind: at least the best one's rounds)
  assert result["auto_over_best_kind"]["min"] <= result["auto_over_best_kind"]["median"]
  printed = capsys.readouterr().out
  assert "auto / the best single kind" in printed and "best kind in hindsight / the best single kind" in printed

  ar.pop("per_prompt")
  texts.write_text(json.dumps({"rows": [ar, auto]}))
  assert run_cli(main, ["--texts", str(texts)], PROG) == 2
  assert "no ar row with its texts" in capsys.readouterr().err
