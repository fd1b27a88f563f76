"""`python -m infer.generate`: output contract and one-line errors with exit code 2."""

import json
import os
import signal
import subprocess
import sys

import jax.numpy as jnp
import pytest

from infer.generate import main
from longspec_jax.methods.past import MAX_SIZE, MIN_SIZE

from helpers import run_cli

PROG = "python -m infer.generate"


def run(argv, capsys):
  """Runs the CLI in-process; returns (exit code, stdout, stderr)."""
  code = run_cli(main, argv, PROG)
  out = capsys.readouterr()
  return code, out.out, out.err


def test_json_contract(tiny_with_tokenizer, capsys):
  code, out, err = run(
    ["--target", str(tiny_with_tokenizer), "--prompt", "def main():", "--max-new-tokens", "7", "--json"], capsys
  )
  assert code == 0, err
  record = json.loads(out.strip().splitlines()[-1])
  for field in (
    "method",
    "text",
    "token_ids",
    "num_new_tokens",
    "mean_accepted_length",
    "steps",
    "rounds_by_length",
    "acceptance_by_depth",
    "prefill_seconds",
    "decode_seconds",
    "tokens_per_second",
    "end_to_end_tokens_per_second",
    "time_to_first_token_seconds",
  ):
    assert field in record
  whole = record["prefill_seconds"] + record["decode_seconds"]
  assert record["end_to_end_tokens_per_second"] == pytest.approx(record["num_new_tokens"] / whole)
  assert record["prefill_seconds"] <= record["time_to_first_token_seconds"] < whole + record["compile_seconds"]
  assert sum(record["rounds_by_length"]) == record["steps"] and len(record["acceptance_by_depth"]) == 10  # (chain)
  # auto, with no draft shipped for this target: AR and prompt lookup rounds, chosen on device
  assert record["method"] == "auto" and record["num_new_tokens"] == len(record["token_ids"]) <= 7
  assert record["draft"] is None and record["copy_tokens"] == 10 and set(record["rounds_by_kind"]) <= {"ar", "copy"}
  assert out.startswith(record["text"])  # the same text was streamed first
  assert "tokens/s" in err


def test_chat_and_prompt_file(tiny_with_tokenizer, tmp_path, capsys):
  prompt = tmp_path / "prompt.txt"
  prompt.write_text("Summarize: the sky is blue.")
  code, out, err = run(
    ["--target", str(tiny_with_tokenizer), "--prompt-file", str(prompt), "--chat", "--max-new-tokens", "3", "--json"],
    capsys,
  )
  assert code == 0, err
  assert json.loads(out.strip().splitlines()[-1])["prompt_tokens"] > 10  # the template was applied


