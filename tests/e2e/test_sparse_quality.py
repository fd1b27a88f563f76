"""`python -m lab.sparse_quality`: the teacher-forced run against one whole-document
pass, p = 1 against dense, and the CLI end to end on a tiny target with the real
tokenizer."""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from lab.sparse_quality import main, teacher_forced
from longspec_jax.methods.longspec import LongSpecDraft
from longspec_jax.models.config import DraftConfig, SparseVerify
from longspec_jax.models.draft import random_draft
from longspec_jax.ops.attention import causal_block_mask
from longspec_jax.weights.hf import load_hf_dir

from helpers import run_cli, save_tiny_hf_model

PROG = "python -m lab.sparse_quality"


def test_teacher_forcing_matches_one_pass_and_every_chunk_kept_is_dense(tmp_path):
  """float32: the dense run's log-likelihoods are those of one causal pass over the whole
  documents; keeping every chunk's mass (p = 1) of the draft's attention, or of each
  layer's own (the oracle), reads all of the K/V and gives them too."""
  model, config = load_hf_dir(save_tiny_hf_model("qwen2", tmp_path / "m"), jnp.float32)
  documents = np.random.default_rng(4).integers(3, 211, size=(2, 90)).astype(np.int32)
  draft = random_draft(DraftConfig.for_target(config, window=16), jnp.float32, seed=1)
  graphdef, params = nnx.split(draft)
  proposer = LongSpecDraft(graphdef, widths=(1, 1, 1))
  dense = teacher_forced(model, proposer, params, documents, 30, 4)
  positions = jnp.broadcast_to(jnp.arange(90), (2, 90))
  hidden, _ = model(jnp.asarray(documents), positions, causal_block_mask(positions, jnp.ones((2, 90), bool)))
  log_probs = jax.nn.log_softmax(model.logits(hidden), axis=-1)
  start, forced = 60, dense["nll"].shape[1]
  assert forced == 28  # whole blocks of 4 with a next token after each
  expected = -np.take_along_axis(
    np.asarray(log_probs[:, start : start + forced]), documents[:, start + 1 : start + 1 + forced, None], axis=-1
  )[..., 0]
  np.testing.assert_allclose(dense["nll"], expected, rtol=1e-4, atol=1e-4)
  assert dense["kv_fraction_read"] == 1.0
  whole = teacher_forced(
    model, dataclasses.replace(proposer, sparse=SparseVerify(1.0, chunk=16, dense_layers=1)), params, documents, 30, 4
  )
  np.testing.assert_allclose(whole["nll"], dense["nll"], rtol=1e-4, atol=1e-4)
  assert whole["kv_fraction_read"] == 1.0
  whole_oracle = teacher_forced(
    model, dataclasses.replace(proposer, sparse=SparseVerify(1.0, chunk=16)), params, documents, 30, 4, oracle=True
  )  # (each layer's own attention, all of it)
  np.testing.assert_allclose(whole_oracle["nll"], dense["nll"], rtol=1e-4, atol=1e-4)
  assert whole_oracle["layer_similarity"].shape == (1, config.num_layers)


@pytest.mark.slow  # (the lab tool's whole run)
def test_quality_rows_and_plot(tiny_with_tokenizer, tmp_path, capsys):
  out = tmp_path / "quality.json"
  assert (
    run_cli(
      main,
      [
        "--target",
        str(tiny_with_tokenizer),
        "--draft",
        "random",
        "--sets",
        "code",
        "--length",
        "80",
        "--eval-tokens",
        "25",
        "--num-docs",
        "2",
        "--block",
        "4",
        "--p",
        "0.5",
        "--chunks",
        "16",
        "--oracle",
        "--dtype",
        "float32",
        "--out",
        str(out),
      ],
      PROG,
    )
    == 0
  ), capsys.readouterr().err
  rows = json.loads(out.read_text())["rows"]
  assert [(r["guide"], r["chunk"], r["p"]) for r in rows] == [
    (None, None, None),
    ("draft", 16, 0.5),
    ("oracle", 16, 0.5),
  ]
  assert rows[0]["relative_increase"] == 0 and rows[0]["top1_differs"] == 0 and rows[0]["kv_fraction_read"] == 1
  assert rows[1]["kv_fraction_read"] < 1 and rows[1]["tokens"] == 2 * 24
  assert rows[2]["kv_fraction_read"] < 1 and "layer_similarity" not in rows[1]
  similarity = np.asarray(rows[2]["layer_similarity"])  # -KL: at most 0
  assert similarity.shape[0] == 1 and np.all(similarity <= 1e-9) and rows[2]["layer_map"] == [0] * similarity.shape[1]
  assert out.with_suffix(".png").stat().st_size > 0
  assert run_cli(main, ["--block", "1"], PROG) == 2
  assert "--block must be at least 2" in capsys.readouterr().err
