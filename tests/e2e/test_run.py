"""`python -m train.run` end to end on a tiny target with the real tokenizer and real files."""

import json
import shutil
import socket
import subprocess
import sys
import sysconfig

import pytest

from train.run import main

from helpers import run_cli

pytestmark = pytest.mark.training  # (train steps: `MARKED_OPTIONS` in conftest.py)

PROG = "python -m train.run"


def run(argv):
  return run_cli(main, argv, PROG)


@pytest.mark.optimized  # (its evaluations run long enough to pay for the optimizations)
def test_train_resume_overwrite_and_load_the_draft(tiny_with_tokenizer, tmp_path, capsys):
  """A run of 3 steps; resumed after a crash that lost its last checkpoint (each step's
  metrics written once) with held-out evaluations; stopped by --time-limit; its draft
  decoding; then replaced by --overwrite."""
  out = tmp_path / "run"
  common = [
    "--stage",
    "pretrain",
    "--target",
    str(tiny_with_tokenizer),
    "--out",
    str(out),
    "--length",
    "64",
    "--batch",
    "2",
    "--data",
    f"{sysconfig.get_paths()['stdlib']}/json/*.py",
    "--dtype",
    "float32",
    "--save-every",
    "2",
    "--warmup-steps",
    "1",
    "--window",
    "16",
    "--max-tokens",
    "3000",
    "--draft-intermediate-size",
    "80",
    "--feature-layers",
    "default",
  ]
  assert run(common + ["--steps", "3"]) == 0, capsys.readouterr().err
  config = json.loads((out / "draft" / "draft_config.json").read_text())
  assert config["intermediate_size"] == 80 and config["feature_layers"]  # (a wider MLP, fused features)
  records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
  assert [r["step"] for r in records] == [1, 2, 3] and all(r["loss"] > 0 for r in records)
  assert (out / "loss.png").stat().st_size > 0
  assert (out / "complete").read_text() == "3\n"  # (all --steps taken)
  held_out = f"{sysconfig.get_paths()['stdlib']}/email/*.py"
  # A crash after step 3's metrics but before its checkpoint: the newest checkpoint is step 2.
  shutil.rmtree(out / "checkpoints" / "3")
  capsys.readouterr()
  assert (
    run(
      common
      + ["--steps", "5", "--resume", "--eval", held_out, "--eval-length", "32", "--eval-rows", "2", "--eval-every", "2"]
    )
    == 0
  )
  assert "resumed from step 2" in capsys.readouterr().err
  records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
  assert [r["step"] for r in records] == [1, 2, 3, 4, 5]  # (step 3 taken again, written once)
  assert all(0 <= r["hit_rate"] <= 1 for r in records)
  report = json.loads((out / "eval.json").read_text())
  assert report["tokens"] == 2 * 31 and [(b["from"], b["to"]) for b in report["by_position"]] == [(0, 31)]
  assert [b["depth"] for b in report["by_depth"]] == [1, 2, 3, 4, 5]  # (the default tree's depths)
  assert report["by_depth"][0]["hit_rate"] == report["hit_rate"]
  curve = [json.loads(line) for line in (out / "eval_curve.jsonl").read_text().splitlines()]
  assert [c["step"] for c in curve] == [4, 5] and curve[-1]["by_depth"] == report["by_depth"]  # (every 2, the end)
  # Stopped by --time-limit short of --steps: a draft and its evaluation, not complete.
  assert (
    run(
      common
      + [
        "--steps",
        "9",
        "--resume",
        "--eval",
        held_out,
        "--eval-length",
        "32",
        "--eval-rows",
        "2",
        "--time-limit",
        "1e-9",
      ]
    )
    == 0
  )
  assert json.loads((out / "eval.json").read_text())["step"] == 6 and not (out / "complete").exists()

  from infer.generate import main as generate

  code = run_cli(
    generate,
    [
      "--target",
      str(tiny_with_tokenizer),
      "--method",
      "longspec",
      "--draft",
      str(out / "draft"),
      "--prompt",
      "import json",
      "--max-new-tokens",
      "4",
      "--tree-widths",
      "2,3",
      "--json",
    ],
    "python -m infer.generate",
  )
  captured = capsys.readouterr()
  assert code == 0, captured.err
  assert json.loads(captured.out.strip().splitlines()[-1])["method"] == "longspec"
  assert run(common + ["--steps", "2", "--overwrite"]) == 0  # a new run in its place
  steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
  assert steps == [1, 2] and sorted(p.name for p in (out / "checkpoints").iterdir() if p.name.isdigit()) == ["2"]


