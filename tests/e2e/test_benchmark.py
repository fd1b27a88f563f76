"""`python -m infer.benchmark` end to end on a tiny target with the real tokenizer."""

import json

from infer.benchmark import main

from helpers import run_cli

PROG = "python -m infer.benchmark"


def test_methods_and_trees_greedy_and_sampled(tiny_with_tokenizer, tmp_path, capsys):
  common = [
    "--target",
    str(tiny_with_tokenizer),
    "--methods",
    "ar",
    "pld:3x2",
    "longspec",
    "--draft",
    "random",
    "--sets",
    "code",
    "--lengths",
    "64",
    "--num-prompts",
    "1",
    "--new-tokens",
    "4",
    "--dtype",
    "float32",
    "--cape-gamma",
    "2",
  ]
  greedy = common + ["--tree-widths", "2,2", "cape", "--copy-tokens", "4", "--out", str(tmp_path / "greedy.json")]
  assert run_cli(main, greedy, PROG) == 0, capsys.readouterr().err
  assert f"wrote {tmp_path / 'greedy.json'} and {tmp_path / 'greedy.png'}" in capsys.readouterr().out
  rows = json.loads((tmp_path / "greedy.json").read_text())["rows"]
  assert [r["method"] for r in rows] == ["ar", "pld+copy3x2", "longspec[2,2]+copy4", "longspec[cape]+copy4"]
  assert all(r["same_tokens_as_ar"] for r in rows)  # float32: lossless
  assert rows[2]["tree_widths"] == [2, 2] and rows[2]["copy_tokens"] == 4
  assert rows[1]["copy_tokens"] == 3 and rows[1]["copy_matches"] == 2
  assert rows[3]["cape"] == {"gamma": 2, "edges": [0.3, 0.6, 0.8], "sizes": [7, 5, 3, 1]}
  assert all(len(r["per_prompt"]) == 1 and r["per_prompt"][0]["new_tokens"] == 4 for r in rows)  # (1 prompt)
  assert all(r["per_prompt"][0]["compile_seconds"] == 0 for r in rows)  # the warm-up compiled everything
  for row in rows:  # the phase split is a partition of the decode time
    shares = [row[f"{phase}_seconds_share"] for phase in ("draft", "verify", "other")]
    assert all(0 <= s <= 1 for s in shares) and abs(sum(shares) - 1) < 1e-9
  assert (tmp_path / "greedy.png").stat().st_size > 0  # the plot beside the JSON
  sampled = common + [
    "--tree-widths",
    "2,2",
    "--methods",
    "ar",
    "glide",
    "tokenswift",
    "auto",
    "--glide-draft",
    "random",
    "--heads",
    "random",
    "--temperature",
    "1.0",
    "--top-k",
    "50",
    "--out",
    str(tmp_path / "sampled.json"),
  ]
  assert run_cli(main, sampled, PROG) == 0, capsys.readouterr().err
  result = json.loads((tmp_path / "sampled.json").read_text())
  # (draws keyed by position, the default: every method samples AR's text)
  assert result["sampling"]["top_k"] == 50 and all(r["same_tokens_as_ar"] for r in result["rows"])
  assert result["rows"][1]["method"] == "glide[2,2]" and result["glide_draft"] == "random"
  swift = result["rows"][2]  # (the beam widths shape the draft methods' trees, not TokenSwift's)
  assert swift["method"] == "tokenswift" and swift["tree_widths"] == [1, 3, 3, 3] and result["heads"] == "random"
  undrafted, auto = result["rows"][-2:]  # auto without the named draft, then with it
  assert undrafted["method"] == "auto" and set(undrafted["rounds_by_kind"]) == {"ar", "copy"}
  assert undrafted["tree_widths"] is None
  assert auto["method"] == "auto+draft[2,2]" and set(auto["rounds_by_kind"]) == {"ar", "copy", "draft"}
  assert auto["draft_seconds_share"] is None  # (its rounds by kind instead of one draft/verify split)
  assert all(p["compile_seconds"] == 0 for r in result["rows"] for p in r["per_prompt"])


