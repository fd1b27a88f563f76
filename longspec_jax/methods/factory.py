"""`make_proposer`: a method's proposer and its params, from the method, a draft and the
proposer options (`registry`)."""

from __future__ import annotations

import dataclasses
import math

from flax import nnx

from longspec_jax import backend
from longspec_jax.decoding.sampling import SamplingConfig
from longspec_jax.errors import UserError
from longspec_jax.methods import past
from longspec_jax.methods.auto import Adaptive
from longspec_jax.methods.base import RootOnly
from longspec_jax.methods.longspec import LongSpecDraft
from longspec_jax.methods.prompt_lookup import PromptLookup
from longspec_jax.methods.registry import Method, ProposerOptions
from longspec_jax.methods.tokenswift import TokenSwift
from longspec_jax.models.config import CapeConfig
from longspec_jax.models.draft import Draft
from longspec_jax.models.heads import Heads

# Rows a round verifies, summed over the batch, up to which `auto`'s continuations grow: where
# a round's price starts growing with its rows. One SmolLM2 sequence on a GPU verifies the
# 97-node trie at about an AR step's price (launch-bound), and two still gain by it: with
# tries of two continuations instead (49 nodes), `auto` ran at 0.74x and 0.92x on two batch
# files in two slots (H200, against the previous run's tries of four). At 16 sequences chains
# of 15 tokens (256 rows) ran faster than of 24 (400 rows) or 10 on all six held-out sets,
# and at 64, of 7 (512 rows) faster than of 3 or 15 (docs/results.md, "Many prompts at
# once"): 64 rows times the batch's square root, through both, and never fewer than two
# tries' MIN_VERIFY_ROWS.
ROWS_PER_ROOT_BATCH = 64
MIN_VERIFY_ROWS = 194


def verify_rows(batch: int) -> int:
  """The rows `auto`'s copy rounds may verify for `batch` sequences (above)."""
  return max(MIN_VERIFY_ROWS, int(ROWS_PER_ROOT_BATCH * math.sqrt(batch)))


