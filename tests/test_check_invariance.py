"""`python -m infer.check_invariance` on a CPU: SmolLM2's shape, a short prompt, one chain."""

import json

from infer.check_invariance import main

from conftest import run_cli

PROG = "python -m infer.check_invariance"


def test_chain_equals_ar_steps_and_bad_input(tmp_path, capsys):
  out = tmp_path / "inv.json"
  assert run_cli(main, ["--context", "40", "--starts", "1", "--out", str(out)], PROG) == 0, capsys.readouterr().err
  result = json.loads(out.read_text())
  assert result["chain_nodes"] == 11 and result["exact"] is True
  assert result["nodes_differing"] == 0 and result["prefill_same_for_two_allocations"]
  assert run_cli(main, ["--context", "9000"], PROG) == 2
  assert "exceed smollm2-135m's context" in capsys.readouterr().err
