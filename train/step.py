"""One draft training step: frozen target forward -> draft forward with flash noisy
cross-attention -> chunked next-token loss -> AdamW. TokenSwift's heads (`heads.py`)
train in the same step on the target's final states: head i at position t predicts the
token at t + 1 + i, against the target's own distribution there.

The target only supplies its K/V at every position and, with `Labels.TARGET`, its
next-token distribution as the soft label (no gradients reach it). Positions are
vanilla or anchor-offset (LongSpec Algorithm 1), the same for target and draft. Flash
noisy training (Algorithm 2) delays the cross-attention by a random j per sequence: query
i sees target K/V up to index i - j, as a draft query at inference sees only the
committed cache; it is a causal pass over the queries shifted by j
(`attention.delayed_attention`), so no [T, T] mask or score matrix is built. At inference
the draft's query for depth d of its tree is d tokens past the committed cache, so j is
drawn from 1 .. the tree's depth (`delay_weights`; the paper's 1..4 left the default
tree's fifth depth untrained).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from longspec_jax.models.config import DraftKind
from longspec_jax.models.draft import CrossAttend, Rollout, SelfAttend
from longspec_jax.models.heads import Heads
from longspec_jax.models.rope import anchor_offset_positions
from longspec_jax.ops.attention import Impl
from longspec_jax.ops.sharding import traced_under
from train import Labels, Positions
from train.loss import chunked_token_losses


@dataclasses.dataclass(frozen=True)
class TrainConfig:
  learning_rate: float = 5e-4
  warmup_steps: int = 100
  total_steps: int = 10_000
  weight_decay: float = 0.01
  clip_norm: float = 1.0
  accumulate: int = 1  # micro-batches per optimizer update
  loss_chunk: int = 512  # positions per chunk of the cross-entropy
  compute_dtype: str = "bfloat16"  # parameters and optimizer state stay float32
  # Flash noisy training: the weight of each cross-attention delay j = 1, 2, ...; (0.0,)
  # alone: no delay (the draft reads target K/V at its own position, which inference never has).
  delay_weights: tuple[float, ...] = (1.0,) * 5
  # A GLIDE draft's training cross-attention instead: blocks of this many tokens, each
  # seeing the target's K/V of the blocks before it (glide-cape.md section 4.1: L = 5).
  cross_block: int = 5
  positions: Positions = Positions.ANCHOR_OFFSET
  max_position: int = 8192  # anchor-offset positions reach up to this
  labels: Labels = Labels.TARGET
  # Training-time test (a LongSpec draft): one pass per tree depth 1 .. this, each position the
  # query of that depth's pass as inference runs it (`rollout_passes`), the loss at every
  # depth; 0: one pass, its cross-attention delayed by `delay_weights`.
  rollout_depth: int = 0
  # The rows of each micro-batch (the first ones) that the training-time test's passes beyond
  # the first run over; 0: every row. Fewer buy throughput with fewer deep samples a step.
  rollout_rows: int = 0


def make_optimizer(config: TrainConfig) -> optax.GradientTransformation:
  """AdamW on a warmup-cosine schedule with global-norm clipping, accumulated over
  `accumulate` micro-batches."""
  schedule = optax.warmup_cosine_decay_schedule(
    config.learning_rate / max(config.warmup_steps, 1),  # the first update already moves
    config.learning_rate,
    config.warmup_steps,
    max(config.total_steps, config.warmup_steps + 1),
    end_value=config.learning_rate * 0.1,
  )
  optimizer = optax.chain(
    optax.clip_by_global_norm(config.clip_norm), optax.adamw(schedule, weight_decay=config.weight_decay)
  )
  return optax.MultiSteps(optimizer, every_k_schedule=config.accumulate) if config.accumulate > 1 else optimizer


def tree_delays(depth: int) -> tuple[float, ...]:
  """The delays a draft with a tree `depth` deep meets, weighted as the accepted path of a
  round meets them: one query at each depth d, d tokens past the committed cache."""
  return (1.0,) * depth


def noisy_delays(key: jax.Array, batch: int, delay_weights: tuple[float, ...]) -> jax.Array:
  """The cross-attention delay j [B] of each sequence, in 1..len(delay_weights) with those
  weights: query i sees target K/V indices 0 .. i - j (the first j queries see nothing,
  as the paper's zero padding); weights (0,) give j = 0, plain causal cross-attention."""
  if not any(delay_weights):
    return jnp.zeros((batch,), jnp.int32)
  weights = jnp.asarray(delay_weights, jnp.float32)
  return 1 + jax.random.categorical(key, jnp.log(weights), shape=(batch,)).astype(jnp.int32)


def training_positions(key: jax.Array, config: TrainConfig, batch: int, length: int) -> jax.Array:
  if config.positions is Positions.ANCHOR_OFFSET:
    return anchor_offset_positions(key, batch, length, config.max_position)
  return jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (batch, length))


