"""Parity of the target model with PyTorch transformers, through the KV cache."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

from longspec_jax.models.cache import KVCache
from longspec_jax.ops.attention import causal_block_mask
from longspec_jax.ops.numerics import Numerics
from longspec_jax.weights.hf import load_hf_dir

from helpers import real_texts, save_tiny_hf_model


@functools.partial(jax.jit, static_argnums=0)
def forward(graphdef, params, tokens, positions, mask, cache):
  model = nnx.merge(graphdef, params)
  hidden, cache = model(tokens, positions, mask, cache)
  return model.logits(hidden), cache.advance(tokens.shape[1])


def run_cached(model, tokens: np.ndarray, prefill: int) -> np.ndarray:
  """Logits [B, T, V]: the first `prefill` tokens in one pass, then one token per step."""
  graphdef, params = nnx.split(model)
  batch, steps = tokens.shape
  cache = KVCache.create(model.config, batch, steps + 3, model.dtype)
  positions = np.broadcast_to(np.arange(steps), (batch, steps))
  mask = causal_block_mask(jnp.asarray(positions[:, :prefill]), jnp.ones((batch, prefill), bool))
  logits, cache = forward(graphdef, params, tokens[:, :prefill], positions[:, :prefill], mask, cache)
  outs = [logits]
  for t in range(prefill, steps):
    one = np.ones((batch, 1, 1), bool)
    logits, cache = forward(graphdef, params, tokens[:, t : t + 1], positions[:, t : t + 1], one, cache)
    outs.append(logits)
  return np.asarray(jnp.concatenate(outs, axis=1))


@pytest.mark.parametrize("kind", ["llama", "qwen2", "mistral", "yarn", "linear"])
def test_logits_match_transformers(kind, tmp_path):
  import transformers

  path = save_tiny_hf_model(kind, tmp_path / kind)
  model, config = load_hf_dir(path, jnp.float32)
  assert config.qkv_bias == (kind in ("qwen2", "yarn"))
  tokens = np.random.default_rng(1).integers(0, config.vocab_size, size=(3, 40))
  hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
  with torch.no_grad():
    expected = hf(torch.tensor(tokens)).logits.numpy()
  got = run_cached(model, tokens, prefill=29)
  np.testing.assert_allclose(got, expected, atol=1e-4, rtol=0)


@pytest.mark.optimized
@pytest.mark.xdist_group("smollm2")
def test_smollm2_gguf_matches_transformers(smollm2_gguf, smollm2_float32):
  """The real model: logits on >= 512 tokens of real text, and 32 greedy tokens."""
  import transformers

  from longspec_jax.engine import generate

  target = smollm2_float32
  ids = target.tokenizer(real_texts()[0]).input_ids[:600]
  assert len(ids) >= 512
  hf = transformers.AutoModelForCausalLM.from_pretrained(
    smollm2_gguf.parent, gguf_file=smollm2_gguf.name, dtype=torch.float32
  ).eval()
  tokens = np.asarray([ids])
  with torch.no_grad():
    expected = hf(torch.tensor(tokens)).logits.numpy()
    hf_greedy = hf.generate(torch.tensor(tokens), max_new_tokens=32, do_sample=False, eos_token_id=None)
  got = run_cached(target.model, tokens, prefill=560)
  scale = np.abs(expected).max()
  assert np.abs(got - expected).max() < 1e-5 * scale * 50, np.abs(got - expected).max()
  assert (got.argmax(-1) == expected.argmax(-1)).all()
  ours = generate(target.model, [ids], 32).token_ids[0]
  assert ours == hf_greedy[0, len(ids) :].tolist()


def test_bfloat16_close_to_float32(tmp_path):
  path = save_tiny_hf_model("llama", tmp_path / "m")
  m32, config = load_hf_dir(path, jnp.float32)
  m16, _ = load_hf_dir(path, jnp.bfloat16)
  tokens = np.random.default_rng(2).integers(0, config.vocab_size, size=(2, 24))
  a, b = run_cached(m32, tokens, 16), run_cached(m16, tokens, 16)
  assert np.abs(a - b).max() / np.abs(a).max() < 3e-2


@pytest.mark.parametrize("window", [None, 6])
def test_the_whole_sequence_forward_is_the_causal_masked_pass(window):
  """`causal_hidden_and_kv` (draft training's frozen target) equals the masked pass over
  a causal mask in sequence order, with jumping (anchor-offset) positions, GQA and a
  sliding window, on the reference and on the fused flash pass training uses."""
  from longspec_jax.models.config import TargetConfig
  from longspec_jax.models.rope import anchor_offset_positions
  from longspec_jax.models.target import random_model
  from longspec_jax.ops.attention import Impl

  config = TargetConfig(
    vocab_size=101,
    hidden_size=48,
    intermediate_size=80,
    num_layers=2,
    num_heads=6,
    num_kv_heads=2,
    head_dim=8,
    max_position_embeddings=512,
    sliding_window=window,
  )
  model = random_model(config, jnp.float32, seed=4, numerics=Numerics(attention=Impl.REFERENCE))
  tokens = jnp.asarray(np.random.default_rng(6).integers(0, 101, (3, 29)), jnp.int32)
  positions = anchor_offset_positions(jax.random.key(2), 3, 29, 512)
  index = jnp.broadcast_to(jnp.arange(29), (3, 29))
  expected = model.hidden_and_kv(tokens, positions, causal_block_mask(index, jnp.ones((3, 29), bool), window))
  for impl in (Impl.REFERENCE, Impl.FLASH):
    for got, want in zip(model.with_numerics(attention=impl).causal_hidden_and_kv(tokens, positions), expected):
      np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-5, atol=2e-5)


def test_batch_invariant_prefill_does_not_depend_on_the_cache_length(tmp_path):
  """With `batch_invariant`, the prompt's cached K/V are the same bits in a cache of any
  allocated length (AR and a method with trees allocate differently), bf16."""
  from longspec_jax.engine import prefill

  model, _ = load_hf_dir(save_tiny_hf_model("llama", tmp_path / "llama"), jnp.bfloat16)
  model = model.with_numerics(batch_invariant=True)
  prompt = np.random.default_rng(2).integers(3, 211, size=(1, 300)).tolist()
  (short, hidden_a), (long, hidden_b) = (prefill(model, prompt, n, chunk=128) for n in (384, 1152))  # 1 or 3 splits
  np.testing.assert_array_equal(np.asarray(hidden_a), np.asarray(hidden_b))
  for a, b in ((short.k, long.k), (short.v, long.v)):
    np.testing.assert_array_equal(np.asarray(a[:, :, :300]), np.asarray(b[:, :, :300]))


def test_unrolled_layers_give_the_loops_results(tmp_path):
  """Decoding rounds on a GPU run the layers unrolled (`Transformer.unrolled_rounds`):
  the same logits and cache as the layer loop, after a cached prefix (float32)."""
  model, config = load_hf_dir(save_tiny_hf_model("qwen2", tmp_path / "m"), jnp.float32)
  graphdef, params = nnx.split(model)
  rng = np.random.default_rng(5)
  prefix, step = rng.integers(0, config.vocab_size, size=(2, 13)), rng.integers(0, config.vocab_size, size=(2, 7))
  prefix_positions = jnp.broadcast_to(jnp.arange(13), (2, 13))
  prefix_mask = causal_block_mask(prefix_positions, jnp.ones((2, 13), bool))
  empty = KVCache.create(config, 2, 24, jnp.float32)
  _, cache = forward(graphdef, params, prefix, prefix_positions, prefix_mask, empty)
  positions = jnp.broadcast_to(13 + jnp.arange(7), (2, 7))
  mask = causal_block_mask(positions, jnp.ones((2, 7), bool))

  @functools.partial(jax.jit, static_argnums=0)
  def round_(unroll, params, cache):
    model = nnx.merge(graphdef, params)
    hidden, cache = model(step, positions, mask, cache, unroll=unroll)
    return model.logits(hidden), cache

  (loop_logits, loop_cache), (flat_logits, flat_cache) = round_(False, params, cache), round_(True, params, cache)
  np.testing.assert_allclose(np.asarray(flat_logits), np.asarray(loop_logits), rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(np.asarray(flat_cache.k), np.asarray(loop_cache.k), rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(np.asarray(flat_cache.v), np.asarray(loop_cache.v), rtol=1e-5, atol=1e-6)


def test_a_sparse_read_of_the_cache_keeps_its_first_layers_dense(tmp_path):
  """Kept chunks covering the first m slots of every head read what a cache of length m
  gives, in the layers from `dense_layers` on; every layer dense (dense_layers = L) or
  every chunk kept is the dense pass."""
  from longspec_jax.models.config import SparseVerify

  model, config = load_hf_dir(save_tiny_hf_model("qwen2", tmp_path / "m"), jnp.float32)
  rng = np.random.default_rng(6)
  prefix = jnp.asarray(rng.integers(0, config.vocab_size, size=(1, 48)))
  positions = jnp.arange(48)[None]
  _, cache = model(
    prefix, positions, causal_block_mask(positions, jnp.ones((1, 48), bool)), KVCache.create(config, 1, 64, jnp.float32)
  )
  cache = KVCache(k=cache.k, v=cache.v, lengths=jnp.asarray([48], jnp.int32))
  step, step_positions = jnp.asarray([[3, 5]]), jnp.asarray([[48, 49]])
  mask = causal_block_mask(step_positions, jnp.ones((1, 2), bool))
  first_half = jnp.broadcast_to(jnp.arange(4) < 2, (1, config.num_kv_heads, 4))  # chunks of 16: slots < 32
  run = lambda cache, **sparse: model.hidden_and_kv(step, step_positions, mask, cache, **sparse)[0]
  dense = run(cache)
  short = run(KVCache(k=cache.k, v=cache.v, lengths=jnp.asarray([32], jnp.int32)))
  sparse = lambda kept, layers: run(cache, kept=kept, sparse=SparseVerify(0.9, chunk=16, dense_layers=layers))
  np.testing.assert_allclose(np.asarray(sparse(first_half, 0)), np.asarray(short), rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(np.asarray(sparse(first_half, config.num_layers)), np.asarray(dense), rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(np.asarray(sparse(jnp.ones_like(first_half), 0)), np.asarray(dense), rtol=1e-5, atol=1e-5)
  assert not np.allclose(np.asarray(sparse(first_half, 1)), np.asarray(dense), atol=1e-5)
  # One kept set per layer: every layer's own = the shared one; layer 0's whole = dense_layers 1.
  per_layer = jnp.broadcast_to(first_half, (config.num_layers, *first_half.shape))
  np.testing.assert_allclose(np.asarray(sparse(per_layer, 0)), np.asarray(short), rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(
    np.asarray(sparse(per_layer.at[0].set(True), 0)), np.asarray(sparse(first_half, 1)), rtol=1e-5, atol=1e-5
  )
  # A dense pass's attention per layer and chunk: each query's and head's weights over the
  # prefix sum to 1, nothing falls past its length.
  masses = model.prefix_masses(step, step_positions, mask, cache, 16)  # [L, B, K, C]
  assert masses.shape == (config.num_layers, 1, config.num_kv_heads, 4)
  np.testing.assert_allclose(np.asarray(masses.sum(-1)), 2 * config.num_heads // config.num_kv_heads, rtol=1e-5)
  assert float(jnp.abs(masses[..., 3]).max()) == 0.0
