"""The AR engine: exact greedy decoding, batching, EOS, sampling reproducibility."""

import dataclasses
from collections import Counter

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from longspec_jax.decoding.sampling import Draw, SamplingConfig
from longspec_jax.decoding.tree import Tree, static_topology
from longspec_jax.decoding.verify import accept_greedy, verify
from longspec_jax.engine import (
  Decoding,
  Memory,
  acceptance_by_depth,
  check_capacity,
  generate,
  propose,
  sequence_stats,
  start,
  verified_size,
)
from longspec_jax.errors import UserError
from longspec_jax.methods.base import RootOnly
from longspec_jax.methods.factory import make_proposer
from longspec_jax.methods.longspec import LongSpecDraft
from longspec_jax.methods.prompt_lookup import PromptLookup
from longspec_jax.methods.registry import ProposerOptions
from longspec_jax.methods.tokenswift import TokenSwift
from longspec_jax.models.config import CapeConfig, DraftConfig, DraftKind, HeadsConfig
from longspec_jax.models.draft import random_draft
from longspec_jax.models.heads import random_heads
from longspec_jax.ops import gemm
from longspec_jax.ops.attention import Impl, causal_block_mask
from longspec_jax.weights.drafts import load_draft

from helpers import real_texts, tiny_target


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
  model = tiny_target("qwen2")
  return model


def naive_greedy(model, prompt, steps):
  """Recomputes the whole sequence for every token: slow, obviously right."""
  tokens = list(prompt)
  for _ in range(steps):
    x = jnp.asarray([tokens])
    positions = jnp.arange(len(tokens))[None]
    hidden, _ = model(x, positions, causal_block_mask(positions, jnp.ones(x.shape, bool)))
    tokens.append(int(jnp.argmax(model.logits(hidden[0, -1]))))
  return tokens[len(prompt) :]


def test_greedy_equals_naive_recompute(tiny):
  prompt = np.random.default_rng(0).integers(3, 211, size=19).tolist()
  result = generate(tiny, [prompt], 12, rounds_per_chunk=5)
  assert result.token_ids[0] == naive_greedy(tiny, prompt, 12)
  assert result.stats.num_new_tokens == 12 and result.stats.rounds == 11
  assert result.stats.chunks == 3  # 11 rounds in chunks of 5


def test_batch_equals_each_prompt_alone(tiny):
  rng = np.random.default_rng(1)
  prompts = [rng.integers(3, 211, size=n).tolist() for n in (7, 23, 15)]
  batched = generate(tiny, prompts, 9, prefill_chunk=8, rounds_per_chunk=4).token_ids
  assert batched == [generate(tiny, [p], 9).token_ids[0] for p in prompts]
  # A token limit a prompt: each stops at its own; the longest runs on alone.
  limited = generate(tiny, prompts, [1, 9, 4], prefill_chunk=8, rounds_per_chunk=4)
  assert limited.token_ids == [batched[0][:1], batched[1], batched[2][:4]]
  assert limited.stats.num_new_tokens == 14
  each = [sequence_stats(len(ids), rows) for ids, rows in zip(limited.token_ids, limited.state.rounds_by_length)]
  assert [s["num_new_tokens"] for s in each] == [1, 9, 4] and each[0]["rounds"] == 0  # (done at its first token)
  assert sum(s["rounds"] for s in each) == limited.stats.rounds and each[1]["mean_accepted_length"] == 1.0  # (AR)
  with pytest.raises(ValueError, match="2 token limits for 3 prompts"):
    generate(tiny, prompts, [9, 9])


def test_eos_stops_exactly_there(tiny):
  prompt = np.random.default_rng(2).integers(3, 211, size=11).tolist()
  free = generate(tiny, [prompt], 10).token_ids[0]
  eos = free[4]
  stopped = generate(tiny, [prompt], 10, Decoding(eos_ids=(eos,)), rounds_per_chunk=3).token_ids[0]
  assert stopped == free[: free.index(eos) + 1]


def test_sampling_is_reproducible_and_seed_dependent(tiny):
  prompt = list(range(3, 30))
  hot = SamplingConfig(temperature=1.5)
  a = generate(tiny, [prompt], 16, Decoding(sampling=hot), seed=7).token_ids
  b = generate(tiny, [prompt], 16, Decoding(sampling=hot), seed=7).token_ids
  c = generate(tiny, [prompt], 16, Decoding(sampling=hot), seed=8).token_ids
  assert a == b and a != c


