"""Frozen model configs: targets read from a Hugging Face `config.json` or GGUF metadata,
and the draft (LongSpec's or GLIDE's) built for a target.

One `TargetConfig` describes every supported Llama-family decoder (Llama 2/3.x, Vicuna,
LongChat, Mistral, Qwen2/2.5/QwQ, SmolLM2): they differ only in head counts, RoPE
scaling, q/k/v biases, tied embeddings and an optional sliding window.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Mapping
from typing import Any

from longspec_jax.errors import UserError

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")
ROPE_KINDS = ("default", "linear", "llama3", "yarn")


@dataclasses.dataclass(frozen=True)
class RopeConfig:
  """Rotary embedding: base, scaling kind and its parameters (HF `rope_parameters` names)."""

  theta: float = 10000.0
  kind: str = "default"
  factor: float = 1.0
  # llama3
  low_freq_factor: float = 1.0
  high_freq_factor: float = 4.0
  original_max_position_embeddings: int = 8192
  # yarn
  beta_fast: float = 32.0
  beta_slow: float = 1.0
  attention_factor: float | None = None
  mscale: float | None = None
  mscale_all_dim: float | None = None
  truncate: bool = True
  # Per-frequency divisors stored in a GGUF file (`rope_freqs.weight`, llama3-style scaling).
  freq_factors: tuple[float, ...] | None = None

  def __post_init__(self):
    if self.kind not in ROPE_KINDS:
      raise UserError(f"RoPE scaling type {self.kind!r} is not supported; supported types are {', '.join(ROPE_KINDS)}.")


@dataclasses.dataclass(frozen=True, kw_only=True)
class BlockConfig:
  """The shape of a decoder block, which the target's layers and the draft's share (the
  draft cross-attends to the target's K/V as they are, so its heads and RoPE are the
  target's)."""

  vocab_size: int
  hidden_size: int
  intermediate_size: int
  num_layers: int
  num_heads: int
  num_kv_heads: int
  head_dim: int
  rope: RopeConfig = RopeConfig()
  rms_norm_eps: float = 1e-5
  qkv_bias: bool = False

  def __post_init__(self):
    if self.num_heads % self.num_kv_heads:
      raise UserError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads}).")

  @property
  def group_size(self) -> int:
    """Query heads per key/value head (GQA group size)."""
    return self.num_heads // self.num_kv_heads


@dataclasses.dataclass(frozen=True, kw_only=True)
class TargetConfig(BlockConfig):
  """Shape and numerics of a Llama-family decoder-only target model."""

  max_position_embeddings: int = 4096
  tie_word_embeddings: bool = False
  # Keys further back than this many positions are invisible (Mistral v0.1); None = full attention.
  sliding_window: int | None = None
  model_type: str = "llama"
  bos_token_id: int | None = None
  eos_token_ids: tuple[int, ...] = ()

  @classmethod
  def from_hf(cls, hf: Mapping[str, Any]) -> TargetConfig:
    """Builds the config from a parsed HF `config.json` (transformers 4.x or 5.x layout)."""
    model_type = hf.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
      raise UserError(
        f"model_type {model_type!r} is not supported; supported Llama-family types are"
        f" {', '.join(SUPPORTED_MODEL_TYPES)}."
      )
    if hf.get("hidden_act", "silu") != "silu":
      raise UserError(f"hidden_act {hf['hidden_act']!r} is not supported; only 'silu' is.")
    if hf.get("mlp_bias", False):
      raise UserError("MLP biases (mlp_bias=true) are not supported.")
    num_heads = hf["num_attention_heads"]
    eos = hf.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (eos,))
    sliding_window = hf.get("sliding_window")
    if model_type == "qwen2" and not hf.get("use_sliding_window", False):
      sliding_window = None
    return cls(
      vocab_size=hf["vocab_size"],
      hidden_size=hf["hidden_size"],
      intermediate_size=hf["intermediate_size"],
      num_layers=hf["num_hidden_layers"],
      num_heads=num_heads,
      num_kv_heads=hf.get("num_key_value_heads") or num_heads,
      head_dim=hf.get("head_dim") or hf["hidden_size"] // num_heads,
      rope=_rope_from_hf(hf),
      rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
      max_position_embeddings=hf.get("max_position_embeddings", 4096),
      tie_word_embeddings=hf.get("tie_word_embeddings", model_type == "qwen2"),
      qkv_bias=model_type == "qwen2" or bool(hf.get("attention_bias", False)),
      sliding_window=sliding_window,
      model_type=model_type,
      bos_token_id=hf.get("bos_token_id"),
      eos_token_ids=eos_ids,
    )


