"""Trees against slow pure-Python references on random trees."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from longspec_jax.decoding.tree import (
  Tree,
  beam_offsets,
  best_children,
  cape_tree,
  chain,
  copy_tree,
  graft_chains,
  static_topology,
)
from longspec_jax.errors import UserError
from longspec_jax.models.config import CapeConfig

from helpers import examples, random_tree


def reference_ancestors(parents, valid):
  n = len(parents)
  mask = np.zeros((n, n), bool)
  for i in range(n):
    if valid[i]:
      j = i
      while j >= 0:
        mask[i, j] = True
        j = parents[j]
  return mask


@examples(15)
@given(seed=st.integers(0, 2**31 - 1), batch=st.integers(1, 3), size=st.integers(1, 24))
def test_ancestors_and_positions_match_python_reference(seed, batch, size):
  rng = np.random.default_rng(seed)
  tree, parents, depths, valid, _, _ = random_tree(rng, batch, size, vocab=64)
  lengths = rng.integers(0, 100, size=batch)
  # (jitted: one program instead of every op compiled eagerly for this example's shapes)
  ancestors, positions = jax.jit(lambda t, n: (t.ancestor_mask(), t.positions(n)))(tree, jnp.asarray(lengths))
  ancestors = np.asarray(ancestors)
  np.testing.assert_array_equal(np.asarray(positions), lengths[:, None] + depths)
  for b in range(batch):
    np.testing.assert_array_equal(ancestors[b], reference_ancestors(parents[b], valid[b]))


def paths_of(tree: Tree, b: int) -> set[tuple[int, ...]]:
  """Every valid node's token path from the root (root excluded)."""
  parents, tokens, valid = (np.asarray(x[b]) for x in (tree.parents, tree.tokens, tree.valid))
  paths = {}
  for i in range(len(tokens)):
    if valid[i]:
      paths[i] = () if parents[i] < 0 else paths[parents[i]] + (int(tokens[i]),)
  return set(paths.values())


@examples(12)
@given(
  seed=st.integers(0, 2**31 - 1),
  batch=st.integers(1, 3),
  size=st.integers(1, 16),
  chains=st.integers(1, 4),
  gamma=st.integers(1, 6),
)
def test_graft_chains_is_a_trie_insert(seed, batch, size, chains, gamma):
  """The grafted tree holds the tree's paths plus every prefix of each chain's valid part,
  each once (siblings distinct); its depths, ancestor mask and node order are consistent."""
  rng = np.random.default_rng(seed)
  tree, *_ = random_tree(rng, batch, size, vocab=16)
  # Chains that often follow the tree's own paths, or an earlier chain, for a while, then leave them.
  drafted = np.asarray(rng.integers(0, 16, (batch, chains, gamma)))
  for b in range(batch):
    for c in range(chains):
      followed = sorted(paths_of(tree, b), key=len)[-1] if c == 0 or rng.random() < 0.5 else drafted[b, rng.integers(c)]
      follow = min(int(rng.integers(0, len(followed) + 1)), gamma)
      drafted[b, c, :follow] = followed[:follow]
  valid = np.arange(gamma)[None, None, :] < rng.integers(0, gamma + 1, (batch, chains, 1))
  # (jitted: one program instead of every op compiled eagerly for this example's shapes)
  grafted = jax.jit(graft_chains)(tree, jnp.asarray(drafted, jnp.int32), jnp.asarray(valid))
  tree, grafted = (jax.tree.map(np.asarray, t) for t in (tree, grafted))  # (read element by element: on the host)
  assert grafted.size == size + chains * gamma
  for b in range(batch):
    want = paths_of(tree, b) | {
      tuple(int(t) for t in drafted[b, c, :i]) for c in range(chains) for i in range(int(valid[b, c].sum()) + 1)
    }
    assert paths_of(grafted, b) == want
    assert sum(map(bool, np.asarray(grafted.valid[b]))) == len(want)  # no path twice
    parents = np.asarray(grafted.parents[b])
    ok = np.asarray(grafted.valid[b])
    np.testing.assert_array_equal(np.asarray(grafted.ancestors[b]), reference_ancestors(parents, ok))
    for i in np.flatnonzero(ok)[1:]:
      assert parents[i] < i and grafted.depths[b, i] == grafted.depths[b, parents[i]] + 1


