"""Verification of a token tree by the target: one forward pass over every node with
hybrid attention (committed prefix + ancestor-masked tree), then acceptance.

Greedy acceptance keeps the longest root-to-node path whose every token is the target's
argmax after its parent, plus the target's own next token (the bonus), so the output is
exactly what greedy AR decoding would emit.

Sampled acceptance walks the tree from the root; at each node it tests the children in
order against the target's (processed) distribution p, starting from p at that node:
a child sampled from a draft distribution q is accepted with probability
min(1, p(x)/q(x)), and on rejection p <- normalize(max(p - q, 0)); a deterministic child
(beam search, n-gram candidates, expansions) is accepted with probability p(x), and on
rejection x is removed from p. The walk moves to an accepted child; when every child of
the current node is rejected, the bonus token is drawn from what is left of p. Each
emitted token is then distributed exactly as the target's next token.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from longspec_jax.decoding.tree import Tree
from longspec_jax.models.cache import KVCache
from longspec_jax.models.config import SparseVerify
from longspec_jax.models.target import Transformer
from longspec_jax.ops.attention import layer_chunks


def verify(
  model: Transformer, tree: Tree, cache: KVCache, sparse: SparseVerify | None = None, live: jax.Array | None = None
) -> tuple[jax.Array, jax.Array, KVCache]:
  """Runs the target over all tree nodes (node i at slot lengths + i, position lengths +
  depth i). Returns float32 logits [B, N, V], the ancestor mask [B, N, N] and the cache
  with the nodes' K/V written after the prefix (lengths unchanged). With the model's
  `batch_invariant`, each node's logits are the bits an AR step at its position computes.
  A tree that carries kept chunks is verified reading only those (`sparse` says how:
  lossy, and without batch-invariant numerics). `live` [B]: the sequences still decoding;
  the others' attention reads none of their cache (their logits are never read: in a
  server's batch, a free slot would otherwise read its whole cache every round)."""
  ancestors = tree.ancestor_mask()
  invariant = model.batch_invariant and tree.kept is None
  if tree.kept is not None and sparse is None:
    raise ValueError("a tree with kept chunks is verified sparsely: give its SparseVerify.")
  sparsely = {} if tree.kept is None else dict(kept=tree.kept, sparse=sparse)
  hidden, cache = model(
    tree.tokens,
    tree.positions(cache.lengths),
    ancestors,
    cache,
    invariant=invariant,
    unroll=model.unrolled_rounds,
    reads=None if live is None else jnp.where(live, cache.lengths, 0),
    **sparsely,
  )
  return model.logits(hidden, invariant=invariant), ancestors, cache


def fraction_read(kept: jax.Array | None, lengths: jax.Array, sparse: SparseVerify | None, layers: int) -> jax.Array:
  """The share of the cached prefix's K/V (lengths [B] slots, every layer and KV head)
  that a verification keeping chunks `kept` [B, K, C] (or one per layer, [L, B, K, C])
  reads: [B] float32, 1 for a dense one (None). A sparse one reads its kept chunks' slots
  below the length in the layers from `sparse.dense_layers` on, and all of them in the
  layers before (SpecAttn's KV fraction)."""
  if kept is None:
    return jnp.ones(lengths.shape, jnp.float32)
  kept = layer_chunks(kept, layers, sparse.dense_layers)  # [L, B, K, C]
  starts = jnp.arange(kept.shape[-1]) * sparse.chunk  # [C]
  filled = jnp.clip(lengths[:, None] - starts[None, :], 0, sparse.chunk)  # [B, C]: slots below the length
  read = jnp.einsum("lbkc,bc->b", kept.astype(jnp.float32), filled.astype(jnp.float32))  # [B]
  return read / (layers * kept.shape[2] * jnp.maximum(lengths, 1))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Acceptance:
  path: jax.Array  # [B, N] int32: node index at each depth of the accepted path (valid below `count`)
  count: jax.Array  # [B] int32: accepted nodes, root included (= tokens emitted this step)
  bonus: jax.Array  # [B] int32: the target's own token after the accepted path


