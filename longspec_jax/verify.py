"""Verification of a token tree by the target: one forward pass over every node with
hybrid attention (committed prefix + ancestor-masked tree), then acceptance.

Greedy acceptance keeps the longest root-to-node path whose every token is the target's
argmax after its parent, plus the target's own next token (the bonus), so the output is
exactly what greedy AR decoding would emit.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from longspec_jax.cache import KVCache
from longspec_jax.target import Transformer
from longspec_jax.tree import Tree


def verify(model: Transformer, tree: Tree, cache: KVCache, impl: str) -> tuple[jax.Array, jax.Array, KVCache]:
  """Runs the target over all tree nodes (node i at slot lengths + i, position lengths +
  depth i). Returns float32 logits [B, N, V], the ancestor mask [B, N, N] and the cache
  with the nodes' K/V written after the prefix (lengths unchanged)."""
  ancestors = tree.ancestor_mask()
  hidden, cache = model(tree.tokens, tree.positions(cache.lengths), ancestors, cache, impl)
  return model.logits(hidden), ancestors, cache


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
