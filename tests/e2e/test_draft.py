"""The draft model: its config against the target, and what its cross-attention may see."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from longspec_jax.errors import UserError
from longspec_jax.models.config import DraftConfig, DraftKind, RopeConfig, TargetConfig
from longspec_jax.models.draft import CrossAttend, SelfAttend, random_draft, with_features
from longspec_jax.models.target import random_model
from longspec_jax.ops.attention import causal_block_mask

TARGET = TargetConfig(
  vocab_size=97,
  hidden_size=32,
  intermediate_size=48,
  num_layers=3,
  num_heads=4,
  num_kv_heads=2,
  head_dim=8,
  rope=RopeConfig(theta=500.0, kind="linear", factor=2.0),
)


def test_config_follows_the_target_and_round_trips():
  assert DraftConfig.for_target(TARGET).num_layers == 1  # one block by default, whatever the target's depth
  config = DraftConfig.for_target(TARGET, num_layers=2, window=64, tree_widths=(2, 3))
  assert (config.vocab_size, config.num_kv_heads, config.head_dim, config.rope) == (97, 2, 8, TARGET.rope)
  assert DraftConfig.from_dict(config.to_dict()) == config
  config.check_matches(TARGET)
  wider = DraftConfig.for_target(TARGET, intermediate_size=96)  # (the MLP's width is the draft's own)
  assert wider.intermediate_size == 96 and DraftConfig.from_dict(wider.to_dict()) == wider
  wider.check_matches(TARGET)


@pytest.mark.parametrize(
  "change, message",
  [
    (dict(vocab_size=98), "vocab_size is 98"),
    (dict(head_dim=16), "head_dim is 16"),
    (dict(rope=RopeConfig(theta=10000.0)), "its rope is"),
    (dict(cross_layer=3), "cross-attends to target layers 3"),
  ],
)
def test_mismatched_drafts_are_refused(change, message):
  config = dataclasses.replace(DraftConfig.for_target(TARGET), **change)
  with pytest.raises(UserError, match=message):
    config.check_matches(TARGET)


def test_a_glide_draft_reads_the_top_target_layers_one_per_layer():
  glide = DraftConfig.for_target(TARGET, num_layers=2, kind=DraftKind.GLIDE)
  assert glide.target_layers(TARGET.num_layers) == (1, 2)  # N_T - N_D + m
  assert dataclasses.replace(glide, cross_layer=0).target_layers(TARGET.num_layers) == (0, 1)  # the bottom ones
  assert DraftConfig.for_target(TARGET, num_layers=2).target_layers(TARGET.num_layers) == (2, 2)  # LongSpec: the last
  assert glide.self_window is None and glide.ring_size(4096) == 4096
  assert DraftConfig.for_target(TARGET).ring_size(4096) == 512
  assert DraftConfig.from_dict(glide.to_dict()) == glide and glide.to_dict()["kind"] == "glide"
  for cross_layer in (2, -1):  # (its second layer would read past the top)
    with pytest.raises(UserError, match="cross-attends to target layers"):
      dataclasses.replace(glide, cross_layer=cross_layer).check_matches(TARGET)
  with pytest.raises(UserError, match="kind is one of longspec, glide"):
    DraftConfig.from_dict({**glide.to_dict(), "kind": "medusa"})


def test_each_glide_layer_cross_attends_to_its_own_target_layer():
  target = random_model(TARGET, jnp.float32, seed=1)
  rng = np.random.default_rng(3)
  tokens = jnp.asarray(rng.integers(0, 97, size=(1, 5)))
  positions = jnp.arange(5)[None]
  k, v = (jnp.asarray(rng.standard_normal((TARGET.num_layers, 1, 16, 2, 8)), jnp.float32) for _ in "kv")

  def changes(draft, layer):
    """Whether the draft's output moves when target layer `layer`'s values do."""
    run = lambda v: np.asarray(
      draft(target, tokens, positions, SelfAttend(mask=None), CrossAttend(k=k, v=v, limits=jnp.full((1, 5), 16)))[0]
    )
    return bool(np.any(np.abs(run(v.at[layer].multiply(3.0)) - run(v)) > 1e-5))

  for cross_layer, read in [(None, {1, 2}), (0, {0, 1})]:
    config = DraftConfig.for_target(TARGET, num_layers=2, kind=DraftKind.GLIDE, cross_layer=cross_layer)
    draft = random_draft(config, jnp.float32, seed=2)
    assert {layer for layer in range(TARGET.num_layers) if changes(draft, layer)} == read


def test_the_ablated_draft_has_no_cross_attention_and_ignores_the_target_cache():
  """GLIDE's "vanilla drafter" (section 5.2): the same layers without cross-attention."""
  target = random_model(TARGET, jnp.float32, seed=1)
  config = DraftConfig.for_target(TARGET, kind=DraftKind.GLIDE, num_layers=2, cross_attention=False)
  assert DraftConfig.from_dict(config.to_dict()) == config
  draft = random_draft(config, jnp.float32, seed=2)
  full = random_draft(dataclasses.replace(config, cross_attention=True), jnp.float32, seed=2)
  count = lambda model: sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
  assert count(full) - count(draft) == 2 * (32 + 2 * 32 * 4 * 8)  # (per layer: the norm, the q and o projections)
  rng = np.random.default_rng(5)
  tokens, positions = jnp.asarray(rng.integers(0, 97, size=(1, 4))), jnp.arange(4)[None]
  k, v = (jnp.asarray(rng.standard_normal((TARGET.num_layers, 1, 8, 2, 8)), jnp.float32) for _ in "kv")
  run = lambda v: np.asarray(
    draft(target, tokens, positions, SelfAttend(mask=None), CrossAttend(k=k, v=v, limits=jnp.full((1, 4), 8)))[0]
  )
  np.testing.assert_array_equal(run(v), run(v * 3.0))