def test_a_glide_draft_trains_and_keeps_its_kind(tiny_with_tokenizer, tmp_path, capsys):
  out = tmp_path / "glide"
  assert (
    run(
      [
        "--stage",
        "pretrain",
        "--target",
        str(tiny_with_tokenizer),
        "--out",
        str(out),
        "--length",
        "40",
        "--batch",
        "2",
        "--data",
        f"{sysconfig.get_paths()['stdlib']}/json/*.py",
        "--dtype",
        "float32",
        "--steps",
        "2",
        "--warmup-steps",
        "1",
        "--max-tokens",
        "2000",
        "--draft-kind",
        "glide",
        "--draft-layers",
        "2",
        "--cross-block",
        "4",
        "--cross-layer",
        "0",
      ]
    )
    == 0
  ), capsys.readouterr().err
  config = json.loads((out / "draft" / "draft_config.json").read_text())
  assert config["kind"] == "glide" and config["num_layers"] == 2 and config["cross_layer"] == 0
  common = [
    "--stage",
    "pretrain",
    "--target",
    str(tiny_with_tokenizer),
    "--length",
    "40",
    "--batch",
    "2",
    "--data",
    f"{sysconfig.get_paths()['stdlib']}/json/*.py",
    "--dtype",
    "float32",
    "--steps",
    "1",
    "--warmup-steps",
    "0",
    "--max-tokens",
    "2000",
    "--init-draft",
    str(out / "draft"),
  ]
  next_run = ["--out", str(tmp_path / "next"), "--draft-kind", "glide", "--feature-layers", "default"]
  assert run(common + next_run) == 0, capsys.readouterr().err
  fused = json.loads((tmp_path / "next" / "draft" / "draft_config.json").read_text())
  assert fused["kind"] == "glide" and fused["feature_layers"]  # (added to a draft without them)
  assert run(common + ["--out", str(tmp_path / "wrong")]) == 2
  assert "holds glide's draft, where longspec's is needed" in capsys.readouterr().err
  assert run(common[:-2] + ["--out", str(tmp_path / "high"), "--draft-kind", "glide", "--cross-layer", "40"]) == 2
  assert "cross-attends to target layers 40, but the target has" in capsys.readouterr().err
  assert run(common[:-2] + ["--out", str(tmp_path / "deep"), "--feature-layers", "0,40"]) == 2
  assert "--feature-layers 0,40: the target has layers 0 .." in capsys.readouterr().err


def test_tokenswift_heads_train_and_report_each_head(tiny_with_tokenizer, tmp_path, capsys):
  """`--draft-kind tokenswift` trains the heads on the frozen target, exports them as a
  draft of their kind, and reports held-out agreement per head."""
  out = tmp_path / "heads"
  data = f"{sysconfig.get_paths()['stdlib']}/json/*.py"
  assert (
    run(
      [
        "--stage",
        "pretrain",
        "--target",
        str(tiny_with_tokenizer),
        "--out",
        str(out),
        "--length",
        "40",
        "--batch",
        "2",
        "--data",
        data,
        "--dtype",
        "float32",
        "--steps",
        "2",
        "--warmup-steps",
        "1",
        "--max-tokens",
        "2000",
        "--draft-kind",
        "tokenswift",
        "--eval",
        data,
        "--eval-rows",
        "2",
        "--eval-length",
        "32",
      ]
    )
    == 0
  ), capsys.readouterr().err
  config = json.loads((out / "draft" / "draft_config.json").read_text())
  assert config["kind"] == "tokenswift" and config["gamma"] == 3
  report = json.loads((out / "eval.json").read_text())
  assert [d["depth"] for d in report["by_depth"]] == [1, 2, 3]
  assert report["tokens"] == 2 * (31 - 1)  # head 1 scores the positions whose token two ahead is in the row
  assert (
    run(
      [
        "--stage",
        "pretrain",
        "--target",
        str(tiny_with_tokenizer),
        "--out",
        str(tmp_path / "more"),
        "--length",
        "40",
        "--batch",
        "2",
        "--data",
        data,
        "--dtype",
        "float32",
        "--steps",
        "1",
        "--warmup-steps",
        "0",
        "--max-tokens",
        "2000",
        "--draft-kind",
        "tokenswift",
        "--init-draft",
        str(out / "draft"),
      ]
    )
    == 0
  ), capsys.readouterr().err