def test_a_batch_sweep_compares_each_method_with_ar_at_the_same_batch(tiny_with_tokenizer, tmp_path, capsys):
  """Three prompts at batch 1 and 2 (the second batch filled up with the first prompt
  again): every row writes AR's text, tokens/s over the batch and per sequence."""
  argv = ["--target", str(tiny_with_tokenizer), "--methods", "ar", "pld", "--sets", "code", "--lengths", "64"]
  argv += ["--num-prompts", "3", "--new-tokens", "4", "--dtype", "float32", "--batch", "1", "2"]
  assert run_cli(main, [*argv, "--out", str(tmp_path / "sweep.json")], PROG) == 0, capsys.readouterr().err
  rows = json.loads((tmp_path / "sweep.json").read_text())["rows"]
  assert [(r["batch"], r["method"]) for r in rows] == [(1, "ar"), (1, "pld"), (2, "ar"), (2, "pld")]
  assert all(r["same_tokens_as_ar"] for r in rows)
  assert [len(r["per_prompt"]) for r in rows] == [3, 3, 2, 2]  # (generations: 3 prompts, then 2 batches of 2)
  assert all(r["tokens_per_second_per_sequence"] == r["tokens_per_second"] / r["batch"] for r in rows)
  assert rows[2]["speedup_vs_ar"] == 1.0 and (tmp_path / "sweep.png").stat().st_size > 0


def test_a_batch_decodes_with_the_tree_priced_for_it(tiny_with_tokenizer, tmp_path, monkeypatch, capsys):
  """Where the table of trees prices one for the target's shape at batch 2, longspec's rows
  at batch 2 run it and those at batch 1 the draft's own; --tree-widths overrides it."""
  from longspec_jax.weights import drafts, read_target_config

  monkeypatch.setattr(drafts, "TREES", tmp_path / "trees.json")
  shape = drafts.target_shape(read_target_config(tiny_with_tokenizer))
  drafts.store_priced_tree("tiny", shape, 4096, (1, 1), 0, batch=2)
  argv = ["--target", str(tiny_with_tokenizer), "--methods", "longspec", "--draft", "random", "--sets", "code"]
  argv += ["--lengths", "64", "--num-prompts", "2", "--new-tokens", "3", "--dtype", "float32"]
  first = [*argv, "--batch", "1", "2", "--out", str(tmp_path / "trees.json.out")]
  assert run_cli(main, first, PROG) == 0, capsys.readouterr().err
  rows = json.loads((tmp_path / "trees.json.out").read_text())["rows"]
  widths = {(r["batch"], r["method"]): r.get("tree_widths") for r in rows}
  assert widths[2, "longspec"] == [1, 1] and widths[1, "longspec"] != [1, 1]
  argv += ["--batch", "2", "--tree-widths", "2", "--out", str(tmp_path / "flag.json")]
  assert run_cli(main, argv, PROG) == 0, capsys.readouterr().err
  rows = json.loads((tmp_path / "flag.json").read_text())["rows"]
  assert {tuple(r["tree_widths"]) for r in rows if r["method"].startswith("longspec")} == {(2,)}


def test_auto_drafts_only_with_a_draft_named(tiny_with_tokenizer, tmp_path, capsys):
  """longspec takes the shipped draft by default (none here: an error), auto none."""
  common = [
    "--target",
    str(tiny_with_tokenizer),
    "--sets",
    "code",
    "--lengths",
    "64",
    "--num-prompts",
    "1",
    "--new-tokens",
    "4",
    "--dtype",
    "float32",
    "--out",
    str(tmp_path / "auto.json"),
  ]
  assert run_cli(main, common + ["--methods", "ar", "auto"], PROG) == 0, capsys.readouterr().err
  result = json.loads((tmp_path / "auto.json").read_text())
  assert result["draft"] is None and set(result["rows"][-1]["rounds_by_kind"]) == {"ar", "copy"}
  assert run_cli(main, common + ["--methods", "longspec"], PROG) == 2
  assert "no default longspec draft is shipped" in capsys.readouterr().err
  # A tree for auto without a draft would label rows with a tree it never grows.
  assert run_cli(main, common + ["--methods", "auto", "--tree-widths", "2,2"], PROG) == 2
  assert "auto runs one only when --draft names it" in capsys.readouterr().err


