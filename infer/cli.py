"""Command-line plumbing shared by `infer.generate` and `infer.benchmark`: one-line errors
with exit code 2, dtype and prompt handling."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Callable, NoReturn

from longspec_jax.errors import UserError

EXIT_USAGE = 2


class ArgumentParser(argparse.ArgumentParser):
  """argparse that reports a bad flag as one sentence on stderr (no usage dump)."""

  def error(self, message: str) -> NoReturn:
    print(f"{self.prog}: error: {message} (see --help).", file=sys.stderr)
    raise SystemExit(EXIT_USAGE)


def run_main(main: Callable[[], None], prog: str) -> None:
  """Runs a CLI entry point; a `UserError` becomes one line on stderr and exit code 2."""
  try:
    main()
  except UserError as e:
    print(f"{prog}: error: {e}", file=sys.stderr)
    raise SystemExit(EXIT_USAGE) from None
  except KeyboardInterrupt:
    print(f"{prog}: interrupted.", file=sys.stderr)
    raise SystemExit(130) from None


def add_sampling_flags(p: argparse.ArgumentParser) -> None:
  """The logit processors' flags (`longspec_jax.sampling.SamplingConfig`)."""
  p.add_argument("--temperature", type=float, default=0.0, help="0 (default): greedy")
  p.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (0: off)")
  p.add_argument("--top-p", type=float, default=1.0, help="keep the most likely tokens of mass p (1: off)")
  p.add_argument("--min-p", type=float, default=0.0, help="keep tokens >= min_p x the most likely (0: off)")
  p.add_argument("--penalty", type=float, default=1.0,
                 help="TokenSwift's contextual penalty theta: divide the logits of recent tokens (1: off)")
  p.add_argument("--penalty-window", type=int, default=1024, help="how many recent tokens the penalty sees")
  p.add_argument("--seed", type=int, default=0)


def sampling_config(args):
  from longspec_jax.sampling import SamplingConfig

  return SamplingConfig(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
                        penalty=args.penalty, penalty_window=args.penalty_window)


def tree_widths(text: str) -> tuple[int, ...]:
  """argparse type for `--tree-widths 4,16,16`: beam widths per depth."""
  from longspec_jax.config import check_tree_widths

  try:
    widths = tuple(int(w) for w in text.split(","))
    check_tree_widths(widths)
  except ValueError:
    raise argparse.ArgumentTypeError(f"expected comma-separated integers like 4,16,16, got {text!r}") from None
  except UserError as e:
    raise argparse.ArgumentTypeError(str(e)) from None
  return widths


def resolve_dtype(name: str | None):
  """`None` means bfloat16 on GPU, float32 elsewhere. float32 also makes matrix products
  float32 (GPUs otherwise round their inputs to TF32), so that float32 runs are exact."""
  import jax
  import jax.numpy as jnp

  if name is None:
    name = "bfloat16" if jax.default_backend() == "gpu" else "float32"
  if name == "float32":
    jax.config.update("jax_default_matmul_precision", "highest")
  return {"float32": jnp.float32, "bfloat16": jnp.bfloat16}[name]


def read_prompt(prompt: str | None, prompt_file: str | None) -> str:
  if prompt_file is not None:
    if prompt_file == "-":
      return sys.stdin.read()
    path = Path(prompt_file)
    try:
      return path.read_text()
    except FileNotFoundError:
      raise UserError(f"prompt file {path} does not exist.") from None
    except (UnicodeDecodeError, IsADirectoryError) as e:
      raise UserError(f"prompt file {path} is not readable text ({type(e).__name__}).") from None
  return prompt


def encode_prompt(tokenizer, text: str, chat: bool) -> list[int]:
  """Token ids of the prompt, through the model's chat template with `chat`."""
  if not text.strip():
    raise UserError("the prompt is empty; give at least one token of text.")
  if chat:
    if not getattr(tokenizer, "chat_template", None):
      raise UserError("--chat was given but the target's tokenizer has no chat template.")
    text = tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False).input_ids
  return tokenizer(text).input_ids