@pytest.mark.parametrize(
  "argv, message",
  [
    (["--prompt", "   "], "the prompt is empty"),
    (["--prompt", ""], "the prompt is empty"),
    (["--prompt", "x", "--max-new-tokens", "0"], "--max-new-tokens: expected an integer >= 1, got '0'"),
    (["--prompt", "x", "--temperature", "-1"], "--temperature: expected a finite number >= 0"),
    (["--prompt", "x", "--temperature", "inf"], "--temperature: expected a finite number >= 0"),
    (["--prompt", "x", "--temperature", "nan"], "--temperature: expected a finite number >= 0"),
    (["--prompt", "x", "--top-k", "-1"], "--top-k: expected an integer >= 0"),
    (["--prompt", "x", "--min-p", "1"], "--min-p: expected a number in [0, 1)"),
    (["--prompt", "x", "--penalty-window", "0"], "--penalty-window: expected an integer >= 1"),
    (["--prompt", "x", "--dtype", "float16"], "invalid choice"),
    (["--prompt", "x", "--method", "magic"], "invalid choice"),
    (["--prompt-file", "/no/such/prompt.txt"], "does not exist"),
    (["--prompt-file", "/"], "is not readable text"),
    ([], "one of the arguments --prompt --prompt-file --input is required"),
    (["--input", "in.jsonl"], "--input needs --output"),
    (["--prompt", "x", "--output", "out.jsonl"], "--output goes with --input"),
    (["--prompt", "x", "--batch", "2"], "--batch goes with --input"),
    (["--input", "in.jsonl", "--output", "out.jsonl", "--json"], "--json prints one prompt's results"),
    (["--input", "/no/such/in.jsonl", "--output", "out.jsonl"], "the input /no/such/in.jsonl does not exist"),
    (["--prompt", "x", "--target", "/no/such/model.gguf"], "does not exist"),
    (["--prompt", "x", "--target", "/no/such/dir"], "does not exist"),
    (["--prompt", "x", "--target", "/etc/hostname"], "neither a Hugging Face model directory nor a .gguf file"),
    (["--prompt", "x", "--target", "/"], "has no config.json"),
    (["--prompt", "x", "--method", "ar", "--draft", "/some/draft"], "--method ar uses no draft tree, but --draft"),
    (["--prompt", "x", "--method", "pld", "--draft", "default"], "--method pld uses no draft tree, but --draft"),
    (["--prompt", "x", "--method", "ar", "--tree-widths", "2,2"], "--method ar uses no draft tree, but --tree-w"),
    (["--prompt", "x", "--method", "ar", "--copy-matches", "4"], "--method ar uses no draft tree, but --copy-m"),
    (["--prompt", "x", "--copy-tokens", "-1"], "an integer >= 0"),
    (["--prompt", "x", "--method", "longspec", "--draft", "none"], "--method longspec needs a draft"),
    (["--prompt", "x", "--method", "ar", "--sparse-verify", "0.9"], "a draft's cross-attention: --method longspec or"),
    (
      ["--prompt", "x", "--tree-widths", "0,4"],
      "tree widths must be one or more positive integers, got [0, 4] (see --help).",
    ),
    (["--prompt", "x", "--tree-widths", "a"], "expected comma-separated integers"),
    (["--prompt", "x", "--cape-bins", "0.5:2"], "the last CAPE bin must end at confidence 1"),
    (["--prompt", "x", "--cape-bins", "half:2,1:1"], "expected confidence:leaves pairs"),
    (["--prompt", "x", "--cape-bins", "0.6:2,0.3:1,1:1"], "confidence edges must rise strictly"),
    (["--prompt", "x", "--cape-gamma", "0"], "--cape-gamma: expected an integer >= 1"),
    (
      ["--prompt", "x", "--method", "pld", "--temperature", "0.7", "--top-p", "0"],
      "--top-p: expected a number in (0, 1]",
    ),
    (["--prompt", "x", "--penalty", "0.5"], "--penalty: expected a finite number >= 1"),
    (["--prompt", "x", "--sparse-verify", "1.5"], "--sparse-verify: expected a fraction 0 < P <= 1"),
    (["--prompt", "x", "--sparse-verify", "0.9", "--batch-invariant"], "which --sparse-verify gives up"),
    (["--prompt", "x", "--devices", "0"], "--devices: expected an integer >= 1"),
    (["--prompt", "x", "--devices", "2", "--batch-invariant"], "--batch-invariant runs on one device"),
    # (this test process has one CPU device: JAX has started, so none can be added)
    (["--prompt", "x", "--devices", "2"], "--devices 2 asks for more devices than this machine's 1 CPU device."),
  ],
)
def test_errors_are_one_line_with_exit_2(argv, message, capsys):
  code, _, err = run(argv, capsys)
  assert code == 2
  last = err.strip().splitlines()[-1]  # earlier lines, if any, are progress
  assert last.startswith(f"{PROG}: error: ") and message in last
  assert "Traceback" not in err


def test_speculative_sampling_with_processors(tiny_with_tokenizer, capsys):
  common = [
    "--target",
    str(tiny_with_tokenizer),
    "--prompt",
    "def f(x): return x\n" * 4,
    "--max-new-tokens",
    "6",
    "--temperature",
    "0.8",
    "--top-k",
    "40",
    "--top-p",
    "0.9",
    "--min-p",
    "0.01",
    "--penalty",
    "1.2",
    "--penalty-window",
    "16",
    "--seed",
    "3",
    "--json",
  ]
  drafted = ["--method", "longspec", "--draft", "random", "--tree-widths", "2,2"]  # (a small tree: CPU time)
  for flags in (["--method", "pld"], drafted):
    code, out, err = run(common + flags, capsys)
    assert code == 0, err
    assert len(json.loads(out.strip().splitlines()[-1])["token_ids"]) == 6
  code, out, err = run(common + drafted + ["--sparse-verify", "0.5"], capsys)
  record = json.loads(out.strip().splitlines()[-1])  # (lossy: any 6 tokens)
  assert code == 0 and len(record["token_ids"]) == 6 and record["sparse_verify"]["p"] == 0.5, err
  assert 0 < record["kv_fraction_read"] <= 1 and "K/V read" in err


