"""Training checkpoints: a run interrupted and resumed ends where an uninterrupted one does."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from longspec_jax.errors import UserError
from longspec_jax.models.config import DraftConfig, TargetConfig
from longspec_jax.models.draft import random_draft
from longspec_jax.models.target import random_model
from train.checkpoint import Checkpoints
from train.step import TrainConfig, make_optimizer, make_train_step

pytestmark = pytest.mark.training  # (train steps: `MARKED_OPTIONS` in conftest.py)

TARGET = TargetConfig(
  vocab_size=128,
  hidden_size=32,
  intermediate_size=48,
  num_layers=2,
  num_heads=4,
  num_kv_heads=2,
  head_dim=8,
  max_position_embeddings=2048,
)
BATCHES = jnp.asarray(np.random.default_rng(0).integers(0, 128, (6, 2, 16)), jnp.int32)  # the data, in order


@functools.cache
def setup():
  """The models, optimizer and compiled step, built once for every run of this module."""
  target_graphdef, target_params = nnx.split(random_model(TARGET, jnp.float32))
  draft_graphdef, params = nnx.split(random_draft(DraftConfig.for_target(TARGET, window=8), jnp.float32))
  config = TrainConfig(compute_dtype="float32", loss_chunk=8, warmup_steps=1, max_position=2048)
  optimizer = make_optimizer(config)
  return target_params, params, optimizer, make_train_step(draft_graphdef, target_graphdef, optimizer, config)


def run(steps, checkpoints=None, start=None):
  """Trains on BATCHES[start:steps] from fresh params or a checkpoint; saves every 2 steps."""
  target_params, initial, optimizer, step_fn = setup()
  params = jax.tree.map(jnp.copy, initial)  # the step donates its params
  opt_state = optimizer.init(params)
  first = 0
  if start == "resume":
    params, opt_state, loop = checkpoints.restore_latest(params, opt_state)
    first = loop["step"]
  for step in range(first, steps):
    tokens = BATCHES[step]
    params, opt_state, _ = step_fn(
      params, opt_state, jax.random.fold_in(jax.random.key(0), step), tokens, jnp.ones_like(tokens), target_params
    )
    if checkpoints:
      checkpoints.maybe_save(step + 1, params, opt_state, {"step": step + 1})
  return params


def test_resume_equals_uninterrupted(tmp_path):
  uninterrupted = run(6)
  checkpoints = Checkpoints(tmp_path / "ckpt", every=2)
  run(3, checkpoints)  # "killed" after step 3: the newest checkpoint is from step 2
  checkpoints.close()
  checkpoints = Checkpoints(tmp_path / "ckpt", every=2)
  assert checkpoints.latest_step() == 2
  resumed = run(6, checkpoints, start="resume")
  checkpoints.close()
  for a, b in zip(jax.tree.leaves(uninterrupted), jax.tree.leaves(resumed)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def _damage(step_dir, how: str) -> None:
  if how == "loop":  # the loop state's JSON
    for f in (step_dir / "loop").rglob("*"):
      if f.is_file():
        f.write_text("{not json")
  else:  # every parameter data file cut to nothing
    for f in (step_dir / "params").rglob("*"):
      if f.is_file() and "d" in f.parent.name:
        f.write_bytes(b"")


@pytest.mark.parametrize("how", ["loop", "params"])
def test_damaged_newest_checkpoint_falls_back(tmp_path, capsys, how):
  """A damaged newest checkpoint: one warning line, the previous intact one is restored
  (and the damaged one deleted so its step can be saved again); none intact: one error."""
  checkpoints = Checkpoints(tmp_path / "ckpt", every=2)
  run(4, checkpoints)
  checkpoints.close()
  _damage(tmp_path / "ckpt" / "4", how)
  checkpoints = Checkpoints(tmp_path / "ckpt", every=2)
  target_params, initial, optimizer, _ = setup()
  _, _, loop = checkpoints.restore_latest(initial, optimizer.init(initial))
  assert loop == {"step": 2}
  warning = capsys.readouterr().err.strip().splitlines()
  assert len(warning) == 1 and "step 4" in warning[0] and "resuming from step 2" in warning[0]
  assert len(warning[0]) < len(str(tmp_path)) + 140  # (the storage layer's messages stay out of it)
  assert checkpoints.all_steps() == [2]
  checkpoints.close()

  _damage(tmp_path / "ckpt" / "2", how)
  checkpoints = Checkpoints(tmp_path / "ckpt", every=2)
  with pytest.raises(UserError, match="no intact checkpoint .*step 2, is damaged"):
    checkpoints.restore_latest(initial, optimizer.init(initial))
  checkpoints.close()
