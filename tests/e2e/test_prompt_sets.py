"""Prompt sets from local text: too few documents is one sentence."""

import pytest

from infer.prompts import PROMPT_SETS
from longspec_jax.weights import load_tokenizer


@pytest.fixture(scope="module")
def tokenizer(smollm2_gguf):
  return load_tokenizer(smollm2_gguf)


def test_too_few_documents_is_one_sentence(tokenizer):
  with pytest.raises(RuntimeError, match="not enough local C headers for 100000 prompts of 4096 tokens"):
    PROMPT_SETS["c-code"](tokenizer, 4096, 100000)
