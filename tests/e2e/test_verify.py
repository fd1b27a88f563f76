"""Greedy acceptance on random trees against a slow pure-Python walk; the sampled walk's
exact law against AR sampling; batch-invariant verification against AR steps, bit for bit."""

import dataclasses
import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hypothesis import given
from hypothesis import strategies as st

from longspec_jax.decoding.sampling import SamplingConfig, probs
from longspec_jax.decoding.tree import Tree, chain, graft_chains, static_topology
from longspec_jax.decoding.tree import cape_tree as build_cape_tree
from longspec_jax.decoding.tree import copy_tree as build_copy_tree
from longspec_jax.decoding.verify import (
  accept_greedy,
  accept_sampled,
  emitted_tokens,
  fraction_read,
  verify,
  walk_outcomes,
)
from longspec_jax.engine import prefill
from longspec_jax.methods.prompt_lookup import PromptLookup
from longspec_jax.models.config import CapeConfig

from helpers import examples, random_tree, tiny_target


def reference_accept(parents, valid, tokens, target):
  """Walk from the root, taking the child that equals the target's choice."""
  path = [0]
  while True:
    children = [j for j in range(len(parents)) if valid[j] and parents[j] == path[-1] and tokens[j] == target[path[-1]]]
    if not children:
      return path, target[path[-1]]
    path.append(children[0])


@examples(12)
@given(seed=st.integers(0, 2**31 - 1), batch=st.integers(1, 3), size=st.integers(1, 24))
def test_random_trees_match_python_reference(seed, batch, size):
  rng = np.random.default_rng(seed)
  tree, parents, depths, valid, tokens, target = random_tree(rng, batch, size, vocab=64)

  @jax.jit  # (one program instead of every op compiled eagerly for this example's shapes)
  def run(tree, target):
    acceptance = accept_greedy(tree, target, tree.ancestor_mask())
    return acceptance, emitted_tokens(tree, acceptance)

  acceptance, emitted = jax.tree.map(np.asarray, run(tree, jnp.asarray(target, jnp.int32)))  # (read on the host)
  for b in range(batch):
    path, bonus = reference_accept(parents[b], valid[b], tokens[b], target[b])
    count = int(acceptance.count[b])
    assert count == len(path)
    assert list(np.asarray(acceptance.path[b, :count])) == path
    assert int(acceptance.bonus[b]) == bonus
    assert list(emitted[b, :count]) == [tokens[b, j] for j in path[1:]] + [bonus]


def test_invalid_nodes_are_never_accepted():
  tree = chain(
    jnp.array([7, 8]), jnp.array([[1, 2, 3], [4, 5, 6]]), jnp.array([[True, True, False], [True, False, True]])
  )
  acceptance = accept_greedy(tree, jnp.array([[1, 2, 3, 0], [4, 5, 6, 0]]), tree.ancestor_mask())
  np.testing.assert_array_equal(np.asarray(acceptance.count), [3, 2])
  np.testing.assert_array_equal(np.asarray(acceptance.bonus), [3, 5])


# --- Sampled verification: the exact law of the emitted tokens equals AR sampling. ---

V = 5  # vocabulary of the toy models
EMITTED = 3  # the law of the first 3 emitted tokens is compared


_probs = jax.jit(probs, static_argnums=2)
_walk = jax.jit(walk_outcomes)


@functools.cache
def toy_distribution(context: tuple, config: SamplingConfig, salt: int = 0) -> np.ndarray:
  """A fixed random model of the next token after `context`, through the processors
  (the penalty sees the last `penalty_window` tokens of the context)."""
  logits = np.random.default_rng([salt, *context]).normal(0, 2, V)
  seen = np.zeros(V, bool)
  seen[list(context[-config.penalty_window :])] = True
  return np.asarray(_probs(jnp.asarray(logits, jnp.float32), jnp.asarray(seen), config), np.float64)