@pytest.mark.parametrize(
  "argv, message",
  [
    (["--prompt", "hello " * 300, "--max-new-tokens", "400"], "exceeds the model's context of 512 tokens"),
    (["--prompt", "x", "--draft", "random", "--tree-widths", "100000"], "100001 nodes, over the limit of 1024"),
    (["--prompt", "x", "--draft", "random", "--tree-widths", "49152"], "49153 nodes, over the limit of 1024"),
    (["--prompt", "x", "--draft", "random", "--tree-widths", "2000,2000"], "4001 nodes, over the limit of 1024"),
    (
      ["--prompt", "x", "--method", "longspec", "--draft", "random", "--tree-widths", "1000,20", "--copy-tokens", "10"],
      "tree widths 1000,20 and 10 copied tokens make 1031 nodes, over the limit of 1024",
    ),
    (["--prompt", "x", "--draft", "/no/such/draft"], "the draft '/no/such/draft' does not exist"),
    (
      ["--prompt", "x", "--draft", "random", "--tree-widths", "cape", "--cape-gamma", "200"],
      "CAPE's tree of 200 tokens with up to 7 leaves each makes 1601 nodes, over the limit of 1024",
    ),
    (["--prompt", "x", "--tree-widths", "2,2"], "--tree-widths shapes a draft's tree, but no draft is used here"),
    (["--prompt", "x", "--method", "pld", "--draft-vocab", "64"], "--draft-vocab sets what a block draft scores"),
    (
      ["--prompt", "x", "--method", "longspec", "--draft", "random", "--draft-vocab", "60000"],
      "--draft-vocab 60000 exceeds the target's vocabulary of 49152 tokens",
    ),
  ],
)
def test_checked_before_the_model_loads(tiny_with_tokenizer, argv, message, capsys):
  """Errors that need the target's config (context, vocabulary) or a path come before the
  weights load: stderr has no loading line."""
  code, _, err = run(["--target", str(tiny_with_tokenizer)] + argv, capsys)
  assert code == 2 and message in err.strip().splitlines()[-1], err
  assert "loading target" not in err


def test_a_batch_file_writes_what_each_prompt_writes_alone_and_resumes(tiny_with_tokenizer, tmp_path, capsys):
  """Prompts of different lengths and token limits, one through the chat template, in two
  slots (a record joins as another finishes): each record's tokens are those of its prompt
  run alone. A rerun skips the records already written, and one whose line was cut off
  runs again."""
  records = [
    {"prompt": "def main():\n    return", "id": "a"},
    {"prompt": "The quick brown fox jumps over the lazy dog. " * 4, "max_new_tokens": 3},
    {"prompt": "Say hello.", "chat": True, "extra": {"kept": True}},
  ]
  source = tmp_path / "in.jsonl"
  source.write_text("".join(json.dumps(r) + "\n" for r in records))
  target = ["--target", str(tiny_with_tokenizer), "--max-new-tokens", "6"]
  out = tmp_path / "out.jsonl"
  code, _, err = run([*target, "--input", str(source), "--output", str(out), "--batch", "2"], capsys)
  assert code == 0, err
  lines = out.read_text().splitlines()
  written = {w["line"]: w for w in map(json.loads, lines)}  # (in the order they finished)
  assert sorted(written) == [1, 2, 3] and written[1]["id"] == "a" and written[3]["extra"] == {"kept": True}
  for line, record in enumerate(records, start=1):
    alone = ["--prompt", record["prompt"], "--json", "--max-new-tokens", str(record.get("max_new_tokens", 6))]
    code, stdout, err = run([*target, *alone, *(["--chat"] if record.get("chat") else [])], capsys)
    assert code == 0, err
    expected, result = json.loads(stdout.strip().splitlines()[-1]), written[line]
    assert result["token_ids"] == expected["token_ids"] and result["text"] == expected["text"]
    assert result["prompt_tokens"] == expected["prompt_tokens"] and result["method"] == "auto"
    assert result["num_new_tokens"] == len(result["token_ids"]) and result["seconds"] > 0
    assert result["mean_accepted_length"] == pytest.approx((result["num_new_tokens"] - 1) / result["steps"])
  assert len(written[2]["token_ids"]) == 3
  # A run cut off after two records, the write of the third cut short.
  out.write_text(lines[0] + "\n" + lines[1] + "\n" + lines[2][:15])
  code, _, err = run([*target, "--input", str(source), "--output", str(out), "--batch", "2"], capsys)
  assert code == 0 and "skipping 2 records of 3 already in" in err, err
  again = [json.loads(line) for line in out.read_text().splitlines()]
  assert again[:2] == [json.loads(lines[0]), json.loads(lines[1])]
  assert again[2]["line"] == json.loads(lines[2])["line"] and again[2]["token_ids"] == json.loads(lines[2])["token_ids"]
  code, _, err = run([*target, "--input", str(source), "--output", str(out)], capsys)
  assert code == 0 and "skipping 3 records of 3" in err and "loading target" not in err


