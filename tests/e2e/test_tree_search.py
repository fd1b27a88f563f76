"""The tree search: its moves, its determinism for a seed, the CLI that stores the tree, and trees
priced at another target's shape (a floor suite's prices, the table of trees by shape)."""

import dataclasses
import json

import pytest

from infer.tree_search import WIDTHS, Candidate, Measurement, Prices, best_priced, main, neighbours, project, search
from longspec_jax.errors import UserError

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


def test_a_tree_parses_from_its_label():
  tree = Candidate((4, 8, 8), 10)
  assert Candidate.parse(tree.label) == tree and Candidate.parse("2,3") == Candidate((2, 3), 0)
  for bad in ("4,x", "", "4,8+copyx", "0,4"):
    with pytest.raises(UserError):
      Candidate.parse(bad)


def _prices(shape: dict, trees: dict[str, tuple[float, float]]) -> dict:
  """A floor suite's JSON: AR steps of 5 and 8 ms at 4k and 32k, each tree's rounds there."""
  rows = [
    {"method": "ar", "numerics": "fast", "batch": 1, "context": c, "round_ms": ms}
    for c, ms in ((4096, 5.0), (32768, 8.0))
  ]
  for label, prices in trees.items():
    tree = Candidate.parse(label)
    for context, ms in zip((4096, 32768), prices):
      rows.append(
        {"method": f"longspec[{label}]", "numerics": "fast", "batch": 1, "context": context, "round_ms": ms}
        | {"tree_widths": list(tree.widths), "copy_tokens": tree.copy_tokens}
      )
  rows.append({"method": "ar", "numerics": "fast", "batch": 8, "context": 4096, "round_ms": 99.0})  # (no tree beside)
  return {"suite": "floor", "shape": "tiny", "target_shape": shape, "rows": rows}


def _batch_rows(batch: int, ar_ms: float, trees: dict[str, float]) -> list[dict]:
  """A floor suite's rows at 4k and `batch` sequences: an AR step and each tree's round."""
  rows = [{"method": "ar", "numerics": "fast", "batch": batch, "context": 4096, "round_ms": ar_ms}]
  for label, ms in trees.items():
    tree = Candidate.parse(label)
    rows.append(
      {"method": f"longspec[{label}]", "numerics": "fast", "batch": batch, "context": 4096, "round_ms": ms}
      | {"tree_widths": list(tree.widths), "copy_tokens": tree.copy_tokens}
    )
  return rows


def test_prices_read_from_a_floor_suite_and_project_tokens_per_second(tmp_path):
  path = tmp_path / "prices.json"
  data = _prices({"hidden_size": 8}, {"2,2": (6.0, 9.0), "4,8,8+copy5": (7.0, 16.0)})
  data["rows"] += _batch_rows(4, 10.0, {"2,2": 12.0, "4,8,8+copy5": 30.0})  # (a batch of 4: the big tree is dear)
  path.write_text(json.dumps(data))
  prices = Prices.read(path)
  assert prices.ar_ms == {(4096, 1): 5.0, (4096, 4): 10.0, (32768, 1): 8.0}  # (batch 8: no tree priced beside)
  assert prices.trees == [Candidate((2, 2), 0), Candidate((4, 8, 8), 5)]
  assert prices.contexts == [4096, 32768] and prices.batches == [1, 4]
  taus = {Candidate((2, 2), 0): 2.4, Candidate((4, 8, 8), 5): 4.2}
  rows = project(prices, {tree: Measurement(tau, 1.0, (0.5,)) for tree, tau in taus.items()})
  by = {(r["context"], r["batch"], r["tree"]): r for r in rows}
  assert by[4096, 1, "ar"]["projected_tokens_per_second"] == pytest.approx(200.0)
  assert by[32768, 1, "4,8,8+copy5"]["projected_tokens_per_second"] == pytest.approx(4.2e3 / 16.0)
  assert by[32768, 1, "4,8,8+copy5"]["projected_speedup"] == pytest.approx(4.2 * 8.0 / 16.0)
  assert by[4096, 1, "2,2"]["ar_steps_per_round"] == pytest.approx(6.0 / 5.0)
  assert best_priced(rows, 4096) == Candidate((4, 8, 8), 5)  # 600 vs 400 tokens/s
  assert best_priced(rows, 32768) == Candidate((2, 2), 0)  # 267 vs 263
  assert best_priced(rows, 4096, 4) == Candidate((2, 2), 0)  # 200 vs 140 tokens/s a sequence

  twice = _prices({}, {"2,2": (6.0, 9.0)})
  twice["rows"].append(dict(twice["rows"][2]))
  for bad, message in (
    (twice, "twice"),
    ({"suite": "smollm2"}, "not the JSON"),
    ({**twice, "rows": []}, "no context and batch"),
  ):
    path.write_text(json.dumps(bad))
    with pytest.raises(UserError, match=message):
      Prices.read(path)
  path.write_text("{")
  with pytest.raises(UserError, match="not a readable JSON"):
    Prices.read(path)