def frozen_target(target_graphdef, target_params):
  """The target as draft training runs it: frozen (no gradient reaches it), its
  whole-sequence forward (`causal_hidden_and_kv`) on `Impl.FLASH`, cuDNN's fused causal
  pass on a GPU. (Its Pallas kernels are built for decoding: run over a whole sequence
  with a [B, T, T] mask, they took 134 ms of a 155 ms step at 2 x 8,192 for SmolLM2 on an
  H100.)"""
  return nnx.merge(target_graphdef, target_params).with_numerics(attention=Impl.FLASH)


def draft_token_losses(
  draft_params,
  draft_graphdef,
  target,
  tokens,
  positions,
  delays,
  config: TrainConfig,
  training: bool = True,
  eval_rollout: int = 0,
):
  """Per-token losses [B, T - 1] of the draft predicting each next token of tokens [B, T],
  and hits [B, T - 1]: the draft's argmax is the label (the target's argmax). The
  cross-attention is delayed by `delays` [B], or in `training` a GLIDE draft's sees the
  blocks before each token's (`TrainConfig.cross_block`). In `training` with
  `config.rollout_depth`, a block draft's [B, D, T - 1] of each depth's pass instead
  (`rollout_passes`); out of training, those of `eval_rollout` depths where it is given."""
  dtype = jnp.dtype(config.compute_dtype)
  draft = nnx.merge(draft_graphdef, jax.tree.map(lambda p: p.astype(dtype), draft_params))
  if draft.attention is Impl.PALLAS:
    raise ValueError(
      "a draft in training needs Impl.FLASH or REFERENCE attention: the Pallas kernels have no gradient."
    )
  # (Masks follow sequence order: anchor-offset positions jump, windows count tokens.)
  target_hidden, k_all, v_all = target.causal_hidden_and_kv(tokens, positions)
  target_k, target_v = jax.lax.stop_gradient((k_all, v_all))
  blockwise = training and draft.config.kind is DraftKind.GLIDE
  teacher = jax.lax.stop_gradient(target_hidden[:, :-1]) if config.labels is Labels.TARGET else None
  if rollout_depth := (config.rollout_depth if training and not blockwise else eval_rollout):
    batch = tokens.shape[0]
    rows = min(config.rollout_rows or batch, batch) if training else batch
    passes = rollout_passes(draft, target, tokens, positions, target_k, target_v, rollout_depth, rows)

    def score(hidden, n):  # passes over the first n sequences -> (loss, hit) [P, n, T - 1]
      labels, soft = tokens[:n, 1:], None if teacher is None else teacher[:n]
      return chunked_token_losses(
        jnp.stack([h[:, :-1] for h in hidden]), target.logits, labels, config.loss_chunk, soft
      )

    if rows == batch:  # (one call: the teacher's logits once for every pass)
      scored = score(passes, batch)
    else:  # (the deeper passes' rows past `rows` scored as nothing: `draft_loss` weighs them 0)
      pad = lambda x: jnp.pad(x, ((0, 0), (0, batch - rows), (0, 0)))
      scored = [jnp.concatenate([a, pad(b)]) for a, b in zip(score(passes[:1], batch), score(passes[1:], rows))]
    return tuple(jnp.moveaxis(x, 0, 1) for x in scored)
  own = SelfAttend(mask=None, window=draft.config.self_window)
  cross = CrossAttend(
    k=target_k,
    v=target_v,
    limits=None,
    delay=None if blockwise else delays,
    block=config.cross_block if blockwise else None,
  )
  hidden, _ = draft(target, tokens, positions, own, cross)
  return chunked_token_losses(hidden[:, :-1], target.logits, tokens[:, 1:], config.loss_chunk, teacher)


