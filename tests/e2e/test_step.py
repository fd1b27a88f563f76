"""Draft training: flash noisy cross-attention against the paper's slicing, and real steps
(TokenSwift's heads too)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from longspec_jax.models.cache import RingCache
from longspec_jax.models.config import DraftConfig, DraftKind, HeadsConfig, TargetConfig
from longspec_jax.models.draft import CrossAttend, SelfAttend, random_draft
from longspec_jax.models.heads import random_heads
from longspec_jax.models.target import random_model
from longspec_jax.ops.attention import Impl, delayed_attention, prefix_attention_reference
from train import Labels, Positions
from train.step import (
  TrainConfig,
  draft_loss,
  draft_token_losses,
  eval_rollout_step,
  eval_step,
  make_optimizer,
  make_train_step,
  noisy_delays,
  rollout_passes,
  tree_delays,
)

from helpers import real_texts, tiny_target

pytestmark = pytest.mark.training  # (train steps: `MARKED_OPTIONS` in conftest.py)


def test_delayed_cross_attention_matches_the_papers_slicing():
  """Algorithm 2: out[j:] = causal attention(Q[j:], K[:-j], V[:-j]), out[:j] = 0, for the
  delay j each sequence drew."""
  rng = np.random.default_rng(0)
  length = 11
  q = jnp.asarray(rng.standard_normal((3, length, 2, 2, 8)), jnp.float32)
  k, v = (jnp.asarray(rng.standard_normal((3, length, 2, 8)), jnp.float32) for _ in "kv")
  delays = noisy_delays(jax.random.key(1), 3, (1.0,) * 4)
  out = delayed_attention(q, k, v, delays, impl=Impl.REFERENCE)
  for b in range(3):
    shift = int(delays[b])
    assert 1 <= shift <= 4
    causal = jnp.arange(1, length - shift + 1)[None]  # query m of the slice sees keys 0..m
    sliced, _ = prefix_attention_reference(q[b : b + 1, shift:], k[b : b + 1, :-shift], v[b : b + 1, :-shift], causal)
    explicit = np.concatenate([np.zeros((shift, 2, 2, 8)), np.asarray(sliced[0])], axis=0)
    np.testing.assert_allclose(np.asarray(out[b]), explicit, atol=1e-6)


def test_delays_are_drawn_with_their_weights():
  """Per sequence j in 1..len(weights) with probability weight / sum, and (0,) is no
  delay (the sampler's law, checked with a chi-square bound)."""
  weights = (1.0, 2.0, 0.0, 5.0)
  counts = np.bincount(np.asarray(noisy_delays(jax.random.key(3), 8000, weights)), minlength=5)
  expected = 8000 * np.asarray(weights) / sum(weights)
  drawn = expected > 0
  assert counts[0] == counts[3] == 0
  assert sum((counts[1:] - expected)[drawn] ** 2 / expected[drawn]) < 16.3  # (chi2, 2 dof: p 3e-4)
  np.testing.assert_array_equal(np.asarray(noisy_delays(jax.random.key(0), 4, (0.0,))), [0] * 4)
  assert tree_delays(5) == (1.0,) * 5


TARGET = TargetConfig(
  vocab_size=211,
  hidden_size=64,
  intermediate_size=96,
  num_layers=2,
  num_heads=4,
  num_kv_heads=2,
  head_dim=16,
  max_position_embeddings=4096,
)


@pytest.mark.parametrize(
  "positions,labels,kind,rollout,features",
  [
    (Positions.ANCHOR_OFFSET, Labels.TARGET, DraftKind.LONGSPEC, 0, ()),
    (Positions.VANILLA, Labels.DATA, DraftKind.LONGSPEC, 0, ()),
    (Positions.VANILLA, Labels.TARGET, DraftKind.GLIDE, 0, (0, 1)),
    (Positions.ANCHOR_OFFSET, Labels.TARGET, DraftKind.LONGSPEC, 3, (0, 1)),
  ],
)
def test_a_few_real_steps_reduce_the_loss(positions, labels, kind, rollout, features):
  """LongSpec's draft with flash noisy training or with the training-time test (a pass a
  depth, each depth's tokens from its round's root on), GLIDE's (two layers: each reads
  its own target layer) with its block-wise cross mask; fused target features in two, the
  training-time test's with its parents' outputs."""
  target = random_model(TARGET, jnp.float32, seed=0)
  layers = 2 if kind is DraftKind.GLIDE else 1
  config = DraftConfig.for_target(
    TARGET, window=16, kind=kind, num_layers=layers, feature_layers=features, parent_features=rollout > 0
  )
  draft = random_draft(config, jnp.float32, seed=1)
  draft_graphdef, draft_params = nnx.split(draft)
  target_graphdef, target_params = nnx.split(target)
  text = real_texts(limit=1)[0].encode()
  tokens = jnp.asarray(np.frombuffer(text[: 4 * 48], np.uint8).reshape(4, 48) % 211, jnp.int32)  # real bytes
  config = TrainConfig(
    learning_rate=3e-3,
    warmup_steps=2,
    total_steps=30,
    loss_chunk=16,
    compute_dtype="float32",
    positions=positions,
    max_position=4096,
    labels=labels,
    rollout_depth=rollout,
  )
  optimizer = make_optimizer(config)
  opt_state = optimizer.init(draft_params)
  step = make_train_step(draft_graphdef, target_graphdef, optimizer, config)
  losses, hits = [], []
  for i in range(12):
    draft_params, opt_state, metrics = step(
      draft_params, opt_state, jax.random.key(i), tokens, jnp.ones_like(tokens), target_params
    )
    losses.append(float(metrics["loss"]))
    hits.append(float(metrics["hit_rate"]))
  assert int(metrics["tokens"]) == 4 * sum(47 - depth for depth in range(max(rollout, 1)))
  if labels == "data":
    assert losses[-1] < losses[0] - 0.5, losses
  else:  # a random target is nearly uniform: the loss is mostly its entropy, agreement is what moves
    assert losses[-1] < losses[0] and hits[-1] > hits[0] + 0.2, (losses, hits)


@pytest.mark.parametrize("labels", [Labels.DATA, Labels.TARGET])
def test_tokenswift_heads_learn_the_tokens_further_ahead(labels):
  """TokenSwift's heads on the frozen target: the loss falls; it counts each head's
  tokens inside the rows (head i at position t predicts the token at t + 1 + i)."""
  target = random_model(TARGET, jnp.float32, seed=0)
  heads_graphdef, heads_params = nnx.split(random_heads(HeadsConfig.for_target(TARGET), jnp.float32))
  target_graphdef, target_params = nnx.split(target)
  text = real_texts(limit=1)[0].encode()
  tokens = jnp.asarray(np.frombuffer(text[: 4 * 48], np.uint8).reshape(4, 48) % 211, jnp.int32)
  config = TrainConfig(
    learning_rate=3e-3,
    warmup_steps=2,
    total_steps=30,
    loss_chunk=16,
    compute_dtype="float32",
    positions=Positions.VANILLA,
    labels=labels,
  )
  optimizer = make_optimizer(config)
  opt_state = optimizer.init(heads_params)
  step = make_train_step(heads_graphdef, target_graphdef, optimizer, config)
  losses = []
  for i in range(12):
    heads_params, opt_state, metrics = step(
      heads_params, opt_state, jax.random.key(i), tokens, jnp.ones_like(tokens), target_params
    )
    losses.append(float(metrics["loss"]))
  assert int(metrics["tokens"]) == 4 * (46 + 45 + 44)
  assert losses[-1] < losses[0] - (0.5 if labels is Labels.DATA else 0.0), losses


def test_accumulation_applies_one_update_per_k_micro_batches():
  target = random_model(TARGET, jnp.float32, seed=0)
  draft_graphdef, draft_params = nnx.split(random_draft(DraftConfig.for_target(TARGET, window=16), jnp.float32))
  target_graphdef, target_params = nnx.split(target)
  config = dataclasses.replace(TrainConfig(compute_dtype="float32", loss_chunk=8), accumulate=2)
  optimizer = make_optimizer(config)
  opt_state = optimizer.init(draft_params)
  tokens = jnp.asarray(np.random.default_rng(0).integers(0, 211, (2, 16)), jnp.int32)
  before = jax.tree.map(jnp.copy, draft_params)
  step = make_train_step(draft_graphdef, target_graphdef, optimizer, config)
  draft_params, opt_state, _ = step(
    draft_params, opt_state, jax.random.key(0), tokens, jnp.ones_like(tokens), target_params
  )
  unchanged = jax.tree.leaves(jax.tree.map(lambda a, b: bool(jnp.all(a == b)), before, draft_params))
  assert all(unchanged)  # the first micro-batch only accumulates
  draft_params, opt_state, _ = step(
    draft_params, opt_state, jax.random.key(1), tokens, jnp.ones_like(tokens), target_params
  )
  assert not all(jax.tree.leaves(jax.tree.map(lambda a, b: bool(jnp.all(a == b)), before, draft_params)))


def test_the_targets_pallas_forward_gives_the_same_step():
  """The frozen target may run on the Pallas masked-attention kernel (no gradient needs
  to pass through it): the loss and the draft's gradients are the reference's."""
  from train.step import draft_loss, training_positions

  target = random_model(TARGET, jnp.float32, seed=0)
  draft_graphdef, draft_params = nnx.split(random_draft(DraftConfig.for_target(TARGET, window=16), jnp.float32))
  tokens = jnp.asarray(np.random.default_rng(0).integers(0, 211, (2, 37)), jnp.int32)
  config = TrainConfig(compute_dtype="float32", loss_chunk=16, positions=Positions.ANCHOR_OFFSET, max_position=4096)
  positions = training_positions(jax.random.key(0), config, 2, 37)
  delays = noisy_delays(jax.random.key(1), 2, (1.0,) * 4)

  def loss_and_grads(impl):
    grad_fn = jax.value_and_grad(draft_loss, has_aux=True)
    return nnx.jit(grad_fn, static_argnums=(1, 7))(
      draft_params,
      draft_graphdef,
      target.with_numerics(attention=impl),
      tokens,
      jnp.ones_like(tokens),
      positions,
      delays,
      config,
    )

  (want, _), want_grads = loss_and_grads(Impl.REFERENCE)
  (got, _), got_grads = loss_and_grads(Impl.PALLAS)
  np.testing.assert_allclose(float(got), float(want), rtol=1e-5)
  for g, w in zip(jax.tree.leaves(got_grads), jax.tree.leaves(want_grads)):
    np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-3, atol=1e-5)


