"""Token trees with a fixed node budget: what every speculative method proposes.

Node 0 is the root: the newest token, already chosen but not yet in the target's cache.
Every other node is a drafted continuation of its parent; parents come before children
(`parents[i] < i`), so a tree is also a topological order. Verification places node i at
cache slot `lengths + i` and RoPE position `lengths + depth[i]`; each node attends to the
committed prefix and to its own ancestors (the ancestor mask).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Tree:
  tokens: jax.Array  # [B, N] int32
  parents: jax.Array  # [B, N] int32: parent index, -1 for the root and for unused nodes
  depths: jax.Array  # [B, N] int32: 0 for the root
  valid: jax.Array  # [B, N] bool: False for unused nodes of the budget

  @property
  def size(self) -> int:
    return self.tokens.shape[1]

  def positions(self, lengths: jax.Array) -> jax.Array:
    """RoPE positions [B, N]: committed length + depth."""
    return lengths[:, None] + self.depths

  def ancestor_mask(self) -> jax.Array:
    """[B, N, N] bool: mask[b, i, j] = node j is node i or one of its ancestors (valid i, j).

    Transitive closure of the parent relation by repeated squaring: ceil(log2 N) small
    matrix products instead of a sequential walk.
    """
    n = self.size
    eye = jnp.eye(n, dtype=bool)[None]
    parent_of = (self.parents[:, :, None] == jnp.arange(n)[None, None, :]) & self.valid[:, :, None]
    reach = (eye | parent_of).astype(jnp.float32)  # [B, N, N]
    for _ in range(max(1, math.ceil(math.log2(n)))):
      reach = jnp.minimum(jnp.einsum("bij,bjk->bik", reach, reach), 1.0)
    both_valid = self.valid[:, :, None] & self.valid[:, None, :]
    return (reach > 0) & both_valid


def chain(root: jax.Array, drafted: jax.Array, valid: jax.Array | None = None) -> Tree:
  """A single branch: root [B] followed by drafted tokens [B, gamma] (`valid` [B, gamma]
  marks how many of them are real; an invalid node makes the rest of the chain invalid)."""
  batch, gamma = drafted.shape
  tokens = jnp.concatenate([root[:, None], drafted], axis=1)
  steps = jnp.arange(gamma + 1)
  drafted_valid = jnp.ones((batch, gamma), bool) if valid is None else jnp.cumprod(valid, axis=1).astype(bool)
  node_valid = jnp.concatenate([jnp.ones((batch, 1), bool), drafted_valid], axis=1)
  return Tree(
      tokens=tokens.astype(jnp.int32),
      parents=jnp.where(node_valid, jnp.broadcast_to(steps - 1, (batch, gamma + 1)), -1).astype(jnp.int32),
      depths=jnp.broadcast_to(steps, (batch, gamma + 1)).astype(jnp.int32),
      valid=node_valid,
  )


def static_topology(branching: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """Parents, depths and child ranks of a full tree with `branching[d]` children per node
  at depth d (e.g. TokenSwift's (1, 3, 3, 3)), nodes in breadth-first order."""
  parents, depths, ranks = [-1], [0], [0]
  frontier = [0]
  for depth, width in enumerate(branching, start=1):
    next_frontier = []
    for parent in frontier:
      for rank in range(width):
        next_frontier.append(len(parents))
        parents.append(parent)
        depths.append(depth)
        ranks.append(rank)
    frontier = next_frontier
  return np.array(parents, np.int32), np.array(depths, np.int32), np.array(ranks, np.int32)


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
    return Acceptance(path=jnp.zeros((batch, 1), jnp.int32), count=jnp.ones((batch,), jnp.int32),
                      bonus=target_tokens[:, 0].astype(jnp.int32))
  parent_choice = jnp.take_along_axis(target_tokens, jnp.maximum(tree.parents, 0), axis=1)
  matches = tree.valid & (tree.tokens == parent_choice)
  matches = matches.at[:, 0].set(True)  # the root is already chosen
  accepted = tree.valid & ~jnp.any(ancestors & ~matches[:, None, :], axis=-1)  # every ancestor matches
  best = jnp.argmax(jnp.where(accepted, tree.depths, -1), axis=1)  # deepest accepted node [B]
  on_path = jnp.take_along_axis(ancestors, best[:, None, None], axis=1)[:, 0]  # [B, N]
  at_depth = on_path[:, None, :] & (tree.depths[:, None, :] == jnp.arange(tree.size)[None, :, None])
  path = jnp.argmax(at_depth, axis=-1).astype(jnp.int32)  # [B, N]: node at depth d
  count = jnp.take_along_axis(tree.depths, best[:, None], axis=1)[:, 0] + 1
  bonus = jnp.take_along_axis(target_tokens, best[:, None], axis=1)[:, 0]
  return Acceptance(path=path, count=count.astype(jnp.int32), bonus=bonus.astype(jnp.int32))


def emitted_tokens(tree: Tree, acceptance: Acceptance) -> jax.Array:
  """Tokens this step adds after the root: accepted drafted tokens then the bonus, [B, N]
  (entries at and past `count` are unspecified)."""
  path_tokens = jnp.take_along_axis(tree.tokens, acceptance.path, axis=1)  # [B, N]; [:, 0] is the root
  shifted = jnp.concatenate([path_tokens[:, 1:], path_tokens[:, :1]], axis=1)
  index = jnp.arange(tree.size)[None, :]
  return jnp.where(index == acceptance.count[:, None] - 1, acceptance.bonus[:, None], shifted)