def test_capacity_and_empty_prompt_errors(tiny):
  with pytest.raises(UserError, match="exceeds the model's context of 512"):
    generate(tiny, [[5] * 500], 20)
  with pytest.raises(UserError, match="empty"):
    generate(tiny, [[]], 4)
  with pytest.raises(UserError, match=r"the prompt \(1 token\) plus 512 new tokens exceeds"):
    check_capacity(tiny.config, [[5]], 512)
  with pytest.raises(UserError, match=r"the prompt \(400 tokens\) plus 200 new tokens exceeds"):
    check_capacity(tiny.config, [[5] * 10, [5] * 400], [500, 200])  # (each prompt with its own limit)


def test_nonfinite_logits_are_reported(tiny):
  from flax import nnx

  graphdef, state = nnx.split(tiny)
  pure = nnx.to_pure_dict(state)
  pure["final_norm"] = pure["final_norm"] * jnp.nan
  nnx.replace_by_pure_dict(state, pure)
  with pytest.raises(UserError, match="NaN"):
    generate(nnx.merge(graphdef, state), [[5, 6, 7]], 4)


def test_finished_sequences_do_not_disturb_the_others(tiny):
  rng = np.random.default_rng(4)
  prompts = [rng.integers(3, 211, size=n).tolist() for n in (9, 14)]
  free = [generate(tiny, [p], 8).token_ids[0] for p in prompts]
  eos = free[0][2]  # the first sequence stops early, the second (most likely) runs on
  batched = generate(tiny, prompts, 8, Decoding(eos_ids=(eos,)), rounds_per_chunk=3).token_ids
  for got, alone in zip(batched, free):
    assert got == (alone[: alone.index(eos) + 1] if eos in alone else alone)


@dataclasses.dataclass(frozen=True)
class Oracle:
  """Proposes a static tree whose all-first-child branch is the known continuation
  `reference[b]` (the AR output) and whose other nodes are decoys."""

  reference: tuple[tuple[int, ...], ...]
  prompt_lengths: tuple[int, ...]
  branching: tuple[int, ...] = (2, 2, 2)
  vocab: int = 211

  @property
  def tree_size(self) -> int:
    return len(static_topology(self.branching)[0])

  @property
  def depth(self) -> int:
    return len(self.branching)

  def start(self, params, *, target, cache, history):
    return None

  def propose(self, params, state, *, target, cache, history, root):
    lengths = cache.lengths
    parents, depths, ranks = static_topology(self.branching)
    on_truth = np.array([all(ranks[j] == 0 for j in self._ancestors(parents, i)) for i in range(len(parents))])
    width = max(map(len, self.reference))
    reference = jnp.asarray([list(r) + [0] * (width - len(r) + len(self.branching) + 1) for r in self.reference])
    offset = lengths - jnp.asarray(self.prompt_lengths)  # the root is reference[offset]
    truth = jnp.take_along_axis(reference, offset[:, None] + jnp.asarray(depths)[None, :], axis=1)  # [B, N]
    tokens = jnp.where(on_truth[None, :], truth, (truth + 1 + jnp.asarray(ranks)[None, :]) % self.vocab)
    tokens = tokens.at[:, 0].set(root)
    batch = root.shape[0]
    tile = lambda x: jnp.broadcast_to(jnp.asarray(x, jnp.int32), (batch, len(parents)))
    return Tree(
      tokens=tokens.astype(jnp.int32),
      parents=tile(parents),
      depths=tile(depths),
      valid=jnp.ones((batch, len(parents)), bool),
    ), state

  @staticmethod
  def _ancestors(parents, i):
    while i > 0:
      yield i
      i = parents[i]


def test_oracle_tree_is_lossless_with_full_acceptance(tiny):
  rng = np.random.default_rng(6)
  prompts = [rng.integers(3, 211, size=n).tolist() for n in (12, 25)]
  reference = generate(tiny, prompts, 20).token_ids
  oracle = Oracle(tuple(map(tuple, reference)), tuple(map(len, prompts)))
  result = generate(tiny, prompts, 20, Decoding(proposer=oracle), rounds_per_chunk=2)
  assert result.token_ids == reference
  assert result.stats.mean_accepted_length >= 3.5  # depth 3 + bonus, less the final round


def test_prompt_lookup_is_lossless(tiny):
  rng = np.random.default_rng(7)
  pattern = rng.integers(3, 211, size=9).tolist()
  prompts = [pattern * 4, rng.integers(3, 211, size=30).tolist()]
  reference = generate(tiny, prompts, 24).token_ids
  result = generate(tiny, prompts, 24, Decoding(proposer=PromptLookup(num_tokens=5)), rounds_per_chunk=3)
  assert result.token_ids == reference
  assert result.stats.rounds < 2 * 23  # rounds, over both sequences
  # Rounds counted by the tokens each emitted: all of them, and every token after the first.
  by_length = np.asarray(result.stats.rounds_by_length)
  assert len(by_length) == 5 + 2 and by_length[0] == 0 and by_length.sum() == result.stats.rounds
  assert (by_length * np.arange(len(by_length))).sum() == result.stats.num_new_tokens - len(prompts)