def walk_law(nodes, context, config):
  """{(node, bonus): probability} of one verification round over the tree `nodes`
  (list of (parent, token, draft distribution or None), the root first)."""
  n = len(nodes)
  paths = [()]
  for parent, token, _ in nodes[1:]:
    paths.append(paths[parent] + (token,))
  target = np.stack([toy_distribution(context + path, config) for path in paths])
  draft = np.stack([np.zeros(V) if q is None else q for _, _, q in nodes])
  tree = Tree(
    tokens=jnp.asarray([[t for _, t, _ in nodes]], jnp.int32),
    parents=jnp.asarray([[p for p, _, _ in nodes]], jnp.int32),
    depths=jnp.asarray([[len(path) for path in paths]], jnp.int32),
    valid=jnp.ones((1, n), bool),
  )
  sampled = [q is not None for _, _, q in nodes]
  draft_args = (jnp.asarray(draft[None], jnp.float32), jnp.asarray([sampled])) if any(sampled) else ()  # as the engine
  stop, residual = _walk(tree, jnp.asarray(target[None], jnp.float32), tree.ancestor_mask(), *draft_args)
  stop, residual = np.asarray(stop[0], np.float64), np.asarray(residual[0], np.float64)
  return {(paths[i], x): stop[i] * residual[i, x] for i in range(n) for x in range(V) if stop[i] * residual[i, x] > 0}


def speculative_law(trees, config, context=(0,), need=EMITTED, memo=None):
  """Exact law of the next `need` emitted tokens when every round verifies a tree drawn
  from trees(context): a list of (probability, nodes)."""
  memo = {} if memo is None else memo
  if (context, need) in memo:
    return memo[context, need]
  law = {}
  for tree_prob, nodes in trees(context):
    for (path, bonus), p in walk_law(nodes, context, config).items():
      emitted = path + (bonus,)
      if len(emitted) >= need:
        law[emitted[:need]] = law.get(emitted[:need], 0.0) + tree_prob * p
      else:
        for rest, q in speculative_law(trees, config, context + emitted, need - len(emitted), memo).items():
          law[emitted + rest] = law.get(emitted + rest, 0.0) + tree_prob * p * q
  memo[context, need] = law
  return law


def ar_law(config, context=(0,), need=EMITTED):
  law = {}
  for tokens in itertools.product(range(V), repeat=need):
    p = 1.0
    for i, token in enumerate(tokens):
      p *= toy_distribution(context + tokens[:i], config)[token]
    if p > 0:
      law[tokens] = p
  return law


def draft_distribution(context):
  """The draft: another toy model, sharper, so it disagrees with the target."""
  return toy_distribution(context, SamplingConfig(temperature=0.5), salt=1)


def chain_tree(context, length=3):
  tokens = np.random.default_rng([2, *context]).integers(0, V, length)
  return [(1.0, [(-1, context[-1], None)] + [(i, int(t), None) for i, t in enumerate(tokens)])]


def beam_tree(context):
  """Two best draft tokens at the root, each with its two best children (deterministic)."""
  nodes = [(-1, context[-1], None)]
  for a in np.argsort(-draft_distribution(context))[:2]:
    nodes.append((0, int(a), None))
  for parent in (1, 2):
    for b in np.argsort(-draft_distribution(context + (nodes[parent][1],)))[:2]:
      nodes.append((parent, int(b), None))
  return [(1.0, nodes)]


def copy_tree(context):
  """`beam_tree` with prompt lookup's two latest distinct 3-token continuations of the
  context grafted in, as LongSpec with copy branches builds it (`tree.graft_chains`;
  shared nodes merged, so a copy may continue under a beam node, or under the other
  copy, or add none)."""
  nodes = beam_tree(context)[0][1]
  tree = Tree(
    tokens=jnp.asarray([[t for _, t, _ in nodes]], jnp.int32),
    parents=jnp.asarray([[p for p, _, _ in nodes]], jnp.int32),
    depths=jnp.asarray([[0, 1, 1, 2, 2, 2, 2]], jnp.int32),
    valid=jnp.ones((1, len(nodes)), bool),
  )
  history = jnp.asarray([list(context) + [0] * 8], jnp.int32)  # the engine's history has room past the root
  drafted, valid = PromptLookup(num_tokens=3, matches=2).lookup(history, jnp.asarray([len(context) - 1]))
  return [(1.0, nodes_of(graft_chains(tree, drafted, valid)))]


