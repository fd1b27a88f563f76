"""Trees against slow pure-Python references on random trees."""

import jax.numpy as jnp
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from longspec_jax.tree import Tree, chain, static_topology
from longspec_jax.verify import accept_greedy, emitted_tokens


def random_tree(rng, batch, size, vocab):
  """Random trees (parent < child) with a random number of valid nodes and siblings of
  distinct tokens; also target choices that agree with some child 70% of the time."""
  parents = np.full((batch, size), -1)
  depths = np.zeros((batch, size), int)
  valid = np.zeros((batch, size), bool)
  tokens = np.stack([rng.permutation(vocab)[:size] for _ in range(batch)])
  target = rng.integers(0, vocab, size=(batch, size))
  for b in range(batch):
    used = rng.integers(1, size + 1)
    valid[b, :used] = True
    for i in range(1, used):
      parents[b, i] = rng.integers(0, i)
      depths[b, i] = depths[b, parents[b, i]] + 1
    for i in range(used):
      children = [j for j in range(used) if parents[b, j] == i]
      if children and rng.random() < 0.7:
        target[b, i] = tokens[b, rng.choice(children)]
  tree = Tree(tokens=jnp.asarray(tokens, jnp.int32), parents=jnp.asarray(parents, jnp.int32),
              depths=jnp.asarray(depths, jnp.int32), valid=jnp.asarray(valid))
  return tree, parents, depths, valid, tokens, target


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


def reference_accept(parents, valid, tokens, target):
  """Walk from the root, taking the child that equals the target's choice."""
  path = [0]
  while True:
    children = [j for j in range(len(parents)) if valid[j] and parents[j] == path[-1] and tokens[j] == target[path[-1]]]
    if not children:
      return path, target[path[-1]]
    path.append(children[0])


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), batch=st.integers(1, 3), size=st.integers(1, 24))
def test_random_trees_match_python_reference(seed, batch, size):
  rng = np.random.default_rng(seed)
  tree, parents, depths, valid, tokens, target = random_tree(rng, batch, size, vocab=64)
  ancestors = np.asarray(tree.ancestor_mask())
  lengths = rng.integers(0, 100, size=batch)
  np.testing.assert_array_equal(np.asarray(tree.positions(jnp.asarray(lengths))), lengths[:, None] + depths)
  acceptance = accept_greedy(tree, jnp.asarray(target, jnp.int32), jnp.asarray(ancestors))
  emitted = np.asarray(emitted_tokens(tree, acceptance))
  for b in range(batch):
    np.testing.assert_array_equal(ancestors[b], reference_ancestors(parents[b], valid[b]))
    path, bonus = reference_accept(parents[b], valid[b], tokens[b], target[b])
    count = int(acceptance.count[b])
    assert count == len(path)
    assert list(np.asarray(acceptance.path[b, :count])) == path
    assert int(acceptance.bonus[b]) == bonus
    assert list(emitted[b, :count]) == [tokens[b, j] for j in path[1:]] + [bonus]


def test_chain_with_partial_draft():
  tree = chain(jnp.array([7, 8]), jnp.array([[1, 2, 3], [4, 5, 6]]), jnp.array([[True, True, False], [True, False, True]]))
  np.testing.assert_array_equal(np.asarray(tree.valid), [[1, 1, 1, 0], [1, 1, 0, 0]])
  np.testing.assert_array_equal(np.asarray(tree.parents), [[-1, 0, 1, -1], [-1, 0, -1, -1]])
  acceptance = accept_greedy(tree, jnp.array([[1, 2, 3, 0], [4, 5, 6, 0]]), tree.ancestor_mask())
  np.testing.assert_array_equal(np.asarray(acceptance.count), [3, 2])  # invalid nodes never accepted
  np.testing.assert_array_equal(np.asarray(acceptance.bonus), [3, 5])


def test_static_topology():
  parents, depths, ranks = static_topology((1, 3, 3, 3))
  assert len(parents) == 1 + 1 + 3 + 9 + 27
  assert all(parents[i] < i for i in range(1, len(parents)))
  assert np.bincount(depths).tolist() == [1, 1, 3, 9, 27]
  assert sorted(set(ranks[depths == 2])) == [0, 1, 2]
