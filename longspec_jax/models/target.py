"""The Llama-family target decoder as Flax NNX modules.

embed -> L x (RMSNorm, attention with RoPE, RMSNorm, SwiGLU MLP) -> RMSNorm -> LM head
(tied to the embedding or separate). The L layers' parameters are stacked on a leading
axis and run with `lax.scan`, so compile time does not grow with depth, except in
decoding rounds on a GPU, which run them unrolled (`Transformer.unrolled_rounds`). q/k/v
share one projection `[E, H + 2K, D]` and gate/up another `[E, 2, F]`: one matrix product
each.

Every forward takes explicit positions and a mask over the step's own tokens, and
attends to the committed prefix of the KV cache through `attention.hybrid_attention`:
the same call serves prefill chunks, AR decode and tree verification.

Batch-invariant decoding (`Transformer.batch_invariant`): a decoding round's forward and
logits run every product through the batch-invariant Pallas matmul, every norm through
the batch-invariant Pallas RMSNorm and every attention through the batch-invariant hybrid
pass, so a token's logits at a position are the same bits whether AR decoding computes
it alone or a verification computes it among a tree's nodes: bf16 speculative output
then equals bf16 AR output token for token, not only up to near-ties. Prefill, which
both share, keeps its fast products; its attention only stops depending on the cache's
allocated length (`attention.Invariance.CACHE`), which a speculative run sizes for its
trees.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from flax import nnx

from longspec_jax import backend
from longspec_jax.models.cache import KVCache, write_block
from longspec_jax.models.config import SparseVerify, TargetConfig
from longspec_jax.models.layers import DecoderLayer, build_random, embed_tokens, init_weight, rms_norm, stacked_layers
from longspec_jax.models.rope import inverse_frequencies, rope_tables
from longspec_jax.ops import attention, topk
from longspec_jax.ops.attention import Impl, Invariance
from longspec_jax.ops.gemm import Compilation, Gemm
from longspec_jax.ops.numerics import Numerics


class Transformer(nnx.Module):
  """The target model. Call it with tokens, positions, a block mask and (optionally) a
  cache. Its `numerics` (`numerics.Numerics`, fixed when it is built or loaded) say which
  code every attention of the model runs (`attention`), which code its matrix products run
  in the engine's compiled functions (`gemm`) and whether decoding rounds compute
  batch-invariantly (`batch_invariant`, module docstring; the engine passes it to
  `__call__` and `logits` for its rounds); `with_numerics` gives a copy that computes
  another way."""

  def __init__(
    self,
    config: TargetConfig,
    dtype=jnp.float32,
    *,
    rngs: nnx.Rngs,
    numerics: Numerics | None = None,
  ):
    self.config = config
    self.numerics = numerics or Numerics()
    self.embed = nnx.Param(init_weight(rngs.params(), (config.vocab_size, config.hidden_size), dtype))

    self.layers = stacked_layers(DecoderLayer, config, dtype, rngs)
    self.final_norm = nnx.Param(jnp.ones((config.hidden_size,), dtype))
    self.lm_head = (
      None
      if config.tie_word_embeddings
      else nnx.Param(init_weight(rngs.params(), (config.hidden_size, config.vocab_size), dtype))
    )

  @property
  def attention(self) -> Impl:
    return self.numerics.attention

  @property
  def gemm(self) -> Gemm:
    return self.numerics.gemm

  @property
  def batch_invariant(self) -> bool:
    return self.numerics.batch_invariant

  def with_numerics(self, numerics: Numerics | None = None, **changes) -> Transformer:
    """A copy computing with `numerics` (default: its own) with `changes` to its fields;
    the two share their arrays."""
    graphdef, state = nnx.split(self)
    copy = nnx.merge(graphdef, state)
    copy.numerics = dataclasses.replace(numerics or self.numerics, **changes)
    return copy

  def compilation(self, rounds: bool = False) -> Compilation:
    """How the engine compiles this model's functions (`gemm.jit`): its `gemm`, exact bf16
    rounding under batch-invariant decoding (`gemm.Compilation`), and for decoding rounds
    (`rounds`) under batch-invariant decoding XLA's own GEMM choice: every product of the
    target is then the Pallas matmul, and rounds compiled with cuBLAS for XLA's remaining
    dots were measured to give some positions different bits from an AR step (H100,
    SmolLM2 shape, before exact rounding: 39 of 330 chain nodes; none with XLA's choice)."""
    gemm = Gemm.XLA if rounds and self.batch_invariant else self.gemm
    return Compilation(gemm, exact=self.batch_invariant)

  @property
  def unrolled_rounds(self) -> bool:
    """Whether decoding rounds (`verify.verify`) run the layers unrolled instead of as a
    loop: on a GPU. XLA launches a loop's body as one CUDA graph per iteration, tens of
    microseconds of host time per layer, and a round's layers on a small model take about
    as long on the device (SmolLM2 at 4k: ~50 us), so the device waited on the host:
    measured on an H100, engine rounds of random SmolLM2-shape weights took 1.50 / 2.61 /
    2.67 ms (AR / PLD's 16 nodes / LongSpec's 80) as a loop and 1.27 / 1.44 / 2.36 ms
    unrolled, the round then one launch. The
    price is compile time (SmolLM2's AR loop 2.8 -> 8.8 s); off a GPU a loop costs no
    launches, so it stays a loop."""
    return backend.on_gpu()

  @property
  def dtype(self):
    return self.embed[...].dtype

  def __call__(
    self,
    tokens: jax.Array,
    positions: jax.Array,
    mask: jax.Array,
    cache: KVCache | None = None,
    *,
    invariant: bool = False,
    unroll: bool = False,
    kept: jax.Array | None = None,
    sparse: SparseVerify | None = None,
    reads: jax.Array | None = None,
  ) -> tuple[jax.Array, KVCache | None]:
    """tokens, positions [B, T]; mask [B, T, T] over this step's tokens, or None for the
    first pass over an empty cache (causal over the tokens alone; with `invariant`,
    batch-invariant numerics: the mask must be a tree's ancestor mask, see the module
    docstring; with `unroll`, the layers unrolled, `unrolled_rounds`; with `kept` and
    `sparse`, the cache read sparsely, `hidden_and_kv`; with `reads` [B], each sequence's
    attention reads that many cached slots instead of all it holds: 0 for a finished one
    in a batch, whose outputs nobody reads).

    Returns the final hidden states [B, T, E] (normed; see `logits`) and the cache with
    this step's K/V written after each sequence's committed prefix (lengths unchanged).
    """
    x, k_new, v_new = self.hidden_and_kv(
      tokens, positions, mask, cache, invariant=invariant, unroll=unroll, kept=kept, sparse=sparse, reads=reads
    )
    if cache is not None:
      # The cache is only read inside the layer scan; all layers' new K/V are written
      # after it, in place, so no layer ever copies the cache.
      cache = KVCache(
        k=write_block(cache.k, cache.lengths, k_new),
        v=write_block(cache.v, cache.lengths, v_new),
        lengths=cache.lengths,
      )
    return x, cache

  def hidden_and_kv(
    self,
    tokens,
    positions,
    mask,
    cache: KVCache | None = None,
    *,
    invariant: bool = False,
    unroll: bool = False,
    any_slot: bool = False,
    kept=None,
    sparse: SparseVerify | None = None,
    reads: jax.Array | None = None,
  ):
    """The forward pass: final hidden states [B, T, E] and every layer's K/V of these
    tokens, k and v [L, B, T, K, D] (what draft training cross-attends to). Without a
    cache the attention is the masked pass alone (not differentiable with pallas). With
    `any_slot`, every committed slot of the cache is visible to every query whatever the
    sliding window: a cache whose slots are not positions (`PartialCache.as_cache`).
    With `kept` [B, K, ceil(S / sparse.chunk)] (or one per layer, [L, B, K, C]) the cache
    is read sparsely, those chunks only, in the layers from `sparse.dense_layers` on
    (`SparseVerify`: lossy). `reads`: see `__call__`."""
    x, k_new, v_new, _ = self._layers(
      tokens,
      positions,
      mask,
      cache,
      invariant=invariant,
      unroll=unroll,
      any_slot=any_slot,
      kept=kept,
      sparse=sparse,
      reads=reads,
    )
    return x, k_new, v_new

  def causal_hidden_and_kv(self, tokens, positions):
    """`hidden_and_kv` of whole sequences tokens [B, T] without a cache, each token
    attending to those before it in sequence order (positions may jump: anchor-offset)
    within the sliding window: the frozen target's forward in draft training. With
    `Impl.FLASH`, a fused causal pass (cuDNN on a GPU), no [B, T, T] mask."""
    x, k, v, _ = self._layers(tokens, positions, None)
    return x, k, v

  def prefix_masses(self, tokens, positions, mask, cache: KVCache, chunk: int) -> jax.Array:
    """Where each layer's attention over the cache fell in a dense pass of these tokens:
    [L, B, K, ceil(S / chunk)] float32, summed over the tokens and each KV head's group
    (`attention.prefix_chunk_mass`). SpecAttn's per-layer oracle: the selection each
    layer would make from its own attention, which a draft's only approximates."""
    return self._layers(tokens, positions, mask, cache, mass_chunk=chunk)[3]

  def _layers(
    self,
    tokens,
    positions,
    mask,
    cache: KVCache | None = None,
    *,
    invariant: bool = False,
    unroll: bool = False,
    any_slot: bool = False,
    kept=None,
    sparse: SparseVerify | None = None,
    mass_chunk: int = 0,
    reads: jax.Array | None = None,
  ):
    """`hidden_and_kv`, and with `mass_chunk` each layer's prefix mass per chunk
    (`prefix_masses`; else None)."""
    c = self.config
    window = None if any_slot else c.sliding_window
    x = embed_tokens(self.embed[...], tokens)  # [B, T, E]
    inv_freq, scale = inverse_frequencies(c.rope, c.head_dim)
    cos, sin = rope_tables(positions, inv_freq, scale)  # [B, T, D/2]
    layer_def, layer_state = nnx.split(self.layers)
    invariance = Invariance.FULL if invariant else Invariance.CACHE if self.batch_invariant else Invariance.NONE
    # Where attention runs the Pallas kernels (inference on a GPU) the norms do too: one
    # launch each instead of XLA's two (`rms_norm`), each layer's gain read from the stack.
    kernel_norms = self.attention is Impl.PALLAS and not invariant
    if kept is not None:  # [L, B, K, C]: scanned with the layers
      kept = attention.layer_chunks(kept, c.num_layers, sparse.dense_layers)

    def block(x, xs):
      state, index, layer_kept = xs  # this layer's params (the scan's slice of the stack), index, kept chunks
      if invariant:
        # The Pallas matmul reads each layer's weights from the stack by index, in place (a
        # slice handed to it would be copied first).
        layer, weights = nnx.merge(layer_def, layer_state), dict(layer=index, invariant=True)
      else:
        # XLA's cuBLAS calls read the scan's own slices in place (offsets at the loop's counter).
        layer, weights = nnx.merge(layer_def, state), {}
      norms = dict(norms=(nnx.merge(layer_def, layer_state), index)) if kernel_norms else {}
      q, k, v = layer.project_qkv(x, cos, sin, **weights, **norms)
      mass = None
      if mask is None:  # causal over these tokens alone: `causal_hidden_and_kv`, or a first prefill pass
        out = attention.causal_attention(q, k, v, window, impl=self.attention)
      elif cache is None:
        out, _ = attention.masked_attention(q, k, v, mask, impl=self.attention)
      else:
        # The whole stacked cache goes in with the layer's index, not a slice of it.
        sparsely = {} if layer_kept is None else dict(kept=layer_kept, chunk=sparse.chunk)
        out = attention.hybrid_attention(
          q,
          cache.k,
          cache.v,
          cache.lengths if reads is None else reads,
          k,
          v,
          mask,
          positions,
          window=window,
          layer=index,
          impl=self.attention,
          invariance=invariance,
          dtype=x.dtype,
          **sparsely,
        )
        if mass_chunk:
          _, lse = attention.prefix_attention(q, cache.k, cache.v, cache.lengths, layer=index, impl=self.attention)
          mass = attention.prefix_chunk_mass(q, cache.k, lse, cache.lengths, mass_chunk, layer=index)
      return layer.add_mlp(layer.add_attention(x, out, **weights), **weights, **norms), (k, v, mass)

    x, (k_new, v_new, mass) = jax.lax.scan(
      block, x, (layer_state, jnp.arange(c.num_layers), kept), unroll=unroll
    )  # k_new [L, B, T, K, D]
    hidden = rms_norm(x, self.final_norm[...], c.rms_norm_eps, invariant=invariant, kernel=kernel_norms)
    return hidden, k_new, v_new, mass

  def _head(self) -> tuple[jax.Array, bool]:
    """The LM head's weights and whether they are stored [V, E] (the tied embedding)
    rather than [E, V]."""
    tied = self.lm_head is None
    return (self.embed[...] if tied else self.lm_head[...]), tied

  def logits(self, hidden: jax.Array, *, invariant: bool = False) -> jax.Array:
    """hidden [..., E] -> float32 logits [..., V] through the (possibly tied) LM head
    (with `invariant`, the batch-invariant matmul).

    The product comes out in the model's dtype (float32 accumulation), as transformers
    computes it, and is widened after: asked for float32 out of bf16 operands, XLA's
    cuBLAS path first widens the whole [E, V] head to float32 (1.4 ms a step at 8B)."""
    head, transposed = self._head()
    if invariant:
      from pallas_kernels.matmul import matmul

      logits = matmul(hidden, head, transposed=transposed, interpret=not backend.on_gpu())
    else:
      logits = jnp.einsum("...e,ve->...v" if transposed else "...e,ev->...v", hidden, head)
    return logits.astype(jnp.float32)

  def head_rows(self, tokens: jax.Array) -> HeadRows:
    """The LM head's rows of `tokens` [N] (ascending ids), [N, E] whichever way the head
    is stored: a copy a draft scores in place of the whole vocabulary."""
    head, transposed = self._head()
    rows = jnp.take(head, tokens, axis=0) if transposed else jnp.take(head, tokens, axis=1).T
    return HeadRows(tokens=tokens, head=rows)

  def top_log_probs(self, hidden: jax.Array, k: int, rows: HeadRows | None = None) -> tuple[jax.Array, jax.Array]:
    """The k most likely next tokens after hidden [..., E] and their log-probabilities,
    largest first (lower token first among equals), each [..., k]: what a draft's beam
    search keeps of a vocabulary pass. With `rows`, over those tokens alone, normalized
    among them (FR-Spec's subset of the vocabulary: the head's product reads only their
    rows). For a few rows on a GPU, the head's product fused with the top-k, the logits
    never in HBM (`topk.head_top_log_probs`); else the logits, a log-softmax and
    `topk.top_k`."""
    head, transposed = self._head() if rows is None else (rows.head, True)
    if topk.fused_head_pays(math.prod(hidden.shape[:-1])):
      top, index = topk.head_top_log_probs(hidden, head, k, transposed=transposed)
    else:
      logits = self.logits(hidden) if rows is None else jnp.einsum("...e,ve->...v", hidden, head).astype(jnp.float32)
      top, index = topk.top_k(jax.nn.log_softmax(logits, axis=-1), k)
    return top, index if rows is None else rows.tokens[index]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class HeadRows:
  """Some tokens' rows of the LM head (`Transformer.head_rows`): the part of the
  vocabulary a draft scores."""

  tokens: jax.Array  # [N] int32, ascending
  head: jax.Array  # [N, E]


def abstract_model(config: TargetConfig, dtype, numerics: Numerics | None = None) -> Transformer:
  """The model's structure with shape/dtype placeholders instead of arrays (no memory)."""
  return nnx.eval_shape(lambda: Transformer(config, dtype, rngs=nnx.Rngs(0), numerics=numerics))


def random_model(config: TargetConfig, dtype, seed: int = 0, numerics: Numerics | None = None) -> Transformer:
  return build_random(lambda rngs: Transformer(config, dtype, rngs=rngs, numerics=numerics), seed)