@pytest.mark.parametrize("weights", [(1.0,) * 5, (0.0,)])
def test_the_drafts_flash_attention_gives_the_same_step(weights):
  """The draft's own attention in training as structured flash passes (a window shorter
  than the sequence, a delay per sequence or none): the reference's loss and gradients."""
  from train.step import draft_loss, training_positions

  target = random_model(TARGET, jnp.float32, seed=0)
  config = TrainConfig(compute_dtype="float32", loss_chunk=16, positions=Positions.ANCHOR_OFFSET, max_position=4096)
  tokens = jnp.asarray(np.random.default_rng(5).integers(0, 211, (3, 41)), jnp.int32)
  positions = training_positions(jax.random.key(2), config, 3, 41)
  delays = noisy_delays(jax.random.key(3), 3, weights)

  def loss_and_grads(impl):
    graphdef, params = nnx.split(
      random_draft(DraftConfig.for_target(TARGET, window=16), jnp.float32, seed=4, attention=impl)
    )
    grad_fn = jax.value_and_grad(draft_loss, has_aux=True)
    return jax.jit(grad_fn, static_argnums=(1, 7))(
      params, graphdef, target, tokens, jnp.ones_like(tokens), positions, delays, config
    )

  (want, _), want_grads = loss_and_grads(Impl.REFERENCE)
  (got, _), got_grads = loss_and_grads(Impl.FLASH)
  np.testing.assert_allclose(float(got), float(want), rtol=1e-5)
  for g, w in zip(jax.tree.leaves(got_grads), jax.tree.leaves(want_grads)):
    np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-3, atol=1e-5)


