"""The benchmarks' timing helpers: chained on-device loops over pytrees, and the split of
a decode round into drafting and verification."""

import jax.numpy as jnp
import numpy as np
import pytest

from infer import timing
from infer.timing import loop_seconds, measure_read_bandwidth, phase_seconds
from longspec_jax.engine import Decoding, generate
from longspec_jax.methods.factory import make_proposer
from longspec_jax.methods.registry import ProposerOptions
from longspec_jax.models.config import DraftConfig
from longspec_jax.models.draft import random_draft

from helpers import tiny_target


def test_loop_seconds_chains_pytrees():
  seconds = loop_seconds(
    lambda carry, w: (carry[0] @ w, carry[1] + 1),
    (jnp.ones((8, 8)), jnp.int32(0)),
    jnp.eye(8),
    iters=4,
    unroll=2,
    repeats=2,
  )
  assert seconds > 0


def test_phase_seconds_on_a_finished_run(tmp_path):
  target = tiny_target("llama")
  draft = random_draft(DraftConfig.for_target(target.config, window=8), jnp.float32)
  proposer, params = make_proposer("longspec", draft, ProposerOptions(tree_widths=(2, 2)))
  decoding = Decoding(proposer=proposer)
  result = generate(target, [np.arange(3, 20).tolist()], 6, decoding, params)
  draft_seconds, verify_seconds = phase_seconds(target, decoding, params, result.state, iters=2)
  assert draft_seconds > 0 and verify_seconds > 0


def test_the_read_rate_reads_at_most_its_cap(monkeypatch):
  sizes = []
  monkeypatch.setattr(timing, "MAX_READ_BYTES", 1 << 20)
  monkeypatch.setattr(timing, "median_seconds", lambda fn, iters: sizes.append(fn()) or 1e-3)
  assert measure_read_bandwidth(1 << 40) == pytest.approx((1 << 20) / 1e-3)  # (a terabyte asked: a MiB read)
  assert len(sizes) == 5