def test_cli_prices_trees_at_another_shape_and_new_drafts_start_from_the_stored_one(
  tiny_with_tokenizer, tmp_path, monkeypatch, capsys
):
  import jax.numpy as jnp

  from longspec_jax.models.config import DraftConfig, DraftKind
  from longspec_jax.models.draft import random_draft
  from longspec_jax.weights import drafts, read_target_config

  config = read_target_config(tiny_with_tokenizer)
  monkeypatch.setattr(drafts, "TREES", tmp_path / "trees.json")
  assert drafts.new_draft_config(config).tree_widths == DraftConfig.for_target(config).tree_widths  # (no table)
  drafts.save_draft(tmp_path / "draft", random_draft(DraftConfig.for_target(config, window=16), jnp.float32))
  prices = tmp_path / "prices.json"
  shape = drafts.target_shape(config)
  data = _prices(shape, {"2,2": (6.0, 9.0), "1,1,1": (5.5, 8.5), "3+copy2": (6.5, 9.5)})
  data["rows"] += _batch_rows(16, 7.0, {"2,2": 30.0, "1,1,1": 9.0, "3+copy2": 40.0})  # (16 sequences: the chain)
  prices.write_text(json.dumps(data))
  out = tmp_path / "projection.json"
  argv = ["--target", str(tiny_with_tokenizer), "--draft", str(tmp_path / "draft"), "--sets", "code"]
  argv += ["--length", "64", "--num-prompts", "1", "--new-tokens", "6", "--dtype", "float32", "--repeats", "1"]
  argv += ["--prices", str(prices), "--price-context", "4096", "--out", str(out), "--store"]
  assert run_cli(main, argv, PROG) == 0, capsys.readouterr().err
  result = json.loads(out.read_text())
  assert result["kind"] == "tree_prices" and result["price_context"] == 4096 and len(result["evaluations"]) == 3
  assert {(r["context"], r["batch"], r["tree"]) for r in result["rows"]} == {
    (c, b, t) for c, b in ((4096, 1), (32768, 1), (4096, 16)) for t in ("ar", "2,2", "1,1,1", "3+copy2")
  }
  tau = {Candidate(tuple(e["tree_widths"]), e["copy_tokens"]).label: e["tau"] for e in result["evaluations"]}
  for r in result["rows"]:
    if r["tree"] != "ar":
      assert r["tau"] == tau[r["tree"]] and r["projected_tokens_per_second"] == pytest.approx(
        r["tau"] * 1e3 / r["round_ms"]
      )
  best = best_priced(result["rows"], 4096)
  assert result["best"] == {"tree_widths": list(best.widths), "copy_tokens": best.copy_tokens}
  assert out.with_suffix(".png").stat().st_size > 0
  stored = json.loads((tmp_path / "trees.json").read_text())["trees"]
  assert [(e["name"], e["shape"], e["context"], e["batch"]) for e in stored] == [
    ("tiny", shape, 4096, 1),
    ("tiny", shape, 4096, 16),
  ]
  assert result["best_by_batch"][1] == {"batch": 16, "tree_widths": [1, 1, 1], "copy_tokens": 0}
  # New drafts for a target of this shape start from the priced tree; other kinds and other shapes do not.
  fresh = drafts.new_draft_config(config)
  assert (fresh.tree_widths, fresh.copy_tokens) == (best.widths, best.copy_tokens)
  assert drafts.load_draft("random", config, jnp.float32).config.tree_widths == best.widths
  assert drafts.new_draft_config(config, tree_widths=(5,)).tree_widths == (5,)  # (overrides win)
  glide = drafts.new_draft_config(config, kind=DraftKind.GLIDE)
  assert glide.tree_widths == DraftConfig.for_target(config).tree_widths
  other = dataclasses.replace(config, num_layers=config.num_layers + 1)
  assert drafts.new_draft_config(other).tree_widths == DraftConfig.for_target(other).tree_widths
  # A batch of 16 or more decodes with the tree priced at 16; fewer, and the flags' own, keep the draft's.
  assert drafts.batch_tree(config, 8) == {} and drafts.batch_tree(config, 64) == {
    "tree_widths": (1, 1, 1),
    "copy_tokens": 0,
  }
  from infer import decoder, generate

  flags = [
    "--prompt",
    "x",
    "--target",
    str(tiny_with_tokenizer),
    "--method",
    "longspec",
    "--draft",
    str(tmp_path / "draft"),
  ]
  assert decoder.check_flags(generate.parse_args(flags), config).widths is None  # (the draft's own tree)
  assert decoder.check_flags(generate.parse_args(flags), config, 16).widths == (1, 1, 1)
  assert decoder.check_flags(generate.parse_args([*flags, "--tree-widths", "2"]), config, 16).widths == (2,)
  drafts.store_priced_tree("tiny", shape, 32768, (1,), 0)  # replaces the shape's entry at batch 1
  assert drafts.priced_tree(config) == {"tree_widths": (1,), "copy_tokens": 0}
  assert drafts.batch_tree(config, 16) == {"tree_widths": (1, 1, 1), "copy_tokens": 0}

  assert run_cli(main, argv[:-5] + ["--prices", str(prices), "--price-context", "1000"], PROG) == 2
  assert "prices contexts 4096, 32768" in capsys.readouterr().err
  assert run_cli(main, argv[:-7] + ["--price-context", "4096"], PROG) == 2
  assert "--price-context chooses among the contexts of --prices" in capsys.readouterr().err
