"""Generation loops: chunked prefill and the autoregressive (AR) baseline.

The model enters jit as (graphdef, params): graphdef is static, params a pytree. Prefill
runs the prompt in fixed-size chunks (bounded activation memory, one compilation). Decode
runs on device in `lax.while_loop`s of `decode_chunk` steps; the host dispatches the next
chunk before it reads the previous chunk's tokens, so streaming costs no device time.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from longspec_jax.attention import causal_block_mask
from longspec_jax.cache import KVCache
from longspec_jax.errors import UserError
from longspec_jax.sampling import SamplingConfig, sample
from longspec_jax.target import Transformer

PAD_ID = -1  # fills token slots after a sequence has finished


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DecodeState:
  cache: KVCache
  token: jax.Array  # [B] int32: the newest token, not yet in the cache
  done: jax.Array  # [B] bool: sequence has emitted EOS
  step: jax.Array  # [] int32: tokens emitted so far per sequence (including `token`)
  key: jax.Array  # PRNG key
  nonfinite: jax.Array  # [B] bool: some logits were NaN or inf


@dataclasses.dataclass
class GenerationResult:
  token_ids: list[list[int]]  # generated ids per sequence, EOS included when emitted
  stats: dict


def _merge(graphdef, params) -> Transformer:
  return nnx.merge(graphdef, params)


@functools.partial(jax.jit, static_argnames=("graphdef", "impl"), donate_argnames=("cache",))
def _prefill_chunk(graphdef, params, cache: KVCache, tokens, start, prompt_lengths, last_hidden, impl):
  """Runs prompt tokens [B, C] at positions start..start+C; keeps each sequence's hidden
  state at its last prompt token in `last_hidden [B, E]`."""
  model = _merge(graphdef, params)
  chunk = tokens.shape[1]
  positions = start + jnp.broadcast_to(jnp.arange(chunk), tokens.shape)  # [B, C]
  valid = positions < prompt_lengths[:, None]
  hidden, cache = model(tokens, positions, causal_block_mask(positions, valid), cache, impl)
  last = prompt_lengths - 1 - start  # [B]: index of the last prompt token in this chunk
  here = (last >= 0) & (last < chunk)
  picked = jnp.take_along_axis(hidden, jnp.clip(last, 0, chunk - 1)[:, None, None], axis=1)[:, 0]
  last_hidden = jnp.where(here[:, None], picked, last_hidden)
  return cache.advance(jnp.sum(valid, axis=1, dtype=jnp.int32)), last_hidden


def prefill(model: Transformer, prompts: Sequence[Sequence[int]], max_len: int, chunk: int, impl: str):
  """Fills a new cache with the prompts; returns (cache, hidden [B, E] at each last prompt token)."""
  graphdef, params = nnx.split(model)
  lengths = np.array([len(p) for p in prompts], np.int32)
  longest = int(lengths.max())
  chunk = min(chunk, 1 << max(4, (longest - 1).bit_length()))  # short prompts: a smaller chunk
  padded = np.zeros((len(prompts), -(-longest // chunk) * chunk), np.int32)
  for row, prompt in zip(padded, prompts):
    row[: len(prompt)] = prompt
  cache = KVCache.create(model.config, len(prompts), max_len, model.dtype)
  last_hidden = jnp.zeros((len(prompts), model.config.hidden_size), model.dtype)
  for start in range(0, padded.shape[1], chunk):
    cache, last_hidden = _prefill_chunk(
        graphdef, params, cache, padded[:, start : start + chunk], start, lengths, last_hidden, impl
    )
  return cache, last_hidden


@functools.partial(
    jax.jit, static_argnames=("graphdef", "impl", "sampling", "steps"), donate_argnames=("state",)
)
def _decode_chunk(graphdef, params, state: DecodeState, limit, eos_ids, impl, sampling, steps):
  """Up to `steps` AR steps on device, stopping at `limit` tokens or when all are done.

  Returns the new state and the chunk's tokens [B, steps] (PAD_ID where none was made).
  """
  model = _merge(graphdef, params)
  batch = state.token.shape[0]
  first_step = state.step

  def cond(carry):
    state, _ = carry
    return (state.step < jnp.minimum(limit, first_step + steps)) & ~jnp.all(state.done)

  def body(carry):
    state, out = carry
    cache = state.cache
    positions = cache.lengths[:, None]  # slot i holds position i
    feed = jnp.maximum(state.token, 0)[:, None]  # finished sequences feed a dummy token
    hidden, cache = model(feed, positions, jnp.ones((batch, 1, 1), bool), cache, impl)
    logits = model.logits(hidden[:, 0])  # [B, V]
    key, step_key = jax.random.split(state.key)
    token = jnp.where(state.done, PAD_ID, sample(logits, step_key, sampling))
    out = out.at[:, state.step - first_step].set(token)
    new_state = DecodeState(
        cache=cache.advance(1),
        token=token,
        done=state.done | jnp.isin(token, eos_ids),
        step=state.step + 1,
        key=key,
        nonfinite=state.nonfinite | (~state.done & ~jnp.all(jnp.isfinite(logits), axis=-1)),
    )
    return new_state, out

  out = jnp.full((batch, steps), PAD_ID, jnp.int32)
  return jax.lax.while_loop(cond, body, (state, out))


@functools.partial(jax.jit, static_argnames=("graphdef", "sampling"))
def _first_token(graphdef, params, last_hidden, key, sampling):
  logits = _merge(graphdef, params).logits(last_hidden)
  return sample(logits, key, sampling), ~jnp.all(jnp.isfinite(logits), axis=-1)


def check_capacity(config, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> None:
  if not prompts or any(len(p) == 0 for p in prompts):
    raise UserError("the prompt is empty; give at least one token of text.")
  if max_new_tokens < 1:
    raise UserError(f"--max-new-tokens must be at least 1, got {max_new_tokens}.")
  longest = max(len(p) for p in prompts)
  if longest + max_new_tokens > config.max_position_embeddings:
    raise UserError(
        f"the prompt ({longest} tokens) plus --max-new-tokens ({max_new_tokens}) exceeds the model's"
        f" context of {config.max_position_embeddings} tokens."
    )


def generate_ar(
    model: Transformer,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    *,
    eos_ids: Sequence[int] = (),
    sampling: SamplingConfig = SamplingConfig(),
    seed: int = 0,
    impl: str = "reference",
    prefill_chunk: int = 512,
    decode_chunk: int = 32,
    on_tokens: Callable[[np.ndarray], None] | None = None,
) -> GenerationResult:
  """Plain autoregressive decoding of a batch of prompts; `on_tokens` receives each
  finished chunk of tokens [B, n] (PAD_ID after EOS) as soon as it is on the host."""
  check_capacity(model.config, prompts, max_new_tokens)
  graphdef, params = nnx.split(model)
  max_len = -(-(max(map(len, prompts)) + max_new_tokens) // 128) * 128
  eos = jnp.asarray(list(eos_ids) or [PAD_ID], jnp.int32)
  key, first_key = jax.random.split(jax.random.key(seed))

  t0 = time.perf_counter()
  cache, last_hidden = prefill(model, prompts, max_len, prefill_chunk, impl)
  token, nonfinite = _first_token(graphdef, params, last_hidden, first_key, sampling)
  first = np.asarray(token)
  prefill_seconds = time.perf_counter() - t0
  if on_tokens:
    on_tokens(first[:, None])

  state = DecodeState(
      cache=cache, token=token, done=jnp.isin(token, eos), step=jnp.int32(1), key=key,
      nonfinite=nonfinite,
  )
  chunks, pending = [first[:, None]], None
  compile_seconds = 0.0
  t1 = time.perf_counter()
  for chunk_start in range(1, max_new_tokens, decode_chunk):
    args = (graphdef, params, state, jnp.int32(max_new_tokens), eos, impl, sampling, decode_chunk)
    if chunk_start == 1:  # compile outside the timed region
      tc = time.perf_counter()
      _decode_chunk.lower(*args).compile()
      compile_seconds = time.perf_counter() - tc
    state, out = _decode_chunk(*args)
    if pending is not None and _take(pending, chunks, on_tokens):
      pending = None
      break
    pending = out
  if pending is not None:
    _take(pending, chunks, on_tokens)
  if bool(np.any(np.asarray(state.nonfinite))):
    raise UserError("the model produced NaN or infinite logits; the weights or the dtype are unsuitable.")
  decode_seconds = time.perf_counter() - t1 - compile_seconds

  tokens = np.concatenate(chunks, axis=1)
  token_ids = [[int(t) for t in row if t != PAD_ID] for row in tokens]
  new_tokens = sum(len(r) for r in token_ids)
  steps = max(len(r) for r in token_ids) - 1
  return GenerationResult(
      token_ids=token_ids,
      stats={
          "method": "ar",
          "num_new_tokens": new_tokens,
          "steps": steps,
          "mean_accepted_length": 1.0,
          "prefill_seconds": prefill_seconds,
          "decode_seconds": decode_seconds,
          "compile_seconds": compile_seconds,
          "tokens_per_second": (new_tokens - len(prompts)) / decode_seconds if decode_seconds > 0 else 0.0,
      },
  )


def _take(out: jax.Array, chunks: list, on_tokens) -> bool:
  """Moves a finished chunk to the host; True when every sequence has ended in it."""
  tokens = np.asarray(out)
  chunks.append(tokens)
  if on_tokens:
    on_tokens(tokens)
  return bool(np.all(np.any(tokens == PAD_ID, axis=1)))
