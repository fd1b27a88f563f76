"""TokenSwift's drafting pass: the target over its partial cache."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from longspec_jax.engine import prefill
from longspec_jax.methods.tokenswift import draft_pass
from longspec_jax.models.cache import PartialCache
from longspec_jax.models.config import TargetConfig
from longspec_jax.models.target import random_model
from longspec_jax.ops.attention import Impl, causal_block_mask

TARGET = TargetConfig(
  vocab_size=97,
  hidden_size=32,
  intermediate_size=48,
  num_layers=2,
  num_heads=4,
  num_kv_heads=2,
  head_dim=8,
  max_position_embeddings=512,
)


def full_hidden(model, tokens):
  positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
  hidden, _ = model(tokens, positions, causal_block_mask(positions, jnp.ones(tokens.shape, bool)))
  return hidden


@pytest.mark.parametrize("impl", [Impl.REFERENCE, Impl.PALLAS])
def test_with_room_for_everything_the_pass_is_the_targets_own_step(impl):
  """A budget that holds the whole context: each pass (a selection first, then appends
  of the tokens committed since) gives the target's own final state at the newest
  token, round after round."""
  model = random_model(TARGET, jnp.float32, seed=0).with_numerics(attention=impl)
  rng = np.random.default_rng(0)
  tokens = jnp.asarray(rng.integers(0, 97, size=(2, 40)), jnp.int32)
  reference = full_hidden(model, tokens)  # [B, T, E]
  lengths = [17, 23]
  full, _ = prefill(model, [tokens[b, :n].tolist() for b, n in enumerate(lengths)], 64)
  partial = PartialCache.create(TARGET, 2, budget=48, sink=4, dtype=jnp.float32)
  for step in range(4):
    root = jnp.asarray([tokens[b, n] for b, n in enumerate(lengths)], jnp.int32)
    hidden, partial = draft_pass(model, partial, full, root, most=3)
    for b, n in enumerate(lengths):
      np.testing.assert_allclose(np.asarray(hidden[b]), np.asarray(reference[b, n]), rtol=2e-4, atol=2e-4)
    assert partial.count.tolist() == lengths
    advance = [1 + step % 3, 3 - step % 3]  # the next round commits the root and some of its tree
    new = [tokens[b, n : n + a] for b, (n, a) in enumerate(zip(lengths, advance))]
    for b, block in enumerate(new):
      _, cache = model(
        block[None],
        jnp.arange(lengths[b], lengths[b] + len(block))[None],
        causal_block_mask(jnp.arange(len(block))[None], jnp.ones((1, len(block)), bool)),
        jax.tree.map(lambda x, b=b: x[:, b : b + 1] if x.ndim == 5 else x[b : b + 1], full),
      )
      full = jax.tree.map(
        lambda whole, one, b=b: (
          whole.at[:, b : b + 1].set(one) if whole.ndim == 5 else whole.at[b].set(one[0] + len(block))
        ),
        full,
        cache,
      )
    lengths = [n + a for n, a in zip(lengths, advance)]


def test_a_small_budget_keeps_its_bytes_and_reselects_when_due():
  """Past its budget the pass attends to `budget` positions (the state differs from the
  full context's), the cache's bytes stay the same, and a selection follows once the
  appended positions would reach the sink."""
  model = random_model(TARGET, jnp.float32, seed=1)
  tokens = jnp.asarray(np.random.default_rng(1).integers(0, 97, size=(1, 80)), jnp.int32)
  reference = full_hidden(model, tokens)
  full, _ = prefill(model, [tokens[0, :60].tolist()], 128)
  partial = PartialCache.create(TARGET, 1, budget=16, sink=4, dtype=jnp.float32)
  size = partial.nbytes()
  hidden, partial = draft_pass(model, partial, full, tokens[:, 60], most=4)
  assert int(partial.selected[0]) == int(partial.copied[0]) == 60 and int(partial.count[0]) == 16
  assert not np.allclose(np.asarray(hidden[0]), np.asarray(reference[0, 60]), atol=1e-3)
  assert not bool(partial.needs_selection(full.lengths + 12)[0])  # 12 more fill slots 15 .. 4
  full = full.advance(jnp.asarray([13], jnp.int32))  # (their slots hold zeros: the bookkeeping is what is tested)
  assert bool(partial.needs_selection(full.lengths)[0])  # the 13th would reach the sink
  _, partial = draft_pass(model, partial, full, tokens[:, 73], most=4)
  assert int(partial.selected[0]) == 73 and partial.nbytes() == size
