import json

import numpy as np
import pytest

from longspec_jax.errors import UserError
from train import rank_vocab

from helpers import run_cli


def test_ranking_orders_by_count_then_id():
  assert rank_vocab.ranking([3, 0, 3, 1, 0]).tolist() == [0, 2, 3, 1, 4]


def test_ranks_the_training_text_and_stores_it_with_the_draft(tmp_path, capsys):
  """On SmolLM2's tokenizer and a few files: the ranking orders every id, its first
  tokens are the text's most frequent, and the draft now scores `--size` of them."""
  import jax.numpy as jnp

  from longspec_jax.models.config import DraftConfig
  from longspec_jax.models.draft import random_draft
  from longspec_jax.weights import load_tokenizer, read_target_config, resolve_target
  from longspec_jax.weights.drafts import CONFIG_NAME, RANKING_NAME, save_draft

  path = resolve_target("smollm2-135m")
  config = read_target_config(path)
  save_draft(tmp_path / "draft", random_draft(DraftConfig.for_target(config), jnp.float32))
  text = "the cat sat on the mat and the dog sat on the cat\n" * 40
  for i in range(3):
    (tmp_path / f"doc{i}.txt").write_text(text)
  argv = ["--draft", str(tmp_path / "draft"), "--data", str(tmp_path / "doc*.txt"), "--size", "100"]
  assert run_cli(rank_vocab.main, argv, "python -m train.rank_vocab") == 0
  assert "the 100 the draft scores cover 100.00%" in capsys.readouterr().out
  ranking = np.load(tmp_path / "draft" / RANKING_NAME)
  assert sorted(ranking.tolist()) == list(range(config.vocab_size))
  the = load_tokenizer(path)(" the", add_special_tokens=False).input_ids
  assert ranking[0] == the[0]  # " the": 4 of the line's 13 tokens
  assert json.loads((tmp_path / "draft" / CONFIG_NAME).read_text())["vocab_subset"] == 100


def test_refuses_a_random_draft_and_a_size_past_the_vocabulary(tmp_path):
  (tmp_path / "a.txt").write_text("text")
  with pytest.raises(UserError, match="a random draft has no training text"):
    rank_vocab.main(["--draft", "random", "--data", str(tmp_path / "a.txt")])