def rollout_passes(draft, target, tokens, positions, target_k, target_v, depth: int, rows: int | None = None) -> list:
  """The draft's passes at tree depths 1 .. `depth` over tokens [B, T], every position i the
  query of each: the query of depth d's pass (a node at depth d - 1 of a round whose root
  sits at i - d + 1, predicting depth d) sees the target's K/V before the root (its
  cross-attention delayed by d), the first pass's K/V up to the root (the ring: committed
  tokens as the draft's first pass wrote them), and its ancestors' K/V as their own
  depths' passes wrote them (`attention.rollout_attention`), and its parent's output as the
  pass before left it (`DraftConfig.parent_features`), as at inference. Returns each
  pass's hidden states [B, T, E], depth 1 first; positions i < d - 1 have no such root.
  With `rows`, the passes beyond the first run over the first `rows` sequences only (their
  hidden states [rows, T, E])."""
  batch, length = tokens.shape
  rows = batch if rows is None else rows
  window = draft.config.self_window

  def run(d: int, n: int, rollout: Rollout | None, parents=None):  # over the first n sequences
    cross = CrossAttend(k=target_k[:, :n], v=target_v[:, :n], limits=None, delay=jnp.full((n,), d, jnp.int32))
    own = SelfAttend(mask=None, window=window, rollout=rollout)
    return draft(target, tokens[:n], positions[:n], own, cross, parents=parents)

  first, (ring_k, ring_v) = run(1, batch, None)
  ring_k, ring_v = ring_k[:, :rows], ring_v[:, :rows]
  hidden, keys, values = [first], [ring_k], [ring_v]  # each pass's K/V [L, B, T, K, D], depth 1 first
  behind = lambda x, u: jnp.pad(x, ((0, 0), (0, 0), (u, 0), (0, 0), (0, 0)))[:, :, :length]  # position i: x at i - u
  for d in range(2, depth + 1):
    # The ancestor u back of a depth-d query sat at depth d - u: its pass's K/V, u positions behind.
    if d == 2:  # (no ancestor but the root, which the ring holds)
      near = [jnp.zeros((*ring_k.shape[:3], 0, *ring_k.shape[3:]), ring_k.dtype)] * 2
    else:
      near = [jnp.stack([behind(x[d - u - 1], u) for u in range(1, d - 1)], axis=3) for x in (keys, values)]
    # The parent (position i - 1, at depth d - 1 of the same round) as its own pass left it.
    parents = jnp.pad(hidden[-1][:rows], ((0, 0), (1, 0), (0, 0)))[:, :length]
    out, (k, v) = run(d, rows, Rollout(ring_k, ring_v, *near, delay=d - 1), parents)
    hidden.append(out)
    keys.append(k)
    values.append(v)
  return hidden


def heads_states(heads_params, heads_graphdef, target, tokens, positions, config: TrainConfig):
  """The frozen target's final states [B, T, E] over tokens [B, T] and TokenSwift's heads'
  states on them [B, T, G, E]: one target forward serves every head."""
  dtype = jnp.dtype(config.compute_dtype)
  heads = nnx.merge(heads_graphdef, jax.tree.map(lambda p: p.astype(dtype), heads_params))
  hidden, _, _ = target.causal_hidden_and_kv(tokens, positions)
  hidden = jax.lax.stop_gradient(hidden)
  return hidden, heads(hidden)


def head_token_losses(target, tokens, hidden, states, config: TrainConfig, head):
  """Per-token (loss, hit) [B, T - 1] of TokenSwift's head `head` (1 .. gamma; an int or
  a traced int32), from `heads_states`: at position t it predicts the token at
  t + 1 + head, against the target's distribution at t + head (or that token, per
  `config.labels`). Its last `head` positions would predict past the sequence: their
  values are meaningless."""
  own = jnp.take(states, head - 1, axis=2)[:, :-1]  # [B, T - 1, E]
  labels = jnp.roll(tokens, -(1 + head), axis=1)[:, :-1]
  teacher = jnp.roll(hidden, -head, axis=1)[:, :-1] if config.labels is Labels.TARGET else None
  return chunked_token_losses(own, target.logits, labels, config.loss_chunk, teacher)


def draft_loss(draft_params, draft_graphdef, target, tokens, loss_mask, positions, delays, config: TrainConfig):
  """Mean loss over the predicted tokens (loss_mask [B, T] marks them; for TokenSwift's
  heads, every head's tokens). Returns (loss, (number of predicted tokens, fraction of
  them hit))."""
  model = nnx.merge(draft_graphdef, draft_params)
  if not isinstance(model, Heads):
    losses, hits = draft_token_losses(draft_params, draft_graphdef, target, tokens, positions, delays, config)
    weights = loss_mask[:, 1:].astype(jnp.float32)
    if losses.ndim == 3:  # [B, D, T - 1]: each depth's pass (training-time test), from the root on
      rooted = jnp.arange(losses.shape[2])[None, :] >= jnp.arange(losses.shape[1])[:, None]
      batch, depth = losses.shape[:2]
      deep_rows = jnp.arange(batch) < (config.rollout_rows or batch)  # the rows the deeper passes ran over
      ran = (jnp.arange(depth) == 0)[None, :] | deep_rows[:, None]  # [B, D]
      weights = weights[:, None, :] * rooted[None] * ran[:, :, None]
  else:
    gamma = model.config.gamma
    hidden, states = heads_states(draft_params, draft_graphdef, target, tokens, positions, config)
    runs = [head_token_losses(target, tokens, hidden, states, config, i) for i in range(1, gamma + 1)]
    losses, hits = (jnp.stack(x, axis=1) for x in zip(*runs))  # [B, G, T - 1]
    within = jnp.arange(tokens.shape[1] - 1)[None, :] < tokens.shape[1] - 1 - jnp.arange(1, gamma + 1)[:, None]
    weights = jnp.stack([jnp.roll(loss_mask, -(1 + i), axis=1)[:, :-1] for i in range(1, gamma + 1)], axis=1)
    weights = (weights & within[None]).astype(jnp.float32)
  count = jnp.maximum(jnp.sum(weights), 1.0)
  return jnp.sum(losses * weights) / count, (jnp.sum(weights), jnp.sum(hits * weights) / count)