def test_bad_tree_widths_are_refused():
  with pytest.raises(UserError, match="tree widths must be"):
    DraftConfig.for_target(TARGET, tree_widths=(4, 0))


def test_cross_attention_sees_only_slots_below_its_limits():
  target = random_model(TARGET, jnp.float32, seed=1)
  draft = random_draft(DraftConfig.for_target(TARGET), jnp.float32, seed=2)
  rng = np.random.default_rng(0)
  tokens = jnp.asarray(rng.integers(0, 97, size=(1, 6)))
  positions = 20 + jnp.arange(6)[None]
  shape = (TARGET.num_layers, 1, 32, 2, 8)  # every target layer's cache: the draft reads the last one's
  target_k, target_v = (jnp.asarray(rng.standard_normal(shape), jnp.float32) for _ in "kv")
  limits = jnp.asarray([[20, 20, 21, 23, 23, 26]])

  def run(k, v):
    hidden, _ = draft(
      target,
      tokens,
      positions,
      SelfAttend(mask=causal_block_mask(positions, jnp.ones((1, 6), bool))),
      CrossAttend(k=k, v=v, limits=limits),
    )
    return np.asarray(hidden[0])

  base = run(target_k, target_v)
  later = run(target_k.at[:, :, 26:].set(9.0), target_v.at[:, :, 26:].set(9.0))
  np.testing.assert_array_equal(later, base)  # beyond every limit: invisible
  np.testing.assert_array_equal(run(target_k.at[:-1].set(9.0), target_v.at[:-1].set(9.0)), base)  # other layers
  slot_22 = run(target_k, target_v.at[:, :, 22].set(9.0))
  changed = np.any(np.abs(slot_22 - base) > 1e-6, axis=-1)
  np.testing.assert_array_equal(changed, np.asarray(limits[0] > 22))


def test_the_draft_says_where_its_cross_attention_looked():
  """With a chunk size the pass also returns its cross-attention's mass per chunk of the
  target's cache and KV head: each query's mass sums to its heads' count (none beyond
  its limit), the hidden states are the plain pass's, and a two-layer draft sums both."""
  target = random_model(TARGET, jnp.float32, seed=1)
  rng = np.random.default_rng(3)
  tokens = jnp.asarray(rng.integers(0, 97, size=(2, 4)))
  positions = 30 + jnp.arange(4)[None].repeat(2, 0)
  shape = (TARGET.num_layers, 2, 40, 2, 8)
  target_k, target_v = (jnp.asarray(rng.standard_normal(shape), jnp.float32) for _ in "kv")
  limits = jnp.asarray([[30, 30, 31, 32], [17, 17, 17, 17]])
  own = SelfAttend(mask=causal_block_mask(positions, jnp.ones((2, 4), bool)))
  cross = CrossAttend(k=target_k, v=target_v, limits=limits)
  for layers in (1, 2):
    draft = random_draft(DraftConfig.for_target(TARGET, num_layers=layers), jnp.float32, seed=2)
    hidden, _, mass = draft.forward(target, tokens, positions, own, cross, chunk=16)
    np.testing.assert_array_equal(np.asarray(hidden), np.asarray(draft(target, tokens, positions, own, cross)[0]))
    group = DraftConfig.for_target(TARGET).group_size
    assert mass.shape == (2, 2, 3)  # [B, K, ceil(40 / 16)]
    np.testing.assert_allclose(np.asarray(mass.sum(-1)), layers * 4 * group, rtol=1e-5)
    assert float(jnp.abs(mass[1, :, 2]).max()) == 0 and float(jnp.abs(mass[1, :, 1]).sum()) > 0  # limit 17