def copies_only(context):
  """Prompt lookup's tree alone: the root and the latest three distinct 3-token
  continuations of the context as a trie (`tree.copy_tree`)."""
  history = jnp.asarray([list(context) + [0] * 8], jnp.int32)
  drafted, valid = PromptLookup(num_tokens=3, matches=3).lookup(history, jnp.asarray([len(context) - 1]))
  return [(1.0, nodes_of(build_copy_tree(jnp.asarray([context[-1]]), drafted, valid)))]


def nodes_of(tree: Tree) -> list:
  """A one-sequence `Tree`'s used nodes as (parent, token, no draft law), renumbered."""
  keep = [i for i in range(tree.size) if bool(tree.valid[0, i])]
  index = {old: new for new, old in enumerate(keep)}
  return [(index.get(int(tree.parents[0, i]), -1), int(tree.tokens[0, i]), None) for i in keep]


def random_tree_of_context(context, size=6):
  """Random shape, random tokens (repeated siblings included), deterministic children."""
  rng = np.random.default_rng([3, *context])
  return [
    (
      1.0,
      [(-1, context[-1], None)] + [(int(rng.integers(0, i)), int(rng.integers(0, V)), None) for i in range(1, size)],
    )
  ]


def cape_tree(context):
  """CAPE's expanded proposal (`tree.cape_tree`): the draft's greedy 2-token chain, and
  beside each of its tokens the draft's next-best ones there, two where its confidence
  is at most 0.5, else one."""
  cape = CapeConfig(gamma=2, edges=(0.5,), sizes=(2, 1))
  top, confidence, after = [], [], context
  for _ in range(cape.gamma):
    q = draft_distribution(after)
    best = np.argsort(-q)[: 1 + cape.most]
    top.append(best)
    confidence.append(q[best[0]])
    after += (int(best[0]),)
  tree = build_cape_tree(jnp.asarray([context[-1]]), jnp.asarray([top]), jnp.asarray([confidence]), cape)
  return [(1.0, nodes_of(tree))]


def tokenswift_tree(context):
  """TokenSwift's tree (`tokenswift.TokenSwift`): a full (1, 2, 2) tree whose depth d holds
  the top tokens of a head's prediction d places ahead of the root, the same under every
  parent (`tree.static_topology`), with two 3-token n-grams that begin with its depth-1
  token grafted in (`tree.graft_chains`)."""
  parents, depths, ranks = static_topology((1, 2, 2))
  top = [np.argsort(-toy_distribution(context, SamplingConfig(temperature=0.5), salt=2 + d))[:2] for d in range(3)]
  tokens = [context[-1]] + [int(top[d - 1][r]) for d, r in zip(depths[1:], ranks[1:])]
  tree = Tree(
    tokens=jnp.asarray([tokens], jnp.int32),
    parents=jnp.asarray([parents]),
    depths=jnp.asarray([depths]),
    valid=jnp.ones((1, len(tokens)), bool),
  )
  grams = np.random.default_rng([4, *context]).integers(0, V, (2, 3))
  grams[:, 0] = tokens[1]
  return [(1.0, nodes_of(graft_chains(tree, jnp.asarray(grams[None], jnp.int32), jnp.ones((1, 2, 3), bool))))]


def sampled_tree(context):
  """Two children drawn i.i.d. from the draft at the root, the first with one child drawn
  from the draft after it: every draw enumerated with its probability."""
  q0 = draft_distribution(context)
  out = []
  for a, b in itertools.product(range(V), repeat=2):
    q1 = draft_distribution(context + (a,))
    for c in range(V):
      nodes = [(-1, context[-1], None), (0, a, q0), (0, b, q0), (1, c, q1)]
      out.append((q0[a] * q0[b] * q1[c], nodes))
  return out