def test_copy_tree_of_one_continuation_is_a_chain():
  root, drafted = jnp.array([7, 8]), jnp.array([[[1, 2, 3]], [[4, 5, 6]]])
  valid = jnp.array([[[True, True, False]], [[True, False, True]]])
  line, tree = chain(root, drafted[:, 0], valid[:, 0]), copy_tree(root, drafted, valid)
  for field in ("tokens", "parents", "depths", "valid"):
    np.testing.assert_array_equal(np.asarray(getattr(tree, field)), np.asarray(getattr(line, field)))


def test_copy_tree_merges_shared_prefixes():
  tree = copy_tree(jnp.array([9]), jnp.array([[[1, 2, 3], [1, 2, 4], [5, 6, 7]]]), jnp.ones((1, 3, 3), bool))
  assert paths_of(tree, 0) == {(), (1,), (1, 2), (1, 2, 3), (1, 2, 4), (5,), (5, 6), (5, 6, 7)}
  assert int(tree.valid.sum()) == 8  # the root and 7 distinct prefixes


def test_chain_with_partial_draft():
  tree = chain(
    jnp.array([7, 8]), jnp.array([[1, 2, 3], [4, 5, 6]]), jnp.array([[True, True, False], [True, False, True]])
  )
  np.testing.assert_array_equal(np.asarray(tree.valid), [[1, 1, 1, 0], [1, 1, 0, 0]])
  np.testing.assert_array_equal(np.asarray(tree.parents), [[-1, 0, 1, -1], [-1, 0, -1, -1]])


def test_static_topology():
  parents, depths, ranks = static_topology((1, 3, 3, 3))
  assert len(parents) == 1 + 1 + 3 + 9 + 27
  assert all(parents[i] < i for i in range(1, len(parents)))
  assert np.bincount(depths).tolist() == [1, 1, 3, 9, 27]
  assert sorted(set(ranks[depths == 2])) == [0, 1, 2]


def test_beam_offsets():
  assert beam_offsets((4, 16, 16, 16, 16)) == (0, 1, 5, 21, 37, 53, 69)


@examples(20)
@given(seed=st.integers(0, 2**31 - 1), frontier=st.integers(1, 5), width=st.integers(1, 7))
def test_best_children_are_the_best_of_all_children(seed, frontier, width):
  rng = np.random.default_rng(seed)
  vocab = 9
  log_probs = np.asarray(jax.nn.log_softmax(rng.standard_normal((2, frontier, vocab)) * 3, axis=-1), np.float32)
  scores = (rng.standard_normal((2, frontier)) * 2).astype(np.float32)
  width = min(width, frontier * vocab)
  top_lp, top_tokens = jax.lax.top_k(jnp.asarray(log_probs), min(width, vocab))
  parent, token, best = map(np.asarray, best_children(top_lp, top_tokens, jnp.asarray(scores), width))
  for b in range(2):
    every = sorted(
      ((scores[b, f] + log_probs[b, f, t], f, t) for f in range(frontier) for t in range(vocab)), reverse=True
    )
    assert [(f, t) for _, f, t in every[:width]] == list(zip(parent[b], token[b]))
    np.testing.assert_allclose(best[b], [s for s, _, _ in every[:width]], rtol=1e-6)


def test_tree_width_limits():
  from longspec_jax.decoding.tree import node_budget
  from longspec_jax.errors import UserError
  from longspec_jax.models.config import MAX_TREE_NODES, check_tree_widths

  check_tree_widths((4, 16, 16, 16, 16), vocab_size=49152)
  with pytest.raises(UserError, match="a tree width of 300 exceeds the vocabulary of 211 tokens"):
    check_tree_widths((300,), vocab_size=211)
  with pytest.raises(UserError, match="make 65 nodes, over the limit of 64"):
    check_tree_widths((32, 32), max_nodes=64)
  with pytest.raises(UserError, match="10 copied tokens make 75 nodes"):
    check_tree_widths((32, 32), max_nodes=70, copy_tokens=10)
  assert 1 <= node_budget(128256, batch=8) <= node_budget(49152) == MAX_TREE_NODES  # this machine holds 1024
  assert node_budget(10**12) == 1  # a vocabulary no machine holds logits of


