"""`python -m train.run` end to end on a tiny target with the real tokenizer and real files."""

import json
import sysconfig


from conftest import run_cli
from train.run import main

PROG = "python -m train.run"


def run(argv):
  return run_cli(main, argv, PROG)


def test_train_resume_and_load_the_draft(tiny_with_tokenizer, tmp_path, capsys):
  out = tmp_path / "run"
  common = ["--stage", "pretrain", "--target", str(tiny_with_tokenizer), "--out", str(out), "--length", "64", "--batch", "2",
            "--data", f"{sysconfig.get_paths()['stdlib']}/json/*.py", "--dtype", "float32", "--save-every", "2",
            "--warmup-steps", "1", "--window", "16", "--max-tokens", "3000"]
  assert run(common + ["--steps", "3"]) == 0, capsys.readouterr().err
  records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
  assert [r["step"] for r in records] == [1, 2, 3] and all(r["loss"] > 0 for r in records)
  assert (out / "loss.png").stat().st_size > 0
  held_out = f"{sysconfig.get_paths()['stdlib']}/email/*.py"
  assert run(common + ["--steps", "5", "--resume", "--eval", held_out, "--eval-length", "48", "--eval-rows", "3"]) == 0
  records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
  assert [r["step"] for r in records] == [1, 2, 3, 4, 5]  # continued after the final checkpoint of step 3
  assert all(0 <= r["hit_rate"] <= 1 for r in records)
  report = json.loads((out / "eval.json").read_text())
  assert report["tokens"] == 3 * 47 and [(b["from"], b["to"]) for b in report["by_position"]] == [(0, 47)]

  from infer.generate import main as generate

  code = run_cli(generate, ["--target", str(tiny_with_tokenizer), "--draft", str(out / "draft"), "--prompt",
                            "import json", "--max-new-tokens", "4", "--tree-widths", "2,3", "--json"],
                 "python -m infer.generate")
  captured = capsys.readouterr()
  assert code == 0, captured.err
  assert json.loads(captured.out.strip().splitlines()[-1])["method"] == "longspec"


def test_bad_arguments(tiny_with_tokenizer, tmp_path, capsys):
  assert run(["--stage", "pretrain", "--data", "x", "--out", str(tmp_path), "--steps", "0"]) == 2
  assert "--steps must be at least 1" in capsys.readouterr().err
  assert run(["--stage", "sft", "--target", str(tiny_with_tokenizer), "--data", "/no/such/*.jsonl", "--out", str(tmp_path),
              "--dtype", "float32"]) == 2
  assert "no training files match" in capsys.readouterr().err