CONFIGS = [
  SamplingConfig(temperature=1.0),
  SamplingConfig(temperature=0.6, top_k=3),
  SamplingConfig(temperature=1.0, top_p=0.8, min_p=0.1),
  SamplingConfig(temperature=1.0, penalty=1.5, penalty_window=2),
]


@pytest.mark.parametrize(
  "trees",
  [chain_tree, beam_tree, copy_tree, copies_only, random_tree_of_context, cape_tree, tokenswift_tree, sampled_tree],
)
@pytest.mark.parametrize("config", CONFIGS, ids=["t1", "top-k", "top-p,min-p", "penalty"])
def test_emitted_tokens_follow_the_target_exactly(trees, config):
  want = ar_law(config)
  got = speculative_law(trees, config)
  assert abs(sum(got.values()) - 1.0) < 1e-6
  for tokens in set(want) | set(got):
    assert abs(got.get(tokens, 0.0) - want.get(tokens, 0.0)) < 1e-6, tokens


@pytest.mark.parametrize("seed", range(4))
def test_closed_form_walk_equals_the_sequential_one(seed):
  """Deterministic children: the closed form (what the engine runs) and the rank-by-rank
  walk with no sampled child agree, on random trees with repeated siblings and invalid nodes."""
  rng = np.random.default_rng(seed)
  batch, n, vocab = 3, 12, 7
  parents = np.stack([[-1] + [int(rng.integers(0, i)) for i in range(1, n)] for _ in range(batch)])
  depths = np.zeros((batch, n), int)
  for i in range(1, n):
    depths[:, i] = depths[np.arange(batch), parents[:, i]] + 1
  valid = np.ones((batch, n), bool)
  valid[:, 1:] = rng.random((batch, n - 1)) < 0.8
  for i in range(1, n):  # children of invalid nodes are invalid
    valid[:, i] &= valid[np.arange(batch), parents[:, i]]
  tree = Tree(
    tokens=jnp.asarray(rng.integers(0, 3, (batch, n)), jnp.int32),
    parents=jnp.asarray(parents, jnp.int32),
    depths=jnp.asarray(depths, jnp.int32),
    valid=jnp.asarray(valid),
  )
  target = jnp.asarray(rng.dirichlet(np.ones(vocab), (batch, n)), jnp.float32)
  draft = jnp.asarray(rng.dirichlet(np.ones(vocab), (batch, n)), jnp.float32)
  closed = walk_outcomes(tree, target, tree.ancestor_mask())
  sequential = walk_outcomes(tree, target, tree.ancestor_mask(), draft, jnp.zeros((batch, n), bool))
  for a, b in zip(closed, sequential):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6)
  np.testing.assert_allclose(np.asarray(closed[0]).sum(-1), 1.0, atol=1e-5)


@examples(10)
@given(seed=st.integers(0, 2**31 - 1), size=st.integers(1, 20), extra=st.integers(1, 9))
def test_padded_trees_accept_and_walk_as_the_tree(seed, size, extra):
  """Unused nodes appended for row alignment change neither the greedy acceptance nor
  the sampled walk's law (they get no probability)."""
  rng = np.random.default_rng(seed)
  tree, *_, target = random_tree(rng, 2, size, vocab=64)
  bigger = tree.padded(size + extra)
  assert bigger.size == size + extra and tree.padded(size) is tree
  target_padded = np.concatenate([target, rng.integers(0, 64, (2, extra))], axis=1)
  # (jitted: one program each instead of every op compiled eagerly for this example's shapes)
  greedy = jax.jit(lambda tree, target: accept_greedy(tree, target, tree.ancestor_mask()))
  a = greedy(tree, jnp.asarray(target, jnp.int32))
  b = greedy(bigger, jnp.asarray(target_padded, jnp.int32))
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y)[:, : x.shape[1]] if x.ndim > 1 else np.asarray(y))
  p = jnp.asarray(rng.dirichlet(np.ones(64), (2, size + extra)), jnp.float32)
  walk = jax.jit(lambda tree, p: walk_outcomes(tree, p, tree.ancestor_mask()))
  stop, residual = walk(tree, p[:, :size])
  stop_padded, residual_padded = walk(bigger, p)
  np.testing.assert_allclose(np.asarray(stop_padded), np.pad(np.asarray(stop), ((0, 0), (0, extra))), atol=1e-7)
  np.testing.assert_allclose(np.asarray(residual_padded)[:, :size], np.asarray(residual), atol=1e-7)