def test_bad_arguments(tiny_with_tokenizer, tmp_path, capsys):
  """Each bad input is one line and exit code 2, before the target loads."""
  stdlib = sysconfig.get_paths()["stdlib"]
  binary = tmp_path / "blob.bin"
  binary.write_bytes(bytes(range(256)) * 8)
  (tmp_path / "used").mkdir()
  (tmp_path / "used" / "metrics.jsonl").write_text("")
  (tmp_path / "notes.txt").write_text("x")
  base = [
    "--stage",
    "pretrain",
    "--target",
    str(tiny_with_tokenizer),
    "--data",
    f"{stdlib}/json/*.py",
    "--dtype",
    "float32",
  ]
  out = ["--out", str(tmp_path / "new")]
  cases = [
    (base + out + ["--steps", "0"], "--steps: expected an integer >= 1, got '0'"),
    (base + out + ["--batch", "0"], "--batch: expected an integer >= 1"),
    (base + out + ["--length", "0"], "--length: expected an integer >= 2"),
    (base + out + ["--length", "1"], "--length: expected an integer >= 2"),
    (base + out + ["--learning-rate", "-1"], "--learning-rate: expected a finite number > 0"),
    (base + out + ["--learning-rate", "0"], "--learning-rate: expected a finite number > 0"),
    (base + out + ["--time-limit", "0"], "--time-limit: expected a finite number > 0"),
    (base + out + ["--warmup-steps", "10", "--steps", "5"], "--warmup-steps (10) must be fewer than --steps (5)"),
    (base + out + ["--length", "100000"], "--length 100000 exceeds the target's context of 512 tokens"),
    (base + out + ["--resume", "--overwrite"], "give one"),
    (base + out + ["--rollout-depth", "3", "--delays", "1,1"], "give it or --delays, not both"),
    (base + out + ["--rollout-depth", "3", "--draft-kind", "glide"], "--rollout-depth trains a LongSpec draft"),
    (base + out + ["--feature-layers", "low"], "expected target layers like 2,15,27"),
    (base + out + ["--parent-features"], "give --rollout-depth 2 or more"),
    (base + out + ["--rollout-rows", "2"], "--rollout-rows sets how many rows"),
    (base + out + ["--feature-layers", "1", "--draft-kind", "tokenswift"], "TokenSwift's heads read the target's"),
    (base + ["--out", str(tmp_path / "notes.txt")], "is a file; give a directory"),
    (base + ["--out", str(tmp_path / "used")], "already holds a run (metrics.jsonl); pass --resume"),
    (base + ["--out", str(tmp_path / "new"), "--resume"], "holds no checkpoints to resume from"),
    (base + out + ["--init-draft", "/no/such/draft"], "--init-draft: the draft '/no/such/draft' does not exist"),
    (base + out + ["--init-draft", "default"], "--init-draft: no default longspec draft is shipped for target"),
    (["--stage", "pretrain", "--data", str(binary)] + out, "the data holds only binary files"),
    (["--stage", "pretrain", "--data", f"{stdlib}/json/*.py", str(binary)] + out, "1 of the data files are binary"),
    (["--stage", "pretrain", "--data", "/no/such/*.py"] + out, "no training files match"),
    (["--stage", "sft", "--data", f"{stdlib}/json/*.py"] + out, "--stage sft trains on chat records"),
  ]
  for argv, message in cases:
    assert run(argv) == 2, argv
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err, (argv, err)
  assert not (tmp_path / "new").exists()  # nothing was written