@examples(15)
@given(seed=st.integers(0, 2**31 - 1), batch=st.integers(1, 3), gamma=st.integers(1, 6))
def test_cape_tree_is_the_chain_with_leaves_sized_by_confidence(seed, batch, gamma):
  """Every chain token's position holds its next-best tokens as leaves beside it, as
  many as the confidence there asks for; the ancestor mask is the tree's own and the
  paper's CAPE mask: a proposal token sees the chain before its position, and itself."""
  rng = np.random.default_rng(seed)
  cape = CapeConfig(gamma=gamma)
  top = np.stack([np.stack([rng.permutation(50)[: 1 + cape.most] for _ in range(gamma)]) for _ in range(batch)])
  confidence = rng.uniform(0.01, 1.0, (batch, gamma)).astype(np.float32)
  root = rng.integers(0, 50, batch)
  # (jitted: one program each instead of every op compiled eagerly for this example's shapes)
  tree = jax.jit(cape_tree, static_argnums=3)(jnp.asarray(root), jnp.asarray(top), jnp.asarray(confidence), cape)
  assert tree.size == cape.tree_size
  computed = jax.jit(lambda t: Tree(t.tokens, t.parents, t.depths, t.valid).ancestor_mask())(tree)
  tree = jax.tree.map(np.asarray, tree)  # (read element by element below: on the host)
  np.testing.assert_array_equal(tree.ancestors, computed)
  sizes = {0.3: 7, 0.6: 5, 0.8: 3, 1.0: 1}
  for b in range(batch):
    nodes = [i for i in range(tree.size) if tree.valid[b, i]]
    assert nodes[: gamma + 1] == list(range(gamma + 1))
    assert [int(tree.tokens[b, i]) for i in range(gamma + 1)] == [root[b], *top[b, :, 0]]
    for i in range(gamma):  # position i + 1: its leaves are children of chain node i
      leaves = [n for n in nodes[gamma + 1 :] if tree.parents[b, n] == i]
      want = next(k for edge, k in sizes.items() if confidence[b, i] <= edge)
      assert [int(tree.tokens[b, n]) for n in leaves] == list(top[b, i, 1 : 1 + want])
      assert all(tree.depths[b, n] == i + 1 for n in leaves)
    # The paper's mask over the linearized proposal (chain first, then the leaves).
    position = {n: (n if n <= gamma else int(tree.depths[b, n])) for n in nodes[1:]}
    for i in nodes[1:]:
      for j in nodes[1:]:
        want = i == j or (j <= gamma and position[i] > j)
        assert bool(tree.ancestors[b, i, j]) == want, (i, j)


def test_cape_sizes_by_confidence_bin_and_bad_configs():
  cape = CapeConfig(gamma=1)
  top = jnp.asarray(np.arange(8)[None, None, :])
  for p, leaves in [(1e-4, 7), (0.3, 7), (0.30001, 5), (0.6, 5), (0.7, 3), (0.8, 3), (0.81, 1), (1.0, 1)]:
    tree = cape_tree(jnp.asarray([9]), top, jnp.asarray([[p]], jnp.float32), cape)
    assert int(tree.valid.sum()) == 2 + leaves, p
  assert CapeConfig(edges=(), sizes=(2,)).tree_size == 16
  for bad, message in [
    (dict(gamma=0), "gamma >= 1"),
    (dict(sizes=(1, 2)), "one expansion size >= 0 per"),
    (dict(edges=(0.6, 0.3, 0.8)), "rise strictly"),
    (dict(edges=(0.0, 0.5, 0.8)), "rise strictly"),
    (dict(sizes=(7, 5, -1, 1)), "size >= 0"),
  ]:
    with pytest.raises(UserError, match=message):
      CapeConfig(**bad)
