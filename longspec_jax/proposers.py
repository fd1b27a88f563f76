"""Proposers: what turns the context into a token tree each round.

A proposer is a frozen (hashable) dataclass, static under jit. Its arrays, if it has any,
travel separately: `params` (e.g. draft weights, a pytree) and a per-sequence `state`
(e.g. the draft's ring buffer) that the engine carries from round to round.

  start(params, *, target, cache, history) -> state      once, after prefill
  propose(params, state, *, target, cache, history, root) -> (Tree, state)

`history [B, S]` holds each sequence's tokens with the root (the newest token, not yet in
the cache) at index `cache.lengths`. `tree_size` is the static node budget and `depth`
the deepest a node can be (the root is at depth 0).
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from flax import nnx

from longspec_jax import gemm
from longspec_jax.attention import causal_block_mask
from longspec_jax.cache import RingCache
from longspec_jax.draft import CrossAttend, Draft, SelfAttend
from longspec_jax.ngram import PromptLookup
from longspec_jax.tree import Tree, beam_offsets, best_children, chain, graft_chain


@dataclasses.dataclass(frozen=True)
class RootOnly:
  """The AR "proposal": a tree of just the root, so every round emits one target token."""

  tree_size: int = dataclasses.field(default=1, init=False)
  depth: int = dataclasses.field(default=0, init=False)

  def start(self, params, *, target, cache, history):
    return None

  def propose(self, params, state, *, target, cache, history, root):
    return chain(root, jnp.zeros((root.shape[0], 0), jnp.int32)), state


@dataclasses.dataclass(frozen=True)
class LongSpecDraft:
  """LongSpec: the draft grows a tree by dynamic beam search (`widths[d - 1]` nodes at
  depth d, chosen by cumulative log-prob over all children of the previous depth).

  Each round starts with one draft pass over the tokens committed since the last round
  and the root, which appends them to the ring and gives the root's next-token
  distribution; then one pass per depth over the new nodes, each attending to the ring
  and to its tree ancestors (a small K/V buffer of the tree's own nodes). Cross-attention
  sees the committed target cache only.

  `copy_tokens` > 0: prompt lookup's continuation of that many tokens (`PromptLookup`)
  joins the tree as a branch under the root (`tree.graft_chain`), verified in the same
  pass, so a round gets whichever of copying and drafting is right.
  """

  graphdef: nnx.GraphDef
  widths: tuple[int, ...]
  copy_tokens: int = 0

  @property
  def tree_size(self) -> int:
    return beam_offsets(self.widths)[-1] + self.copy_tokens

  @property
  def depth(self) -> int:
    return max(len(self.widths), self.copy_tokens)

  def start(self, params, *, target, cache, history) -> RingCache:
    """Fills the ring with the last `window` prompt positions (< lengths). Layer l's K/V
    at p depend on the l layers below over the window before p, so the pass runs over
    num_layers * window positions to make them exact."""
    draft: Draft = nnx.merge(self.graphdef, params)
    window = draft.config.window
    span = draft.config.num_layers * window
    positions = cache.lengths[:, None] - span + jnp.arange(span)[None, :]  # [B, span]
    valid = positions >= 0
    keep = valid & (positions >= cache.lengths[:, None] - window)
    return self._append(draft, target, cache, history, None, positions, valid, keep)[1]

  def propose(self, params, ring: RingCache, *, target, cache, history, root):
    draft: Draft = nnx.merge(self.graphdef, params)
    lengths = cache.lengths
    batch = root.shape[0]
    # Catch up: the drafted tokens accepted last round (at most depth of them) and the new
    # root, in rows the draft's products take as they are (those past the root are unused).
    first = jnp.minimum(ring.length, lengths)  # finished sequences recompute just the root
    positions = first[:, None] + jnp.arange(gemm.aligned_rows(self.depth + 1))[None, :]
    hidden, ring = self._append(draft, target, cache, history, ring, positions, positions <= lengths[:, None])
    root_hidden = jnp.take_along_axis(hidden, (lengths - first)[:, None, None], axis=1)  # [B, 1, E]

    offsets = beam_offsets(self.widths)
    n = offsets[-1]
    tokens = jnp.zeros((batch, n), jnp.int32).at[:, 0].set(root)
    parents = jnp.full((batch, n), -1, jnp.int32)
    ancestors = jnp.broadcast_to(jnp.eye(n, dtype=bool), (batch, n, n))  # rows filled as nodes appear
    cfg = draft.config
    buffer_shape = (cfg.num_layers, batch, n, cfg.num_kv_heads, cfg.head_dim)
    buffer = (jnp.zeros(buffer_shape, cache.k.dtype), jnp.zeros(buffer_shape, cache.k.dtype))
    hidden, scores = root_hidden, jnp.zeros((batch, 1), jnp.float32)
    for depth, width in enumerate(self.widths, start=1):
      top_lp, top_tokens = target.top_log_probs(hidden, min(width, target.config.vocab_size))  # [B, F, k]
      rank, new_tokens, scores = best_children(top_lp, top_tokens, scores, width)
      nodes = jnp.arange(offsets[depth], offsets[depth] + width)  # [width]
      new_parents = offsets[depth - 1] + rank  # [B, width]
      tokens = tokens.at[:, nodes].set(new_tokens)
      parents = parents.at[:, nodes].set(new_parents)
      inherited = jnp.take_along_axis(ancestors, new_parents[:, :, None], axis=1)  # [B, width, N]
      ancestors = ancestors.at[:, nodes].set(inherited | (jnp.arange(n)[None, None, :] == nodes[None, :, None]))
      if depth == len(self.widths):
        break
      node_positions = jnp.broadcast_to(lengths[:, None] + depth, (batch, width))
      drafted = jnp.arange(n)[None, None, :] > 0  # the root is in the ring, not the buffer
      hidden, buffer = draft(
          target, new_tokens, node_positions,
          SelfAttend(mask=ancestors[:, nodes] & drafted, ring=ring, ring_limit=lengths + 1,
                     buffer=(*buffer, jnp.broadcast_to(nodes, (batch, width)))),
          CrossAttend(k=cache.k, v=cache.v, limits=jnp.broadcast_to(lengths[:, None], (batch, width)),
                      layer=cfg.cross_layer),
      )
    depths = jnp.asarray([d for d, w in enumerate((1,) + self.widths) for _ in range(w)], jnp.int32)
    tree = Tree(tokens=tokens, parents=parents, depths=jnp.broadcast_to(depths, (batch, n)),
                valid=jnp.ones((batch, n), bool), ancestors=ancestors)
    if self.copy_tokens:
      tree = graft_chain(tree, *PromptLookup(num_tokens=self.copy_tokens).lookup(history, lengths))
    return tree, ring

  @staticmethod
  def _append(draft: Draft, target, cache, history, ring: RingCache | None, positions, valid, keep=None):
    """One draft pass over the tokens at consecutive `positions [B, T]` (where valid),
    which then join the ring (those marked `keep`, by default all valid ones; at most
    `window` of them); with no ring, a new one. Cross-attention: a query at p sees target
    slots < min(p, lengths)."""
    tokens = jnp.take_along_axis(history, jnp.clip(positions, 0, history.shape[1] - 1), axis=1)
    cfg = draft.config
    limits = jnp.minimum(positions, cache.lengths[:, None])
    hidden, (k, v) = draft(
        target, tokens, positions,
        SelfAttend(mask=causal_block_mask(positions, valid, cfg.window), ring=ring, ring_limit=positions[:, 0]),
        CrossAttend(k=cache.k, v=cache.v, limits=jnp.maximum(limits, 0), layer=cfg.cross_layer),
    )
    if ring is None:
      ring = RingCache.create(cfg, positions.shape[0], cache.k.dtype)
    return hidden, ring.write(k, v, positions, valid if keep is None else keep)


# Decoding methods by name -> their proposer class. The draft-free ones are constructible
# with no arguments; those in DRAFT_METHODS take the draft's graphdef.
PROPOSERS = {"ar": RootOnly, "pld": PromptLookup, "longspec": LongSpecDraft}
DRAFT_METHODS = ("longspec",)


def make_proposer(method: str, draft: Draft | None = None, tree_widths: tuple[int, ...] | None = None,
                  copy_tokens: int = 0):
  """(proposer, proposer_params) for `generate`: a draft method's proposer holds the
  draft's graphdef and tree (`tree_widths`, by default the draft's own; `copy_tokens`
  of prompt lookup grafted in) and its params are the draft's; the others have none."""
  if method in DRAFT_METHODS:
    graphdef, params = nnx.split(draft)
    return PROPOSERS[method](graphdef, tuple(tree_widths or draft.config.tree_widths), copy_tokens), params
  return PROPOSERS[method](), None