def test_fused_features_are_the_committed_previous_positions_values():
  """Each query adds the target's cached values of the feature layers at the slot before
  its own, each layer RMS-normed, projected together, where its cross-attention sees that
  slot; zero elsewhere (training's delays and blocks give the same rule as inference's
  limits), where a draft reading its parents' outputs reads them instead."""
  target = random_model(TARGET, jnp.float32, seed=1)
  draft = random_draft(DraftConfig.for_target(TARGET, feature_layers=(0, -1)), jnp.float32, seed=2)
  rng = np.random.default_rng(3)
  shape = (TARGET.num_layers, 2, 32, 2, 8)
  k, v = (jnp.asarray(rng.standard_normal(shape), jnp.float32) for _ in "kv")
  positions = jnp.asarray([[20, 21, 22, 23], [0, 1, 2, 3]])
  limits = jnp.asarray([[20, 21, 21, 21], [0, 1, 2, 2]])

  def expected(b, slot):
    parts = []
    for n, layer in enumerate((0, TARGET.num_layers - 1)):
      x = np.asarray(v[layer, b, slot - 1])
      x = x / np.sqrt(np.mean(x * x) + TARGET.rms_norm_eps) * np.asarray(draft.feature_norm[n])
      parts.append(np.einsum("kd,kde->e", x, np.asarray(draft.feature_proj[n])))
    return sum(parts)

  got = np.asarray(draft.target_features(target, positions, CrossAttend(k, v, limits)))
  for b in range(2):
    for t in range(4):
      slot, seen = int(positions[b, t]), int(limits[b, t])
      want = expected(b, slot) if slot >= 1 and seen >= slot else np.zeros(TARGET.hidden_size)
      np.testing.assert_allclose(got[b, t], want, rtol=1e-5, atol=1e-6)
  # Parents' outputs: read exactly where the previous position is not committed.
  with_parents = random_draft(DraftConfig.for_target(TARGET, parent_features=True), jnp.float32, seed=5)
  cross = CrossAttend(k, v, limits)
  parents = jnp.asarray(rng.standard_normal((2, 4, TARGET.hidden_size)), jnp.float32)
  moved = with_parents.inputs(target, positions, positions, cross, parents) != with_parents.inputs(
    target, positions, positions, cross, None
  )
  np.testing.assert_array_equal(np.any(np.asarray(moved), axis=-1), ~((positions >= 1) & (limits >= positions)))
  # Training: query i at delay j sees slots 0 .. i - j, so only delays 0 and 1 read features.
  steps = jnp.broadcast_to(jnp.arange(4), (2, 4))
  for delay in (0, 1, 2):
    trained = draft.target_features(target, steps, CrossAttend(k, v, None, delay=jnp.full((2,), delay)))
    np.testing.assert_array_equal(np.any(np.asarray(trained) != 0, axis=-1), np.asarray((steps >= 1) & (delay <= 1)))


def test_a_draft_given_features_computes_what_it_did_until_trained():
  target = random_model(TARGET, jnp.float32, seed=1)
  draft = random_draft(DraftConfig.for_target(TARGET, num_layers=2), jnp.float32, seed=2)
  fused = with_features(draft, (0, 2), parents=True)
  assert fused.config.feature_layers == (0, 2) and fused.feature_proj.shape == (2, 2, 8, TARGET.hidden_size)
  assert fused.config.parent_features and fused.parent_proj.shape == (TARGET.hidden_size,) * 2
  rng = np.random.default_rng(4)
  tokens = jnp.asarray(rng.integers(0, 97, size=(1, 6)))
  positions = jnp.arange(6)[None]
  k, v = (jnp.asarray(rng.standard_normal((TARGET.num_layers, 1, 8, 2, 8)), jnp.float32) for _ in "kv")
  own = SelfAttend(mask=causal_block_mask(positions, jnp.ones((1, 6), bool)))
  cross = CrossAttend(k=k, v=v, limits=positions)
  parents = jnp.asarray(rng.standard_normal((1, 6, TARGET.hidden_size)), jnp.float32)
  np.testing.assert_array_equal(
    np.asarray(fused(target, tokens, positions, own, cross, parents)[0]),
    np.asarray(draft(target, tokens, positions, own, cross)[0]),
  )
