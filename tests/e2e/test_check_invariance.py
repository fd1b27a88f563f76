"""`python -m lab.check_invariance` on a CPU: the real SmolLM2, a short prompt, one chain."""

import json

import pytest

from lab.check_invariance import main

from helpers import run_cli

PROG = "python -m lab.check_invariance"


@pytest.mark.slow  # (the lab tool on the real model; batch invariance: test_verify.py)
@pytest.mark.optimized
@pytest.mark.xdist_group("smollm2")
def test_real_target_and_prompt_and_bad_input(tmp_path, capsys, smollm2_gguf):
  """The real weights (outlier dimensions: inexact float32 sums) on a real document prompt:
  a chain's nodes equal AR's steps; then input the tool refuses."""
  out = tmp_path / "inv.json"
  argv = ["--target", str(smollm2_gguf), "--set", "docs", "--context", "64", "--starts", "1", "--out", str(out)]
  assert run_cli(main, argv, PROG) == 0, capsys.readouterr().err
  result = json.loads(out.read_text())
  assert result["weights"] == "real" and result["set"] == "docs" and result["chain_nodes"] == 11
  assert result["exact"] is True and result["nodes_differing"] == 0 and result["prefill_same_for_two_allocations"]
  assert run_cli(main, ["--context", "9000"], PROG) == 2
  assert "exceed smollm2-135m's context" in capsys.readouterr().err
  assert run_cli(main, ["--set", "code"], PROG) == 2
  assert "give --target as well" in capsys.readouterr().err