def test_batch_file_records_sample_with_their_own_settings(tiny_with_tokenizer, tmp_path, capsys):
  """Records with their own temperature, top-p and seed (one greedy) share two slots: each
  writes what its prompt writes alone with those flags."""
  records = [
    {"prompt": "def main():", "temperature": 0.9, "seed": 3},
    {"prompt": "The quick brown fox", "temperature": 0.7, "top_p": 0.8, "seed": 4},
    {"prompt": "Once upon a time"},
  ]
  source, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
  source.write_text("".join(json.dumps(r) + "\n" for r in records))
  target = ["--target", str(tiny_with_tokenizer), "--max-new-tokens", "7"]
  code, _, err = run([*target, "--input", str(source), "--output", str(out), "--batch", "2"], capsys)
  assert code == 0, err
  written = {w["line"]: w for w in map(json.loads, out.read_text().splitlines())}
  for line, record in enumerate(records, start=1):
    flags = ["--temperature", str(record.get("temperature", 0.0)), "--top-p", str(record.get("top_p", 1.0))]
    alone = ["--prompt", record["prompt"], "--json", "--seed", str(record.get("seed", 0)), *flags]
    code, stdout, err = run([*target, *alone], capsys)
    assert code == 0, err
    assert written[line]["token_ids"] == json.loads(stdout.strip().splitlines()[-1])["token_ids"], line


@pytest.mark.parametrize("method", ["pld", "auto"])
def test_a_batch_file_draws_on_its_earlier_records_outputs(tiny_with_tokenizer, tmp_path, capsys, method):
  """With --past-tokens, a record that repeats an earlier one's answer is proposed that
  answer (prompt lookup over the earlier records' outputs): the same tokens, and for
  prompt lookup far fewer rounds than the first time."""
  prompts = ["def main():\n    return", "def main():\n    return", "The quick brown fox"]
  source = tmp_path / "in.jsonl"
  source.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
  written = {}
  for past in ("0", "523"):  # (a ring size of its own: the process's rings are kept by size)
    out = tmp_path / f"out_{past}.jsonl"
    flags = ["--method", method, "--max-new-tokens", "40", "--batch", "1", "--past-tokens", past]
    code, _, err = run(
      ["--target", str(tiny_with_tokenizer), *flags, "--input", str(source), "--output", str(out)], capsys
    )
    assert code == 0, err
    written[past] = sorted(map(json.loads, out.read_text().splitlines()), key=lambda w: w["line"])
  assert [w["token_ids"] for w in written["523"]] == [w["token_ids"] for w in written["0"]]
  if method == "pld":
    assert written["523"][1]["steps"] <= written["523"][0]["steps"] // 2


def test_a_corpus_file_is_searched_as_past_outputs(tiny_with_tokenizer, tmp_path, capsys, monkeypatch):
  """--corpus holding the answer a prompt gets: the same tokens, in far fewer rounds."""
  monkeypatch.setenv("LONGSPEC_CACHE", str(tmp_path / "cache"))
  target = ["--target", str(tiny_with_tokenizer), "--prompt", "def main():", "--max-new-tokens", "40", "--json"]
  code, out, err = run([*target, "--method", "pld"], capsys)
  assert code == 0, err
  alone = json.loads(out.strip().splitlines()[-1])
  corpus = tmp_path / "answers.txt"
  corpus.write_text("def main():" + alone["text"])
  code, out, err = run([*target, "--method", "pld", "--past-tokens", "541", "--corpus", str(corpus)], capsys)
  assert code == 0 and "corpus: " in err, err
  searched = json.loads(out.strip().splitlines()[-1])
  assert searched["token_ids"] == alone["token_ids"] and searched["steps"] <= alone["steps"] // 2