def test_a_draw_follows_the_walks_law():
  config = SamplingConfig(temperature=1.0)
  nodes = beam_tree((0,))[0][1]
  law = walk_law(nodes, (0,), config)
  paths = [()]
  for parent, token, _ in nodes[1:]:
    paths.append(paths[parent] + (token,))
  target = np.stack([toy_distribution((0,) + path, config) for path in paths])
  tree = Tree(
    tokens=jnp.asarray([[t for _, t, _ in nodes]] * 4000, jnp.int32),
    parents=jnp.asarray([[p for p, _, _ in nodes]] * 4000, jnp.int32),
    depths=jnp.asarray([[len(p) for p in paths]] * 4000, jnp.int32),
    valid=jnp.ones((4000, 7), bool),
  )
  acceptance = accept_sampled(
    tree, jnp.asarray(np.broadcast_to(target, (4000, 7, V)), jnp.float32), tree.ancestor_mask(), jax.random.key(0)
  )
  emitted = np.asarray(emitted_tokens(tree, acceptance))
  counts = {}
  for row, count in zip(emitted, np.asarray(acceptance.count)):
    key = (tuple(row[: count - 1]), int(row[count - 1]))
    counts[key] = counts.get(key, 0) + 1
  for key, p in law.items():  # 4000 draws: within 4.5 standard deviations
    assert abs(counts.get(key, 0) / 4000 - p) < 4.5 * np.sqrt(p * (1 - p) / 4000) + 1e-3, key


@pytest.mark.parametrize("kind", ["llama", "qwen2"])  # a separate LM head; a tied one with q/k/v biases
def test_batch_invariant_verification_computes_the_ar_bits(kind, tmp_path):
  """bf16: with `batch_invariant`, every node on a random tree's paths gets the logits an
  AR step at its position computes alone, bit for bit (the kernels interpreted on CPU),
  after a 400-token prefill (the cache spans two split-K ranges)."""
  model = tiny_target(kind, jnp.bfloat16).with_numerics(batch_invariant=True)
  graphdef, params = nnx.split(model)
  run = jax.jit(lambda params, tree, cache: verify(nnx.merge(graphdef, params), tree, cache)[::2])
  rng = np.random.default_rng(4)
  cache, _ = prefill(model, rng.integers(3, 211, size=(2, 400)).tolist(), 512)
  tree = random_tree(rng, 2, 12, 211)[0]
  tree = Tree(tokens=tree.tokens, parents=tree.parents, depths=tree.depths, valid=jnp.ones_like(tree.valid))
  many, _ = run(params, tree, cache)  # [B, N, V]
  depths, parents = np.asarray(tree.depths), np.asarray(tree.parents)
  deepest = depths.argmax(axis=1)
  paths = []
  for b, node in enumerate(deepest):
    path = [int(node)]
    while parents[b, path[-1]] >= 0:
      path.append(int(parents[b, path[-1]]))
    paths.append(path[::-1])
  for depth in range(max(map(len, paths))):  # AR along each sequence's deepest path
    nodes = [path[min(depth, len(path) - 1)] for path in paths]
    alone, cache = run(
      params, chain(tree.tokens[jnp.arange(2), jnp.asarray(nodes)], jnp.zeros((2, 0), jnp.int32)), cache
    )
    for b, path in enumerate(paths):
      if depth < len(path):
        np.testing.assert_array_equal(np.asarray(alone[b, 0]), np.asarray(many[b, nodes[b]]))
    cache = cache.advance(1)