def test_bf16_rows_compare_identical_text_with_the_price_beside(tiny_with_tokenizer, tmp_path, capsys):
  """In bfloat16 the rounds are batch-invariant by default (kernels interpreted on a CPU):
  prompt lookup writes AR's text, AR on the fastest kernels runs second as the price of
  that, and every row has its end-to-end rate; `--no-batch-invariant` drops the row."""
  common = ["--target", str(tiny_with_tokenizer), "--methods", "ar", "pld", "--sets", "code", "--lengths", "64"]
  common += ["--num-prompts", "1", "--new-tokens", "4", "--dtype", "bfloat16", "--out", str(tmp_path / "b.json")]
  assert run_cli(main, common, PROG) == 0, capsys.readouterr().err
  result = json.loads((tmp_path / "b.json").read_text())
  rows = {r["method"]: r for r in result["rows"]}
  assert list(rows) == ["ar", "ar+fast-numerics", "pld"] and result["batch_invariant"] is True
  assert rows["pld"]["same_tokens_as_ar"] and rows["pld"]["batch_invariant"]
  assert not rows["ar+fast-numerics"]["batch_invariant"]
  for row in rows.values():
    prompt = row["per_prompt"][0]
    assert prompt["end_to_end_tokens_per_second"] > 0 and prompt["time_to_first_token_seconds"] > 0
    assert row["end_to_end_speedup_vs_ar"] > 0
  assert run_cli(main, common + ["--no-batch-invariant"], PROG) == 0, capsys.readouterr().err
  result = json.loads((tmp_path / "b.json").read_text())
  assert [r["method"] for r in result["rows"]] == ["ar", "pld"] and result["batch_invariant"] is False


def test_sparse_verification_runs_beside_the_dense_one(tiny_with_tokenizer, tmp_path, capsys):
  common = [
    "--target",
    str(tiny_with_tokenizer),
    "--methods",
    "longspec",
    "--draft",
    "random",
    "--sets",
    "code",
    "--lengths",
    "64",
    "--num-prompts",
    "1",
    "--new-tokens",
    "4",
    "--dtype",
    "float32",
    "--tree-widths",
    "2,2",
  ]
  out = tmp_path / "sparse.json"
  assert run_cli(main, common + ["--sparse-verify", "0.5", "--out", str(out)], PROG) == 0, capsys.readouterr().err
  rows = json.loads(out.read_text())["rows"]
  assert [r["method"] for r in rows] == ["ar", "longspec[2,2]", "longspec[2,2]+sparse0.5"]
  assert rows[2]["sparse_verify"]["p"] == 0.5 and rows[2]["kv_fraction_read"] < 1 == rows[1]["kv_fraction_read"]
  assert run_cli(main, ["--methods", "pld", "--sparse-verify", "0.9"], PROG) == 2
  assert "neither longspec nor glide" in capsys.readouterr().err


def test_devices_are_checked_before_the_weights_load(tiny_with_tokenizer, capsys):
  """(A run over two CPU devices needs them made before JAX starts: test_generate's
  `--devices` subprocess; here, the one-line errors.)"""
  common = ["--target", str(tiny_with_tokenizer), "--methods", "ar", "--sets", "code", "--lengths", "64"]
  assert run_cli(main, common + ["--devices", "2", "--batch-invariant"], PROG) == 2
  assert "--batch-invariant runs on one device" in capsys.readouterr().err
  assert run_cli(main, common + ["--devices", "2"], PROG) == 2  # (this process has one CPU device)
  assert "--devices 2 asks for more devices than this machine's 1 CPU device." in capsys.readouterr().err


def test_a_generation_that_compiled_is_timed_again(compiling):
  """The warm-up runs the first prompt; a longer second one needs programs of its own
  (its prefill chunk and cache are larger): that generation runs twice, the second timed."""
  import types

  import jax.numpy as jnp

  from infer.benchmark import run_config
  from longspec_jax.engine import Decoding
  from longspec_jax.models.config import TargetConfig
  from longspec_jax.models.target import random_model

  config = TargetConfig(
    vocab_size=97,
    hidden_size=32,
    intermediate_size=48,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
    max_position_embeddings=512,
  )
  target = types.SimpleNamespace(model=random_model(config, jnp.float32))
  row = run_config(target, Decoding(), None, [[5] * 6, [7] * 70], 3, seed=0)
  first, second = row["per_prompt"]
  assert first["rerun_after_compile_seconds"] == 0 and first["compile_seconds"] == 0
  assert second["rerun_after_compile_seconds"] > 0 and second["compile_seconds"] == 0