def test_past_outputs_are_searched_by_prompt_lookup_only(tiny_with_tokenizer, capsys):
  target = ["--target", str(tiny_with_tokenizer), "--prompt", "x", "--max-new-tokens", "2"]
  code, _, err = run([*target, "--method", "ar", "--past-tokens", "512"], capsys)
  assert code == 2 and "method pld or auto, not ar" in err
  code, _, err = run([*target, "--method", "pld", "--past-tokens", "5"], capsys)
  assert code == 2 and f"holds {MIN_SIZE} to {MAX_SIZE} tokens, got 5" in err
  code, _, err = run([*target, "--method", "pld", "--corpus", "nowhere.txt"], capsys)
  assert code == 2 and "give --past-tokens too" in err
  code, _, err = run([*target, "--method", "pld", "--past-tokens", "512", "--corpus", "nowhere.txt"], capsys)
  assert code == 2 and "the corpus file nowhere.txt does not exist." in err


def test_a_batch_file_through_the_real_entry_point(tiny_with_tokenizer, tmp_path):
  """`python -m infer.generate --input` in a process of its own, one slot: two records over
  one document, the second prefilling only its question."""
  document = "The quick brown fox jumps over the lazy dog. " * 8
  source = tmp_path / "in.jsonl"
  source.write_text("".join(json.dumps({"prompt": document + q, "id": q}) + "\n" for q in ("Who?", "Why?")))
  out = tmp_path / "out.jsonl"
  argv = ["--target", str(tiny_with_tokenizer), "--input", str(source), "--output", str(out), "--batch", "1"]
  proc = subprocess.run(
    [sys.executable, "-m", "infer.generate", *argv, "--max-new-tokens", "4"], capture_output=True, text=True
  )
  assert proc.returncode == 0, proc.stderr
  assert [json.loads(line)["id"] for line in out.read_text().splitlines()] == ["Who?", "Why?"]


def test_a_batch_files_record_too_long_is_named_before_the_model_loads(tiny_with_tokenizer, tmp_path, capsys):
  source = tmp_path / "in.jsonl"
  source.write_text(json.dumps({"prompt": "x"}) + "\n" + json.dumps({"prompt": "hello " * 300}) + "\n")
  argv = ["--target", str(tiny_with_tokenizer), "--input", str(source), "--output", str(tmp_path / "out.jsonl")]
  code, _, err = run([*argv, "--max-new-tokens", "400"], capsys)
  assert code == 2 and f"{source} line 2: the prompt" in err and "exceeds the model's context" in err, err
  assert "loading target" not in err


def test_corrupt_weights_through_the_real_entry_point(tmp_path):
  broken = tmp_path / "broken.gguf"
  broken.write_bytes(b"GGUF" + b"\0" * 64)
  proc = subprocess.run(
    [sys.executable, "-m", "infer.generate", "--prompt", "x", "--target", str(broken)], capture_output=True, text=True
  )
  assert proc.returncode == 2
  assert proc.stderr.strip().splitlines()[-1].startswith(f"{PROG}: error: {broken} is not a readable GGUF file")
  assert "Traceback" not in proc.stderr


