"""The benchmark prompt sets, from this machine's own text, with the real tokenizer."""

import re

import pytest

from infer import prompts
from infer.prompts import HELD_OUT, PROMPT_SETS
from longspec_jax.weights import load_tokenizer
from train.corpus import EXCLUDED


@pytest.fixture(scope="module")
def tokenizer(smollm2_gguf):
  return load_tokenizer(smollm2_gguf)


@pytest.mark.parametrize("name", sorted(PROMPT_SETS))
def test_each_set_gives_distinct_prompts_of_the_length(tokenizer, name):
  prompts = PROMPT_SETS[name](tokenizer, 512, 3)
  assert len(prompts) == 3 and len({tuple(p) for p in prompts}) == 3  # no document twice
  completion = name.endswith("-code") or name == "code"
  for prompt in prompts:
    assert len(prompt) == 512 if completion else abs(len(prompt) - 512) <= 16
  text = tokenizer.decode(prompts[0])
  if name == "c-code":
    assert "#define" in text or "#include" in text
  if name == "cpp-code":
    assert "C++" in text
  if name.startswith("perl-"):
    assert re.search(r"^\s*(package|use|sub) ", text, re.MULTILINE)
  if not completion:
    assert "<|im_start|>assistant" in text  # through the chat template


def test_questions_name_a_heading_of_the_document_held(tokenizer):
  for prompt in PROMPT_SETS["pod-qa"](tokenizer, 1024, 2):
    text = tokenizer.decode(prompt)
    document, question = text.split("\n\nQuestion: ")
    heading = re.search(r'heading "(.+)"', question).group(1)
    assert re.search(rf"^=head\d\s+{re.escape(heading)}\s*$", document, re.MULTILINE)


def test_held_out_sets_are_text_the_corpus_never_takes(tokenizer):
  """Six held-out kinds of text, each from files that `train.corpus` excludes."""
  assert len(HELD_OUT) == 6 and set(HELD_OUT) < set(PROMPT_SETS)
  for globs in (prompts.POD_GLOBS, prompts.PERL_GLOBS, prompts.CPP_GLOBS):
    files = prompts._paths(globs)
    assert files and all(EXCLUDED.search(str(f)) for f in files)


def test_held_out_on_the_command_line_is_every_held_out_set():
  assert prompts.set_names(["code", "held-out", "pod-qa"]) == ["code", *HELD_OUT]


def test_the_sets_of_repeated_answers_ask_about_one_document(tokenizer):
  questions = [tokenizer.decode(p) for p in PROMPT_SETS["doc-questions"](tokenizer, 1024, 3)]
  assert len({q.split("\n\nQuestion: ")[0] for q in questions}) == 1  # (one document, three headings)
  edits = [tokenizer.decode(p) for p in PROMPT_SETS["code-edits"](tokenizer, 1024, 3)]
  assert len({e.split("alone.\n\n", 1)[1] for e in edits}) == 1 and len(set(edits)) == 3  # (one source, three names)
  for edit in edits:
    old = re.search(r"with `(\w+)` renamed to `\1_v2`", edit).group(1)
    assert re.search(rf"^(def|class) {old}\b", edit, re.MULTILINE)
