"""The AR engine: exact greedy decoding, batching, EOS, sampling reproducibility."""

import jax.numpy as jnp
import numpy as np
import pytest

from conftest import save_tiny_hf_model
from longspec_jax.attention import causal_block_mask
from longspec_jax.engine import generate_ar
from longspec_jax.errors import UserError
from longspec_jax.sampling import SamplingConfig
from longspec_jax.weights.hf import load_hf_dir


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
  model, _ = load_hf_dir(save_tiny_hf_model("qwen2", tmp_path_factory.mktemp("m") / "qwen2"), jnp.float32)
  return model


def naive_greedy(model, prompt, steps):
  """Recomputes the whole sequence for every token: slow, obviously right."""
  tokens = list(prompt)
  for _ in range(steps):
    x = jnp.asarray([tokens])
    positions = jnp.arange(len(tokens))[None]
    hidden, _ = model(x, positions, causal_block_mask(positions, jnp.ones(x.shape, bool)))
    tokens.append(int(jnp.argmax(model.logits(hidden[0, -1]))))
  return tokens[len(prompt):]


def test_greedy_equals_naive_recompute(tiny):
  prompt = np.random.default_rng(0).integers(3, 211, size=19).tolist()
  result = generate_ar(tiny, [prompt], 12, decode_chunk=5)
  assert result.token_ids[0] == naive_greedy(tiny, prompt, 12)
  assert result.stats["num_new_tokens"] == 12 and result.stats["steps"] == 11


def test_batch_equals_each_prompt_alone(tiny):
  rng = np.random.default_rng(1)
  prompts = [rng.integers(3, 211, size=n).tolist() for n in (7, 23, 15)]
  batched = generate_ar(tiny, prompts, 9, prefill_chunk=8, decode_chunk=4).token_ids
  assert batched == [generate_ar(tiny, [p], 9).token_ids[0] for p in prompts]


def test_eos_stops_exactly_there(tiny):
  prompt = np.random.default_rng(2).integers(3, 211, size=11).tolist()
  free = generate_ar(tiny, [prompt], 10).token_ids[0]
  eos = free[4]
  stopped = generate_ar(tiny, [prompt], 10, eos_ids=[eos], decode_chunk=3).token_ids[0]
  assert stopped == free[: free.index(eos) + 1]


def test_sampling_is_reproducible_and_seed_dependent(tiny):
  prompt = list(range(3, 30))
  hot = SamplingConfig(temperature=1.5)
  a = generate_ar(tiny, [prompt], 16, sampling=hot, seed=7).token_ids
  b = generate_ar(tiny, [prompt], 16, sampling=hot, seed=7).token_ids
  c = generate_ar(tiny, [prompt], 16, sampling=hot, seed=8).token_ids
  assert a == b and a != c


def test_capacity_and_empty_prompt_errors(tiny):
  with pytest.raises(UserError, match="exceeds the model's context of 512"):
    generate_ar(tiny, [[5] * 500], 20)
  with pytest.raises(UserError, match="empty"):
    generate_ar(tiny, [[]], 4)


def test_nonfinite_logits_are_reported(tiny):
  from flax import nnx

  graphdef, state = nnx.split(tiny)
  pure = nnx.to_pure_dict(state)
  pure["final_norm"] = pure["final_norm"] * jnp.nan
  nnx.replace_by_pure_dict(state, pure)
  with pytest.raises(UserError, match="NaN"):
    generate_ar(nnx.merge(graphdef, state), [[5, 6, 7]], 4)


def test_finished_sequences_do_not_disturb_the_others(tiny):
  rng = np.random.default_rng(4)
  prompts = [rng.integers(3, 211, size=n).tolist() for n in (9, 14)]
  free = [generate_ar(tiny, [p], 8).token_ids[0] for p in prompts]
  eos = free[0][2]  # the first sequence stops early, the second (most likely) runs on
  batched = generate_ar(tiny, prompts, 8, eos_ids=[eos], decode_chunk=3).token_ids
  for got, alone in zip(batched, free):
    assert got == (alone[: alone.index(eos) + 1] if eos in alone else alone)