def _rope_from_hf(hf: Mapping[str, Any]) -> RopeConfig:
  """Reads `rope_parameters` (transformers 5) or `rope_theta` + `rope_scaling` (4.x)."""
  params = dict(hf.get("rope_parameters") or {})
  params.update(hf.get("rope_scaling") or {})
  theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
  kind = params.get("rope_type", params.get("type", "default"))
  if kind == "default":
    return RopeConfig(theta=theta)
  fields = {f.name for f in dataclasses.fields(RopeConfig)}
  extra = {k: v for k, v in params.items() if k in fields and v is not None}
  extra.setdefault(
    "original_max_position_embeddings",
    hf.get("original_max_position_embeddings", hf.get("max_position_embeddings", 8192)),
  )
  return RopeConfig(theta=theta, kind=kind, **extra)


class DraftKind(enum.Enum):
  """Whose draft: LongSpec's, every layer's self-attention over a sliding window (a ring
  of `window` slots: constant memory) and its cross-attention over one target layer's
  cache; or GLIDE's (glide-cape.md, section 4.1), full causal self-attention over its own
  cache of the whole context (it grows with the context) and draft layer m cross-attending
  to target layer `cross_layer` + m, by default the top ones: N_T - N_D + m."""

  LONGSPEC = "longspec"
  GLIDE = "glide"
  # TokenSwift's (tokenswift.md, section 3.2): no block, residual heads on the target's
  # own hidden state (`HeadsConfig`, `heads.py`)
  TOKENSWIFT = "tokenswift"


BLOCK_KINDS = (DraftKind.LONGSPEC, DraftKind.GLIDE)  # the kinds a `DraftConfig` (a block draft) has