def accept_greedy(tree: Tree, target_tokens: jax.Array, ancestors: jax.Array) -> Acceptance:
  """Longest root-to-node path whose every token is the target's argmax at its parent.

  target_tokens [B, N]: the target's greedy token after each node. With siblings distinct,
  at most one child of an accepted node can match, so the accepted nodes form one path.
  """
  if tree.size == 1:  # the root alone (AR decoding): nothing to accept but the bonus
    batch = target_tokens.shape[0]
    return Acceptance(
      path=jnp.zeros((batch, 1), jnp.int32),
      count=jnp.ones((batch,), jnp.int32),
      bonus=target_tokens[:, 0].astype(jnp.int32),
    )
  parent_choice = jnp.take_along_axis(target_tokens, jnp.maximum(tree.parents, 0), axis=1)
  matches = tree.valid & (tree.tokens == parent_choice)
  matches = matches.at[:, 0].set(True)  # the root is already chosen
  accepted = tree.valid & ~jnp.any(ancestors & ~matches[:, None, :], axis=-1)  # every ancestor matches
  best = jnp.argmax(jnp.where(accepted, tree.depths, -1), axis=1)  # deepest accepted node [B]
  return _accept_up_to(tree, ancestors, best, jnp.take_along_axis(target_tokens, best[:, None], axis=1)[:, 0])


