"""`python -m train.self_text`: the target's own continuations and answers, as records
the SFT stage reads."""

import json

import jax.numpy as jnp

from train.data import has_chat_records, load_records, record_tokens
from train.self_text import main

from helpers import real_texts, run_cli

PROG = "python -m train.self_text"


def test_the_targets_text_as_training_records(tiny_with_tokenizer, tmp_path, capsys):
  corpus = tmp_path / "corpus.jsonl"
  texts = real_texts(limit=6)
  corpus.write_text(
    "".join(
      json.dumps({"text": t, "domain": d, "source": f"/doc/{i}"}) + "\n"
      for i, (t, d) in enumerate(zip(texts, ["python", "markdown"] * 3))
    )
  )
  common = [
    "--data",
    str(corpus),
    "--target",
    str(tiny_with_tokenizer),
    "--samples",
    "5",
    "--batch",
    "2",
    "--prompt-tokens",
    "24",
    "--new-tokens",
    "5",
    "--temperatures",
    "0",
    "1",
    "--dtype",
    "float32",
    "--draft",
    "none",
  ]
  from longspec_jax.models.config import DraftConfig, DraftKind, TargetConfig
  from longspec_jax.models.draft import random_draft
  from longspec_jax.weights.drafts import save_draft

  config = TargetConfig.from_hf(json.loads((tiny_with_tokenizer / "config.json").read_text()))
  save_draft(tmp_path / "glide", random_draft(DraftConfig.for_target(config, kind=DraftKind.GLIDE), jnp.float32))
  runs = {}
  for method, flags in (
    ("ar", []),
    ("glide", ["--draft", str(tmp_path / "glide")]),
  ):
    out = tmp_path / f"{method}.jsonl"
    assert run_cli(main, common + ["--method", method, "--out", str(out)] + flags, PROG) == 0, capsys.readouterr().err
    runs[method] = [json.loads(line) for line in out.read_text().splitlines()]
  records = runs["ar"]
  assert len(records) == 5 and [r["temperature"] for r in records] == [0.0, 0.0, 1.0, 1.0, 0.0]
  assert {r["kind"] for r in records} <= {"continuation", "answer"} and all(0 < r["new_tokens"] <= 5 for r in records)
  for r in records:
    assert ("messages" in r) == (r["kind"] == "answer") and r["domain"] in ("python", "markdown")
  resumed = tmp_path / "resumed.jsonl"  # 2 records (one batch) written, then the rest
  resumed.write_text("".join(json.dumps(r) + "\n" for r in records[:2]))
  assert run_cli(main, common + ["--method", "ar", "--out", str(resumed), "--resume"], PROG) == 0
  assert [json.loads(line) for line in resumed.read_text().splitlines()] == records
  greedy = [i for i, r in enumerate(records) if r["temperature"] == 0.0]
  assert [runs["glide"][i] for i in greedy] == [records[i] for i in greedy]  # lossless: the target's own text
  loaded = load_records(str(tmp_path / "ar.jsonl"))
  if any(r["kind"] == "answer" for r in records):
    assert has_chat_records(loaded)
  rows = record_tokens(_tokenizer(tiny_with_tokenizer), loaded[:5])
  assert len(rows) == 5 and all(any(mask) for _, mask in rows)


def _tokenizer(path):
  from longspec_jax.weights import load_tokenizer

  return load_tokenizer(path)


def test_bad_input_is_one_line(tmp_path, capsys):
  corpus = tmp_path / "c.jsonl"
  corpus.write_text(json.dumps({"text": "x"}) + "\n")
  out = tmp_path / "o.jsonl"
  out.write_text("")
  assert run_cli(main, ["--data", str(corpus), "--out", str(out)], PROG) == 2
  assert "exists" in capsys.readouterr().err
  assert run_cli(main, ["--data", str(corpus), "--out", str(tmp_path / "n.jsonl"), "--chat-share", "2"], PROG) == 2
  assert capsys.readouterr().err.count("\n") == 1