@pytest.mark.parametrize("depth", [2, 3, 5])
def test_each_rollout_pass_computes_what_inference_computes_at_its_depth(depth):
  """Training-time test: a two-layer draft's pass at depth d, at position i, equals what
  inference computes for the tree node at depth d - 1 of a round whose root sits at
  i - d + 1, each node in turn (its cross-attention over the target's cache below the
  root; its self-attention over the ring, the first pass's K/V up to the root within the
  window, and over the K/V its ancestors got in their own inference passes), fused
  target features included (the first pass's, which the ring holds; no node has them),
  and each node's parent's output (the pass before's)."""
  target = tiny_target("llama")
  config = DraftConfig.for_target(target.config, num_layers=2, window=6, feature_layers=(0, 2), parent_features=True)
  draft = random_draft(config, jnp.float32)
  batch, length = 2, 17
  tokens = jnp.asarray(np.random.default_rng(depth).integers(3, 200, (batch, length)), jnp.int32)
  positions = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (batch, length))
  _, target_k, target_v = target.causal_hidden_and_kv(tokens, positions)  # [L, B, T, K, D]
  passes = rollout_passes(draft, target, tokens, positions, target_k, target_v, depth)
  own = SelfAttend(mask=None, window=config.self_window)
  first, (ring_k, ring_v) = draft(
    target, tokens, positions, own, CrossAttend(target_k, target_v, None, delay=jnp.ones((batch,), jnp.int32))
  )
  np.testing.assert_allclose(np.asarray(passes[0]), np.asarray(first), atol=1e-6)
  for root in (0, 4, 9, length - depth):
    ring = RingCache.create(config, batch, jnp.float32, config.window)
    held = jnp.broadcast_to(
      jnp.arange(max(0, root - config.window + 1), root + 1), (batch, min(root + 1, config.window))
    )
    ring = ring.write(ring_k[:, :, held[0]], ring_v[:, :, held[0]], held, jnp.ones(held.shape, bool))
    buffer = [jnp.zeros((config.num_layers, batch, depth, config.num_kv_heads, config.head_dim))] * 2
    parent = first[:, root : root + 1]  # the root's output, from the catch-up pass
    for node in range(1, depth):  # the node at depth `node`, position root + node
      at = root + node
      parent, buffer = draft(
        target,
        tokens[:, at : at + 1],
        positions[:, at : at + 1],
        SelfAttend(
          mask=jnp.broadcast_to((jnp.arange(depth) >= 1) & (jnp.arange(depth) <= node), (batch, 1, depth)),
          ring=ring,
          ring_limit=jnp.full((batch,), root + 1),
          buffer=(*buffer, jnp.full((batch, 1), node)),
        ),
        CrossAttend(target_k, target_v, limits=jnp.full((batch, 1), root)),
        parents=parent,
      )
      np.testing.assert_allclose(np.asarray(passes[node][:, at]), np.asarray(parent[:, 0]), atol=1e-5)


