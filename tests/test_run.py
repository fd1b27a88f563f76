"""`python -m train.run` end to end on a tiny target with the real tokenizer and real files."""

import json
import sysconfig

import pytest

from conftest import save_tiny_hf_model
from infer.cli import run_main
from train.run import main

PROG = "python -m train.run"


@pytest.fixture(scope="module")
def tiny_target(tmp_path_factory, smollm2_gguf):
  from longspec_jax.weights import load_tokenizer

  path = save_tiny_hf_model("llama", tmp_path_factory.mktemp("m") / "tiny", vocab_size=49152, eos_token_id=2)
  load_tokenizer(smollm2_gguf).save_pretrained(path)
  return path


def run(argv):
  try:
    run_main(lambda: main(argv), PROG)
    return 0
  except SystemExit as e:
    return e.code


def test_train_resume_and_load_the_draft(tiny_target, tmp_path, capsys):
  out = tmp_path / "run"
  common = ["--stage", "pretrain", "--target", str(tiny_target), "--out", str(out), "--length", "64", "--batch", "2",
            "--data", f"{sysconfig.get_paths()['stdlib']}/json/*.py", "--dtype", "float32", "--save-every", "2",
            "--warmup-steps", "1", "--window", "16"]
  assert run(common + ["--steps", "3"]) == 0, capsys.readouterr().err
  records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
  assert [r["step"] for r in records] == [1, 2, 3] and all(r["loss"] > 0 for r in records)
  assert (out / "loss.png").stat().st_size > 0
  assert run(common + ["--steps", "5", "--resume"]) == 0, capsys.readouterr().err
  records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
  assert [r["step"] for r in records] == [1, 2, 3, 4, 5]  # continued after the final checkpoint of step 3

  from infer.generate import main as generate

  code = 0
  try:
    run_main(lambda: generate(["--target", str(tiny_target), "--draft", str(out / "draft"), "--prompt",
                               "import json", "--max-new-tokens", "4", "--json"]), "python -m infer.generate")
  except SystemExit as e:
    code = e.code
  captured = capsys.readouterr()
  assert code == 0, captured.err
  assert json.loads(captured.out.strip().splitlines()[-1])["method"] == "longspec"


def test_bad_arguments(tiny_target, tmp_path, capsys):
  assert run(["--stage", "pretrain", "--data", "x", "--out", str(tmp_path), "--steps", "0"]) == 2
  assert "--steps must be at least 1" in capsys.readouterr().err
  assert run(["--stage", "sft", "--target", str(tiny_target), "--data", "/no/such/*.jsonl", "--out", str(tmp_path),
              "--dtype", "float32"]) == 2
  assert "no training files match" in capsys.readouterr().err
