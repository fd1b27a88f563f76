"""`python -m infer.generate`: generate text from a prompt with the target model.

Text streams to stdout as it is made; a progress line goes to stderr; with --json the
last stdout line is one JSON object with the token ids and timing statistics.
"""

from __future__ import annotations

import json
import sys
import time

from infer.cli import (ArgumentParser, add_sampling_flags, encode_prompt, read_prompt, resolve_dtype, run_main,
                       sampling_config, tree_widths)
from longspec_jax.errors import UserError
from longspec_jax.weights import default

# `proposers.PROPOSERS` by name, listed here so that flags are checked before JAX is
# imported. Without --method: longspec when a draft is given, or shipped and on GPU (on
# CPU its rounds cost more than they save, docs/benchmarks.md); else AR (PLD needs no
# draft but is slower than AR at low n-gram overlap).
METHODS = ("ar", "pld", "longspec")


def parse_args(argv=None):
  p = ArgumentParser(prog="python -m infer.generate", description=__doc__.splitlines()[0])
  src = p.add_mutually_exclusive_group(required=True)
  src.add_argument("--prompt", help="the prompt text")
  src.add_argument("--prompt-file", help="read the prompt from this file ('-' = stdin)")
  p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
  p.add_argument("--target", default=default.NAME, help=f"'{default.NAME}' (default), a HF model dir, or a .gguf file")
  p.add_argument(
      "--draft", default="default",
      help="draft for --method longspec: 'default' (shipped for the target), 'random', 'none', or a checkpoint dir",
  )
  p.add_argument("--method", choices=METHODS, help="decoding method (default: the best available)")
  p.add_argument("--tree-widths", type=tree_widths,
                 help="longspec: beam widths per tree depth, e.g. 4,16,16 (default: the draft's)")
  p.add_argument("--max-new-tokens", type=int, default=256)
  add_sampling_flags(p)
  p.add_argument("--dtype", choices=("float32", "bfloat16"), help="default: bfloat16 on GPU, float32 on CPU")
  from longspec_jax.attention import IMPLS, default_impl

  p.add_argument("--attention", choices=IMPLS, help="attention kernels (default: pallas on GPU, else reference)")
  p.add_argument("--json", action="store_true", help="end stdout with one JSON line of results")
  args = p.parse_args(argv)
  args.attention = args.attention or default_impl()
  if args.max_new_tokens < 1:
    p.error(f"--max-new-tokens must be at least 1, got {args.max_new_tokens}")
  return args


class TextStream:
  """Decodes the growing token list and writes only the new text (multi-byte safe)."""

  def __init__(self, tokenizer):
    self.tokenizer = tokenizer
    self.ids: list[int] = []
    self.written = ""

  def __call__(self, chunk) -> None:
    from longspec_jax.engine import PAD_ID

    self.ids.extend(int(t) for t in chunk[0] if t != PAD_ID)
    text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
    if text.endswith("\ufffd"):  # an incomplete UTF-8 sequence: wait for the next token
      return
    sys.stdout.write(text[len(self.written):])
    sys.stdout.flush()
    self.written = text


def main(argv=None) -> None:
  args = parse_args(argv)
  prompt_text = read_prompt(args.prompt, args.prompt_file)
  import jax  # after argument checks: bad flags fail fast
  import jax.numpy as jnp

  from longspec_jax.engine import generate
  from longspec_jax.proposers import DRAFT_METHODS, make_proposer
  from longspec_jax.weights import load_target
  from longspec_jax.weights.drafts import has_shipped_draft, load_draft

  method = args.method or ("longspec" if args.draft != "none" and (args.draft != "default" or (
      has_shipped_draft(args.target) and jax.default_backend() == "gpu")) else "ar")
  if method not in DRAFT_METHODS and args.draft not in ("default", "none"):
    raise UserError(f"--method {method} uses no draft, but --draft {args.draft} was given.")
  if method in DRAFT_METHODS and args.draft == "none":
    raise UserError(f"--method {method} needs a draft, but --draft none was given.")
  sampling = sampling_config(args)
  dtype = resolve_dtype(args.dtype)
  t0 = time.perf_counter()
  print(f"loading target {args.target} ({jnp.dtype(dtype).name}) ...", file=sys.stderr, flush=True)
  target = load_target(args.target, dtype)
  prompt = encode_prompt(target.tokenizer, prompt_text, args.chat)
  print(
      f"loaded in {time.perf_counter() - t0:.1f} s; prompt {len(prompt)} tokens; method {method}",
      file=sys.stderr, flush=True,
  )
  stream = TextStream(target.tokenizer)
  draft = load_draft(args.draft, target.config, dtype, args.target) if method in DRAFT_METHODS else None
  proposer, draft_params = make_proposer(method, draft, args.tree_widths)
  result = generate(
      target.model, [prompt], args.max_new_tokens, proposer=proposer, proposer_params=draft_params, method=method,
      eos_ids=target.config.eos_token_ids, sampling=sampling, seed=args.seed, impl=args.attention,
      on_tokens=stream,
  )
  stats = result.stats
  print(file=sys.stdout)
  print(
      f"[{method}] {stats['num_new_tokens']} tokens, {stats['tokens_per_second']:.1f} tokens/s decode,"
      f" prefill {stats['prefill_seconds']:.2f} s, tau {stats['mean_accepted_length']:.2f}",
      file=sys.stderr,
  )
  if args.json:
    token_ids = result.token_ids[0]
    record = {
        **stats,
        "target": args.target,
        "dtype": jnp.dtype(dtype).name,
        "attention": args.attention,
        "draft": args.draft if method in DRAFT_METHODS else None,
        "prompt_tokens": len(prompt),
        "text": target.tokenizer.decode(token_ids, skip_special_tokens=True),
        "token_ids": token_ids,
    }
    print(json.dumps(record))


if __name__ == "__main__":
  run_main(main, "python -m infer.generate")
