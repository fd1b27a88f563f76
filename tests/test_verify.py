"""Greedy acceptance on random trees against a slow pure-Python walk."""

import jax.numpy as jnp
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from longspec_jax.tree import chain
from longspec_jax.verify import accept_greedy, emitted_tokens
from test_tree import random_tree


def reference_accept(parents, valid, tokens, target):
  """Walk from the root, taking the child that equals the target's choice."""
  path = [0]
  while True:
    children = [j for j in range(len(parents)) if valid[j] and parents[j] == path[-1] and tokens[j] == target[path[-1]]]
    if not children:
      return path, target[path[-1]]
    path.append(children[0])


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), batch=st.integers(1, 3), size=st.integers(1, 24))
def test_random_trees_match_python_reference(seed, batch, size):
  rng = np.random.default_rng(seed)
  tree, parents, depths, valid, tokens, target = random_tree(rng, batch, size, vocab=64)
  acceptance = accept_greedy(tree, jnp.asarray(target, jnp.int32), tree.ancestor_mask())
  emitted = np.asarray(emitted_tokens(tree, acceptance))
  for b in range(batch):
    path, bonus = reference_accept(parents[b], valid[b], tokens[b], target[b])
    count = int(acceptance.count[b])
    assert count == len(path)
    assert list(np.asarray(acceptance.path[b, :count])) == path
    assert int(acceptance.bonus[b]) == bonus
    assert list(emitted[b, :count]) == [tokens[b, j] for j in path[1:]] + [bonus]


def test_invalid_nodes_are_never_accepted():
  tree = chain(jnp.array([7, 8]), jnp.array([[1, 2, 3], [4, 5, 6]]), jnp.array([[True, True, False], [True, False, True]]))
  acceptance = accept_greedy(tree, jnp.array([[1, 2, 3, 0], [4, 5, 6, 0]]), tree.ancestor_mask())
  np.testing.assert_array_equal(np.asarray(acceptance.count), [3, 2])
  np.testing.assert_array_equal(np.asarray(acceptance.bonus), [3, 5])
