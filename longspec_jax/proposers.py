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

import jax
import jax.numpy as jnp
from flax import nnx

from longspec_jax import attention, gemm
from longspec_jax.adaptive import Adaptive
from longspec_jax.attention import causal_block_mask
from longspec_jax.cache import PartialCache, RingCache
from longspec_jax.config import CapeConfig, DraftKind, SparseVerify
from longspec_jax.draft import CrossAttend, Draft, SelfAttend
from longspec_jax.errors import UserError
from longspec_jax.heads import Heads
from longspec_jax.ngram import NGramTable, PromptLookup
from longspec_jax.sampling import SamplingConfig, penalize, recent_tokens
from longspec_jax.self_draft import draft_pass
from longspec_jax.tree import Tree, beam_offsets, best_children, cape_tree, chain, graft_chains, static_topology

# Tokens one catch-up pass takes when the draft's ring lags behind (`LongSpecDraft.catch_up`):
# after 32 copy rounds of ~5 tokens, one pass of 128 instead of ten of 16, each with its
# own launches (and, on a GPU, a loop step that waits for the host).
LAG_ROWS = 128
# Tokens one pass at a generation's start takes at most (`LongSpecDraft.start`): GLIDE's
# draft fills a cache as long as the context, in passes of this many rather than one
# pass (and one [T, T] mask) over the whole prompt.
START_ROWS = 512


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

  def start(self, params, *, target, cache, history) -> RingCache:
    """Fills the ring with the last `window` prompt positions (< lengths; GLIDE's: all of
    them). Layer l's K/V at p depend on the l layers below over the window before p, so
    the passes run over num_layers * window positions (at most the cache's) to make them
    exact: one pass, or passes of `START_ROWS` (at most a window) in order, each joining
    the ring before the next (the ring then holds the window before each pass)."""
    draft: Draft = nnx.merge(self.graphdef, params)
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

  def propose(self, params, ring: RingCache, *, target, cache, history, root):
    draft: Draft = nnx.merge(self.graphdef, params)
    root_hidden, ring = self.catch_up(draft, target, cache, history, ring)
    tree = self.grow(draft, target, cache, ring, root, root_hidden)
    if self.copy_tokens:
      lookup = PromptLookup(num_tokens=self.copy_tokens, matches=self.copy_matches)
      tree = graft_chains(tree, *lookup.lookup(history, cache.lengths))
    return tree, ring

  def catch_up(self, draft: Draft, target, cache, history, ring: RingCache, *, lagging: bool = False):
    """One draft pass over the tokens committed since the ring's last position and the
    root (at most `depth` + 1 of them after a round of this tree), which joins them to the
    ring. Returns the root's hidden state [B, 1, E] and the ring. With `lagging`, the ring
    may be any number of tokens behind (rounds without the draft, `adaptive.Adaptive`):
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

  def grow(self, draft: Draft, target, cache, ring: RingCache, root, root_hidden) -> Tree:
    """The round's tree from the root's hidden state [B, 1, E]: CAPE's or the beam
    search's (with `sparse`, carrying the chunks its verification reads)."""
    looked = []  # each pass's cross-attention mass [B, K, C], with `sparse`

    def run(*args):
      if self.sparse is None:
        return draft(target, *args)
      hidden, block_kv, mass = draft.forward(target, *args, chunk=self.sparse.chunk)
      looked.append(mass)
      return hidden, block_kv

    build = self._cape_tree if self.cape is not None else self._beam_tree
    tree = build(run, target, draft.config, cache, ring, root, root_hidden)
    if self.sparse is None:
      return tree
    if not looked:  # (a one-deep tree: no pass but the root's catch-up; every chunk)
      return dataclasses.replace(tree, kept=jnp.ones(self._chunks(cache), bool))
    return dataclasses.replace(tree, kept=attention.select_chunks(sum(looked), self.sparse.p, impl=draft.attention))

  def _chunks(self, cache) -> tuple[int, int, int]:
    b, s, k = cache.k.shape[1:4]
    return b, k, -(-s // self.sparse.chunk)

  def _beam_tree(self, run, target, cfg, cache, ring: RingCache, root, root_hidden) -> Tree:
    """Per depth, the frontier's best children by cumulative log-prob, then one draft
    pass over them (`run(tokens, positions, own, cross)`, the draft's)."""
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
      hidden, buffer = run(
        new_tokens,
        node_positions,
        SelfAttend(
          mask=ancestors[:, nodes] & drafted,
          ring=ring,
          ring_limit=lengths + 1,
          buffer=(*buffer, jnp.broadcast_to(nodes, (batch, width))),
        ),
        CrossAttend(k=cache.k, v=cache.v, limits=jnp.broadcast_to(lengths[:, None], (batch, width))),
      )
    depths = jnp.asarray([d for d, w in enumerate((1,) + self.widths) for _ in range(w)], jnp.int32)
    return Tree(
      tokens=tokens,
      parents=parents,
      depths=jnp.broadcast_to(depths, (batch, n)),
      valid=jnp.ones((batch, n), bool),
      ancestors=ancestors,
    )

  def _cape_tree(self, run, target, cfg, cache, ring: RingCache, root, root_hidden) -> Tree:
    """The greedy chain, keeping each position's `1 + cape.most` most likely tokens and
    the chain token's probability; one draft pass per chain token (the leaves get none)."""
    cape, lengths = self.cape, cache.lengths
    batch = root.shape[0]
    nodes = cape.gamma + 1  # the chain's, root first (in the ring, not the buffer)
    buffer_shape = (cfg.num_layers, batch, nodes, cfg.num_kv_heads, cfg.head_dim)
    buffer = (jnp.zeros(buffer_shape, cache.k.dtype), jnp.zeros(buffer_shape, cache.k.dtype))
    hidden, tops, confidence = root_hidden, [], []
    for depth in range(1, cape.gamma + 1):
      top_lp, top_tokens = target.top_log_probs(hidden, 1 + cape.most)  # [B, 1, 1 + most]
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
        CrossAttend(k=cache.k, v=cache.v, limits=lengths[:, None]),
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


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SelfDraftState:
  """TokenSwift's per-sequence state: its partial cache and its n-gram table."""

  partial: PartialCache
  table: NGramTable | None  # (None: no n-gram branches)
  tabled: jax.Array  # [B] int32: the n-grams that begin below this position are in the table


@dataclasses.dataclass(frozen=True)
class TokenSwift:
  """TokenSwift (tokenswift.md, Algorithm 1): the target drafts for itself. Each round it
  runs its newest token over its partial cache (`self_draft.draft_pass`); its own
  prediction there and its heads' (`heads.py`: `params` are theirs) give each depth's
  most likely tokens, set as a full tree with `tree_widths[d - 1]` children per node at
  depth d (the paper's ternary (1, 3, 3, 3), Medusa-style: a depth's candidates are the
  same under every parent); and the `ngrams` most frequent n-grams of the text so far
  that begin with the target's own top token (`ngram.NGramTable`, n-grams entered once
  they are `lag` tokens old, the contextual penalty's window: the paper's table lags
  as much) join it as branches (`tree.graft_chains`). Verification then runs over the
  full cache, so the draft's approximations cost acceptance, never exactness.

  Candidates are ranked by the logits under `sampling`'s contextual penalty (over the
  text up to the root; the only processor that reorders tokens), as the verification
  will weigh them. Deviation: of several fully accepted paths the walk keeps the first,
  not one at random (the paper's "random n-gram selection", exact only under greedy
  decoding)."""

  graphdef: nnx.GraphDef  # the heads'
  tree_widths: tuple[int, ...] = (1, 3, 3, 3)
  budget: int = 4096  # |B|: positions the partial cache holds (the authors' scripts: 4,096)
  sink: int = 16  # |S|: the first positions, always kept (the authors' code: 16)
  ngrams: int = 20  # k: n-gram branches a round (the paper's Table 11)
  ngram_slots: int = 32  # continuations the table holds per first token
  n: int = 4  # the paper's 4-grams: as deep as the heads' tree
  lag: int = 1024
  sampling: SamplingConfig = SamplingConfig()  # the generation's processors (the penalty ranks candidates)

  @property
  def tree_size(self) -> int:
    return len(static_topology(self.tree_widths)[0]) + self.ngrams * self.n

  @property
  def depth(self) -> int:
    return max(len(self.tree_widths), self.n if self.ngrams else 0)

  def start(self, params, *, target, cache, history) -> SelfDraftState:
    """An empty partial cache (the first round selects its positions) and the table of the
    prompt's n-grams that are `lag` tokens old (none without n-gram branches)."""
    batch = history.shape[0]
    budget = min(self.budget, cache.max_len)
    partial = PartialCache.create(target.config, batch, budget, min(self.sink, budget - 1), cache.k.dtype)
    old = cache.lengths + 1 - self.lag  # the text so far (the root included), less the lag
    table = NGramTable.build(history, old, target.config.vocab_size, self.ngram_slots, self.n) if self.ngrams else None
    return SelfDraftState(partial=partial, table=table, tabled=jnp.maximum(old - self.n + 1, 0))

  def propose(self, params, state: SelfDraftState, *, target, cache, history, root):
    heads: Heads = nnx.merge(self.graphdef, params)
    hidden, partial = draft_pass(target, state.partial, cache, root, most=self.depth + 1)
    logits = target.logits(jnp.concatenate([hidden[:, None], heads(hidden)], axis=1))  # [B, G + 1, V]
    if self.sampling.penalized:  # (the window up to the root: the tree's own tokens are left out)
      none = jnp.full((root.shape[0], 1, 1), -1, jnp.int32)
      seen = recent_tokens(history, cache.lengths, none, self.sampling, logits.shape[-1])  # [B, 1, V]
      logits = penalize(logits, seen, self.sampling)
    _, top = jax.lax.top_k(logits, max(self.tree_widths))  # [B, G + 1, W]
    parents, depths, ranks = static_topology(self.tree_widths)
    tokens = jnp.concatenate([root[:, None], top[:, depths[1:] - 1, ranks[1:]]], axis=1)
    tree = Tree(
      tokens=tokens.astype(jnp.int32),
      parents=jnp.broadcast_to(parents, tokens.shape),
      depths=jnp.broadcast_to(depths, tokens.shape),
      valid=jnp.ones(tokens.shape, bool),
    )
    if not self.ngrams:
      return tree, dataclasses.replace(state, partial=partial)
    stop = jnp.maximum(cache.lengths + 1 - self.lag - self.n + 1, state.tabled)  # n-grams now `lag` old
    table = state.table.add(history, state.tabled, stop, most=self.depth + 1)
    grams, real = table.top(top[:, 0, 0], self.ngrams)  # [B, k, n]: those that begin with its own top token
    tree = graft_chains(tree, grams, jnp.broadcast_to(real[:, :, None], grams.shape))
    return tree, SelfDraftState(partial=partial, table=table, tabled=stop)


# Decoding methods by name -> their proposer class. The draft-free ones are constructible
# with no arguments; those in DRAFT_METHODS take the draft's graphdef; `auto` uses a draft
# when one is named (`draft_spec`).
PROPOSERS = {
  "ar": RootOnly,
  "pld": PromptLookup,
  "longspec": LongSpecDraft,
  "glide": LongSpecDraft,
  "auto": Adaptive,
  "tokenswift": TokenSwift,
}
# The draft methods and the kind of draft each runs (`auto` runs LongSpec's; TokenSwift's
# "draft" is its heads).
DRAFT_KINDS = {"longspec": DraftKind.LONGSPEC, "glide": DraftKind.GLIDE, "tokenswift": DraftKind.TOKENSWIFT}
DRAFT_METHODS = tuple(DRAFT_KINDS)


def draft_kind(method: str) -> DraftKind:
  """The kind of draft `method` runs (`auto`: LongSpec's)."""
  return DRAFT_KINDS.get(method, DraftKind.LONGSPEC)


def draft_spec(method: str, named: str | None) -> str | None:
  """The draft `method` runs, given the draft a user named (None: none named; 'none':
  none): the draft methods' named one or else 'default' (the one shipped for the
  target); `auto`'s only when named. On SmolLM2, a GPU's `auto` with the shipped draft
  ran slower than the copy trie alone (`pld:24x4`) on six of seven prompt sets (H200,
  session 20; on 20 of 28 prompts on an H100, session 19): its draft rounds cost more in
  a generation than the tokens they add, so by default `auto` chooses between AR and
  prompt lookup's continuations, and `--draft default` adds the draft's rounds."""
  if method in DRAFT_METHODS:
    return named or "default"
  if method == "auto" and named != "none":
    return named
  return None


def auto_copies() -> tuple[int, int]:
  """`auto`'s prompt-lookup continuations when neither the flags nor the draft set them:
  (tokens each, how many). On a GPU, where a round of a small target costs about the
  same for a hundred nodes as for one (its kernels are launch-bound), four of 24 tokens:
  on SmolLM2 (H100, 4k, seven prompt sets) `auto` with them ran 1.04-1.93x prompt
  lookup's one of 10, median 1.45x, and with four of 16 median 1.23x
  (docs/benchmarks.md, session 19). Where the trie is dear (a large target's long
  contexts: 2.06 AR steps at Llama-3.1-8B's shape and 32k), `auto` runs its first
  continuation alone (`adaptive.Kind.CHAIN`). Elsewhere, where a round's cost grows with
  its nodes, prompt lookup's own one of 10."""
  if jax.default_backend() == "gpu":
    return 24, 4
  return PromptLookup().num_tokens, 1


def make_proposer(
  method: str,
  draft: Draft | None = None,
  tree_widths: tuple[int, ...] | None = None,
  copy_tokens: int | None = None,
  cape: CapeConfig | None = None,
  copy_matches: int | None = None,
  sampling: SamplingConfig | None = None,
  sparse: SparseVerify | None = None,
):
  """(proposer, proposer_params) for `generate`. A draft method's proposer holds the
  draft's graphdef and tree, `tree_widths` (or with `cape`, CAPE's tree) with
  `copy_matches` (default 1) prompt-lookup continuations of `copy_tokens` grafted in
  (each by default the draft's own, `DraftConfig`), and its params are the draft's.
  `pld` proposes `copy_matches` continuations of `copy_tokens` (default: one of 10, the
  published method). `auto` chooses each round among AR, prompt lookup's continuations
  (by default the draft's copy length, else `auto_copies`) and, if a draft is given, the
  draft's tree with them grafted in. GLIDE's draft takes CAPE's tree (its paper's)
  unless widths or CAPE are given. `tokenswift`'s draft is its heads (`Heads`), whose
  full tree `tree_widths` replaces; it ranks its candidates under `sampling`'s penalty.
  `sparse`: the draft methods' trees are verified sparsely (SpecAttn, lossy). The other
  methods have no params."""
  if sparse is not None and PROPOSERS.get(method) is not LongSpecDraft:
    raise UserError(
      f"sparse verification selects what the target reads from a draft's cross-attention: --method"
      f" longspec or glide, not {method}."
    )
  stored = draft.config if draft is not None else None
  if method in DRAFT_METHODS and stored is not None and stored.kind is not DRAFT_KINDS[method]:
    raise UserError(
      f"--method {method} runs {DRAFT_KINDS[method].value}'s draft, but this draft is {stored.kind.value}'s."
    )
  if method == "tokenswift":
    return _tokenswift(draft, tree_widths, copy_tokens, cape, copy_matches, sampling)
  if method == "glide" and tree_widths is None and cape is None:
    cape = CapeConfig()
  if cape is not None and stored is not None:
    cape.check_fits(stored.vocab_size)
  if method == "pld":
    return PromptLookup(num_tokens=copy_tokens or PromptLookup().num_tokens, matches=copy_matches or 1), None
  if method == "auto":
    tokens, matches = auto_copies()
    lookup = PromptLookup(
      num_tokens=copy_tokens or (stored.copy_tokens if stored else 0) or tokens, matches=copy_matches or matches
    )
    if draft is None:
      return Adaptive(lookup), None
    graphdef, params = nnx.split(draft)
    return Adaptive(lookup, LongSpecDraft(graphdef, tuple(tree_widths or stored.tree_widths), cape=cape)), params
  if method in DRAFT_METHODS:
    graphdef, params = nnx.split(draft)
    copies = stored.copy_tokens if copy_tokens is None else copy_tokens
    widths = tuple(tree_widths or stored.tree_widths)
    return PROPOSERS[method](graphdef, widths, copies, cape, copy_matches or 1, sparse), params
  return PROPOSERS[method](), None


def _tokenswift(heads: Heads, tree_widths, copy_tokens, cape, copy_matches, sampling) -> tuple[TokenSwift, nnx.State]:
  """`make_proposer`'s TokenSwift: its heads' full tree (or `tree_widths`) with
  `copy_matches` n-grams of `copy_tokens` tokens grafted (its continuations: 20 of 4 by
  default, its paper's; `copy_tokens` 0: none)."""
  if cape is not None:
    raise UserError("--method tokenswift drafts with its heads' full tree: CAPE's tree does not apply to it.")
  slots = TokenSwift.ngram_slots
  if copy_tokens == 1 or (copy_matches is not None and not 1 <= copy_matches <= slots):
    raise UserError(
      f"--method tokenswift grafts n-grams of at least 2 tokens (--copy-tokens 0: none), at most {slots}"
      f" of them a round (--copy-matches), got {copy_tokens} x {copy_matches}."
    )
  graphdef, params = nnx.split(heads)
  config = heads.config if tree_widths is None else dataclasses.replace(heads.config, tree_widths=tuple(tree_widths))
  if copy_tokens == 0:
    grams = dict(ngrams=0)
  else:
    grams = dict(n=copy_tokens or TokenSwift.n, ngrams=copy_matches or TokenSwift.ngrams)
  return TokenSwift(graphdef, config.tree_widths, **grams, sampling=sampling or SamplingConfig()), params