@dataclasses.dataclass(frozen=True, kw_only=True)
class DraftConfig(BlockConfig):
  """A draft for one target: blocks of the target's shape (its embedding and LM head are
  the target's own arrays, shared, so they appear here only as `vocab_size`)."""

  num_layers: int = 1
  kind: DraftKind = DraftKind.LONGSPEC
  window: int = 512  # LongSpec: sliding window of the self-attention (and size of its ring buffer)
  # The target layer the cross-attention reads (LongSpec: every draft layer; GLIDE: the
  # first draft layer, each next one the layer above). None: the last layer (LongSpec),
  # the top `num_layers` layers (GLIDE).
  cross_layer: int | None = None
  # False: no cross-attention at all, the ablation of GLIDE's section 5.2 (a draft of the
  # same size that reads only its own context)
  cross_attention: bool = True
  # The tree inference uses by default: beam widths per depth, LongSpec's (paper,
  # Appendix D), and prompt-lookup tokens grafted in as a copy branch (none), unless a
  # measurement (`python -m infer.tree_search --store`) found a faster tree for this
  # draft's target.
  tree_widths: tuple[int, ...] = (4, 16, 16, 16, 16)
  copy_tokens: int = 0
  # How many tokens the draft scores, the most frequent of its training text (FR-Spec;
  # the ranking is saved with the draft); 0: the whole vocabulary. The target still
  # verifies against every token, so the output is unchanged.
  vocab_subset: int = 0
  # Fused target features (EAGLE-3's multi-layer fusion, read from the target's cache):
  # the target layers whose cached values at the position before each draft token, where
  # that position is committed, the draft adds to the token's embedding through a learned
  # projection (`Draft.target_features`); (): none.
  feature_layers: tuple[int, ...] = ()
  # EAGLE-3's stand-in at drafted positions: a query whose previous position is a drafted
  # parent (a tree node's) adds the parent's own output state through a learned
  # projection instead; trained by the training-time test, whose passes supply it.
  parent_features: bool = False

  def __post_init__(self):
    super().__post_init__()
    if self.kind not in BLOCK_KINDS:
      raise UserError(f"a block draft's kind is one of {', '.join(k.value for k in BLOCK_KINDS)}, got {self.kind!r}.")
    if self.num_layers < 1 or self.window < 1:
      raise UserError(f"a draft needs num_layers >= 1 and window >= 1, got {self.num_layers} and {self.window}.")
    if self.copy_tokens < 0:
      raise UserError(f"a draft's copy_tokens must be >= 0, got {self.copy_tokens}.")
    if not 0 <= self.vocab_subset <= self.vocab_size:
      raise UserError(f"a draft's vocab_subset must be 0 (all) to {self.vocab_size} tokens, got {self.vocab_subset}.")
    check_tree_widths(self.tree_widths, copy_tokens=self.copy_tokens)

  @classmethod
  def for_target(cls, target: TargetConfig, **overrides) -> DraftConfig:
    """The draft whose block has the target's shapes (`overrides`: num_layers, window, ...;
    also a shape the target does not fix, such as a wider MLP's `intermediate_size`)."""
    shared = (
      "vocab_size",
      "hidden_size",
      "intermediate_size",
      "num_heads",
      "num_kv_heads",
      "head_dim",
      "rope",
      "rms_norm_eps",
    )
    return cls(**{**{name: getattr(target, name) for name in shared}, **overrides})

  @property
  def self_window(self) -> int | None:
    """The self-attention's window: LongSpec's `window`, or None (GLIDE: the whole context)."""
    return self.window if self.kind is DraftKind.LONGSPEC else None

  def ring_size(self, context: int) -> int:
    """Slots of the draft's own K/V cache for a target cache of `context` slots: the
    window (LongSpec's ring), or every slot (GLIDE's cache never wraps)."""
    return self.window if self.kind is DraftKind.LONGSPEC else context

  def target_layers(self, num_target_layers: int) -> tuple[int, ...]:
    """The target layer (0-based) each draft layer cross-attends to. Raises UserError
    where one lies outside the target's `num_target_layers`."""
    glide = self.kind is DraftKind.GLIDE
    first = self.cross_layer if self.cross_layer is not None else (-self.num_layers if glide else -1)
    layers = tuple(first + m if glide else first for m in range(self.num_layers))
    if not all(-num_target_layers <= layer < num_target_layers for layer in layers) or (
      glide and first < 0 <= layers[-1]
    ):
      raise UserError(
        f"the draft cross-attends to target layers {', '.join(map(str, layers))}, but the target has"
        f" {num_target_layers} layers."
      )
    return tuple(layer % num_target_layers for layer in layers)

  def check_matches(self, target: TargetConfig) -> None:
    """Raises UserError unless this draft can run on `target` (shared vocabulary and
    hidden size, the cross-attended layers' heads, the same RoPE)."""
    for name in ("vocab_size", "hidden_size", "num_kv_heads", "head_dim", "rope"):
      mine, theirs = getattr(self, name), getattr(target, name)
      if mine != theirs:
        raise UserError(f"the draft does not match the target: its {name} is {mine}, the target's is {theirs}.")
    self.target_layers(target.num_layers)
    self.feature_indices(target.num_layers)

  def feature_indices(self, num_target_layers: int) -> tuple[int, ...]:
    """The target layers (0-based) whose cached values the draft fuses into its input.
    Raises UserError where one lies outside the target's `num_target_layers`."""
    if not all(-num_target_layers <= layer < num_target_layers for layer in self.feature_layers):
      raise UserError(
        f"the draft reads features of target layers {', '.join(map(str, self.feature_layers))}, but the target"
        f" has {num_target_layers} layers."
      )
    return tuple(layer % num_target_layers for layer in self.feature_layers)

  def to_dict(self) -> dict:
    return {**dataclasses.asdict(self), "kind": self.kind.value}

  @classmethod
  def from_dict(cls, d: Mapping[str, Any]) -> DraftConfig:
    fields = {f.name for f in dataclasses.fields(cls)}
    unknown = set(d) - fields
    if unknown:
      raise UserError(f"unknown draft config keys: {', '.join(sorted(unknown))}.")
    rope = dict(d.get("rope") or {})
    if rope.get("freq_factors") is not None:
      rope["freq_factors"] = tuple(rope["freq_factors"])
    try:
      kind = DraftKind(d.get("kind", DraftKind.LONGSPEC.value))
    except ValueError:
      raise UserError(f"a draft's kind is one of {', '.join(k.value for k in DraftKind)}, got {d['kind']!r}.") from None
    return cls(
      **{
        **d,
        "kind": kind,
        "rope": RopeConfig(**rope),
        **{name: tuple(d[name]) for name in ("tree_widths", "feature_layers") if name in d},
      }
    )


