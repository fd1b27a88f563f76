"""Prompt sets from local text: too few documents is one sentence."""

import pytest

from infer import prompts
from infer.prompts import PROMPT_SETS
from longspec_jax.weights import load_tokenizer


@pytest.fixture(scope="module")
def tokenizer(smollm2_gguf):
  return load_tokenizer(smollm2_gguf)


@pytest.mark.parametrize("name, what", [("c-code", "C headers"), ("pod-qa", "Perl documentation")])
def test_too_few_documents_is_one_sentence(tokenizer, monkeypatch, name, what):
  """Three short documents (the machine's own would take a minute to tokenize to the end)."""
  monkeypatch.setattr(prompts, "_files", lambda patterns: ["=head1 NAME\n\nA short document.\n" * 20] * 3)
  with pytest.raises(RuntimeError, match=f"not enough local {what} for 5 prompts of 4096 tokens"):
    PROMPT_SETS[name](tokenizer, 4096, 5)
