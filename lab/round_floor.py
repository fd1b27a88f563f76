"""The floor of a decoding round, term by term, from the shapes alone: the bytes each pass
must read (weights, the K/V it attends to, the LM head rows the draft scores) over a
measured read bandwidth, and the FLOPs of the verify pass (its matmuls over the tree's
rows and its attention over the context) over a measured matmul peak. A pass costs at
least the larger of its bytes and its FLOPs; a round's passes run one after another, so
its floor is their sum. Free of JAX: `lab.bench_target` measures the two rates and the
rounds, and tests check the arithmetic by hand."""

from __future__ import annotations

import dataclasses

from longspec_jax.models.config import BlockConfig, DraftConfig, TargetConfig


def layer_params(c: BlockConfig) -> int:
  """Matmul weights of one decoder layer: q, k, v, o and the SwiGLU MLP's three."""
  e, d = c.hidden_size, c.head_dim
  return e * (c.num_heads + 2 * c.num_kv_heads) * d + c.num_heads * d * e + 3 * e * c.intermediate_size


@dataclasses.dataclass(frozen=True)
class Round:
  """One round of a method at batch `batch` and `context` cached positions: a verify pass
  of `nodes` rows per sequence (1: an AR step) after `draft_passes` passes of the draft
  (LongSpec's: its catch-up and one per beam depth but the last; each reads the draft's
  layers, the K/V of the target layer it cross-attends to and its ring) and `head_reads`
  top-k passes over `head_rows` rows of the LM head (the vocabulary, or the draft's
  subset of it). TokenSwift drafts with one pass of the target itself over
  `self_draft_slots` slots of its partial cache (its heads' few weights left out)."""

  target: TargetConfig
  itemsize: int
  batch: int
  context: int
  nodes: int = 1
  draft: DraftConfig | None = None
  draft_passes: int = 0
  head_reads: int = 0
  head_rows: int | None = None  # None: the whole vocabulary
  self_draft_slots: int = 0  # TokenSwift: its drafting pass, the target over this many cached slots
  devices: int = 1  # tensor parallelism: each device reads its share

  @property
  def target_weight_bytes(self) -> int:
    """The weights a target pass reads: its layers and the LM head (of the embedding
    table, one row per token)."""
    c = self.target
    return (c.num_layers * layer_params(c) + c.vocab_size * c.hidden_size) * self.itemsize

  @property
  def kv_bytes(self) -> int:
    """The target's cached K/V of the context, every layer."""
    c = self.target
    return self.batch * c.num_layers * self.context * 2 * c.num_kv_heads * c.head_dim * self.itemsize

  @property
  def draft_pass_bytes(self) -> int:
    """One draft pass: its layers (and their cross-attention's q and o), the K/V of one
    target layer per draft layer over the context, and its ring; TokenSwift's, the
    target's weights and its partial cache."""
    d = self.draft
    if self.self_draft_slots:
      c = self.target
      partial = self.batch * c.num_layers * self.self_draft_slots * 2 * c.num_kv_heads * c.head_dim * self.itemsize
      return self.target_weight_bytes + partial
    if d is None:
      return 0
    cross = 2 * d.hidden_size * d.num_heads * d.head_dim if d.cross_attention else 0
    kv_row = 2 * d.num_kv_heads * d.head_dim * self.itemsize
    cross_kv = self.batch * self.context * kv_row if d.cross_attention else 0
    ring = self.batch * d.ring_size(self.context) * kv_row
    return d.num_layers * ((layer_params(d) + cross) * self.itemsize + cross_kv + ring)

  @property
  def head_bytes(self) -> int:
    """One top-k pass of the draft: the LM head's rows it scores."""
    rows = self.target.vocab_size if self.head_rows is None else self.head_rows
    return rows * self.target.hidden_size * self.itemsize

  @property
  def verify_gemm_flops(self) -> int:
    c = self.target
    return 2 * self.batch * self.nodes * (c.num_layers * layer_params(c) + c.vocab_size * c.hidden_size)

  @property
  def verify_attention_flops(self) -> int:
    """Scores and values of every node against the context and the tree (QK and PV)."""
    c = self.target
    return 4 * self.batch * self.nodes * (self.context + self.nodes) * c.num_heads * c.head_dim * c.num_layers

  def terms_ms(self, read_bandwidth: float, peak_flops: float) -> dict[str, float]:
    """Each term in ms (bytes over `read_bandwidth` bytes/s, FLOPs over `peak_flops`
    FLOP/s, a device's share of each under tensor parallelism) and the round's floor:
    the draft's passes and head reads, then the verify pass at the larger of its bytes
    and its FLOPs."""
    share = 1e3 / self.devices
    terms = {
      "draft_ms": self.draft_passes * self.draft_pass_bytes / read_bandwidth * share,
      "head_ms": self.head_reads * self.head_bytes / read_bandwidth * share,
      "verify_bytes_ms": (self.target_weight_bytes + self.kv_bytes) / read_bandwidth * share,
      "verify_gemm_ms": self.verify_gemm_flops / peak_flops * share,
      "verify_attention_ms": self.verify_attention_flops / peak_flops * share,
    }
    verify = max(terms["verify_bytes_ms"], terms["verify_gemm_ms"] + terms["verify_attention_ms"])
    return {**terms, "floor_ms": terms["draft_ms"] + terms["head_ms"] + verify}


def prefill_flops(target: TargetConfig, tokens: int) -> int:
  """A prefill's FLOPs: every layer's matmuls over `tokens` rows, causal attention (each
  token's scores and values against itself and those before it) and the LM head's row for
  the last token."""
  c = target
  attention = 4 * c.num_heads * c.head_dim * c.num_layers * tokens * (tokens + 1) // 2
  return 2 * tokens * c.num_layers * layer_params(c) + attention + 2 * c.vocab_size * c.hidden_size