def test_speculative_methods_match_ar(tiny_with_tokenizer, tmp_path, capsys):
  from longspec_jax.models.config import DraftConfig, TargetConfig
  from longspec_jax.models.draft import random_draft
  from longspec_jax.weights.drafts import save_draft

  config = TargetConfig.from_hf(json.loads((tiny_with_tokenizer / "config.json").read_text()))
  save_draft(tmp_path / "draft", random_draft(DraftConfig.for_target(config, window=16), jnp.float32, seed=1))
  common = [
    "--target",
    str(tiny_with_tokenizer),
    "--prompt",
    "a b c a b c a b c a b",
    "--max-new-tokens",
    "12",
    "--json",
  ]
  results = {}
  for name, flags in [
    ("ar", ["--method", "ar"]),
    ("pld-trie", ["--method", "pld", "--copy-tokens", "5", "--copy-matches", "3"]),
    ("copies", ["--method", "longspec", "--draft", "random", "--tree-widths", "2,2", "--copy-tokens", "4"]),
    (
      "cape",
      [
        "--method",
        "longspec",
        "--draft",
        "random",
        "--tree-widths",
        "cape",
        "--cape-gamma",
        "3",
        "--cape-bins",
        "0.5:2,1:1",
      ],
    ),
    ("glide", ["--method", "glide", "--draft", "random"]),  # (CAPE's tree: its default)
    ("ar-penalized", ["--method", "ar", "--penalty", "1.2"]),
    ("tokenswift-default", ["--method", "tokenswift", "--draft", "random"]),
    (
      "tokenswift-grams",
      ["--method", "tokenswift", "--draft", "random", "--tree-widths", "1,2,2,2", "--penalty", "1"]
      + ["--copy-tokens", "3", "--copy-matches", "2"],
    ),  # (AR's processors: its own default penalty is 1.2)
    ("auto", []),  # (no draft on a CPU unless one is named)
    ("checkpoint", ["--draft", str(tmp_path / "draft")]),
  ]:  # auto with this draft
    code, out, err = run(common + flags, capsys)
    assert code == 0, err
    results[name] = json.loads(out.strip().splitlines()[-1])
  for name in ("pld-trie", "copies", "cape", "glide", "tokenswift-grams", "auto", "checkpoint"):
    assert results[name]["token_ids"] == results["ar"]["token_ids"], name
  assert results["checkpoint"]["method"] == "auto" and results["checkpoint"]["draft"] == str(tmp_path / "draft")
  assert set(results["checkpoint"]["rounds_by_kind"]) <= {"ar", "copy", "draft"} and results["auto"]["draft"] is None
  assert results["copies"]["copy_tokens"] == 4 and results["cape"]["copy_tokens"] == 0
  assert (results["pld-trie"]["copy_tokens"], results["pld-trie"]["copy_matches"]) == (5, 3)
  assert results["cape"]["cape"] == {"gamma": 3, "edges": [0.5], "sizes": [2, 1]}
  assert "tree_widths" not in results["cape"]
  assert results["glide"]["method"] == "glide" and results["glide"]["cape"]["gamma"] == 5
  assert results["tokenswift-grams"]["tree_widths"] == [1, 2, 2, 2] and results["tokenswift-default"]["ngrams"] == 20
  assert (results["tokenswift-grams"]["ngram_tokens"], results["tokenswift-grams"]["ngrams"]) == (3, 2)
  # TokenSwift's own default penalty (its paper's theta), under which it writes what AR writes
  assert results["tokenswift-default"]["sampling"]["penalty"] == 1.2 == results["ar-penalized"]["sampling"]["penalty"]
  assert results["tokenswift-default"]["token_ids"] == results["ar-penalized"]["token_ids"]
  assert results["ar"]["sampling"]["penalty"] == 1.0


def test_draft_errors(tiny_with_tokenizer, tmp_path, capsys):
  from longspec_jax.models.config import DraftConfig, TargetConfig
  from longspec_jax.models.draft import random_draft
  from longspec_jax.weights.drafts import save_draft

  other = TargetConfig(
    vocab_size=100, hidden_size=64, intermediate_size=32, num_layers=2, num_heads=8, num_kv_heads=2, head_dim=8
  )
  save_draft(tmp_path / "other", random_draft(DraftConfig.for_target(other), jnp.float32))
  config = TargetConfig.from_hf(json.loads((tiny_with_tokenizer / "config.json").read_text()))
  save_draft(tmp_path / "longspec", random_draft(DraftConfig.for_target(config), jnp.float32))
  common = ["--target", str(tiny_with_tokenizer), "--prompt", "hello", "--max-new-tokens", "3"]
  for flags, message in [
    (["--method", "longspec"], "no default longspec draft is shipped for target"),
    (["--method", "glide"], "no default glide draft is shipped for target"),
    (["--method", "tokenswift"], "no default tokenswift draft is shipped for target"),
    (["--method", "tokenswift", "--draft", "random", "--copy-tokens", "1"], "grafts n-grams of at least 2 tokens"),
    (["--method", "tokenswift", "--draft", "random", "--copy-matches", "33"], "at most 32 of them a round"),
    (["--method", "tokenswift", "--draft", "random", "--tree-widths", "cape"], "CAPE's tree does not apply to it"),
    (
      ["--method", "tokenswift", "--draft", "random", "--tree-widths", "1,3"],
      "one width >= 1 per depth, 4 for gamma 3",
    ),
    (["--method", "glide", "--draft", str(tmp_path / "longspec")], "holds longspec's draft, where glide's is"),
    (["--method", "pld", "--sparse-verify", "0.9"], "a draft's cross-attention: --method longspec or glide"),
    (["--draft", str(tmp_path)], "is not a draft checkpoint"),
    (["--draft", str(tmp_path / "other")], "the draft does not match the target: its vocab_size is 100"),
  ]:
    code, _, err = run(common + flags, capsys)
    assert code == 2 and message in err.strip().splitlines()[-1], err