def walk_outcomes(
  tree: Tree,
  target_probs: jax.Array,
  ancestors: jax.Array,
  draft_probs: jax.Array | None = None,
  sampled: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
  """The exact law of the sampled verification walk (module docstring).

  target_probs [B, N, V]: the target's processed next-token distribution after each node.
  draft_probs [B, N, V] and sampled [B, N]: for nodes drawn from a draft distribution,
  that distribution (at their parent); other nodes are deterministic.
  Returns (stop [B, N]: the probability that the walk ends at node n, having accepted
  its ancestors; residual [B, N, V]: the distribution of the bonus token when it does).
  """
  batch, n, _ = target_probs.shape
  valid = tree.valid
  earlier = jnp.arange(n)[None, :, None] > jnp.arange(n)[None, None, :]  # [1, c, c']: c' < c
  same_parent = (tree.parents[:, :, None] == tree.parents[:, None, :]) & valid[:, None, :]
  if draft_probs is None:
    move, stay, residual = _deterministic_moves(tree, target_probs, same_parent & earlier)
  else:
    move, stay, residual = _sequential_moves(tree, target_probs, same_parent & earlier, draft_probs, sampled)
  below_root = ancestors & (jnp.arange(n) > 0)[None, None, :]
  reach = jnp.prod(jnp.where(below_root, move[:, None, :], 1.0), axis=-1)  # [B, N]
  return jnp.where(valid, reach * stay, 0.0), residual


def _deterministic_moves(tree: Tree, target_probs: jax.Array, earlier_sibling: jax.Array):
  """The walk's steps when every child is deterministic, in closed form: testing children
  x_1, x_2, ... with removal moves to child x_k with probability p(x_k) (the chance that
  the target's own draw is x_k) unless an earlier sibling holds the same token, and the
  bonus is drawn from p without the children's tokens. Returns (move [B, N]: P(parent ->
  node), stay [B, N]: P(every child rejected), residual [B, N, V])."""
  batch, n, _ = target_probs.shape
  rows = jnp.broadcast_to(jnp.arange(batch)[:, None], (batch, n))
  parent = jnp.maximum(tree.parents, 0)
  is_child = tree.valid & (jnp.arange(n) > 0)[None, :]
  repeated = jnp.any(earlier_sibling & (tree.tokens[:, :, None] == tree.tokens[:, None, :]), axis=-1)
  move = jnp.where(is_child & ~repeated, target_probs[rows, parent, tree.tokens], 0.0)  # p(x) at the parent
  left = target_probs.at[rows, jnp.where(is_child, parent, n), tree.tokens].set(0.0, mode="drop")  # children removed
  stay = jnp.sum(left, axis=-1)
  return move, stay, left / jnp.maximum(stay, 1e-30)[..., None]


def _sequential_moves(
  tree: Tree, target_probs: jax.Array, earlier_sibling: jax.Array, draft_probs: jax.Array, sampled: jax.Array | None
):
  """The walk's steps with children drawn from the draft among them: each parent tests its
  children in order, the residual after each test feeding the next (recursive rejection
  for sampled children, removal for deterministic ones). Returns (move, stay, residual)
  as `_deterministic_moves`."""
  batch, n, _ = target_probs.shape
  valid = tree.valid
  child_of = (tree.parents[:, None, :] == jnp.arange(n)[None, :, None]) & valid[:, None, :]  # [B, parent, child]
  rank = jnp.sum(earlier_sibling, axis=-1)  # [B, N]: place among its siblings
  sampled = jnp.zeros((batch, n), bool) if sampled is None else sampled & valid

  def test_rank(k, carry):
    residual, stay, move = carry  # [B, N, V]; stay [B, N]: P(children so far rejected); move [B, N]
    selected = child_of & (rank[:, None, :] == k)  # [B, parent, child]
    has = jnp.any(selected, axis=-1)  # [B, N]
    child = jnp.argmax(selected, axis=-1)  # [B, N]
    x = jnp.take_along_axis(tree.tokens, child, axis=1)  # [B, N]
    p_x = jnp.take_along_axis(residual, x[..., None], axis=-1)[..., 0]
    is_sampled = jnp.take_along_axis(sampled, child, axis=1)
    q = jnp.take_along_axis(draft_probs, child[..., None], axis=1)  # [B, N, V]: what the child was drawn from
    q_x = jnp.take_along_axis(q, x[..., None], axis=-1)[..., 0]
    accept = jnp.where(is_sampled, jnp.minimum(1.0, p_x / jnp.maximum(q_x, 1e-30)), p_x)
    after = jnp.where(is_sampled[..., None], jnp.maximum(residual - q, 0.0), residual)
    removed = jnp.arange(residual.shape[-1])[None, None, :] == x[..., None]
    after = jnp.where(~is_sampled[..., None] & removed, 0.0, after)
    after = after / jnp.maximum(jnp.sum(after, axis=-1, keepdims=True), 1e-30)
    accept = jnp.where(has, accept, 0.0)
    residual = jnp.where(has[..., None], after, residual)
    moved = (stay * accept)[:, :, None] * selected  # [B, parent, child]: P(move to child | at parent)
    return residual, stay * (1.0 - accept), move + jnp.sum(moved, axis=1)

  init = (target_probs, jnp.ones((batch, n), jnp.float32), jnp.zeros((batch, n), jnp.float32))
  residual, stay, move = jax.lax.fori_loop(0, jnp.max(rank) + 1, test_rank, init)  # as many as the most siblings
  return move, stay, residual


def accept_sampled(
  tree: Tree,
  target_probs: jax.Array,
  ancestors: jax.Array,
  key: jax.Array,
  draft_probs: jax.Array | None = None,
  sampled: jax.Array | None = None,
) -> Acceptance:
  """A draw of the sampled verification walk: the node it stops at, then the bonus token
  from the residual there (`walk_outcomes` gives their exact law)."""
  stop, residual = walk_outcomes(tree, target_probs, ancestors, draft_probs, sampled)
  stop_key, bonus_key = jax.random.split(key)
  best = jax.random.categorical(stop_key, jnp.log(stop), axis=-1)  # [B]
  at_best = jnp.take_along_axis(residual, best[:, None, None], axis=1)[:, 0]  # [B, V]
  bonus = jax.random.categorical(bonus_key, jnp.log(at_best), axis=-1)
  return _accept_up_to(tree, ancestors, best, bonus)


def _accept_up_to(tree: Tree, ancestors: jax.Array, best: jax.Array, bonus: jax.Array) -> Acceptance:
  """The acceptance of the path from the root to node best [B], then bonus [B]."""
  on_path = jnp.take_along_axis(ancestors, best[:, None, None], axis=1)[:, 0]  # [B, N]
  at_depth = on_path[:, None, :] & (tree.depths[:, None, :] == jnp.arange(tree.size)[None, :, None])
  path = jnp.argmax(at_depth, axis=-1).astype(jnp.int32)  # [B, N]: node at depth d
  count = jnp.take_along_axis(tree.depths, best[:, None], axis=1)[:, 0] + 1
  return Acceptance(path=path, count=count.astype(jnp.int32), bonus=bonus.astype(jnp.int32))


def emitted_tokens(tree: Tree, acceptance: Acceptance) -> jax.Array:
  """Tokens this step adds after the root: accepted drafted tokens then the bonus, [B, N]
  (entries at and past `count` are unspecified)."""
  path_tokens = jnp.take_along_axis(tree.tokens, acceptance.path, axis=1)  # [B, N]; [:, 0] is the root
  shifted = jnp.concatenate([path_tokens[:, 1:], path_tokens[:, :1]], axis=1)
  index = jnp.arange(tree.size)[None, :]
  return jnp.where(index == acceptance.count[:, None] - 1, acceptance.bonus[:, None], shifted)