def test_acceptance_by_depth_is_each_depth_given_the_one_before():
  # 10 rounds: 4 emitted 1 token (nothing accepted), 3 emitted 2, 3 emitted 4 (depths 1-3).
  assert acceptance_by_depth([0, 4, 3, 0, 3, 0]) == [0.6, 0.5, 1.0, 0.0]
  assert acceptance_by_depth([0, 5, 0, 0]) == [0.0, None]  # nothing past the root: depth 2 unknown
  assert acceptance_by_depth([0, 7]) == []  # AR: no depths


def longspec(target, widths=(2, 3, 3), seed=0, attention=None, copy_tokens=0, cape=None, **draft_config):
  """A LongSpec proposer (with `copy_tokens` of prompt lookup grafted in; CAPE's tree
  with `cape`) and its random draft's params."""
  draft = random_draft(
    DraftConfig.for_target(target.config, **draft_config), target.dtype, seed=seed, attention=attention
  )
  graphdef, params = nnx.split(draft)
  return LongSpecDraft(graphdef, widths, copy_tokens, cape), params


CAPE = CapeConfig(gamma=4, edges=(0.005, 0.01), sizes=(3, 2, 1))


@pytest.mark.parametrize(
  "kind, cape, cross",
  [
    (DraftKind.LONGSPEC, None, True),
    (DraftKind.LONGSPEC, CAPE, True),
    (DraftKind.GLIDE, None, True),
    (DraftKind.GLIDE, CAPE, True),
    (DraftKind.GLIDE, CAPE, False),
  ],
  ids=["longspec-beam", "longspec-cape", "glide-beam", "glide-cape", "glide-no-cross-cape"],
)
def test_a_random_draft_is_lossless(tiny, kind, cape, cross):
  """Either draft with either tree (and GLIDE's ablation without cross-attention), reading
  fused target features and its parents' outputs, emits the AR tokens; GLIDE's own cache
  holds every position of the context (it never wraps, where LongSpec's ring of 8 does)."""
  rng = np.random.default_rng(9)
  prompts = [rng.integers(3, 211, size=n).tolist() for n in (30, 9, 21)]
  reference = generate(tiny, prompts, 24).token_ids
  eos = reference[1][6]
  inputs = dict(feature_layers=(0, tiny.config.num_layers - 1), parent_features=True)
  proposer, params = longspec(tiny, num_layers=2, window=8, cape=cape, kind=kind, cross_attention=cross, **inputs)
  result = generate(tiny, prompts, 24, Decoding(proposer=proposer, eos_ids=(eos,)), params, rounds_per_chunk=5)
  assert result.token_ids == [r[: r.index(eos) + 1] if eos in r else r for r in reference]
  ring, cache = result.state.proposal.ring, result.state.cache
  if kind is DraftKind.GLIDE:
    assert ring.window == cache.k.shape[2]
    for b, length in enumerate(np.asarray(ring.length)):
      np.testing.assert_array_equal(np.asarray(ring.positions[b, :length]), np.arange(length))
  else:
    assert ring.window == 8


def test_longspec_with_copy_branches_is_lossless_and_accepts_the_better_branch(tiny):
  """Prompt lookup grafted into the random draft's tree: AR's tokens; and from each of
  several states a round accepts exactly as many tokens as the better of the beam tree
  and the copy chain verified alone (the grafted tree's paths are the union of theirs)."""
  rng = np.random.default_rng(7)
  pattern = rng.integers(3, 211, size=9).tolist()
  prompts = [pattern * 4, rng.integers(3, 211, size=30).tolist()]
  reference = generate(tiny, prompts, 24).token_ids
  alone, params = longspec(tiny, widths=(2, 2), window=8)
  copying, _ = longspec(tiny, widths=(2, 2), window=8, copy_tokens=6)
  assert copying.tree_size == alone.tree_size + 6 and copying.depth == 6
  assert generate(tiny, prompts, 24, Decoding(proposer=copying), params, rounds_per_chunk=3).token_ids == reference

  def accepted(proposer, prompt):
    state = start(tiny, [prompt], 8, Decoding(proposer=proposer), params).state
    tree, _ = propose(tiny, proposer, params, state)
    logits, ancestors, _ = verify(tiny, tree, state.cache)
    return int(accept_greedy(tree, jnp.argmax(logits, -1), ancestors).count[0])

  counts = []
  for prompt in [pattern * 3 + pattern[:4], prompts[1], prompts[0] + reference[0][:5]]:
    counts.append((accepted(copying, prompt), accepted(alone, prompt), accepted(PromptLookup(num_tokens=6), prompt)))
  assert all(both == max(beam, copy) for both, beam, copy in counts), counts


