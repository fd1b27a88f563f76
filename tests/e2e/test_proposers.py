"""The LongSpec proposer against a slow reference: dynamic beam search where every node's
draft distribution is recomputed from scratch over the whole token sequence (no ring, no
tree buffer, no catch-up)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from longspec_jax import backend
from longspec_jax.decoding.tree import cape_tree
from longspec_jax.engine import prefill
from longspec_jax.errors import UserError
from longspec_jax.methods import longspec
from longspec_jax.methods.factory import make_proposer
from longspec_jax.methods.longspec import LongSpecDraft
from longspec_jax.methods.registry import ProposerOptions
from longspec_jax.models.cache import KVCache
from longspec_jax.models.config import BLOCK_KINDS, CapeConfig, DraftConfig, DraftKind
from longspec_jax.models.draft import CrossAttend, Draft, SelfAttend, random_draft
from longspec_jax.ops.attention import causal_block_mask

from helpers import tiny_target

WIDTHS = (2, 3, 3)


@pytest.fixture(scope="module", params=list(BLOCK_KINDS), ids=[kind.value for kind in BLOCK_KINDS])
def models(tmp_path_factory, request):
  target = tiny_target("llama")
  # Two layers, so that ring K/V depend on the cross-attention too; a window shorter than
  # the prompts, so that LongSpec's ring wraps (GLIDE's self-attention sees everything);
  # fused target features, which committed tokens read, and parents' outputs, which tree
  # nodes read instead.
  config = DraftConfig.for_target(
    target.config,
    num_layers=2,
    window=8,
    kind=request.param,
    feature_layers=(0, target.config.num_layers - 1),
    parent_features=True,
  )
  return target, random_draft(config, jnp.float32, seed=3)


def reference_log_probs(target, draft, cache, b, tokens, padded: int = 32):
  """Draft log-probs after the last of `tokens` (sequence b's committed tokens, its root,
  then a tree path), recomputed over the whole sequence. A committed token at p sees
  target slots < p; the root and path tokens see the committed cache. The sequence is
  padded to `padded` tokens (after it, so causally invisible) to compile once."""
  assert len(tokens) <= padded
  return np.asarray(
    _reference_log_probs(
      target,
      draft,
      jnp.asarray([tokens + [0] * (padded - len(tokens))]),
      len(tokens) - 1,
      cache.k[:, b : b + 1],
      cache.v[:, b : b + 1],
      cache.lengths[b],
    )
  )


@nnx.jit
def _reference_log_probs(target, draft, tokens, last, k, v, length):
  positions = jnp.arange(tokens.shape[1])[None]
  mask = causal_block_mask(positions, jnp.ones_like(positions, bool), draft.config.self_window)
  own, cross = SelfAttend(mask=mask), CrossAttend(k=k, v=v, limits=jnp.minimum(positions, length))
  hidden, _ = draft(target, tokens, positions, own, cross)
  # A drafted token reads its parent's output, which rests on its own parent's: one more
  # pass per tree depth settles every path.
  for _ in WIDTHS if draft.config.parent_features else ():
    hidden, _ = draft(target, tokens, positions, own, cross, parents=jnp.pad(hidden, ((0, 0), (1, 0), (0, 0)))[:, :-1])
  return jax.nn.log_softmax(target.logits(hidden[0, last]))


def reference_beam(target, draft, cache, b, context):
  """(tokens, parents) of the dynamic beam-search tree, breadth-first, best first per depth."""
  tokens, parents = [context[-1]], [-1]
  frontier = [(0, [], 0.0)]  # (node index, path tokens, cumulative log-prob)
  for width in WIDTHS:
    candidates = []
    for node, path, score in frontier:
      log_probs = reference_log_probs(target, draft, cache, b, context + path)
      for token in np.argsort(-log_probs)[:width]:
        candidates.append((score + log_probs[token], node, path + [int(token)]))
    candidates.sort(key=lambda c: -c[0])
    frontier = []
    for score, parent, path in candidates[:width]:
      frontier.append((len(tokens), path, score))
      tokens.append(path[-1])
      parents.append(parent)
  return tokens, parents


def test_beam_tree_matches_recomputed_reference_over_two_rounds(models):
  target, draft = models
  graphdef, params = nnx.split(draft)
  proposer = LongSpecDraft(graphdef, WIDTHS)
  rng = np.random.default_rng(0)
  texts = [rng.integers(3, 211, size=40).tolist(), rng.integers(3, 211, size=40).tolist()]
  history = jnp.asarray(texts, jnp.int32)
  propose = jax.jit(
    lambda ring, cache, root: proposer.propose(params, ring, target=target, cache=cache, history=history, root=root)
  )

  # Round 1 after prefill; round 2 after the longest possible commit (depth + bonus tokens).
  first = [20, 11]
  ring = None
  for step, lengths in enumerate([first, [n + len(WIDTHS) + 1 for n in first]]):
    cache, _ = prefill(target, [t[:n] for t, n in zip(texts, lengths)], 64, 16)
    root = jnp.asarray([t[n] for t, n in zip(texts, lengths)], jnp.int32)
    if step == 0:
      ring = proposer.start(params, target=target, cache=cache, history=history)
    tree, ring = propose(ring, cache, root)
    assert tree.size == 1 + sum(WIDTHS)
    for b, (text, n) in enumerate(zip(texts, lengths)):
      tokens, parents = reference_beam(target, draft, cache, b, text[: n + 1])
      assert np.asarray(tree.tokens[b]).tolist() == tokens
      assert np.asarray(tree.parents[b]).tolist() == parents
      np.testing.assert_array_equal(np.asarray(tree.depths[b]), [0, 1, 1, 2, 2, 2, 3, 3, 3])
    np.testing.assert_array_equal(np.asarray(ring.ring.length), np.asarray(lengths) + 1)  # the root is in the ring


def test_cape_tree_matches_recomputed_reference_over_two_rounds(models):
  """CAPE on the LongSpec draft: the chain is the draft's greedy continuation, and each
  position's leaves and their number come from the draft's distribution there
  (recomputed over the whole sequence), as `tree.cape_tree` lays them out."""
  target, draft = models
  graphdef, params = nnx.split(draft)
  cape = CapeConfig(gamma=3, edges=(0.005, 0.01), sizes=(3, 2, 1))
  proposer = LongSpecDraft(graphdef, WIDTHS, cape=cape)
  assert proposer.tree_size == cape.tree_size == 13 and proposer.depth == 3
  rng = np.random.default_rng(1)
  texts = [rng.integers(3, 211, size=40).tolist(), rng.integers(3, 211, size=40).tolist()]
  history = jnp.asarray(texts, jnp.int32)
  propose = jax.jit(
    lambda ring, cache, root: proposer.propose(params, ring, target=target, cache=cache, history=history, root=root)
  )
  first, ring = [20, 11], None
  for step, lengths in enumerate([first, [n + cape.gamma + 1 for n in first]]):
    cache, _ = prefill(target, [t[:n] for t, n in zip(texts, lengths)], 64, 16)
    root = jnp.asarray([t[n] for t, n in zip(texts, lengths)], jnp.int32)
    if step == 0:
      ring = proposer.start(params, target=target, cache=cache, history=history)
    tree, ring = propose(ring, cache, root)
    for b, (text, n) in enumerate(zip(texts, lengths)):
      context, top, confidence = text[: n + 1], [], []
      for _ in range(cape.gamma):
        log_probs = reference_log_probs(target, draft, cache, b, context)
        best = np.argsort(-log_probs)[: 1 + cape.most]
        top.append(best)
        confidence.append(np.exp(log_probs[best[0]]))
        context = context + [int(best[0])]
      want = cape_tree(root[b : b + 1], jnp.asarray([top]), jnp.asarray([confidence], jnp.float32), cape)
      for field in ("tokens", "parents", "depths", "valid"):
        np.testing.assert_array_equal(np.asarray(getattr(tree, field)[b]), np.asarray(getattr(want, field)[0]))
      np.testing.assert_array_equal(np.asarray(tree.ancestors[b]), np.asarray(want.ancestors[0]))


def test_cape_needs_a_vocabulary_wider_than_its_largest_expansion(models):
  target, draft = models
  with pytest.raises(UserError, match="CAPE's largest expansion"):
    make_proposer(
      draft.config.kind.value, draft, ProposerOptions(cape=CapeConfig(sizes=(7, 5, 3, draft.config.vocab_size)))
    )


def test_longspec_state_does_not_grow_with_context_and_glides_does(models):
  target, draft = models
  proposer, params = make_proposer(draft.config.kind.value, draft)  # (the method named as the kind)

  def state_bytes(context):
    cache = jax.eval_shape(lambda: KVCache.create(target.config, 1, context, jnp.float32))
    history = jax.ShapeDtypeStruct((1, context), jnp.int32)
    start = lambda c, h: proposer.start(params, target=target, cache=c, history=h)
    ring = jax.eval_shape(start, cache, history)
    _, ring = jax.eval_shape(
      lambda c, h, r: proposer.propose(params, r, target=target, cache=c, history=h, root=jnp.zeros((1,), jnp.int32)),
      cache,
      history,
      ring,
    )
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(ring))

  if draft.config.kind is DraftKind.LONGSPEC:
    assert state_bytes(1024) == state_bytes(100 * 1024)
  else:  # (its cache holds every position: ~100x the bytes)
    assert state_bytes(100 * 1024) > 99 * state_bytes(1024)
  vocab = target.config.vocab_size
  assert all(vocab not in x.shape for x in jax.tree.leaves(params))  # embedding and LM head are the target's


def test_each_draft_method_runs_its_own_kind_of_draft(models):
  """`glide` takes a GLIDE draft and CAPE's tree by default (its paper's), beam widths
  when given; `longspec` refuses a GLIDE draft and `glide` a LongSpec one."""
  _, draft = models
  kind, other = draft.config.kind.value, next(k.value for k in DraftKind if k is not draft.config.kind)
  with pytest.raises(UserError, match=f"method {other} runs {other}'s draft, but this draft is {kind}'s"):
    make_proposer(other, draft)
  proposer, _ = make_proposer(kind, draft)
  assert (proposer.cape == CapeConfig()) == (draft.config.kind is DraftKind.GLIDE)
  assert make_proposer(kind, draft, ProposerOptions(tree_widths=(2, 2)))[0].cape is None


@pytest.mark.parametrize("gpu, copies", [(True, (24, 4)), (False, (10, 1))])
def test_prompt_lookups_continuations_by_method_and_device(models, gpu, copies, monkeypatch):
  """`pld` is prompt lookup as published unless told; `auto` proposes four continuations
  of 24 on a GPU (a round costs about the same for ~100 nodes there) and one of 10
  elsewhere; flags win, and a draft method grafts as many as it is given."""
  _, draft = models
  monkeypatch.setattr(backend, "on_gpu", lambda: gpu)
  assert make_proposer("pld")[0].tree_size == 11
  assert make_proposer("pld", None, ProposerOptions(copy_tokens=6, copy_matches=3))[0].tree_size == 19
  lookup = make_proposer("auto")[0].lookup
  assert (lookup.num_tokens, lookup.matches) == copies
  lookup = make_proposer("auto", draft, ProposerOptions(copy_tokens=5, copy_matches=2))[0].lookup
  assert (lookup.num_tokens, lookup.matches) == (5, 2)
  if draft.config.kind is DraftKind.LONGSPEC:
    grafted = make_proposer("longspec", draft, ProposerOptions(tree_widths=(2, 2), copy_tokens=3, copy_matches=2))[0]
    assert grafted.tree_size == 1 + 2 + 2 + 2 * 3


def test_a_start_in_passes_fills_the_ring_as_one_pass_does(models, monkeypatch):
  """Passes of `START_ROWS` (GLIDE's over a long prompt; LongSpec's when its layers span
  more than one) leave the ring one pass leaves: each pass reads the ring the ones before
  filled."""
  target, draft = models
  rng = np.random.default_rng(11)
  prompts = [rng.integers(3, 200, size=n).tolist() for n in (29, 13)]
  cache, _ = prefill(target, prompts, 64)
  history = jnp.asarray([p + [0] * (64 - len(p)) for p in prompts])
  proposer, params = make_proposer(draft.config.kind.value, draft, ProposerOptions(tree_widths=WIDTHS))
  start = lambda: proposer.start(params, target=target, cache=cache, history=history).ring
  whole = start()
  monkeypatch.setattr(longspec, "START_ROWS", 5)
  passes = start()
  np.testing.assert_array_equal(np.asarray(passes.positions), np.asarray(whole.positions))
  np.testing.assert_array_equal(np.asarray(passes.length), np.asarray(whole.length))
  held = np.asarray(whole.positions)[:, None, :, None, None] >= 0  # [B, 1, W, 1, 1]: slots written
  for got, want in ((passes.k, whole.k), (passes.v, whole.v)):
    np.testing.assert_allclose(
      np.where(held.swapaxes(0, 1), np.asarray(got), 0), np.where(held.swapaxes(0, 1), np.asarray(want), 0), atol=2e-5
    )


def test_a_draft_scoring_a_vocabulary_subset_proposes_its_tokens_alone():
  """A draft that scores some tokens (FR-Spec) grows its tree from them alone; scoring
  every token through a ranking (a permutation) grows the tree of the whole head.
  (LongSpec's draft: the subset is the proposer's, the same for GLIDE's.)"""
  target = tiny_target("llama")
  draft = random_draft(DraftConfig.for_target(target.config, num_layers=2, window=8), jnp.float32, seed=3)
  vocab = target.config.vocab_size
  rng = np.random.default_rng(5)
  prompts = [rng.integers(3, vocab, size=n).tolist() for n in (21, 14)]
  cache, _ = prefill(target, prompts, 64)
  history = jnp.asarray([p + [0] * (64 - len(p)) for p in prompts])
  root = jnp.asarray([p[-1] for p in prompts], jnp.int32)
  cache = dataclasses.replace(cache, lengths=cache.lengths - 1)  # the last token is the root

  def tree(config, ranking=None):
    subset = Draft(config, jnp.float32, rngs=nnx.Rngs(0), attention=draft.attention, ranking=ranking)
    nnx.update(subset, nnx.state(draft, nnx.Param))
    proposer, params = make_proposer(config.kind.value, subset, ProposerOptions(tree_widths=WIDTHS))
    state = proposer.start(params, target=target, cache=cache, history=history)
    return proposer.propose(params, state, target=target, cache=cache, history=history, root=root)[0]

  whole = tree(draft.config)
  ranking = rng.permutation(vocab)
  permuted = tree(dataclasses.replace(draft.config, vocab_subset=vocab), ranking)
  for field in ("tokens", "parents", "depths"):
    np.testing.assert_array_equal(np.asarray(getattr(permuted, field)), np.asarray(getattr(whole, field)))
  few = tree(dataclasses.replace(draft.config, vocab_subset=40), ranking)
  assert np.isin(np.asarray(few.tokens)[:, 1:], ranking[:40]).all()
  assert not np.isin(np.asarray(whole.tokens)[:, 1:], ranking[:40]).all()
