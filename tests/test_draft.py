"""The draft model: its config against the target, and what its cross-attention may see."""

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

from longspec_jax.attention import causal_block_mask
from longspec_jax.config import DraftConfig, RopeConfig, TargetConfig
from longspec_jax.draft import CrossAttend, SelfAttend, random_draft
from longspec_jax.errors import UserError
from longspec_jax.target import random_model

TARGET = TargetConfig(vocab_size=97, hidden_size=32, intermediate_size=48, num_layers=3, num_heads=4,
                      num_kv_heads=2, head_dim=8, rope=RopeConfig(theta=500.0, kind="linear", factor=2.0))


def test_config_follows_the_target_and_round_trips():
  assert DraftConfig.for_target(TARGET).num_layers == 1  # one block by default, whatever the target's depth
  config = DraftConfig.for_target(TARGET, num_layers=2, window=64, tree_widths=(2, 3))
  assert (config.vocab_size, config.num_kv_heads, config.head_dim, config.rope) == (97, 2, 8, TARGET.rope)
  assert DraftConfig.from_dict(config.to_dict()) == config
  config.check_matches(TARGET)


@pytest.mark.parametrize("change, message", [
    (dict(vocab_size=98), "vocab_size is 98"),
    (dict(head_dim=16), "head_dim is 16"),
    (dict(rope=RopeConfig(theta=10000.0)), "its rope is"),
    (dict(cross_layer=3), "cross-attends to target layer 3"),
])
def test_mismatched_drafts_are_refused(change, message):
  config = dataclasses.replace(DraftConfig.for_target(TARGET), **change)
  with pytest.raises(UserError, match=message):
    config.check_matches(TARGET)


def test_bad_tree_widths_are_refused():
  with pytest.raises(UserError, match="tree widths must be"):
    DraftConfig.for_target(TARGET, tree_widths=(4, 0))


def test_cross_attention_sees_only_slots_below_its_limits():
  target = random_model(TARGET, jnp.float32, seed=1)
  draft = random_draft(DraftConfig.for_target(TARGET), jnp.float32, seed=2)
  rng = np.random.default_rng(0)
  tokens = jnp.asarray(rng.integers(0, 97, size=(1, 6)))
  positions = 20 + jnp.arange(6)[None]
  target_k, target_v = (jnp.asarray(rng.standard_normal((1, 32, 2, 8)), jnp.float32) for _ in "kv")
  limits = jnp.asarray([[20, 20, 21, 23, 23, 26]])

  def run(k, v):
    hidden, _ = draft(target, tokens, positions, SelfAttend(mask=causal_block_mask(positions, jnp.ones((1, 6), bool))),
                      CrossAttend(k=k, v=v, limits=limits))
    return np.asarray(hidden[0])

  base = run(target_k, target_v)
  later = run(target_k.at[:, 26:].set(9.0), target_v.at[:, 26:].set(9.0))
  np.testing.assert_array_equal(later, base)  # beyond every limit: invisible
  slot_22 = run(target_k, target_v.at[:, 22].set(9.0))
  changed = np.any(np.abs(slot_22 - base) > 1e-6, axis=-1)
  np.testing.assert_array_equal(changed, np.asarray(limits[0] > 22))