def auto_copies(batch: int = 1, tokens: int | None = None) -> tuple[int, int]:
  """`auto`'s prompt-lookup continuations for `batch` sequences verified together when the
  flags do not set them: (tokens each, how many); `tokens` the draft's copy length, if it
  sets one. On a GPU, where a round of a small target costs about the same for a hundred
  nodes as for one (its kernels are launch-bound), four of 24 tokens: on SmolLM2 at 4k
  their trie ran at a median 1.35x prompt lookup's one of 10 over seven prompt sets
  (docs/results.md, "End-to-end decoding"). Where the trie is dear (a large target's long
  contexts: 2.06 AR steps at Llama-3.1-8B's shape and 32k), `auto` runs its first
  continuation alone (`auto.Kind.CHAIN`). Elsewhere, where a round's cost grows with its
  nodes, prompt lookup's own one of 10. A batch shortens them and then drops all but the
  first until its trie fits `verify_rows(batch)` rows (a chain of one token at least)."""
  rows = verify_rows(batch)
  tokens, matches = (tokens or 24, 4) if backend.on_gpu() else (tokens or PromptLookup().num_tokens, 1)
  tokens = max(1, min(tokens, rows // batch - 1))
  return tokens, max(1, min(matches, (rows // batch - 1) // tokens))


def make_proposer(
  method: Method | str, draft: Draft | Heads | None = None, options: ProposerOptions = ProposerOptions()
):
  """(proposer, proposer_params) for `engine.generate`. A draft method's proposer holds the
  draft's graphdef and tree, `options.tree_widths` (or with `cape`, CAPE's tree) with
  `copy_matches` (default 1) prompt-lookup continuations of `copy_tokens` grafted in (each
  by default the draft's own, `DraftConfig`), and its params are the draft's. `pld`
  proposes `copy_matches` continuations of `copy_tokens` (default: one of 10, the published
  method). `auto` chooses each round among AR, prompt lookup's continuations (by default
  `auto_copies` for `options.batch` sequences, from the draft's copy length if it sets one)
  and, if a draft is given, the draft's tree with
  them grafted in. GLIDE's draft takes CAPE's tree (its paper's) unless widths or CAPE are
  given. `tokenswift`'s draft is its heads (`Heads`), whose full tree `tree_widths`
  replaces; it ranks its candidates under `sampling`'s penalty. `sparse`: the draft methods'
  trees are verified sparsely (SpecAttn, lossy). The other methods have no params."""
  method, o = Method(method), options
  if o.sparse is not None and not method.reads_sparsely:
    raise UserError(
      f"sparse verification selects what the target reads from a draft's cross-attention: method longspec or"
      f" glide, not {method.value}."
    )
  stored = draft.config if draft is not None else None
  if method.needs_draft and stored is not None and stored.kind is not method.draft_kind:
    raise UserError(
      f"method {method.value} runs {method.draft_kind.value}'s draft, but this draft is {stored.kind.value}'s."
    )
  if method is Method.TOKENSWIFT:
    return _tokenswift(draft, o)
  cape = CapeConfig() if method is Method.GLIDE and o.tree_widths is None and o.cape is None else o.cape
  if cape is not None and stored is not None:
    cape.check_fits(stored.vocab_size)
  if o.past_tokens and method not in (Method.PLD, Method.AUTO):
    raise UserError(f"past outputs are searched by prompt lookup's rounds: method pld or auto, not {method.value}.")
  if o.past_tokens and not past.MIN_SIZE <= o.past_tokens <= past.MAX_SIZE:
    raise UserError(f"a ring of past outputs holds {past.MIN_SIZE} to {past.MAX_SIZE} tokens, got {o.past_tokens}.")
  if method is Method.AR:
    return RootOnly(), None
  if method is Method.PLD:
    tokens, matches = o.copy_tokens or PromptLookup().num_tokens, o.copy_matches or 1
    return PromptLookup(num_tokens=tokens, matches=matches, past_tokens=o.past_tokens), None
  if method is Method.AUTO:
    tokens, matches = auto_copies(o.batch, stored.copy_tokens if stored else None)
    lookup = PromptLookup(
      num_tokens=o.copy_tokens or tokens, matches=o.copy_matches or matches, past_tokens=o.past_tokens
    )
    if draft is None:
      return Adaptive(lookup), None
    graphdef, params = nnx.split(draft)
    return Adaptive(lookup, LongSpecDraft(graphdef, tuple(o.tree_widths or stored.tree_widths), cape=cape)), params
  graphdef, params = nnx.split(draft)
  copies = stored.copy_tokens if o.copy_tokens is None else o.copy_tokens
  widths = tuple(o.tree_widths or stored.tree_widths)
  return LongSpecDraft(graphdef, widths, copies, cape, o.copy_matches or 1, o.sparse), params


def _tokenswift(heads: Heads, o: ProposerOptions) -> tuple[TokenSwift, nnx.State]:
  """`make_proposer`'s TokenSwift: its heads' full tree (or `tree_widths`) with
  `copy_matches` n-grams of `copy_tokens` tokens grafted (its continuations: 20 of 4 by
  default, its paper's; `copy_tokens` 0: none)."""
  if o.cape is not None:
    raise UserError("method tokenswift drafts with its heads' full tree: CAPE's tree does not apply to it.")
  slots = TokenSwift.ngram_slots
  if o.copy_tokens == 1 or (o.copy_matches is not None and not 1 <= o.copy_matches <= slots):
    raise UserError(
      f"method tokenswift grafts n-grams of at least 2 tokens (copy_tokens 0: none), at most {slots} of them a round"
      f" (copy_matches), got {o.copy_tokens} x {o.copy_matches}."
    )
  graphdef, params = nnx.split(heads)
  # (the heads' config checks the widths: one per depth, its gamma + 1)
  config = (
    heads.config if o.tree_widths is None else dataclasses.replace(heads.config, tree_widths=tuple(o.tree_widths))
  )
  if o.copy_tokens == 0:
    grams = dict(ngrams=0)
  else:
    grams = dict(n=o.copy_tokens or TokenSwift.n, ngrams=o.copy_matches or TokenSwift.ngrams)
  return TokenSwift(graphdef, config.tree_widths, **grams, sampling=o.sampling or SamplingConfig()), params
