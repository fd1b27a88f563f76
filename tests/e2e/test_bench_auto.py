"""`python -m lab.bench_auto` end to end on a tiny target with the real tokenizer."""

import json

import jax.numpy as jnp
import numpy as np
import pytest

from infer.timing import warmed_up
from lab.bench_auto import OneKind, main, summary, variants
from longspec_jax.engine import Decoding, generate
from longspec_jax.methods import prices
from longspec_jax.methods.auto import Kind
from longspec_jax.methods.prompt_lookup import PromptLookup
from longspec_jax.models.config import DraftConfig
from longspec_jax.models.draft import random_draft
from longspec_jax.weights.hf import load_hf_dir

from helpers import run_cli, save_tiny_hf_model

PROG = "python -m lab.bench_auto"


@pytest.mark.slow  # (the lab tool's whole run; its variants: below)
def test_variants_interleaved_with_prompt_lookup(tiny_with_tokenizer, tmp_path, capsys):
  out = tmp_path / "auto.json"
  args = [
    "--target",
    str(tiny_with_tokenizer),
    "--draft",
    "none",  # (the draft's variants: test_prompt_lookup_runs_autos_own_continuations)
    "--sets",
    "code",
    "--length",
    "64",
    "--num-prompts",
    "1",
    "--new-tokens",
    "5",
    "--repeats",
    "1",
    "--dtype",
    "float32",
    "--copy-tokens",
    "3",
    "--copy-matches",
    "2",
    "--out",
    str(out),
  ]
  assert run_cli(main, args, PROG) == 0, capsys.readouterr().err
  result = json.loads(out.read_text())
  assert (result["copy_tokens"], result["copy_matches"]) == (3, 2)  # (pld's and auto's alike)
  rows = result["sets"]["code"]["summary"]
  assert list(rows) == ["pld", "auto, no draft", "auto, no draft, copy only"]
  assert rows["pld"]["ms_per_round_vs_pld"] == 1.0 and rows["pld"]["rounds_by_kind"] is None
  assert all(len(g) == 1 for g in result["sets"]["code"]["generations"].values())  # 1 prompt x 1 repeat
  assert [(r["set"], r["variant"]) for r in result["rows"]] == [("code", label) for label in rows]
  assert set(rows["auto, no draft"]["rounds_by_kind"]) == {"ar", "chain", "copy"}  # (two continuations)
  assert out.with_suffix(".png").stat().st_size > 0 and "auto, no draft, copy only" in capsys.readouterr().out


def test_prompt_lookup_runs_autos_own_continuations(tmp_path):
  """Every variant's continuations are prompt lookup's; with a draft, auto's variants with
  it come first, each with the draft's params."""
  chosen = variants(None, 7, 3)
  assert list(chosen) == ["pld", "auto, no draft", "auto, no draft, copy only"]
  assert chosen["pld"][0] == chosen["auto, no draft"][0].lookup == PromptLookup(num_tokens=7, matches=3)
  tiny, _ = load_hf_dir(save_tiny_hf_model("llama", tmp_path / "llama"), jnp.float32)
  drafted = variants(random_draft(DraftConfig.for_target(tiny.config, window=8), jnp.float32), 7, 3)
  assert list(drafted) == ["pld", "auto", "auto, copy only", "auto, draft only", *list(chosen)[1:]]
  assert drafted["auto, draft only"][0].only == Kind.DRAFT and drafted["auto, copy only"][1] is not None
  assert all(drafted[label][0].lookup == chosen["pld"][0] for label in ("auto", "auto, copy only", "auto, no draft"))


def test_one_kind_runs_only_its_kind_and_stays_lossless(tmp_path, monkeypatch):
  monkeypatch.setattr(prices, "HOST", prices.Schedule(rounds=1, repeats=1))  # (all measured in the first generation)
  tiny, _ = load_hf_dir(save_tiny_hf_model("llama", tmp_path / "llama"), jnp.float32)
  prompt = np.random.default_rng(3).integers(0, tiny.config.vocab_size, 40).tolist() * 2
  decoding = Decoding(proposer=OneKind(PromptLookup(num_tokens=3), only=Kind.COPY))
  result = warmed_up(lambda: generate(tiny, [prompt], 12, decoding))  # (its kinds each forced, timed first)
  assert result.token_ids == generate(tiny, [prompt], 12).token_ids
  assert result.stats.calibration_seconds == 0 and result.stats.rounds_by_kind == {"ar": 0, "copy": 11}


def test_summary_pairs_each_generation_with_prompt_lookups():
  run = lambda seconds, rounds: {
    "seconds": seconds,
    "rounds": rounds,
    "new_tokens": 2 * rounds + 1,
    "rounds_by_kind": None,
  }
  rows = summary({"pld": [run(1.0, 10), run(4.0, 10)], "auto": [run(1.5, 10), run(4.0, 10)]})
  assert rows["auto"]["ms_per_round_vs_pld"] == 1.25 and rows["auto"]["ms_per_round"] == 275.0
  assert rows["auto"]["tau"] == 2.0 and rows["auto"]["ms_per_round_over_prices"] is None