def test_trees_padded_to_gpu_row_multiples_give_the_same_tokens(tiny, monkeypatch):
  """On a GPU a round verifies its tree padded with unused nodes to cuBLAS's row multiple
  (`gemm.aligned_rows`), and the draft's catch-up pass runs as many rows: forced here on
  the CPU, greedy and sampled output stay AR's (trees and passes unique to this test, so
  that no compilation of another test is reused)."""
  monkeypatch.setattr(gemm, "aligned_rows", lambda rows: rows if rows == 1 else -(-rows // 8) * 8)
  rng = np.random.default_rng(12)
  pattern = rng.integers(3, 211, size=7).tolist()
  prompts = [pattern * 3, rng.integers(3, 211, size=17).tolist()]
  reference = generate(tiny, prompts, 16).token_ids
  proposer, params = longspec(tiny, widths=(3, 2), window=8, copy_tokens=4)
  assert verified_size(proposer) == 16
  assert generate(tiny, prompts, 16, Decoding(proposer=proposer), params, rounds_per_chunk=4).token_ids == reference
  lookup = PromptLookup(num_tokens=3)
  assert generate(tiny, prompts, 16, Decoding(proposer=lookup)).token_ids == reference
  sampled = Decoding(proposer=lookup, sampling=SamplingConfig(temperature=1e-4))
  assert generate(tiny, prompts, 16, sampled, seed=3).token_ids == reference


def test_pallas_attention_gives_the_same_tokens(tiny):
  """The whole engine (prefill, AR decode, LongSpec drafting and verification) with the
  Pallas kernels, interpreted on CPU."""
  rng = np.random.default_rng(10)
  prompts = [rng.integers(3, 211, size=n).tolist() for n in (19, 7)]
  reference = generate(tiny, prompts, 10).token_ids
  pallas = tiny.with_numerics(attention=Impl.PALLAS)
  assert generate(pallas, prompts, 10, prefill_chunk=16).token_ids == reference
  proposer, params = longspec(tiny, window=8, attention=Impl.PALLAS)
  assert generate(pallas, prompts, 10, Decoding(proposer=proposer), params).token_ids == reference
  assert tiny.attention is Impl.REFERENCE  # (the fixture is untouched)


def test_batch_invariant_bf16_speculation_emits_the_ar_tokens(tmp_path):
  """bf16 with batch-invariant rounds (kernels interpreted on CPU): PLD and LongSpec emit
  AR's tokens, though their caches are allocated longer (108 + 16 tokens fit in 128 slots
  with AR's one-node tree, not with their trees); a tree deeper than the invariant pass
  allows is refused in one sentence."""
  model = tiny_target("llama", jnp.bfloat16).with_numerics(batch_invariant=True)
  rng = np.random.default_rng(12)
  pattern = rng.integers(3, 211, size=7).tolist()
  prompts = [pattern * 5, rng.integers(3, 211, size=108).tolist()]
  reference = generate(model, prompts, 16).token_ids
  assert generate(model, prompts, 16, Decoding(proposer=PromptLookup(num_tokens=6))).token_ids == reference
  proposer, params = longspec(model, widths=(2, 2, 2), window=8, copy_tokens=6)
  assert generate(model, prompts, 16, Decoding(proposer=proposer), params).token_ids == reference
  with pytest.raises(UserError, match="at most 31 tokens deep"):
    generate(model, prompts, 4, Decoding(proposer=PromptLookup(num_tokens=40)))


def test_eos_inside_an_accepted_path_stops_exactly_there(tiny):
  prompt = np.random.default_rng(8).integers(3, 211, size=15).tolist()
  free = generate(tiny, [prompt], 16).token_ids[0]
  eos = free[5]
  oracle = Oracle((tuple(free),), (len(prompt),))
  stopped = generate(tiny, [prompt], 16, Decoding(proposer=oracle, eos_ids=(eos,))).token_ids[0]
  assert stopped == free[: free.index(eos) + 1]


def real_prompt(target, text: str) -> list[int]:
  """A real document's first 640 tokens: past the draft's ring of 512, so the ring wraps."""
  ids = target.tokenizer(text).input_ids[:640]
  assert len(ids) == 640
  return ids


@pytest.fixture(scope="module")
def real_run(smollm2_float32):
  """SmolLM2 on a real document (a Python source) and its 32 AR tokens: what every method
  must emit exactly. One prompt: on two cores its 640-token prefill alone takes ~3.5 s a
  generation (the batches' own paths are the tiny models' tests, and auto's below)."""
  prompts = [real_prompt(smollm2_float32, real_texts()[-1])]
  reference = generate(smollm2_float32.model, prompts, 32).token_ids
  assert all(len(r) == 32 for r in reference)
  return smollm2_float32, prompts, reference


@pytest.mark.optimized
@pytest.mark.xdist_group("smollm2")
def test_real_model_prompt_lookup_is_lossless(real_run):
  """PLD searching the outputs of earlier generations too: the first generation (none
  yet), then the same prompts again, finding their whole answers there (accepting far
  more). (Its trie of several continuations: auto's test below.)"""
  target, prompts, reference = real_run
  memory, decoding = Memory(), Decoding(proposer=PromptLookup(past_tokens=4096))
  pld = generate(target.model, prompts, 32, decoding, memory=memory)
  again = generate(target.model, prompts, 32, decoding, memory=memory)
  assert pld.token_ids == again.token_ids == reference
  assert again.stats.mean_accepted_length > 2 * pld.stats.mean_accepted_length


@pytest.mark.optimized
@pytest.mark.xdist_group("smollm2")
def test_real_model_longspec_is_lossless(real_run):
  """LongSpec with the shipped trained draft: scoring its vocabulary subset (a smaller tree
  than its default, for CPU time, prompt lookup's copies grafted in), and CAPE's tree over
  every token."""
  target, prompts, reference = real_run
  draft = load_draft("default", target.config, jnp.float32, "smollm2-135m")
  proposer, params = make_proposer("longspec", draft, ProposerOptions(tree_widths=(2, 2, 2), copy_tokens=10))
  longspec_run = generate(target.model, prompts, 32, Decoding(proposer=proposer), params)
  assert longspec_run.token_ids == reference
  assert longspec_run.stats.mean_accepted_length > 1.5  # a trained draft: several tokens per round
  whole = load_draft("default", target.config, jnp.float32, "smollm2-135m", vocab_subset=0)  # (every token scored)
  proposer, params = make_proposer("longspec", whole, ProposerOptions(cape=CapeConfig(gamma=4)))
  assert generate(target.model, prompts, 32, Decoding(proposer=proposer), params).token_ids == reference


@pytest.mark.slow  # (the tiny targets' GLIDE and TokenSwift tests run in CI)
@pytest.mark.optimized
@pytest.mark.xdist_group("smollm2")
def test_real_model_glide_and_tokenswift_are_lossless(real_run):
  """GLIDE with its shipped draft and CAPE's tree; TokenSwift with its shipped heads and a
  partial cache of 256 positions."""
  target, prompts, reference = real_run
  glide = load_draft("default", target.config, jnp.float32, "smollm2-135m", kind=DraftKind.GLIDE)
  proposer, params = make_proposer("glide", glide)  # (CAPE's tree: its default)
  glide_run = generate(target.model, prompts, 32, Decoding(proposer=proposer), params)
  assert glide_run.token_ids == reference and glide_run.stats.mean_accepted_length > 1.5
  heads = load_draft("default", target.config, jnp.float32, "smollm2-135m", kind=DraftKind.TOKENSWIFT)
  proposer, params = make_proposer("tokenswift", heads)  # (a partial cache, fewer n-grams)
  swift = generate(
    target.model, prompts, 32, Decoding(proposer=dataclasses.replace(proposer, budget=256, ngrams=4, lag=64)), params
  )
  assert swift.token_ids == reference and swift.stats.mean_accepted_length > 1.5


@pytest.mark.optimized
@pytest.mark.xdist_group("smollm2")
def test_real_model_auto_is_lossless(real_run):
  """auto with LongSpec's draft (a trie of two continuations) and past outputs holding the
  answers, on a batch of two documents (a Python source and a license). (An oracle tree
  accepted to its full depth: test_oracle_tree_is_lossless_with_full_acceptance.)"""
  target, prompts, reference = real_run
  license_text = real_prompt(target, real_texts()[0])
  prompts, reference = [*prompts, license_text], [*reference, generate(target.model, [license_text], 32).token_ids[0]]
  draft = load_draft("default", target.config, jnp.float32, "smollm2-135m")
  options = ProposerOptions(tree_widths=(2, 2, 2), copy_matches=2, past_tokens=4096)
  proposer, params = make_proposer("auto", draft, options)
  memory = Memory()
  for answer in reference:
    memory.past_for(target.config, Decoding(proposer=proposer)).append(answer)
  auto = generate(target.model, prompts, 32, Decoding(proposer=proposer), params, memory=memory)
  assert auto.token_ids == reference


def tokenswift(target, **options):
  """TokenSwift with untrained heads (they predict what the target predicts) on `target`."""
  graphdef, params = nnx.split(
    random_heads(HeadsConfig.for_target(target.config, **options.pop("heads", {})), jnp.float32)
  )
  return TokenSwift(graphdef, **options), params


def speculative_methods(target):
  """name -> (proposer, its params)."""
  return {
    "pld": (PromptLookup(num_tokens=4), None),
    "longspec": longspec(target, widths=(2, 2), window=8),
    "tokenswift": tokenswift(
      target,
      heads={"gamma": 2, "tree_widths": (1, 2, 2)},
      tree_widths=(1, 2, 2),
      budget=16,
      sink=2,
      ngrams=2,
      ngram_slots=4,
      n=3,
      lag=0,
    ),
  }


@pytest.mark.parametrize("budget, lag", [(96, 0), (12, 8)], ids=["whole-context", "partial-lagging"])
def test_tokenswift_is_lossless(tiny, budget, lag):
  """TokenSwift emits the AR tokens with a partial cache that holds the whole context and
  an n-gram table that is current, and with one smaller than the context (selected again
  as the output grows) and a table that lags; on repeated text its n-gram branches are
  accepted."""
  rng = np.random.default_rng(5)
  pattern = rng.integers(3, 211, size=7).tolist()
  prompts = [pattern * 5, rng.integers(3, 211, size=26).tolist()]
  reference = generate(tiny, prompts, 30).token_ids
  proposer, params = tokenswift(tiny, budget=budget, sink=2, ngrams=3, ngram_slots=4, lag=lag)
  result = generate(tiny, prompts, 30, Decoding(proposer=proposer), params, rounds_per_chunk=4)
  assert result.token_ids == reference
  assert result.state.proposal.partial.budget == budget
  assert result.stats.compile_seconds > 0 and result.stats.decode_compile_seconds == 0  # chunk after chunk: one program
  if lag == 0:
    assert result.stats.mean_accepted_length > 1.5


def test_a_seed_writes_one_text_with_every_method(tiny):
  """Sampled with the default draw (keyed by seed and position), AR, prompt lookup,
  LongSpec, TokenSwift and auto write the same tokens for a seed, a row of a batch those
  it writes alone with its seed."""
  rng = np.random.default_rng(13)
  pattern = rng.integers(3, 211, size=6).tolist()
  prompts = [pattern * 4, rng.integers(3, 211, size=21).tolist()]
  config = SamplingConfig(temperature=0.8, top_k=40, penalty=1.2, penalty_window=8)
  reference = generate(tiny, prompts, 14, Decoding(sampling=config), seed=3).token_ids
  assert generate(tiny, prompts[1:], 14, Decoding(sampling=config), seed=4).token_ids == reference[1:]
  methods = {**speculative_methods(tiny), "auto": make_proposer("auto", None, ProposerOptions(sampling=config))}
  for name, (proposer, params) in methods.items():
    assert generate(tiny, prompts, 14, Decoding(proposer=proposer, sampling=config), params, seed=3).token_ids == (
      reference
    ), name


def test_sampling_near_zero_temperature_is_greedy(tiny):
  rng = np.random.default_rng(11)
  pattern = rng.integers(3, 211, size=7).tolist()
  prompts = [pattern * 3, rng.integers(3, 211, size=17).tolist()]
  greedy = generate(tiny, prompts, 12).token_ids
  cold = SamplingConfig(temperature=1e-4)
  for name, (proposer, params) in {"ar": (RootOnly(), None), **speculative_methods(tiny)}.items():
    decoding = Decoding(proposer=proposer, sampling=cold)
    assert generate(tiny, prompts, 12, decoding, params, seed=5).token_ids == greedy, name


def assert_same_law(reference: np.ndarray, got: np.ndarray, label) -> None:
  """Chi-square test of homogeneity of two samples of categories (rows of `reference`,
  `got`, e.g. tokens or token tuples; categories seen fewer than 10 times in all pooled):
  must not reject at the 1% level."""
  from scipy.stats import chi2_contingency

  counts = [Counter(tuple(np.atleast_1d(r)) for r in x) for x in (reference, got)]
  categories = sorted(counts[0].keys() | counts[1].keys())
  table = np.array([[count[c] for c in categories] for count in counts])
  common = table.sum(0) >= 10
  table = np.concatenate([table[:, common], table[:, ~common].sum(1, keepdims=True)], axis=1)
  table = table[:, table.sum(0) > 0]
  p_value = chi2_contingency(table)[1]
  print(f"{label}: chi-square p = {p_value:.3f} over {table.shape[1]} categories")
  assert p_value > 0.01, label


@pytest.mark.optimized
def test_sampled_speculation_matches_ar_statistically(tiny):
  """1,000 seeded samples of tokens 2-4 (the first is prefill's) per method against AR's
  (rows drawing with other seeds than AR's), under each draw: a chi-square test of
  homogeneity per position (rare tokens pooled) must not reject. And each method accepts
  alike under both draws (what a draw keyed by position costs in acceptance: nothing, in
  law): its rounds counted by the tokens they emitted pass the same test."""
  from scipy.stats import chi2_contingency

  pattern = np.random.default_rng(12).integers(3, 211, size=5).tolist()
  prompts = [pattern * 4] * 1000
  emitted = {}
  for draw in Draw:
    config = SamplingConfig(temperature=0.8, top_k=12, top_p=0.9, penalty=1.5, penalty_window=6, draw=draw)

    def samples(seed, proposer=RootOnly(), params=None):
      result = generate(tiny, prompts, 4, Decoding(proposer=proposer, sampling=config), params, seed=seed)
      return np.asarray(result.token_ids)[:, 1:], np.asarray(result.stats.rounds_by_length)

    reference, _ = samples(0)
    for i, (name, (proposer, params)) in enumerate(speculative_methods(tiny).items()):
      got, by_length = samples(len(prompts) * (i + 1), proposer, params)
      emitted.setdefault(name, []).append(by_length)
      for position in range(3):
        assert_same_law(reference[:, position], got[:, position], (name, draw.value, position))
  for name, counts in emitted.items():
    table = np.asarray(counts)[:, np.asarray(counts).sum(0) >= 10]
    p_value = chi2_contingency(table)[1]
    print(f"{name}: rounds by tokens emitted {table.tolist()}, chi-square p = {p_value:.3f}")
    assert table.shape[1] >= 2 and p_value > 0.01, name


REAL_CONFIGS = {
  "t1": SamplingConfig(temperature=1.0),
  "t07-top-k": SamplingConfig(temperature=0.7, top_k=40),
  "top-p-min-p": SamplingConfig(temperature=1.0, top_p=0.9, min_p=0.05),
  "penalty": SamplingConfig(temperature=1.0, penalty=1.3, penalty_window=32),
}


@pytest.mark.slow
@pytest.mark.parametrize("config", REAL_CONFIGS.values(), ids=REAL_CONFIGS.keys())
def test_real_model_sampling_matches_ar(smollm2_float32, config):
  """SmolLM2 with each processor setting: 2,000 seeded runs of PLD and of LongSpec (the
  shipped draft) against 2,000 AR runs; the joint law of tokens 2-4 (the first is
  prefill's) must pass a chi-square test of homogeneity. Opt-in (`pytest -m slow`): sized
  for a GPU, far too slow for the CPU suite."""
  target = smollm2_float32
  text = real_texts()[0]
  head = target.tokenizer(text).input_ids[:64]
  prompt = head + head[:12]  # a repeat in progress: PLD finds its n-gram, LongSpec its cached context
  draft = load_draft("default", target.config, jnp.float32, "smollm2-135m")
  methods = {
    "pld": (PromptLookup(), None),
    "longspec": make_proposer("longspec", draft, ProposerOptions(tree_widths=(4, 8, 8))),
  }

  def samples(first_seed, proposer=RootOnly(), params=None):  # 4 x 500 rows: 2,000 independent runs
    decoding = Decoding(proposer=proposer, sampling=config)
    runs = [generate(target.model, [prompt] * 500, 4, decoding, params, seed=first_seed + i) for i in range(4)]
    mean_accepted = np.mean([r.stats.mean_accepted_length for r in runs])
    return np.concatenate([np.asarray(r.token_ids)[:, 1:] for r in runs]), mean_accepted

  with jax.default_matmul_precision("highest"):
    reference, _ = samples(0)
    for i, (name, (proposer, params)) in enumerate(methods.items()):
      got, mean_accepted = samples(100 * (i + 1), proposer, params)
      assert mean_accepted > 1.0, name  # the speculation ran and accepted drafted tokens
      assert_same_law(reference, got, f"{name}, {mean_accepted:.2f} tokens per round")


def test_chunks_follow_the_measured_round_time(tiny, monkeypatch):
  """A chunk runs as many rounds as fit in CHUNK_SECONDS at the measured pace: a tiny
  budget streams every round, a large one streams in few chunks."""
  from longspec_jax import engine

  def chunks(seconds):
    monkeypatch.setattr(engine, "CHUNK_SECONDS", seconds)
    engine.MEMORY.pace.clear()  # (no pace remembered from other generations)
    calls = []
    result = engine.generate(tiny, [[5, 6, 7]], 40, on_tokens=calls.append)
    assert sum(int((c >= 0).sum()) for c in calls) == 40
    # (the first wait, after the first token, holds the decode loop's compilation)
    assert 0 < result.stats.max_stream_gap_seconds <= result.stats.decode_seconds + result.stats.compile_seconds
    return len(calls), result.stats.rounds

  streamed, rounds = chunks(1e-9)
  assert streamed == rounds + 1  # the first token, then one chunk per round
  assert chunks(1e3)[0] <= 4  # 1, 1, then all the rest


def test_chunks_done_when_their_call_returns_are_streamed_before_the_next(tiny, monkeypatch):
  """On a GPU the call that runs a chunk returns when the chunk is done (XLA steps its
  loop from the host): the next chunk is then sized from it before it is dispatched, and
  none is dispatched after the last. The next generation starts at the pace it left."""
  from longspec_jax import engine

  reference = engine.generate(tiny, [[5, 6, 7]], 40).token_ids
  run, dispatched = engine._Chunk.run.__func__, []

  def waiting(cls, decode_fn, args, rounds):
    dispatched.append(rounds)
    return run(cls, lambda *a: jax.block_until_ready(decode_fn(*a)), args, rounds)

  monkeypatch.setattr(engine._Chunk, "run", classmethod(waiting))
  monkeypatch.setattr(engine, "CHUNK_SECONDS", 1e3)
  engine.MEMORY.pace.clear()
  calls = []
  assert engine.generate(tiny, [[5, 6, 7]], 40, on_tokens=calls.append).token_ids == reference
  assert dispatched == [1, engine.MAX_ROUNDS_PER_CHUNK]  # one round, then all the rest at its pace; nothing after
  assert len(calls) == 3  # the first token and the two chunks
  dispatched.clear()
  assert engine.generate(tiny, [[5, 6, 7]], 40).token_ids == reference
  assert dispatched == [engine.MAX_ROUNDS_PER_CHUNK]  # the pace of the generation before


def test_tokenswift_ranks_its_candidates_under_the_penalty(tiny):
  """Under a contextual penalty TokenSwift proposes the penalised ranking's tokens (its
  one depth-1 candidate is the target's penalised choice), so its rounds accept more
  than the raw ranking's, and both emit AR's tokens under that penalty."""
  rng = np.random.default_rng(3)
  prompts = [rng.integers(3, 40, size=30).tolist(), rng.integers(3, 211, size=24).tolist()]
  sampling = SamplingConfig(penalty=3.0, penalty_window=12)
  reference = generate(tiny, prompts, 24, Decoding(sampling=sampling)).token_ids
  heads, params = tokenswift(tiny, budget=96, ngrams=2, lag=0)
  runs = {}
  for name, proposer in (("raw", heads), ("penalised", dataclasses.replace(heads, sampling=sampling))):
    runs[name] = generate(tiny, prompts, 24, Decoding(proposer=proposer, sampling=sampling), params)
    assert runs[name].token_ids == reference, name
  assert runs["penalised"].stats.mean_accepted_length > runs["raw"].stats.mean_accepted_length


def test_sparse_verification_keeping_all_the_mass_is_lossless(tiny):
  """SpecAttn's sparse verification with p = 1 keeps every chunk: AR's tokens (float32);
  at p = 0.3 the trees carry fewer chunks than the cache has, and generation runs on
  (its tokens may differ: lossy)."""
  from longspec_jax.models.config import SparseVerify

  rng = np.random.default_rng(9)
  prompts = [rng.integers(3, 211, size=70).tolist(), rng.integers(3, 211, size=45).tolist()]
  reference = generate(tiny, prompts, 12).token_ids
  proposer, params = longspec(tiny, widths=(2, 2), window=8)
  whole = dataclasses.replace(proposer, sparse=SparseVerify(1.0, chunk=16, dense_layers=1))
  result = generate(tiny, prompts, 12, Decoding(proposer=whole), params)
  assert result.token_ids == reference and result.stats.kv_fraction_read == pytest.approx(1.0)
  some = dataclasses.replace(proposer, sparse=SparseVerify(0.3, chunk=16, dense_layers=1))
  result = generate(tiny, prompts, 12, Decoding(proposer=some), params)
  assert [len(t) for t in result.token_ids] == [12, 12] and result.stats.kv_fraction_read < 1
  state = start(tiny, prompts, 12, Decoding(proposer=some), params).state
  tree, _ = propose(tiny, some, params, state)
  assert tree.kept is not None and 0 < int(tree.kept.sum()) < tree.kept.size