def train_step(
  draft_params,
  opt_state,
  key,
  tokens,
  loss_mask,
  target_params,
  *,
  draft_graphdef,
  target_graphdef,
  optimizer: optax.GradientTransformation,
  config: TrainConfig,
):
  """One micro-batch: returns (draft_params, opt_state, metrics). Pure; `make_train_step`
  jits it, with shardings when given a mesh."""
  target = frozen_target(target_graphdef, target_params)
  batch, length = tokens.shape
  position_key, shift_key = jax.random.split(key)
  positions = training_positions(position_key, config, batch, length)
  delays = noisy_delays(shift_key, batch, config.delay_weights)
  (loss, (count, hit_rate)), grads = jax.value_and_grad(draft_loss, has_aux=True)(
    draft_params, draft_graphdef, target, tokens, loss_mask, positions, delays, config
  )
  updates, opt_state = optimizer.update(grads, opt_state, draft_params)
  draft_params = optax.apply_updates(draft_params, updates)
  return (
    draft_params,
    opt_state,
    {"loss": loss, "tokens": count, "hit_rate": hit_rate, "grad_norm": optax.global_norm(grads)},
  )


def eval_step(draft_params, tokens, target_params, *, draft_graphdef, target_graphdef, config: TrainConfig, delay=1):
  """Per-token (loss, hit) [B, T - 1] on held-out tokens [B, T] as inference sees them at
  a tree depth `delay`: vanilla positions, cross-attention delayed by that many tokens
  (depth 1, the root's prediction, reads the committed cache up to the token before it).
  TokenSwift's heads: head `delay`'s (its last `delay` positions meaningless)."""
  target = frozen_target(target_graphdef, target_params)
  batch, length = tokens.shape
  positions = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (batch, length))
  if isinstance(nnx.merge(draft_graphdef, draft_params), Heads):
    hidden, states = heads_states(draft_params, draft_graphdef, target, tokens, positions, config)
    return head_token_losses(target, tokens, hidden, states, config, delay)
  delays = jnp.full((batch,), delay, jnp.int32)
  return draft_token_losses(draft_params, draft_graphdef, target, tokens, positions, delays, config, training=False)


def eval_rollout_step(draft_params, tokens, target_params, *, draft_graphdef, target_graphdef, config, depth: int):
  """Per-token (loss, hit) [B, D, T - 1] on held-out tokens [B, T] at tree depths 1 ..
  `depth`, each as the training-time test's pass of that depth computes it (vanilla
  positions): what inference computes there, a draft reading its parents' outputs
  (`DraftConfig.parent_features`) included, which `eval_step`'s one delayed pass lacks."""
  target = frozen_target(target_graphdef, target_params)
  batch, length = tokens.shape
  positions = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (batch, length))
  return draft_token_losses(
    draft_params, draft_graphdef, target, tokens, positions, None, config, training=False, eval_rollout=depth
  )


def make_train_step(draft_graphdef, target_graphdef, optimizer, config: TrainConfig, shardings=None):
  """The jitted step `(draft_params, opt_state, key, tokens, loss_mask, target_params) ->
  (draft_params, opt_state, metrics)`, params and optimizer state donated. `shardings`:
  (draft params, optimizer state, batch, target params) shardings from `longspec_jax.ops.sharding`."""
  step = functools.partial(
    train_step, draft_graphdef=draft_graphdef, target_graphdef=target_graphdef, optimizer=optimizer, config=config
  )
  if shardings is None:
    return jax.jit(step, donate_argnums=(0, 1))
  params, opt_state, batch, target = shardings
  # (traced under the mesh: the frozen target's kernels run on each device's sequences,
  # where left to XLA every device would gather the whole batch and run all of it)
  return jax.jit(
    traced_under(batch.mesh, step),
    donate_argnums=(0, 1),
    in_shardings=(params, opt_state, None, batch, batch, target),
    out_shardings=(params, opt_state, None),
  )