def default_feature_layers(num_target_layers: int) -> tuple[int, ...]:
  """EAGLE-3's features (the inputs of target layers 2, L / 2 and L - 3, as SGLang captures
  them for Llama-3.1-8B: 2, 16, 29): a layer's cached values are a projection of its input."""
  low, high = min(2, num_target_layers - 1), max(num_target_layers - 3, 0)
  return tuple(sorted({low, num_target_layers // 2, high}))


@dataclasses.dataclass(frozen=True, kw_only=True)
class HeadsConfig:
  """TokenSwift's multi-token heads for one target (tokenswift.md, section 3.2): `gamma`
  residual linear layers on the target's last hidden state, head i predicting the token
  i + 1 places past the one the target predicts; the target's LM head is shared, so
  only its vocabulary and width appear here. `tree_widths`: the tokens each depth of its
  tree takes from the target's prediction (depth 1) and each head's (depths 2 ..
  gamma + 1), the paper's [1, 3, 3, 3]."""

  vocab_size: int
  hidden_size: int
  rms_norm_eps: float = 1e-6
  gamma: int = 3
  tree_widths: tuple[int, ...] = (1, 3, 3, 3)

  @property
  def kind(self) -> DraftKind:
    return DraftKind.TOKENSWIFT

  def __post_init__(self):
    if self.gamma < 1:
      raise UserError(f"TokenSwift needs gamma >= 1 heads, got {self.gamma}.")
    if len(self.tree_widths) != self.gamma + 1 or any(w < 1 for w in self.tree_widths):
      raise UserError(
        f"TokenSwift's tree takes one width >= 1 per depth, {self.gamma + 1} for gamma {self.gamma},"
        f" got {list(self.tree_widths)}."
      )

  @classmethod
  def for_target(cls, target: TargetConfig, **overrides) -> HeadsConfig:
    return cls(
      vocab_size=target.vocab_size, hidden_size=target.hidden_size, rms_norm_eps=target.rms_norm_eps, **overrides
    )

  def check_matches(self, target: TargetConfig) -> None:
    """Raises UserError unless these heads read this target's hidden states and share its
    vocabulary."""
    for name in ("vocab_size", "hidden_size"):
      mine, theirs = getattr(self, name), getattr(target, name)
      if mine != theirs:
        raise UserError(f"the heads do not match the target: their {name} is {mine}, the target's is {theirs}.")

  def to_dict(self) -> dict:
    return {**dataclasses.asdict(self), "kind": self.kind.value}

  @classmethod
  def from_dict(cls, d: Mapping[str, Any]) -> HeadsConfig:
    fields = {f.name for f in dataclasses.fields(cls)}
    unknown = set(d) - fields - {"kind"}
    if unknown:
      raise UserError(f"unknown TokenSwift heads config keys: {', '.join(sorted(unknown))}.")
    return cls(**{k: tuple(v) if k == "tree_widths" else v for k, v in d.items() if k in fields})


def draft_config_from_dict(d: Mapping[str, Any]) -> DraftConfig | HeadsConfig:
  """A draft checkpoint's config by its `kind`: a block draft's (`DraftConfig`) or
  TokenSwift's heads' (`HeadsConfig`)."""
  if d.get("kind") == DraftKind.TOKENSWIFT.value:
    return HeadsConfig.from_dict(d)
  return DraftConfig.from_dict(d)


# Most nodes a token tree may have (root included): the papers' trees have 20-70 nodes,
# and past a few hundred a verification pass costs more than any acceptance can repay.
MAX_TREE_NODES = 1024


def check_tree_widths(
  widths: tuple[int, ...], vocab_size: int | None = None, max_nodes: int = MAX_TREE_NODES, copy_tokens: int = 0
) -> None:
  """Beam widths per depth: positive, each at most the vocabulary (a depth picks its nodes
  among the tokens), and 1 + sum(widths) nodes, with `copy_tokens` grafted copies, within
  `max_nodes`."""
  if not widths or any(w < 1 for w in widths):
    raise UserError(f"tree widths must be one or more positive integers, got {list(widths)}.")
  if vocab_size is not None and max(widths) > vocab_size:
    raise UserError(f"a tree width of {max(widths)} exceeds the vocabulary of {vocab_size} tokens.")
  nodes = 1 + sum(widths) + copy_tokens
  if nodes > max_nodes:
    copies = f" and {copy_tokens} copied tokens" if copy_tokens else ""
    raise UserError(
      f"tree widths {','.join(map(str, widths))}{copies} make {nodes} nodes, over the limit of"
      f" {max_nodes} on this machine."
    )


@dataclasses.dataclass(frozen=True)
class SparseVerify:
  """SpecAttn's sparse verification (specattn.md): the target's prefix pass reads, for
  each KV head, only the chunks of `chunk` slots holding `p` of the draft's attention
  mass over the context, in every layer from `dense_layers` on (the paper keeps its
  first two layers dense). Lossy: outputs then differ from the target's own.

  chunk: 64 slots where the paper selects 16: read as 16-key blocks the sparse pass runs
  at 0.30-0.44x the dense pass's rate per key on an H100, as 64-key blocks at 0.69-0.84x
  (docs/results.md, "Kernels")."""

  p: float
  chunk: int = 64
  dense_layers: int = 2

  def __post_init__(self):
    if not 0 < self.p <= 1:
      raise ValueError(f"sparse verification keeps a fraction 0 < p <= 1 of the attention mass, got {self.p}.")


@dataclasses.dataclass(frozen=True)
class CapeConfig:
  """CAPE's expanded proposal (GLIDE with a CAPE, section 4.2): a greedy chain of `gamma`
  draft tokens, and beside each the next-best tokens at its position, as many as the
  draft's confidence there (its top-1 probability p) asks for: `sizes[i]` for p in
  (edges[i - 1], edges[i]] (edges[-1] = 0, edges[len] = 1). The paper's: 7, 5, 3, 1 for
  p in (0, .3], (.3, .6], (.6, .8], (.8, 1]."""

  gamma: int = 5
  edges: tuple[float, ...] = (0.3, 0.6, 0.8)
  sizes: tuple[int, ...] = (7, 5, 3, 1)

  def __post_init__(self):
    if self.gamma < 1:
      raise UserError(f"a CAPE chain needs gamma >= 1 tokens, got {self.gamma}.")
    if len(self.sizes) != len(self.edges) + 1 or any(s < 0 for s in self.sizes):
      raise UserError(
        f"CAPE needs one expansion size >= 0 per confidence bin ({len(self.edges) + 1} for edges"
        f" {list(self.edges)}), got {list(self.sizes)}."
      )
    if any(not 0 < e < 1 for e in self.edges) or any(a >= b for a, b in zip(self.edges, self.edges[1:])):
      raise UserError(f"CAPE's confidence edges must rise strictly inside (0, 1), got {list(self.edges)}.")

  @property
  def most(self) -> int:
    """The largest expansion at one position."""
    return max(self.sizes)

  @property
  def tree_size(self) -> int:
    """Nodes of its tree: the root, the chain, and room for the largest expansion at each
    position (`tree.cape_tree`)."""
    return 1 + self.gamma * (1 + self.most)

  def check_fits(self, vocab_size: int, max_nodes: int = MAX_TREE_NODES, copy_tokens: int = 0) -> None:
    """Raises UserError unless the largest expansion leaves the chain's token among the
    vocabulary's and the tree, with `copy_tokens` grafted copies, fits `max_nodes`."""
    if self.most >= vocab_size:
      raise UserError(
        f"CAPE's largest expansion ({self.most} tokens beside the chain's) needs a vocabulary of more"
        f" than {self.most} tokens; this one has {vocab_size}."
      )
    nodes = self.tree_size + copy_tokens
    if nodes > max_nodes:
      copies = f" and {copy_tokens} copied tokens" if copy_tokens else ""
      raise UserError(
        f"CAPE's tree of {self.gamma} tokens with up to {self.most} leaves each{copies} makes {nodes}"
        f" nodes, over the limit of {max_nodes} on this machine."
      )