def test_held_out_scoring_of_a_draft_reading_its_parents_runs_the_rollout_passes():
  """A draft reading its parents' outputs is scored at depth d by the training-time test's
  pass d (`eval_rollout_step`), which gives them: its depth 1 is the one delayed pass's,
  its depth 2 not (that pass has no parents)."""
  target = random_model(TARGET, jnp.float32, seed=0)
  config = DraftConfig.for_target(TARGET, window=16, feature_layers=(0, 1), parent_features=True)
  draft_graphdef, draft_params = nnx.split(random_draft(config, jnp.float32, seed=1))
  target_graphdef, target_params = nnx.split(target)
  tokens = jnp.asarray(np.random.default_rng(0).integers(3, 200, (2, 24)), jnp.int32)
  common = dict(
    draft_graphdef=draft_graphdef, target_graphdef=target_graphdef, config=TrainConfig(compute_dtype="float32")
  )
  losses, _ = eval_rollout_step(draft_params, tokens, target_params, depth=2, **common)
  assert losses.shape == (2, 2, 23)
  delayed = [eval_step(draft_params, tokens, target_params, delay=d, **common)[0] for d in (1, 2)]
  np.testing.assert_allclose(np.asarray(losses[:, 0]), np.asarray(delayed[0]), rtol=1e-5)
  assert not np.allclose(np.asarray(losses[:, 1, 2:]), np.asarray(delayed[1][:, 2:]))


def test_the_deeper_passes_on_fewer_rows_score_those_rows_as_all_rows_do():
  """`rollout_rows`: passes 2 .. D run over the first rows only; their losses there, and
  every row's first pass, are what the passes over every row give, and the other rows'
  deeper losses weigh nothing."""
  target = random_model(TARGET, jnp.float32, seed=0)
  config = DraftConfig.for_target(TARGET, window=16, parent_features=True)
  draft_graphdef, draft_params = nnx.split(random_draft(config, jnp.float32, seed=1))
  tokens = jnp.asarray(np.random.default_rng(2).integers(3, 200, (4, 20)), jnp.int32)
  positions = jnp.broadcast_to(jnp.arange(20), (4, 20))
  every = TrainConfig(compute_dtype="float32", rollout_depth=3)
  some = dataclasses.replace(every, rollout_rows=2)
  args = (draft_params, draft_graphdef, target, tokens)
  full, _ = draft_token_losses(*args, positions, None, every)
  part, _ = draft_token_losses(*args, positions, None, some)
  np.testing.assert_allclose(np.asarray(part[:2]), np.asarray(full[:2]), rtol=1e-5)
  np.testing.assert_allclose(np.asarray(part[2:, 0]), np.asarray(full[2:, 0]), rtol=1e-5)
  mask = jnp.ones_like(tokens)
  _, (count, _) = draft_loss(*args, mask, positions, None, some)
  assert int(count) == 4 * 19 + 2 * (18 + 17)  # (the first pass everywhere; the deeper ones on two rows, from a root)
