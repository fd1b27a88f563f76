"""GGUF tokenizers built without torch, against transformers' own GGUF conversion."""

from __future__ import annotations

import gguf
import numpy as np
import pytest

from longspec_jax.weights.gguf_file import open_gguf
from longspec_jax.weights.tokenizer import gguf_metadata, spm_merges, tokenizer_from_gguf_metadata

from helpers import real_texts


@pytest.fixture(scope="module")
def smollm2_pair(smollm2_gguf):
  from transformers import AutoTokenizer

  ours = tokenizer_from_gguf_metadata(gguf_metadata(open_gguf(smollm2_gguf), smollm2_gguf))
  theirs = AutoTokenizer.from_pretrained(str(smollm2_gguf.parent), gguf_file=smollm2_gguf.name)
  return ours, theirs


def test_smollm2_matches_transformers_on_real_text(smollm2_pair):
  """Same ids and decoded text as transformers on real documents. (transformers knows no
  `smollm` pre-tokenizer and falls back to GPT-2's split; the two differ only where
  whitespace precedes a digit, which llama.cpp's `smollm` splits first, as the model's own
  tokenizer does: see the next test. So the real texts lose the whitespace before digits.)"""
  import re

  ours, theirs = smollm2_pair
  texts = [re.sub(r"\s+(?=\d)", "", t)[:20000] for t in real_texts(limit=24)]
  texts += ["héllo wörld — 你好 🤖 <|im_start|>user\nhi<|im_end|>\n", " leading space", "<repo_name>x", "\t\ttabs"]
  for text in texts:
    ids = ours(text).input_ids
    assert ids == theirs(text).input_ids
    assert ours.decode(ids, skip_special_tokens=True) == theirs.decode(ids, skip_special_tokens=True)
    assert ours.decode(ids) == text


def test_smollm2_splits_digits_first(smollm2_pair):
  ours, _ = smollm2_pair
  assert ours.tokenize("x =    12") == ["x", "Ġ=", "ĠĠĠĠ", "1", "2"]  # four spaces stay one token
  assert ours.decode(ours("a  1\n  3.14").input_ids) == "a  1\n  3.14"


def test_smollm2_chat_template_and_special_tokens(smollm2_pair):
  ours, theirs = smollm2_pair
  messages = [{"role": "user", "content": "Summarize the GNU GPL in one line."}]
  for prompt in (True, False):
    assert ours.apply_chat_template(
      messages, tokenize=False, add_generation_prompt=prompt
    ) == theirs.apply_chat_template(messages, tokenize=False, add_generation_prompt=prompt)
  assert (ours.bos_token, ours.eos_token, ours.unk_token, ours.pad_token) == (
    theirs.bos_token,
    theirs.eos_token,
    theirs.unk_token,
    theirs.pad_token,
  )
  assert len(ours) == len(theirs) == 49152
  assert ours("<|im_start|>user").input_ids[0] == 1  # a control token is matched whole
  assert ours.decode(ours("<|im_start|>hi").input_ids, skip_special_tokens=True) == "hi"


SPM_PIECES = [
  "▁",
  "h",
  "e",
  "l",
  "o",
  "w",
  "r",
  "d",
  "he",
  "ll",
  "▁h",
  "▁he",
  "llo",
  "▁hello",
  "▁w",
  "or",
  "▁wor",
  "ld",
  "▁world",
  "▁the",
  "t",
  "▁t",
  "th",
]


def write_spm_gguf(path, with_merges: bool = False):
  """A tiny llama-architecture GGUF with a SentencePiece vocabulary: <unk>, <s>, </s>, the
  256 byte pieces, then word pieces with scores."""
  tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + SPM_PIECES
  types = [2, 3, 3] + [6] * 256 + [1] * len(SPM_PIECES)
  scores = [0.0, 0.0, 0.0] + [0.0] * 256 + [-float(i) for i in range(len(SPM_PIECES))]
  w = gguf.GGUFWriter(str(path), "llama")
  w.add_block_count(1)
  w.add_context_length(64)
  w.add_embedding_length(8)
  w.add_feed_forward_length(16)
  w.add_head_count(2)
  w.add_layer_norm_rms_eps(1e-5)
  w.add_tokenizer_model("llama")
  w.add_token_list(tokens)
  w.add_token_types(types)
  w.add_token_scores(scores)
  if with_merges:
    w.add_token_merges([" ".join(m) for m in spm_merges(tokens, scores)])
  w.add_bos_token_id(1)
  w.add_eos_token_id(2)
  w.add_unk_token_id(0)
  w.add_chat_template("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}{% endfor %}")
  w.add_tensor("token_embd.weight", np.zeros((len(tokens), 8), np.float32))
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()
  return path


@pytest.mark.parametrize("with_merges", [False, True])
def test_sentencepiece_gguf_matches_transformers(tmp_path, with_merges):
  from transformers import AutoTokenizer

  path = write_spm_gguf(tmp_path / "spm.gguf", with_merges)
  ours = tokenizer_from_gguf_metadata(gguf_metadata(gguf.GGUFReader(str(path)), path))
  theirs = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
  for text in ["hello world", "the world", "héllo wörld", " hello", "hello\nworld  the", "xyz 123", "hello"]:
    ids = ours(text).input_ids
    assert ids == theirs(text).input_ids, text
    assert ids[0] == 1  # BOS, as llama.cpp adds to SentencePiece vocabularies
    decoded = ours.decode(ids, skip_special_tokens=True)
    assert decoded == theirs.decode(ids, skip_special_tokens=True)
    assert decoded == text.removeprefix(" ")  # (SentencePiece's prefix space is stripped)
  messages = [{"role": "user", "content": "hi"}]
  assert ours.apply_chat_template(messages, tokenize=False) == "[user] hi"


def test_unsupported_tokenizer_kind(tmp_path):
  from longspec_jax.errors import UserError

  path = tmp_path / "bert.gguf"
  w = gguf.GGUFWriter(str(path), "llama")
  w.add_tokenizer_model("bert")
  w.add_token_list(["[UNK]"])
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()
  with pytest.raises(UserError, match="tokenizer kind 'bert' is not supported"):
    gguf_metadata(gguf.GGUFReader(str(path)), path)