def test_a_tree_with_kept_chunks_is_verified_reading_only_those(tmp_path):
  """float32: every chunk kept = the dense verification; kept chunks = the target's
  sparse read; padding and grafting keep them; kept without its SparseVerify is refused."""
  from longspec_jax.models.config import SparseVerify

  model = tiny_target("qwen2")
  config = model.config
  rng = np.random.default_rng(8)
  cache, _ = prefill(model, rng.integers(3, 211, size=(2, 70)).tolist(), 96)
  tree = random_tree(rng, 2, 6, 211)[0]
  sparse = SparseVerify(0.9, chunk=16, dense_layers=1)
  every = jnp.ones((2, config.num_kv_heads, 6), bool)
  kept = jnp.asarray(rng.random((2, config.num_kv_heads, 6)) < 0.5)
  dense_logits, ancestors, dense_cache = verify(model, tree, cache)
  logits, _, _ = verify(model, dataclasses.replace(tree, kept=every), cache, sparse)
  np.testing.assert_allclose(np.asarray(logits), np.asarray(dense_logits), rtol=1e-5, atol=1e-5)
  padded = dataclasses.replace(tree, kept=kept).padded(9)
  assert padded.kept is not None and padded.size == 9
  logits, _, _ = verify(model, padded, cache, sparse)
  hidden, _ = model(tree.tokens, tree.positions(cache.lengths), ancestors, cache, kept=kept, sparse=sparse)
  np.testing.assert_allclose(np.asarray(logits[:, :6]), np.asarray(model.logits(hidden)), rtol=1e-5, atol=1e-5)
  assert not np.allclose(np.asarray(logits[:, :6]), np.asarray(dense_logits), atol=1e-4)
  grafted = graft_chains(dataclasses.replace(tree, kept=kept), jnp.full((2, 1, 2), 5), jnp.ones((2, 1, 2), bool))
  assert grafted.kept is kept
  # The share read: kept chunks' slots below each length, counted one by one; layers
  # before dense_layers read everything.
  lengths = jnp.asarray([70, 37])
  layers = config.num_layers
  share = [
    np.mean(
      [
        sum(bool(kept[b, k, s // 16]) for s in range(int(lengths[b]))) / int(lengths[b])
        for k in range(config.num_kv_heads)
      ]
    )
    for b in range(2)
  ]
  np.testing.assert_allclose(
    np.asarray(fraction_read(padded.kept, lengths, sparse, layers)),
    (1 + (layers - 1) * np.asarray(share)) / layers,
    rtol=1e-6,
  )
  np.testing.assert_array_equal(np.asarray(fraction_read(None, lengths, None, layers)), [1.0, 1.0])
  with pytest.raises(ValueError, match="SparseVerify"):
    verify(model, dataclasses.replace(tree, kept=kept), cache)


def test_a_finished_sequence_reads_none_of_its_cache_and_keeps_it():
  """With `live`, the live rows' logits and cache writes are those of a plain verification
  (float32); a finished row reads nothing, and its committed prefix (which a slot keeps
  for its next request) is untouched: only its tree's scratch slots after it differ."""
  model = tiny_target("llama")
  rng = np.random.default_rng(12)
  cache, _ = prefill(model, rng.integers(3, 211, size=(3, 40)).tolist(), 64)
  tree = random_tree(rng, 3, 5, 211)[0]
  live = jnp.asarray([True, False, True])
  logits, _, written = verify(model, tree, cache)
  logits_live, _, written_live = verify(model, tree, cache, live=live)
  np.testing.assert_allclose(np.asarray(logits_live)[[0, 2]], np.asarray(logits)[[0, 2]], rtol=1e-6, atol=1e-6)
  assert not np.allclose(np.asarray(logits_live)[1], np.asarray(logits)[1], atol=1e-3)  # (row 1 read nothing)
  for a, b, before in ((written.k, written_live.k, cache.k), (written.v, written_live.v, cache.v)):
    a, b = np.asarray(a), np.asarray(b)
    np.testing.assert_array_equal(a[:, [0, 2]], b[:, [0, 2]])
    np.testing.assert_array_equal(b[:, 1, :40], np.asarray(before)[:, 1, :40])
