"""TokenSwift's multi-token heads: the residual chain, their start, their config and checkpoint."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from longspec_jax.errors import UserError
from longspec_jax.models.config import DraftKind, HeadsConfig, TargetConfig, draft_config_from_dict
from longspec_jax.models.heads import Heads, random_heads
from longspec_jax.models.layers import rms_norm
from longspec_jax.models.target import random_model
from longspec_jax.weights.drafts import load_draft, save_draft

TARGET = TargetConfig(
  vocab_size=97,
  hidden_size=32,
  intermediate_size=48,
  num_layers=2,
  num_heads=4,
  num_kv_heads=2,
  head_dim=8,
  max_position_embeddings=512,
)


def test_each_head_adds_its_linear_map_to_the_one_before():
  """h_i = f_i(h_{i-1}) + h_{i-1} (f_i: RMSNorm, then a linear map), each head's state
  normalised again for the LM head."""
  heads = random_heads(HeadsConfig.for_target(TARGET, gamma=3), jnp.float32)
  rng = np.random.default_rng(0)
  weights = {
    name: jnp.asarray(rng.standard_normal(getattr(heads, name)[...].shape) * 0.3, jnp.float32)
    for name in ("input_norm", "linear", "output_norm")
  }
  for name, value in weights.items():
    getattr(heads, name)[...] = value
  hidden = jnp.asarray(rng.standard_normal((2, 5, 32)), jnp.float32)  # [B, T, E]
  states = heads(hidden)
  assert states.shape == (2, 5, 3, 32)
  h = hidden
  for i in range(3):
    h = h + rms_norm(h, weights["input_norm"][i], TARGET.rms_norm_eps) @ weights["linear"][i]
    np.testing.assert_allclose(
      np.asarray(states[:, :, i]),
      np.asarray(rms_norm(h, weights["output_norm"][i], TARGET.rms_norm_eps)),
      rtol=1e-5,
      atol=1e-5,
    )


def test_untrained_heads_predict_what_the_target_predicts():
  """The linear maps start at zero, so every head's argmax through the shared LM head is
  the target's own next token."""
  target = random_model(TARGET, jnp.float32, seed=1)
  tokens = jnp.asarray(np.random.default_rng(1).integers(0, 97, size=(2, 9)), jnp.int32)
  positions = jnp.broadcast_to(jnp.arange(9), (2, 9))
  causal = positions[:, :, None] >= positions[:, None, :]
  hidden, _ = target(tokens, positions, causal)
  heads = random_heads(HeadsConfig.for_target(TARGET), jnp.float32)
  own = jnp.argmax(target.logits(hidden), axis=-1)  # [B, T]
  drafted = jnp.argmax(target.logits(heads(hidden)), axis=-1)  # [B, T, G]
  np.testing.assert_array_equal(np.asarray(drafted), np.broadcast_to(np.asarray(own)[..., None], drafted.shape))


def test_config_checks_and_round_trip():
  config = HeadsConfig.for_target(TARGET, gamma=2, tree_widths=(1, 4, 2))
  assert config.kind is DraftKind.TOKENSWIFT
  assert draft_config_from_dict(json.loads(json.dumps(config.to_dict()))) == config
  with pytest.raises(UserError, match="one width >= 1 per depth, 3 for gamma 2"):
    HeadsConfig.for_target(TARGET, gamma=2)  # (the default tree is gamma 3's)
  with pytest.raises(UserError, match="needs gamma >= 1"):
    HeadsConfig.for_target(TARGET, gamma=0, tree_widths=(1,))
  with pytest.raises(UserError, match="unknown TokenSwift heads config keys: window"):
    HeadsConfig.from_dict({**config.to_dict(), "window": 512})
  with pytest.raises(UserError, match="their hidden_size is 32, the target's is 64"):
    config.check_matches(
      TargetConfig(
        vocab_size=97, hidden_size=64, intermediate_size=48, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16
      )
    )


def test_heads_save_and_load_as_a_draft_of_their_kind(tmp_path):
  heads = random_heads(HeadsConfig.for_target(TARGET), jnp.float32)
  heads.linear[...] = jnp.full(heads.linear.shape, 0.01, jnp.float32)
  save_draft(tmp_path / "heads", heads)
  loaded = load_draft(str(tmp_path / "heads"), TARGET, jnp.bfloat16, kind=DraftKind.TOKENSWIFT)
  assert isinstance(loaded, Heads) and loaded.config == heads.config
  for a, b in zip(jax.tree.leaves(nnx.state(heads)), jax.tree.leaves(nnx.state(loaded))):
    assert b.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(a), np.asarray(b, np.float32), rtol=1e-2)
  with pytest.raises(UserError, match="holds tokenswift's draft, where longspec's is needed"):
    load_draft(str(tmp_path / "heads"), TARGET, jnp.float32)
  assert isinstance(load_draft("random", TARGET, jnp.float32, kind=DraftKind.TOKENSWIFT), Heads)
