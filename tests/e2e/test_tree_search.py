"""The tree search: its moves, its determinism for a seed, and the CLI that stores the tree."""

import json

import pytest

from infer.tree_search import WIDTHS, Candidate, Measurement, main, neighbours, search

from helpers import run_cli

PROG = "python -m infer.tree_search"


def test_neighbours_are_one_move_away_and_within_the_budget():
  tree = Candidate((4, 16, 16), 10)
  found = neighbours(tree, max_nodes=1024)
  assert found == [
    Candidate((3, 16, 16), 10),
    Candidate((6, 16, 16), 10),  # the first width
    Candidate((4, 12, 12), 10),
    Candidate((4, 24, 24), 10),  # the deeper widths together
    Candidate((4, 16, 12), 10),
    Candidate((4, 16, 24), 10),  # the deepest alone
    Candidate((4, 16, 16, 16), 10),
    Candidate((4, 16), 10),  # a depth more, a depth less
    Candidate((4, 16, 16), 5),
    Candidate((4, 16, 16), 15),  # the copy branch
  ]
  assert all(w in WIDTHS for c in found for w in c.widths)
  small = neighbours(tree, max_nodes=tree.nodes)
  assert small and all(c.nodes <= tree.nodes for c in small)
  assert neighbours(Candidate((1,), 0), max_nodes=3) == [Candidate((2,), 0), Candidate((1, 1), 0)]
  assert Candidate((32, 32), 20) not in neighbours(Candidate((32, 32), 20), max_nodes=1024)  # ends of the ladders


def _landscape(tree: Candidate) -> Measurement:
  """A made-up speed with one best tree, (4, 8, 8) with 10 copies: tokens/s falls with the
  distance from it."""
  best = (4, 8, 8)
  distance = sum(abs(a - b) for a, b in zip(tree.widths + (0,) * 4, best + (0,) * 4)) + abs(tree.copy_tokens - 10)
  return Measurement(tau=1 + len(tree.widths), tokens_per_second=1000.0 / (1 + distance))


def test_search_climbs_to_the_best_tree_and_is_deterministic_for_a_seed():
  runs = [search(Candidate((2, 4), 0), _landscape, max_nodes=200, seed=seed, max_evaluations=200) for seed in (0, 0, 1)]
  assert runs[0].best == Candidate((4, 8, 8), 10)
  assert runs[0] == runs[1]  # the same seed: the same trees measured in the same order
  assert runs[2].best == runs[0].best and [c for c, _ in runs[2].evaluations] != [c for c, _ in runs[0].evaluations]
  measured = []
  spent = search(
    Candidate((2, 4), 0), lambda c: measured.append(c) or _landscape(c), max_nodes=200, seed=0, max_evaluations=5
  )
  assert len(spent.evaluations) == 5 == len(measured) == len(set(measured))  # each tree measured once
  assert spent.best in measured


def test_search_keeps_the_start_unless_a_neighbour_is_clearly_faster():
  flat = lambda tree: Measurement(tau=2.0, tokens_per_second=1000.0 + tree.nodes * 0.01)  # within tolerance
  found = search(Candidate((4, 4), 0), flat, max_nodes=100, seed=0, max_evaluations=50, tolerance=0.02)
  assert found.best == Candidate((4, 4), 0)
  with pytest.raises(Exception, match="at least one evaluation"):
    search(Candidate((4, 4), 0), flat, max_nodes=100, seed=0, max_evaluations=0)


def test_cli_measures_stores_and_longspec_uses_the_stored_tree(tiny_with_tokenizer, tmp_path, capsys):
  import jax.numpy as jnp

  from longspec_jax.methods.factory import make_proposer
  from longspec_jax.methods.registry import ProposerOptions
  from longspec_jax.models.config import DraftConfig
  from longspec_jax.models.draft import random_draft
  from longspec_jax.weights import read_target_config
  from longspec_jax.weights.drafts import load_draft, save_draft

  config = read_target_config(tiny_with_tokenizer)
  save_draft(tmp_path / "draft", random_draft(DraftConfig.for_target(config, window=16), jnp.float32, seed=1))
  out = tmp_path / "search.json"
  argv = [
    "--target",
    str(tiny_with_tokenizer),
    "--draft",
    str(tmp_path / "draft"),
    "--sets",
    "code",
    "--length",
    "64",
    "--num-prompts",
    "1",
    "--new-tokens",
    "4",
    "--dtype",
    "float32",
    "--start",
    "2,2",
    "--max-evaluations",
    "2",
    "--repeats",
    "1",
    "--out",
    str(out),
    "--store",
  ]
  assert run_cli(main, argv, PROG) == 0, capsys.readouterr().err
  result = json.loads(out.read_text())
  assert len(result["evaluations"]) == 2 and result["evaluations"][0]["tree_widths"] == [2, 2]
  assert all(e["tau"] >= 1 and e["tokens_per_second"] > 0 for e in result["evaluations"])
  assert out.with_suffix(".png").stat().st_size > 0
  best = result["best"]
  draft = load_draft(str(tmp_path / "draft"), config, jnp.float32)
  assert list(draft.config.tree_widths) == best["tree_widths"] and draft.config.copy_tokens == best["copy_tokens"]
  proposer, _ = make_proposer("longspec", draft)
  assert list(proposer.widths) == best["tree_widths"] and proposer.copy_tokens == best["copy_tokens"]
  assert (
    make_proposer("longspec", draft, ProposerOptions(tree_widths=(3,), copy_tokens=0))[0].copy_tokens == 0
  )  # flags override the stored tree

  assert run_cli(main, argv[:2] + ["--draft", "random"], PROG) == 2
  assert "proposes noise" in capsys.readouterr().err
