"""`python -m train.rank_vocab`: ranks the target's vocabulary by how often each token is a
prediction target in a draft's training text, and stores the ranking with the draft, so
that it scores only the most frequent tokens (FR-Spec: the draft's LM head product and
top-k read those rows alone; the target still verifies against every token, so the
output is unchanged).

  python -m train.rank_vocab --draft runs/sft/draft --data corpus/train.jsonl --size 16384
"""

from __future__ import annotations

import json
from pathlib import Path

from longspec_jax.cli import ArgumentParser, nonnegative_int, positive_int, run_main
from longspec_jax.errors import UserError
from longspec_jax.weights import default

# SmolLM2's shipped draft scores this many of its 49,152 tokens: the most tokens a draft
# round emits per second on its held-out prompt sets (docs/results.md, "The draft's
# vocabulary").
DEFAULT_SIZE = 8192


def parse_args(argv=None):
  p = ArgumentParser(prog="python -m train.rank_vocab", description=__doc__.splitlines()[0])
  p.add_argument(
    "--draft", required=True, help="the block draft's checkpoint directory (or 'default': the shipped one)"
  )
  p.add_argument("--data", nargs="+", required=True, help="its training text: what `train.run --data` takes")
  p.add_argument("--target", default=default.NAME, help=f"the draft's target: '{default.NAME}' (default) or a path")
  p.add_argument(
    "--size",
    type=nonnegative_int,
    default=DEFAULT_SIZE,
    help="how many of the most frequent tokens the draft scores (0: the whole vocabulary, the ranking kept)",
  )
  p.add_argument("--max-tokens", type=positive_int, default=20_000_000, help="tokens read, a seeded sample")
  p.add_argument("--seed", type=int, default=0, help="the sample's order")
  return p.parse_args(argv)


def ranking(counts):
  """Token ids by count, the most frequent first, lower ids first among equals."""
  import numpy as np

  return np.lexsort((np.arange(len(counts)), -np.asarray(counts))).astype(np.int32)


def main(argv=None) -> None:
  args = parse_args(argv)
  import numpy as np

  from longspec_jax.models.config import DraftConfig, DraftKind
  from longspec_jax.weights import load_tokenizer, read_target_config, resolve_target
  from longspec_jax.weights.drafts import CONFIG_NAME, resolve_draft, store_vocab
  from train.data import load_records, pack, resolve_sources

  sources = resolve_sources(args.data)
  path = resolve_target(args.target)
  config = read_target_config(path)
  draft = resolve_draft(args.draft, args.target)
  if draft is None:
    raise UserError("a random draft has no training text to rank; give a draft checkpoint directory.")
  stored = json.loads((draft / CONFIG_NAME).read_text())
  if stored.get("kind") == DraftKind.TOKENSWIFT.value:
    raise UserError("TokenSwift's heads score the whole vocabulary: a vocabulary subset is for a block draft.")
  DraftConfig.from_dict(stored).check_matches(config)
  if args.size > config.vocab_size:
    raise UserError(f"--size {args.size} exceeds the target's vocabulary of {config.vocab_size} tokens.")
  tokenizer = load_tokenizer(path)
  eos = config.eos_token_ids[0] if config.eos_token_ids else tokenizer.eos_token_id
  packed = pack(load_records(sources), tokenizer, 1, eos, args.max_tokens, args.seed)
  counts = np.bincount(packed.tokens[packed.loss_mask], minlength=config.vocab_size)
  order = ranking(counts)
  store_vocab(Path(draft), order, args.size)
  covered = counts[order[: args.size or config.vocab_size]].sum() / max(counts.sum(), 1)
  print(
    f"ranked {config.vocab_size} tokens over {counts.sum()} of the text's; the {args.size or config.vocab_size} the"
    f" draft scores cover {covered:.2%} of them; wrote {draft}"
  )


if __name__ == "__main__":
  run_main(main, "python -m train.rank_vocab")
