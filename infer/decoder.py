"""What a decoding command loads, shared by `infer.generate` and `infer.serve`: the method's
draft and tree flags checked against the target's config before any weights load, then the
target, the draft and the proposer."""

from __future__ import annotations

import dataclasses
from typing import Any

from infer.cli import batch_tree_choice, check_tree, sampling_config, tree_choice
from longspec_jax.cli import attention_impl, numerics, resolve_dtype
from longspec_jax.errors import UserError
from longspec_jax.methods.registry import Method


@dataclasses.dataclass(frozen=True)
class Plan:
  """The flags, checked: the draft to load (None: none), the tree (None: the draft's own)
  and its copy branch (None: the flag's or the draft's), the dtype, the sampling, and the
  sequences decoded together."""

  method: Method
  draft: str | None
  widths: Any
  cape: Any
  dtype: Any
  sampling: Any
  copy_tokens: int | None = None
  batch: int = 1


def check_flags(args, config, batch: int = 1) -> Plan:
  """The method's draft and tree flags against the target's `config` (a `UserError` for a
  bad combination), before the weights load. Decoding `batch` sequences together, a
  LongSpec draft's tree is the one priced for the target's shape at that batch size where
  the table of trees has one and the flags name none (`weights.drafts.batch_tree`), and
  `auto`'s continuations are sized for it (`methods.factory.auto_copies`)."""
  from longspec_jax.weights.drafts import resolve_draft

  method = args.method
  spec = method.draft_spec(args.draft)
  if spec is not None:
    resolve_draft(spec, args.target, method.draft_kind)
  if args.tree_widths and spec is None:
    raise UserError("--tree-widths shapes a draft's tree, but no draft is used here (give --draft on a CPU)")
  if args.draft_vocab is not None:
    if spec is None or method is Method.TOKENSWIFT:
      raise UserError("--draft-vocab sets what a block draft scores (longspec, glide, auto with --draft)")
    if args.draft_vocab > config.vocab_size:
      raise UserError(f"--draft-vocab {args.draft_vocab} exceeds the target's vocabulary of {config.vocab_size} tokens")
  corpus = getattr(args, "corpus", [])
  if corpus and not args.past_tokens:
    raise UserError("--corpus fills the past outputs prompt lookup searches: give --past-tokens too")
  for path in corpus:
    if not path.is_file():
      raise UserError(f"the corpus file {path} does not exist.")
  widths, cape = tree_choice(args.tree_widths, args)
  copy_tokens = args.copy_tokens
  if spec is not None:
    widths, copy_tokens = batch_tree_choice(config, method, batch, widths, cape, copy_tokens)
  check_tree(widths, cape, config.vocab_size, (copy_tokens or 0) * (args.copy_matches or 1))
  dtype, sampling = resolve_dtype(args.dtype), sampling_config(args, method)
  return Plan(method, spec, widths, cape, dtype, sampling, copy_tokens, batch)


@dataclasses.dataclass(frozen=True)
class Loaded:
  target: Any  # `weights.LoadedTarget`: the model, its config and tokenizer
  decoding: Any  # `engine.Decoding`
  proposer: Any
  draft_params: Any
  sparse: Any  # `SparseVerify` or None


def load(args, plan: Plan, path, tokenizer) -> Loaded:
  """The target, the draft and the proposer the checked `plan` names (inside the caller's
  mesh, for --devices)."""
  from longspec_jax.engine import Decoding
  from longspec_jax.methods.factory import make_proposer
  from longspec_jax.methods.registry import ProposerOptions
  from longspec_jax.models.config import SparseVerify
  from longspec_jax.ops import sharding
  from longspec_jax.weights import load_target
  from longspec_jax.weights.drafts import load_draft

  target = load_target(path, plan.dtype, tokenizer, numerics=numerics(args))
  draft = None
  if plan.draft is not None:
    draft = sharding.placed(
      load_draft(
        plan.draft,
        target.config,
        plan.dtype,
        args.target,
        attention=attention_impl(args.attention),
        kind=plan.method.draft_kind,
        vocab_subset=args.draft_vocab,
      )
    )
  sparse = None if getattr(args, "sparse_verify", None) is None else SparseVerify(args.sparse_verify)
  proposer, draft_params = make_proposer(
    plan.method,
    draft,
    ProposerOptions(
      tree_widths=plan.widths,
      copy_tokens=plan.copy_tokens,
      cape=plan.cape,
      copy_matches=args.copy_matches,
      sampling=plan.sampling,
      sparse=sparse,
      batch=plan.batch,
      past_tokens=args.past_tokens,
    ),
  )
  decoding = Decoding(proposer=proposer, sampling=plan.sampling, eos_ids=tuple(target.config.eos_token_ids))
  return Loaded(target, decoding, proposer, draft_params, sparse)


def fill_past(args, loaded: Loaded, memory=None) -> None:
  """Writes --corpus's files into the ring of past outputs the method searches, in `memory`
  (default the process's `engine.MEMORY`)."""
  if not getattr(args, "corpus", None):
    return
  import sys

  from infer import past_corpus
  from longspec_jax.engine import MEMORY

  past = (memory or MEMORY).past_for(loaded.target.config, loaded.decoding)
  written = past_corpus.fill(past, args.corpus, loaded.target.tokenizer)
  print(f"corpus: {written} tokens of {len(args.corpus)} files, in past outputs of {past.size}", file=sys.stderr)
