"""`python -m lab.bench_step`: the floor is what it says, and the CLI runs end to end."""

import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import lab.bench_step
from lab.bench_step import floor_loss, main, target_forward
from longspec_jax.models.config import TargetConfig
from longspec_jax.models.target import random_model
from train.step import TrainConfig

from helpers import run_cli

pytestmark = pytest.mark.training  # (train steps: `MARKED_OPTIONS` in conftest.py)

TARGET = TargetConfig(
  vocab_size=97,
  hidden_size=32,
  intermediate_size=48,
  num_layers=2,
  num_heads=4,
  num_kv_heads=2,
  head_dim=8,
  max_position_embeddings=512,
  tie_word_embeddings=True,
)


def test_the_floor_is_a_draft_that_is_the_target():
  """A draft whose states are the target's, distilled from the target: its loss is the
  entropy of the target's next-token distributions, its minimum: the gradient vanishes there."""
  model = random_model(TARGET, jnp.float32, seed=3)
  graphdef, params = nnx.split(model)
  tokens = jnp.asarray(np.random.default_rng(1).integers(0, 97, (3, 37)), jnp.int32)
  positions = jnp.broadcast_to(jnp.arange(37), (3, 37))
  config = TrainConfig(compute_dtype="float32", loss_chunk=16)  # (three chunks, the last one partial)
  loss = functools.partial(
    floor_loss, tokens=tokens, positions=positions, target_params=params, target_graphdef=graphdef, config=config
  )
  delta = jnp.zeros((32,), jnp.float32)
  hidden, k, _ = target_forward(tokens, positions, params, target_graphdef=graphdef)
  probs = jax.nn.softmax(model.logits(hidden[:, :-1]), axis=-1)
  entropy = -jnp.sum(probs * jnp.log(probs), axis=-1)
  assert k.shape == (2, 3, 37, 2, 8)  # [L, B, T, K, D]: every layer's K/V, as training reads them
  np.testing.assert_allclose(loss(delta), jnp.mean(entropy), rtol=1e-5)
  np.testing.assert_allclose(jax.grad(loss)(delta), 0.0, atol=1e-6)
  assert loss(delta + 0.5) > loss(delta) + 1e-4  # (cross-entropy over entropy: the KL, > 0 elsewhere)


@pytest.mark.slow  # (the lab tool's whole run)
def test_the_cli_times_the_step_and_writes_json_and_a_plot(tmp_path, monkeypatch, capsys):
  monkeypatch.setattr(lab.bench_step, "SHAPES", {"tiny": TARGET})
  out = tmp_path / "step.json"
  code = run_cli(
    main,
    ["--shape", "tiny", "--sizes", "2x24", "--iters", "1", "--dtype", "float32", "--out", str(out)],
    "python -m lab.bench_step",
  )
  assert code == 0, capsys.readouterr().err
  result = json.loads(out.read_text())
  assert result["kind"] == "train_step" and [(r["batch"], r["length"]) for r in result["rows"]] == [(2, 24)]
  for row in result["rows"]:
    assert all(row[f"{k}_ms"] > 0 for k in ("step", "floor", "target"))
    assert np.isclose(row["step_tokens_per_second"], row["batch"] * row["length"] / row["step_ms"] * 1e3)
  assert out.with_suffix(".png").stat().st_size > 0
  assert run_cli(main, ["--shape", "tiny", "--sizes", "16by1024"], "python -m lab.bench_step") == 2
  assert "expected BATCHxLENGTH like 16x1024, got '16by1024'" in capsys.readouterr().err
  assert run_cli(main, ["--shape", "tiny", "--sizes", "1x4096"], "python -m lab.bench_step") == 2
  assert "exceeds tiny's context of 512 tokens" in capsys.readouterr().err
