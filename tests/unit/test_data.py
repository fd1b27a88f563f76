"""Training data from local files: packing, chat loss masks, deterministic host-split order."""

import json

import numpy as np
import pytest

from longspec_jax.errors import UserError
from train.data import batches, chat_tokens, load_records, pack


@pytest.fixture(scope="module")
def tokenizer(smollm2_gguf):
  from longspec_jax.weights import load_tokenizer

  return load_tokenizer(smollm2_gguf)


def test_code_files_pack_into_rows(tokenizer, tmp_path):
  import sysconfig

  stdlib = sysconfig.get_paths()["stdlib"]
  records = load_records(f"{stdlib}/json/*.py")
  assert len(records) >= 4 and all(len(r["text"]) > 0 for r in records)
  packed = pack(records, tokenizer, 256, eos_id=2)
  assert packed.tokens.shape[1] == 256 and packed.loss_mask.all()
  first = tokenizer(records[0]["text"], add_special_tokens=False).input_ids
  assert packed.tokens.reshape(-1)[: len(first)].tolist() == first  # documents in order, whole
  assert packed.tokens.reshape(-1)[len(first)] == 2  # then EOS


def test_chat_records_mask_only_the_assistant(tokenizer, tmp_path):
  path = tmp_path / "sft.jsonl"
  rows = [
    {"prompt": "What is a list?", "response": "An ordered, mutable sequence."},
    {
      "messages": [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "Bye"},
        {"role": "assistant", "content": "Goodbye."},
      ]
    },
  ]
  path.write_text("\n".join(json.dumps(r) for r in rows))
  records = load_records(str(path))
  tokens, targets = chat_tokens(tokenizer, records[1]["messages"])
  said = tokenizer.decode([t for t, m in zip(tokens, targets) if m])
  assert "Hello!" in said and "Goodbye." in said and "Hi" not in said and "Bye" not in said.replace("Goodbye", "")
  packed = pack(records, tokenizer, 16, eos_id=2)
  assert 0 < packed.loss_mask.mean() < 1


def test_order_is_deterministic_and_split_across_hosts():
  from train.data import Packed

  data = Packed(tokens=np.arange(40 * 3).reshape(40, 3).astype(np.int32), loss_mask=np.ones((40, 3), bool))
  take = lambda it, n: [next(it)[0] for _ in range(n)]
  a = take(batches(data, 4, seed=1), 12)  # crosses into the second epoch
  resumed = take(batches(data, 4, seed=1, start=7), 5)
  assert all((x == y).all() for x, y in zip(a[7:], resumed))
  epoch = np.concatenate(a[:10])[:, 0] // 3
  assert sorted(epoch.tolist()) == list(range(40))  # one epoch: every row once
  assert not (np.concatenate(a[10:12]) == np.concatenate(a[:2])).all()  # reshuffled per epoch
  hosts = [take(batches(data, 2, seed=1, host=h, hosts=2), 12) for h in (0, 1)]
  # each global batch of two hosts is one host's batch of 4, host 0 its first rows
  assert all((np.concatenate([h0, h1]) == x).all() for h0, h1, x in zip(*hosts, a))


def test_bad_sources():
  with pytest.raises(UserError, match="no training files match"):
    load_records("/no/such/dir/*.py")


def test_sources_combine_and_a_token_cap_samples_them(tokenizer):
  import sysconfig

  stdlib = sysconfig.get_paths()["stdlib"]
  json_files, email_files = load_records(f"{stdlib}/json/*.py"), load_records(f"{stdlib}/email/*.py")
  both = load_records([f"{stdlib}/json/*.py", f"{stdlib}/email/*.py"])
  assert len(both) == len(json_files) + len(email_files)
  capped = pack(both, tokenizer, 64, eos_id=2, max_tokens=3000, seed=1)
  assert capped.tokens.shape == (3000 // 64, 64)
  np.testing.assert_array_equal(capped.tokens, pack(both, tokenizer, 64, eos_id=2, max_tokens=3000, seed=1).tokens)
  assert not np.array_equal(capped.tokens, pack(both, tokenizer, 64, eos_id=2, max_tokens=3000, seed=2).tokens)
