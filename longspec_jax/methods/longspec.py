"""LongSpec's proposer: a draft model's beam tree (GLIDE's draft and CAPE's tree too),
with prompt lookup's continuations grafted in as copy branches."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from longspec_jax.decoding.tree import Tree, beam_offsets, best_children, cape_tree, graft_chains
from longspec_jax.methods.prompt_lookup import PromptLookup
from longspec_jax.models.cache import RingCache
from longspec_jax.models.config import CapeConfig, SparseVerify
from longspec_jax.models.draft import CrossAttend, Draft, SelfAttend
from longspec_jax.models.target import HeadRows
from longspec_jax.ops import attention, gemm
from longspec_jax.ops.attention import causal_block_mask

# Tokens one catch-up pass takes when the draft's ring lags behind (`LongSpecDraft.catch_up`):
# after 32 copy rounds of ~5 tokens, one pass of 128 instead of ten of 16, each with its
# own launches (and, on a GPU, a loop step that waits for the host).
LAG_ROWS = 128
# Tokens one pass at a generation's start takes at most (`LongSpecDraft.start`): GLIDE's
# draft fills a cache as long as the context, in passes of this many rather than one
# pass (and one [T, T] mask) over the whole prompt.
START_ROWS = 512


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DraftState:
  """What the draft carries from round to round: its ring of K/V and, when it scores a
  subset of the vocabulary, the LM head's rows of it (copied once a generation; None:
  the whole head)."""

  ring: RingCache
  rows: HeadRows | None


@dataclasses.dataclass(frozen=True)
class LongSpecDraft:
  """LongSpec: the draft grows a tree by dynamic beam search (`widths[d - 1]` nodes at
  depth d, chosen by cumulative log-prob over all children of the previous depth). The
  same proposer runs GLIDE's draft (`--method glide`): the two drafts differ only inside
  the model (`config.DraftKind`), its ring then holding every position.

  Each round starts with one draft pass over the tokens committed since the last round
  and the root, which appends them to the ring and gives the root's next-token
  distribution; then one pass per depth over the new nodes, each attending to the ring
  and to its tree ancestors (a small K/V buffer of the tree's own nodes). Cross-attention
  sees the committed target cache only.

  `cape`: CAPE's tree instead of the beam search (GLIDE with a CAPE): a greedy chain of
  `cape.gamma` draft tokens, one pass per token, with the next-best tokens at each
  position as leaves beside it, as many as the draft's confidence there asks for
  (`tree.cape_tree`).

  `copy_tokens` > 0: prompt lookup's continuations of that many tokens (`copy_matches`
  of them, `PromptLookup`) join the tree as branches under the root (`tree.graft_chains`),
  verified in the same pass, so a round gets whichever of copying and drafting is right.

  `sparse` (SpecAttn, lossy): the tree's passes also report where their cross-attention
  looked in the target's cache (`Draft.forward`), and the tree carries, for each KV head,
  the chunks holding `sparse.p` of that mass summed over the passes' queries: what its
  verification reads (`verify.verify`).
  """

  graphdef: nnx.GraphDef
  widths: tuple[int, ...]
  copy_tokens: int = 0
  cape: CapeConfig | None = None
  copy_matches: int = 1
  sparse: SparseVerify | None = None

  @property
  def tree_size(self) -> int:
    return (self.cape.tree_size if self.cape else beam_offsets(self.widths)[-1]) + self.copy_matches * self.copy_tokens

  @property
  def depth(self) -> int:
    return max(self.cape.gamma if self.cape else len(self.widths), self.copy_tokens)

  def describe(self) -> dict:
    """The draft's tree (beam widths or CAPE's settings) and its copy branches."""
    shape = {"cape": dataclasses.asdict(self.cape)} if self.cape else {"tree_widths": list(self.widths)}
    return {**shape, "copy_tokens": self.copy_tokens, "copy_matches": self.copy_matches}

  def start(self, params, *, target, cache, history) -> DraftState:
    """The draft's state after prefill: its ring and the head rows it scores."""
    draft: Draft = nnx.merge(self.graphdef, params)
    tokens = draft.subset_tokens()
    rows = None if tokens is None else target.head_rows(tokens)
    return DraftState(ring=self.fill_ring(draft, target, cache, history), rows=rows)

  def fill_ring(self, draft: Draft, target, cache, history) -> RingCache:
    """Fills the ring with the last `window` prompt positions (< lengths; GLIDE's: all of
    them). Layer l's K/V at p depend on the l layers below over the window before p, so
    the passes run over num_layers * window positions (at most the cache's) to make them
    exact: one pass, or passes of `START_ROWS` (at most a window) in order, each joining
    the ring before the next (the ring then holds the window before each pass)."""
    cfg, lengths = draft.config, cache.lengths
    window = cfg.ring_size(cache.k.shape[2])
    span = min(cfg.num_layers * window, cache.k.shape[2])
    if span <= min(START_ROWS, window):
      positions = lengths[:, None] - span + jnp.arange(span)[None, :]  # [B, span]
      valid = positions >= 0
      keep = valid & (positions >= lengths[:, None] - window)
      return self._append(draft, target, cache, history, None, positions, valid, keep)[1]
    ring = RingCache.create(cfg, lengths.shape[0], cache.k.dtype, window)
    ring = dataclasses.replace(ring, length=jnp.maximum(lengths - span, 0))
    return self._fill(draft, target, cache, history, ring, START_ROWS, lengths)

  def propose(self, params, state: DraftState, *, target, cache, history, root):
    draft: Draft = nnx.merge(self.graphdef, params)
    root_hidden, ring = self.catch_up(draft, target, cache, history, state.ring)
    tree = self.grow(draft, target, cache, ring, root, root_hidden, state.rows)
    if self.copy_tokens:
      lookup = PromptLookup(num_tokens=self.copy_tokens, matches=self.copy_matches)
      tree = graft_chains(tree, *lookup.lookup(history, cache.lengths))
    return tree, dataclasses.replace(state, ring=ring)

  def catch_up(self, draft: Draft, target, cache, history, ring: RingCache, *, lagging: bool = False):
    """One draft pass over the tokens committed since the ring's last position and the
    root (at most `depth` + 1 of them after a round of this tree), which joins them to the
    ring. Returns the root's hidden state [B, 1, E] and the ring. With `lagging`, the ring
    may be any number of tokens behind (rounds without the draft, `auto.Adaptive`):
    passes of `LAG_ROWS` tokens first bring it within one pass of the root, starting
    where the window still matters."""
    lengths = cache.lengths

    def step(ring, span):
      first = jnp.minimum(ring.length, lengths)  # finished sequences recompute just the root
      positions = first[:, None] + jnp.arange(span)[None, :]
      hidden, ring = self._append(draft, target, cache, history, ring, positions, positions <= lengths[:, None])
      return jnp.take_along_axis(hidden, jnp.clip(lengths - first, 0, span - 1)[:, None, None], axis=1), ring

    span = gemm.aligned_rows(self.depth + 1)  # rows the draft's products take as they are
    if lagging:
      # Layer l's K/V at p depend on the l layers below over the window before p (as `start`).
      oldest = jnp.maximum(lengths - draft.config.num_layers * ring.window, 0)
      ring = dataclasses.replace(ring, length=jnp.maximum(ring.length, oldest))
      ring = self._fill(draft, target, cache, history, ring, max(LAG_ROWS, span), lengths - span + 1)
    return step(ring, span)

  def _fill(self, draft: Draft, target, cache, history, ring: RingCache, rows: int, until) -> RingCache:
    """Passes of `rows` positions (at most the ring's window: a ring takes no more in
    one write) from each ring's length, each joining the ring before the next, until
    every ring holds the positions below `until [B]`."""
    rows = min(rows, ring.window)

    def step(ring):
      positions = ring.length[:, None] + jnp.arange(rows)[None, :]  # [B, rows]
      return self._append(draft, target, cache, history, ring, positions, positions < until[:, None])[1]

    return jax.lax.while_loop(lambda ring: jnp.any(ring.length < until), step, ring)

  def grow(self, draft: Draft, target, cache, ring: RingCache, root, root_hidden, rows: HeadRows | None) -> Tree:
    """The round's tree from the root's hidden state [B, 1, E]: CAPE's or the beam
    search's, its tokens among `rows` (None: the whole vocabulary; with `sparse`,
    carrying the chunks its verification reads)."""
    looked = []  # each pass's cross-attention mass [B, K, C], with `sparse`

    def run(*args, parents):
      if self.sparse is None:
        return draft(target, *args, parents=parents)
      hidden, block_kv, mass = draft.forward(target, *args, chunk=self.sparse.chunk, parents=parents)
      looked.append(mass)
      return hidden, block_kv

    build = self._cape_tree if self.cape is not None else self._beam_tree
    scored = draft.config.vocab_size if rows is None else rows.tokens.shape[0]
    top = lambda hidden, k: target.top_log_probs(hidden, min(k, scored), rows)
    tree = build(run, top, draft.config, cache, ring, root, root_hidden)
    if self.sparse is None:
      return tree
    if not looked:  # (a one-deep tree: no pass but the root's catch-up; every chunk)
      return dataclasses.replace(tree, kept=jnp.ones(self._chunks(cache), bool))
    return dataclasses.replace(tree, kept=attention.select_chunks(sum(looked), self.sparse.p, impl=draft.attention))

  def _chunks(self, cache) -> tuple[int, int, int]:
    b, s, k = cache.k.shape[1:4]
    return b, k, -(-s // self.sparse.chunk)

  def _beam_tree(self, run, top, cfg, cache, ring: RingCache, root, root_hidden) -> Tree:
    """Per depth, the frontier's best children by cumulative log-prob (`top(hidden, k)`:
    the draft's top k), then one draft pass over them (`run(tokens, positions, own,
    cross, parents=their parents' outputs)`, the draft's)."""
    lengths = cache.lengths
    batch = root.shape[0]
    offsets = beam_offsets(self.widths)
    n = offsets[-1]
    tokens = jnp.zeros((batch, n), jnp.int32).at[:, 0].set(root)
    parents = jnp.full((batch, n), -1, jnp.int32)
    ancestors = jnp.broadcast_to(jnp.eye(n, dtype=bool), (batch, n, n))  # rows filled as nodes appear
    buffer_shape = (cfg.num_layers, batch, n, cfg.num_kv_heads, cfg.head_dim)
    buffer = (jnp.zeros(buffer_shape, cache.k.dtype), jnp.zeros(buffer_shape, cache.k.dtype))
    hidden, scores = root_hidden, jnp.zeros((batch, 1), jnp.float32)
    for depth, width in enumerate(self.widths, start=1):
      top_lp, top_tokens = top(hidden, width)  # [B, F, k]
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
      hidden, buffer = run(
        new_tokens,
        node_positions,
        SelfAttend(
          mask=ancestors[:, nodes] & drafted,
          ring=ring,
          ring_limit=lengths + 1,
          buffer=(*buffer, jnp.broadcast_to(nodes, (batch, width))),
        ),
        CrossAttend(k=cache.k, v=cache.v, limits=jnp.broadcast_to(lengths[:, None], (batch, width)), fuse=False),
        parents=jnp.take_along_axis(hidden, rank[:, :, None], axis=1),  # each new node's parent's output
      )
    depths = jnp.asarray([d for d, w in enumerate((1,) + self.widths) for _ in range(w)], jnp.int32)
    return Tree(
      tokens=tokens,
      parents=parents,
      depths=jnp.broadcast_to(depths, (batch, n)),
      valid=jnp.ones((batch, n), bool),
      ancestors=ancestors,
    )

  def _cape_tree(self, run, top, cfg, cache, ring: RingCache, root, root_hidden) -> Tree:
    """The greedy chain, keeping each position's `1 + cape.most` most likely tokens and
    the chain token's probability; one draft pass per chain token (the leaves get none)."""
    cape, lengths = self.cape, cache.lengths
    batch = root.shape[0]
    nodes = cape.gamma + 1  # the chain's, root first (in the ring, not the buffer)
    buffer_shape = (cfg.num_layers, batch, nodes, cfg.num_kv_heads, cfg.head_dim)
    buffer = (jnp.zeros(buffer_shape, cache.k.dtype), jnp.zeros(buffer_shape, cache.k.dtype))
    hidden, tops, confidence = root_hidden, [], []
    for depth in range(1, cape.gamma + 1):
      top_lp, top_tokens = top(hidden, 1 + cape.most)  # [B, 1, 1 + most]
      tops.append(top_tokens[:, 0])
      confidence.append(jnp.exp(top_lp[:, 0, 0]))
      if depth == cape.gamma:
        break
      seen = (jnp.arange(nodes) >= 1) & (jnp.arange(nodes) <= depth)  # the chain so far, this node included
      hidden, buffer = run(
        top_tokens[:, :, 0],
        jnp.broadcast_to(lengths[:, None] + depth, (batch, 1)),
        SelfAttend(
          mask=jnp.broadcast_to(seen, (batch, 1, nodes)),
          ring=ring,
          ring_limit=lengths + 1,
          buffer=(*buffer, jnp.full((batch, 1), depth)),
        ),
        CrossAttend(k=cache.k, v=cache.v, limits=lengths[:, None], fuse=False),
        parents=hidden,
      )
    return cape_tree(root, jnp.stack(tops, axis=1), jnp.stack(confidence, axis=1), cape)

  @staticmethod
  def _append(draft: Draft, target, cache, history, ring: RingCache | None, positions, valid, keep=None):
    """One draft pass over the tokens at consecutive `positions [B, T]` (where valid),
    which then join the ring (those marked `keep`, by default all valid ones; at most
    `window` of them); with no ring, a new one. Cross-attention: a query at p sees target
    slots < min(p, lengths)."""
    tokens = jnp.take_along_axis(history, jnp.clip(positions, 0, history.shape[1] - 1), axis=1)
    cfg = draft.config
    window = cfg.ring_size(cache.k.shape[2])
    limits = jnp.minimum(positions, cache.lengths[:, None])
    hidden, (k, v) = draft(
      target,
      tokens,
      positions,
      SelfAttend(mask=causal_block_mask(positions, valid, window), ring=ring, ring_limit=positions[:, 0]),
      CrossAttend(k=cache.k, v=cache.v, limits=jnp.maximum(limits, 0)),
    )
    if ring is None:
      ring = RingCache.create(cfg, positions.shape[0], cache.k.dtype, window)
    return hidden, ring.write(k, v, positions, valid if keep is None else keep)
