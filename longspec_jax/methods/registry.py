"""The decoding methods and the options their proposers take; JAX-free, so a CLI can offer
the choices before it imports JAX.

`Method` is the one decision point for the method: the CLIs' choices, whether a method runs
a draft (and which kind), whether it copies from the context and whether its verification
can read the cache sparsely all come from it. `factory.make_proposer` builds its proposer.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import TYPE_CHECKING

from longspec_jax.models.config import CapeConfig, DraftKind, SparseVerify

if TYPE_CHECKING:
  from longspec_jax.decoding.sampling import SamplingConfig


class Method(enum.Enum):
  """A decoding method; every one but SpecAttn's sparse verification is lossless."""

  AUTO = "auto"  # per round, the kind of tree with the most tokens per second expected (`auto.py`)
  AR = "ar"  # plain decoding: one target step a round
  PLD = "pld"  # prompt lookup decoding: continuations copied from the context
  LONGSPEC = "longspec"  # LongSpec's draft and its beam tree (`longspec.py`)
  GLIDE = "glide"  # GLIDE's draft, with CAPE's tree by default (`longspec.py`)
  TOKENSWIFT = "tokenswift"  # the target drafts for itself with multi-token heads (`tokenswift.py`)

  def __str__(self) -> str:  # as users write it (argparse's choices, messages)
    return self.value

  @property
  def draft_kind(self) -> DraftKind | None:
    """The kind of draft the method runs (`auto`: LongSpec's, when one is named)."""
    return _DRAFT_KINDS.get(self)

  @property
  def needs_draft(self) -> bool:
    """Whether the method cannot run without its draft (`auto` can)."""
    return self in (Method.LONGSPEC, Method.GLIDE, Method.TOKENSWIFT)

  @property
  def copies(self) -> bool:
    """Whether the method proposes continuations copied from the context (its
    `copy_tokens` and `copy_matches` apply)."""
    return self is not Method.AR

  @property
  def reads_sparsely(self) -> bool:
    """Whether its verification can read the cache sparsely (SpecAttn): the chunks come
    from a draft's cross-attention."""
    return self in (Method.LONGSPEC, Method.GLIDE)

  def draft_spec(self, named: str | None) -> str | None:
    """The draft the method runs, given the draft a user named (None: none named; 'none':
    none): a draft method's named one or else 'default' (the one shipped for the target);
    `auto`'s only when named. By default `auto` chooses between AR and prompt lookup's
    continuations: on SmolLM2 the shipped draft's tree with the copy trie grafted in runs
    slower than the trie alone on all seven prompt sets at 4k (docs/results.md,
    "End-to-end decoding"); `--draft default` adds its rounds."""
    if self.needs_draft:
      return named or "default"
    if self is Method.AUTO and named != "none":
      return named
    return None


_DRAFT_KINDS = {
  Method.AUTO: DraftKind.LONGSPEC,
  Method.LONGSPEC: DraftKind.LONGSPEC,
  Method.GLIDE: DraftKind.GLIDE,
  Method.TOKENSWIFT: DraftKind.TOKENSWIFT,
}


@dataclasses.dataclass(frozen=True)
class ProposerOptions:
  """What a user may set of a method's proposer; None takes the method's or its draft's
  default.

  tree_widths: a draft's beam widths per depth (TokenSwift: its heads' full tree).
  cape: CAPE's tree instead of a beam search (GLIDE's default).
  copy_tokens, copy_matches: prompt lookup's continuations, their length and count.
  sampling: the generation's processors (TokenSwift ranks its candidates under the penalty).
  sparse: verify the draft's tree reading the cache sparsely (SpecAttn, lossy).
  batch: the sequences decoded together (their rows verified together): `auto` sizes its
  continuations by it (`factory.auto_copies`).
  past_tokens: prompt lookup (pld, auto) also searches this many tokens of earlier
  generations' outputs (`methods.past`; 0: none).
  """

  tree_widths: tuple[int, ...] | None = None
  cape: CapeConfig | None = None
  copy_tokens: int | None = None
  copy_matches: int | None = None
  sampling: SamplingConfig | None = None
  sparse: SparseVerify | None = None
  batch: int = 1
  past_tokens: int = 0
