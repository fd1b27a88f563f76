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
import os

import jax
import jax.numpy as jnp
import numpy as np

from longspec_jax.models.config import MAX_TREE_NODES, CapeConfig


def node_budget(vocab_size: int, batch: int = 1) -> int:
  """Most tree nodes one verification may hold on this machine: `MAX_TREE_NODES`, or
  fewer where the tree's float32 logits with the copies acceptance makes of them (about
  8 x [B, N, V]) would take more than a quarter of the device's memory."""
  stats = jax.devices()[0].memory_stats() or {}
  memory = stats.get("bytes_limit") or os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
  return max(1, min(MAX_TREE_NODES, memory // 4 // (8 * batch * vocab_size * 4)))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Tree:
  tokens: jax.Array  # [B, N] int32
  parents: jax.Array  # [B, N] int32: parent index, -1 for the root and for unused nodes
  depths: jax.Array  # [B, N] int32: 0 for the root
  valid: jax.Array  # [B, N] bool: False for unused nodes of the budget
  # [B, N, N] bool, the ancestor mask when the proposer built it as it grew the tree (a
  # beam search does), so that verification need not build it again; None: computed.
  ancestors: jax.Array | None = None
  # [B, K, C] bool: the chunks of the target's cache its verification reads for each KV
  # head (SpecAttn's sparse verification, `config.SparseVerify`: lossy); None: all of it.
  kept: jax.Array | None = None

  @property
  def size(self) -> int:
    return self.tokens.shape[1]

  def positions(self, lengths: jax.Array) -> jax.Array:
    """RoPE positions [B, N]: committed length + depth."""
    return lengths[:, None] + self.depths

  def ancestor_mask(self) -> jax.Array:
    """[B, N, N] bool: mask[b, i, j] = node j is node i or one of its ancestors (valid i, j).

    Transitive closure of the parent relation by repeated squaring: ceil(log2 N) small
    matrix products instead of a sequential walk (unless the proposer supplied it).
    """
    if self.ancestors is not None:
      return self.ancestors
    n = self.size
    eye = jnp.eye(n, dtype=bool)[None]
    parent_of = (self.parents[:, :, None] == jnp.arange(n)[None, None, :]) & self.valid[:, :, None]
    reach = (eye | parent_of).astype(jnp.float32)  # [B, N, N]
    for _ in range(max(1, math.ceil(math.log2(n)))):
      reach = jnp.minimum(jnp.einsum("bij,bjk->bik", reach, reach), 1.0)
    both_valid = self.valid[:, :, None] & self.valid[:, None, :]
    return (reach > 0) & both_valid

  def padded(self, size: int) -> Tree:
    """The tree with unused nodes appended up to `size` nodes (no token, parent or
    ancestor, not even themselves): verification runs them and acceptance never takes
    them. How a tree reaches a row count that its matrix products run without padding
    copies (`gemm.aligned_rows`)."""
    extra = size - self.size
    if extra <= 0:
      return self
    pad = lambda x, value: jnp.pad(x, ((0, 0), (0, extra)), constant_values=value)
    return Tree(
      tokens=pad(self.tokens, 0),
      parents=pad(self.parents, -1),
      depths=pad(self.depths, 0),
      valid=pad(self.valid, False),
      ancestors=jnp.pad(self.ancestor_mask(), ((0, 0), (0, extra), (0, extra))),
      kept=self.kept,
    )


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


def graft_chains(tree: Tree, drafted: jax.Array, valid: jax.Array) -> Tree:
  """The tree with M chains of drafted tokens [B, M, G] under its root merged in as a
  trie: a chain follows the tree's own nodes, and the chains before it, while its
  tokens match them (siblings stay distinct), and leaves them at its first new token.
  Chain m's nodes take slots N + m * G .. N + m * G + G - 1 after the tree's N; those it
  shares with the tree or an earlier chain, and `valid` [B, M, G] False ones with all
  after them, are unused. How prompt-lookup copies join a draft's tree (and several
  copies one tree): one verification then accepts whichever of them is right, and a
  sampled walk that accepts a shared node keeps every continuation under it.

  Built in one pass, with no loop over the chains' tokens: a chain node is the tree node
  whose path is its prefix when one is (`path` below), else the node of the first chain
  with the same prefix."""
  batch, n = tree.tokens.shape
  _, m, g = drafted.shape
  size = n + m * g
  live = jnp.cumprod(valid.astype(jnp.int32), axis=2).astype(bool)  # [B, M, G]
  # Chains c and c2 agree on their first i + 1 tokens: [B, M, M, G]
  agree = (drafted[:, :, None, :] == drafted[:, None, :, :]) & live[:, :, None, :] & live[:, None, :, :]
  # [B, M, G]: the first chain with this prefix
  first = jnp.argmax(jnp.cumprod(agree.astype(jnp.int32), axis=3), axis=2)
  tree = dataclasses.replace(tree, ancestors=tree.ancestor_mask())  # (built once, for `path` and `padded`)
  at_depth = tree.depths[:, None, None, :] == jnp.arange(1, g + 1)[None, None, :, None]  # [B, 1, G, N]
  # The token at depth d + 1 on each tree node's path, -1 beyond its depth: [B, N, G]
  path = jnp.max(jnp.where(at_depth & tree.ancestors[:, :, None, :], tree.tokens[:, None, None, :], -1), axis=-1)
  # Tree node t holds chain c's prefix of i + 1 tokens: [B, M, G, N]
  same = (path[:, None, :, :] == drafted[:, :, None, :]) & live[:, :, None, :]  # [B, M, N, G]
  on_path = jnp.cumprod(same.astype(jnp.int32), axis=3)
  holds = jnp.moveaxis(on_path, 2, 3).astype(bool) & tree.valid[:, None, None, :] & at_depth
  shared = jnp.any(holds, axis=-1)  # [B, M, G]
  slot = jnp.where(shared, jnp.argmax(holds, axis=-1), n + first * g + jnp.arange(g)[None, None, :])  # [B, M, G]
  placed = live & ~shared & (first == jnp.arange(m)[None, :, None])  # [B, M, G]
  parents = jnp.concatenate([jnp.zeros((batch, m, 1), slot.dtype), slot[:, :, :-1]], axis=2)
  # A placed node's ancestors: the root and the nodes of its prefix.
  own = jnp.arange(size)[None, None, None, :] == slot[..., None]  # [B, M, G, size]
  rows = (jnp.cumsum(own, axis=2) > 0) | (jnp.arange(size) == 0)[None, None, None, :]
  rows = (rows & placed[..., None]).reshape(batch, m * g, size)
  room = tree.padded(size)
  flat = lambda x: x.reshape(batch, m * g)
  return Tree(
    tokens=room.tokens.at[:, n:].set(flat(drafted).astype(jnp.int32)),
    parents=room.parents.at[:, n:].set(jnp.where(flat(placed), flat(parents), -1).astype(jnp.int32)),
    depths=room.depths.at[:, n:].set(jnp.broadcast_to(jnp.tile(jnp.arange(1, g + 1), m), (batch, m * g))),
    valid=room.valid.at[:, n:].set(flat(placed)),
    ancestors=room.ancestors.at[:, n:].set(rows),
    kept=tree.kept,
  )


def distinct_continuations(tokens: jax.Array, real: jax.Array, count: int) -> tuple[jax.Array, jax.Array]:
  """Of candidate continuations tokens [B, C, G] (which are real: [B, C, G]), best first,
  the first `count` that add something to a trie of those before them: each with a real
  first token, and not held whole by an earlier candidate (its real tokens a prefix of
  that one's). Returns their indices into C [B, count] and whether each was found."""
  kept = real[:, :, 0]  # [B, C]
  if count > 1:
    holds = jnp.all(
      ~real[:, :, None, :] | (real[:, None, :, :] & (tokens[:, :, None, :] == tokens[:, None, :, :])), axis=-1
    )  # [B, C, C']: C's tokens are a prefix of C''s
    earlier = jnp.arange(kept.shape[1])[:, None] > jnp.arange(kept.shape[1])[None, :]
    kept &= ~jnp.any(holds & earlier[None], axis=-1)
  rank = jnp.cumsum(kept, axis=1) - 1  # [B, C]
  chosen = kept[:, None, :] & (rank[:, None, :] == jnp.arange(count)[None, :, None])  # [B, count, C]
  return jnp.argmax(chosen, axis=-1), jnp.any(chosen, axis=-1)


def copy_tree(root: jax.Array, drafted: jax.Array, valid: jax.Array) -> Tree:
  """Prompt lookup's tree: root [B], then its M continuations [B, M, G] merged as a trie
  (`graft_chains`); one continuation is a plain chain."""
  if drafted.shape[1] == 1:
    return chain(root, drafted[:, 0], valid[:, 0])
  return graft_chains(chain(root, jnp.zeros((root.shape[0], 0), jnp.int32)), drafted, valid)


def cape_tree(root: jax.Array, top_tokens: jax.Array, confidence: jax.Array, cape: CapeConfig) -> Tree:
  """CAPE's expanded proposal as a token tree (GLIDE with a CAPE, Algorithm 1): the draft's
  greedy chain root -> c_1 -> ... -> c_gamma, c_i = top_tokens[:, i - 1, 0], and beside
  each c_i its next-best tokens top_tokens[:, i - 1, 1:1 + K_i] as leaves under c_{i - 1}
  (no descendants: CAPE grows only the chain), K_i as `cape` sizes the draft's confidence
  at that position. Each node then attends to the chain before its position and to itself:
  the paper's CAPE mask, as an ancestor mask.

  root [B]; top_tokens [B, gamma, 1 + cape.most]: each position's most likely tokens, best
  first; confidence [B, gamma]: the probability of the chain's token there. Nodes: the
  root, the chain, then `cape.most` places per position (those past K_i unused)."""
  batch, gamma, _ = top_tokens.shape
  most = cape.most
  position = np.repeat(np.arange(gamma), most)  # each expansion place's chain position (0-based)
  rank = np.tile(np.arange(1, most + 1), gamma)  # its rank among that position's tokens (0: the chain's)
  sizes = jnp.asarray(cape.sizes, jnp.int32)[
    jnp.searchsorted(jnp.asarray(cape.edges, confidence.dtype), confidence, side="left")
  ]  # [B, gamma]
  expanded = rank[None, :] <= sizes[:, position]  # [B, gamma * most]
  line = chain(root, top_tokens[:, :, 0])
  # Static layout: chain node i's ancestors are nodes 0..i; an expansion's, the chain
  # before its position (nodes 0..position) and itself.
  n = 1 + gamma + gamma * most
  parents = np.concatenate([np.arange(-1, gamma), position])
  ancestors = np.zeros((n, n), bool)
  for node in range(n):
    at = node if node <= gamma else parents[node]
    ancestors[node, : at + 1] = True
    ancestors[node, node] = True
  valid = jnp.concatenate([line.valid, expanded], axis=1)  # [B, N]
  return Tree(
    tokens=jnp.concatenate([line.tokens, top_tokens[:, position, rank].astype(jnp.int32)], axis=1),
    parents=jnp.where(valid, jnp.asarray(parents, jnp.int32)[None], -1),
    depths=jnp.broadcast_to(jnp.asarray(np.concatenate([np.arange(gamma + 1), position + 1]), jnp.int32), (batch, n)),
    valid=valid,
    ancestors=jnp.asarray(ancestors)[None] & valid[:, :, None] & valid[:, None, :],
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


def beam_offsets(widths: tuple[int, ...]) -> tuple[int, ...]:
  """Index of the first node at each depth (0 = the root) of a beam-search tree with
  `widths[d - 1]` nodes at depth d, nodes in breadth-first order; the last entry is the size."""
  return (0,) + tuple(int(x) for x in np.cumsum((1,) + tuple(widths)))


def best_children(
  top_lp: jax.Array, top_tokens: jax.Array, scores: jax.Array, width: int
) -> tuple[jax.Array, jax.Array, jax.Array]:
  """One depth of LongSpec's dynamic beam search: of all children of the frontier nodes,
  the `width` with the highest cumulative log-probability. A frontier node may get many
  children or none; nodes left without children simply stop growing (nothing moves).

  top_lp, top_tokens [B, F, k]: each frontier node's k = min(width, V) most likely next
  tokens and their log-probs, best first (no node can contribute more than `width`
  children; `Transformer.top_log_probs`); scores [B, F]: the frontier's cumulative
  log-probs. Returns (parent rank in the frontier, token, cumulative score), each
  [B, width], best first; siblings are distinct tokens.
  """
  batch, frontier, per_node = top_lp.shape
  total = (scores[:, :, None] + top_lp).reshape(batch, frontier * per_node)
  best, flat = jax.lax.top_k(total, width)  # [B, width]
  tokens = jnp.take_along_axis(top_tokens.reshape(batch, frontier * per_node), flat, axis=1)
  return (flat // per_node).astype(jnp.int32), tokens.astype(jnp.int32), best
