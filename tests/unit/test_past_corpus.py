"""`--corpus`'s files: tokenized once (then read from the cache), written into past outputs in order."""

import numpy as np

from infer import past_corpus
from longspec_jax.methods.past import SEPARATOR, Past


class Words:
  """A tokenizer of words (each word its length), counting the texts it tokenizes."""

  def __init__(self):
    self.calls = 0

  def get_vocab(self):
    return {"w": 0}

  def __call__(self, text, add_special_tokens=False):
    self.calls += 1
    return type("Encoding", (), {"input_ids": [len(word) for word in text.split()]})()


def test_files_are_tokenized_once_and_written_in_order(tmp_path):
  first, second = tmp_path / "a.txt", tmp_path / "b.txt"
  first.write_text("one three five")
  second.write_text("seventeen")
  tokenizer, cache = Words(), tmp_path / "cache"
  past = Past.empty(16)
  assert past_corpus.fill(past, [first, second], tokenizer, cache) == 4
  assert past.tokens[: past.written].tolist() == [3, 5, 4, SEPARATOR, 9, SEPARATOR]
  again = Past.empty(16)
  past_corpus.fill(again, [first, second], tokenizer, cache)
  assert tokenizer.calls == 2 and np.array_equal(again.tokens, past.tokens)  # (the second time: from the cache)
  first.write_text("one three")  # (new text: tokenized anew)
  assert past_corpus.tokenized(first, tokenizer, cache).tolist() == [3, 5] and tokenizer.calls == 3