@pytest.mark.slow  # (two processes; one process's runs: above)
def test_two_processes_train_as_one(tiny_with_tokenizer, tmp_path, capsys):
  """A real two-process `jax.distributed` run on the CPU (one device each, gradients summed
  through gloo; each process reads its half of every batch) takes the steps one process
  takes: the same losses, the same exported draft."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  from flax import nnx

  from longspec_jax.models.config import TargetConfig
  from longspec_jax.weights.drafts import load_draft

  common = [
    "--stage",
    "pretrain",
    "--target",
    str(tiny_with_tokenizer),
    "--length",
    "40",
    "--batch",
    "4",
    "--data",
    f"{sysconfig.get_paths()['stdlib']}/json/*.py",
    "--dtype",
    "float32",
    "--steps",
    "3",
    "--warmup-steps",
    "1",
    "--window",
    "16",
    "--max-tokens",
    "3000",
  ]
  with socket.socket() as s:  # a free port for the coordinator
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
  two = tmp_path / "two"
  procs = [
    subprocess.Popen(
      [
        sys.executable,
        "-m",
        "train.run",
        *common,
        "--out",
        str(two),
        "--coordinator",
        f"127.0.0.1:{port}",
        "--num-processes",
        "2",
        "--process-id",
        str(i),
      ],
      stdout=subprocess.PIPE,
      stderr=subprocess.PIPE,
      text=True,
    )
    for i in range(2)
  ]
  assert run(common + ["--out", str(tmp_path / "one")]) == 0, capsys.readouterr().err
  for proc in procs:
    _, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-3000:]
  losses = lambda out: [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]
  assert len(losses(two)) == 3  # (process 0 alone writes them)
  np.testing.assert_allclose(losses(two), losses(tmp_path / "one"), rtol=1e-5)
  config = TargetConfig.from_hf(json.loads((tiny_with_tokenizer / "config.json").read_text()))
  drafts = [nnx.state(load_draft(str(out / "draft"), config, jnp.float32)) for out in (two, tmp_path / "one")]
  a, b = (np.concatenate([np.ravel(x) for x in jax.tree.leaves(d)]) for d in drafts)
  # Adam's first steps move each weight by about the learning rate whatever its gradient's
  # size, so a gradient within rounding of zero (summed in another order) may move it the
  # other way: a few such weights, each off by at most the steps' learning rates.
  off = np.abs(a - b) > 2e-5
  assert off.mean() < 0.01 and np.abs(a - b).max() <= 3 * 2 * 5e-4, (off.sum(), np.abs(a - b).max())  # (pretrain lr)


def test_init_draft_gains_the_inputs_it_lacks_and_keeps_those_it_has():
  """--feature-layers and --parent-features on --init-draft's draft: what it lacks comes
  with a zero projection, the same layers again change nothing, other layers are refused."""
  import jax.numpy as jnp

  from longspec_jax.errors import UserError
  from longspec_jax.models.config import DraftConfig
  from longspec_jax.models.draft import random_draft
  from train.run import add_features, requested_features

  from helpers import tiny_target

  target = tiny_target("llama")
  layers = requested_features("default", target.config)
  assert layers == requested_features(tuple(x - target.config.num_layers for x in layers), target.config)
  with pytest.raises(UserError, match="the target has layers 0 .."):
    requested_features((target.config.num_layers,), target.config)
  plain = random_draft(DraftConfig.for_target(target.config), jnp.float32)
  both = add_features(plain, layers, True)
  assert both.config.feature_layers == layers and both.config.parent_features
  assert not jnp.any(both.feature_proj[...]) and not jnp.any(both.parent_proj[...])
  assert add_features(both, layers, True).config == both.config
  with pytest.raises(UserError, match="leave out --feature-layers"):
    add_features(both, (0,), False)


def test_init_draft_default_is_the_draft_shipped_for_the_target(tmp_path):
  from longspec_jax.weights.drafts import SHIPPED
  from train.run import check_inputs, parse_args

  data = f"{sysconfig.get_paths()['stdlib']}/json/*.py"
  for kind, folder in (("longspec", "smollm2-135m"), ("glide", "smollm2-135m-glide")):
    argv = ["--stage", "pretrain", "--data", data, "--out", str(tmp_path / kind), "--init-draft", "default"]
    args = parse_args(argv + ["--draft-kind", kind])  # (the target: smollm2-135m, the default)
    check_inputs(args)
    assert (SHIPPED / folder / "draft_config.json").is_file()