def test_main_job_runs_without_torch(smollm2_gguf, tmp_path):
  """The README's first command's path with torch unimportable and a fresh tokenizer cache:
  the GGUF tokenizer and chat template are built from the file's metadata."""
  script = (
    "import runpy, sys; sys.modules['torch'] = None; sys.argv[0] = 'infer.generate';"
    " runpy.run_module('infer.generate', run_name='__main__', alter_sys=True)"
  )
  env = {**os.environ, "LONGSPEC_SMOLLM2_GGUF": str(smollm2_gguf), "LONGSPEC_CACHE": str(tmp_path)}
  proc = subprocess.run(
    [sys.executable, "-c", script, "--chat", "--prompt", "Name a colour.", "--max-new-tokens", "5", "--json"],
    capture_output=True,
    text=True,
    env=env,
    timeout=600,
  )
  assert proc.returncode == 0, proc.stderr[-3000:]
  record = json.loads(proc.stdout.strip().splitlines()[-1])
  assert record["num_new_tokens"] == 5 and record["prompt_tokens"] > 20  # the chat template's system turn
  assert "Traceback" not in proc.stderr and "PyTorch" not in proc.stderr
  assert any((tmp_path / "tokenizers").iterdir())


def test_devices_split_the_models_and_decode_the_same_tokens(tiny_with_tokenizer, capsys):
  """`--devices 2` on a CPU: two host devices made for it, the target and draft split over
  them (tensor parallel), the tokens those of one device (float32; `auto`, the default:
  its AR and copy rounds; the draft methods under a mesh: test_sharding)."""
  argv = ["--target", str(tiny_with_tokenizer), "--prompt", "a b c a b c a b c a b", "--max-new-tokens", "8", "--json"]
  code, out, err = run(argv, capsys)
  assert code == 0, err
  one = json.loads(out.strip().splitlines()[-1])
  proc = subprocess.run(
    [sys.executable, "-m", "infer.generate", *argv, "--devices", "2"], capture_output=True, text=True, timeout=600
  )
  assert proc.returncode == 0, proc.stderr[-3000:]
  split = json.loads(proc.stdout.strip().splitlines()[-1])
  assert split["devices"] == 2 and one["devices"] == 1 and "over 2 devices" in proc.stderr
  assert split["token_ids"] == one["token_ids"]


# `python -m infer.generate` with Ctrl-C's default meaning: a test runner started with
# Ctrl-C ignored (e.g. a background job of a non-interactive shell) passes that on, and
# Python then leaves it ignored, as it should for a user who ignored it.
GENERATE_WITH_CTRL_C = (
  "import runpy, signal; signal.signal(signal.SIGINT, signal.default_int_handler);"
  " runpy.run_module('infer.generate', run_name='__main__', alter_sys=True)"
)


def test_ctrl_c_ends_the_run_at_once(tiny_with_tokenizer):
  proc = subprocess.Popen(
    [
      sys.executable,
      "-c",
      GENERATE_WITH_CTRL_C,
      "--target",
      str(tiny_with_tokenizer),
      "--prompt",
      "hello",
      "--method",
      "longspec",
      "--draft",
      "random",
      "--max-new-tokens",
      "500",
    ],
    stdout=subprocess.PIPE,
    stderr=subprocess.PIPE,
    text=True,
  )
  assert proc.stderr.readline().startswith("loading target")  # then it loads and compiles
  proc.send_signal(signal.SIGINT)
  _, err = proc.communicate(timeout=120)
  assert proc.returncode == 130 and err.strip().endswith("interrupted.") and "Traceback" not in err
