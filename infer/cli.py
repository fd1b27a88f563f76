"""Command-line plumbing shared by the CLIs: one-line errors with exit code 2, checked
flag types, Ctrl-C within a second, dtype and prompt handling."""

from __future__ import annotations

import argparse
import math
import os
import sys
import threading
from pathlib import Path
from typing import Callable, NoReturn

from longspec_jax.errors import UserError

# The decoding methods (`longspec_jax.proposers.PROPOSERS`) by name, listed here, free of
# JAX, so that flags are checked before JAX is imported.
METHODS = ("ar", "pld", "longspec")
# `longspec_jax.attention.Impl` by value, likewise.
ATTENTION = ("reference", "pallas")
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130
# Optional packages -> the extra that installs them (pyproject.toml).
EXTRAS = {"optax": "train", "datasets": "train", "matplotlib": "bench", "scipy": "dev", "torch": None}
# transformers announces at import that it found no torch; the main job never needs it.
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")


class ArgumentParser(argparse.ArgumentParser):
  """argparse that reports a bad flag as one sentence on stderr (no usage dump)."""

  def error(self, message: str) -> NoReturn:
    print(f"{self.prog}: error: {message.rstrip('.')} (see --help).", file=sys.stderr)
    raise SystemExit(EXIT_USAGE)


def _missing_package(e: ModuleNotFoundError) -> str | None:
  """One sentence for an optional package that is not installed, else None."""
  package = (e.name or "").split(".")[0]
  if package not in EXTRAS:
    return None
  extra = EXTRAS[package]
  how = f"pip install 'longspec-jax[{extra}]'" if extra else f"pip install {package}"
  return f"this command needs the package {package!r}, which is not installed ({how})."


def run_main(main: Callable[[], None], prog: str, interruptible: bool = True) -> None:
  """Runs a CLI entry point; a `UserError` (or a missing optional package) becomes one
  line on stderr and exit code 2. With `interruptible`, `main` runs in a worker thread so
  that Ctrl-C ends the process at once, even while the main thread would sit in a
  compilation or a device wait that Python cannot interrupt (training runs in the main
  thread, where Ctrl-C unwinds through its checkpoint bookkeeping instead)."""
  outcome: list[BaseException | None] = []

  def work():
    try:
      main()
      outcome.append(None)
    except BaseException as e:  # handed to the main thread
      outcome.append(e)

  try:
    if interruptible:
      worker = threading.Thread(target=work, daemon=True)
      worker.start()
      while worker.is_alive():
        worker.join(0.1)
    else:
      work()
    if outcome and outcome[0] is not None:
      raise outcome[0]
  except UserError as e:
    print(f"{prog}: error: {e}", file=sys.stderr)
    raise SystemExit(EXIT_USAGE) from None
  except ModuleNotFoundError as e:
    if (message := _missing_package(e)) is None:
      raise
    print(f"{prog}: error: {message}", file=sys.stderr)
    raise SystemExit(EXIT_USAGE) from None
  except KeyboardInterrupt:
    print(f"\n{prog}: interrupted.", file=sys.stderr)
    if interruptible:  # the worker may be inside XLA: leave without waiting for it
      sys.stdout.flush()
      sys.stderr.flush()
      os._exit(EXIT_INTERRUPTED)
    raise SystemExit(EXIT_INTERRUPTED) from None


def number_type(kind, check: Callable[[float], bool], what: str):
  """An argparse type: `kind` parsed, then `check`ed (finite floats only)."""
  def parse(text: str):
    try:
      value = kind(text)
    except ValueError:
      raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
    if (kind is float and not math.isfinite(value)) or not check(value):
      raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}")
    return value

  parse.__name__ = what  # argparse names the type in some messages
  return parse


positive_int = number_type(int, lambda x: x >= 1, "an integer >= 1")
nonnegative_int = number_type(int, lambda x: x >= 0, "an integer >= 0")
positive_float = number_type(float, lambda x: x > 0, "a finite number > 0")
nonnegative_float = number_type(float, lambda x: x >= 0, "a finite number >= 0")
any_int = number_type(int, lambda x: True, "an integer")


def add_sampling_flags(p: argparse.ArgumentParser) -> None:
  """The logit processors' flags (`longspec_jax.sampling.SamplingConfig`)."""
  p.add_argument("--temperature", type=nonnegative_float, default=0.0, help="0 (default): greedy")
  p.add_argument("--top-k", type=nonnegative_int, default=0, help="keep the k most likely tokens (0: off)")
  p.add_argument("--top-p", type=number_type(float, lambda x: 0 < x <= 1, "a number in (0, 1]"), default=1.0,
                 help="keep the most likely tokens of mass p (1: off)")
  p.add_argument("--min-p", type=number_type(float, lambda x: 0 <= x < 1, "a number in [0, 1)"), default=0.0,
                 help="keep tokens >= min_p x the most likely (0: off)")
  p.add_argument("--penalty", type=number_type(float, lambda x: x >= 1, "a finite number >= 1"), default=1.0,
                 help="TokenSwift's contextual penalty theta: divide the logits of recent tokens (1: off)")
  p.add_argument("--penalty-window", type=positive_int, default=1024, help="how many recent tokens the penalty sees")
  p.add_argument("--seed", type=any_int, default=0)


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


def output_path(path: Path, kind: str = "file") -> Path:
  """Checks before any work that `path` can be written as a `kind` ('file' or 'directory')."""
  if kind == "file" and path.is_dir():
    raise UserError(f"the output {path} is a directory; give a file name.")
  if kind == "directory" and path.exists() and not path.is_dir():
    raise UserError(f"the output {path} is a file; give a directory.")
  parent = path if kind == "directory" and path.exists() else path.parent
  while not parent.exists():
    parent = parent.parent
  if not parent.is_dir() or not os.access(parent, os.W_OK):
    raise UserError(f"cannot write {path}: {parent} is not a writable directory.")
  return path


def add_attention_flag(p: argparse.ArgumentParser) -> None:
  p.add_argument("--attention", choices=ATTENTION, help="attention code: pallas (default on GPU) or reference (jnp)")


def attention_impl(name: str | None):
  """The `attention.Impl` a flag names; None: the default for this backend."""
  from longspec_jax.attention import Impl

  return Impl(name) if name else Impl.default()


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
  """The prompt's text, from the flag, a file or stdin ('-'); an empty one is refused."""
  if prompt_file == "-":
    prompt = sys.stdin.read()
  elif prompt_file is not None:
    path = Path(prompt_file)
    try:
      prompt = path.read_text()
    except FileNotFoundError:
      raise UserError(f"prompt file {path} does not exist.") from None
    except (UnicodeDecodeError, IsADirectoryError) as e:
      raise UserError(f"prompt file {path} is not readable text ({type(e).__name__}).") from None
  if not prompt.strip():
    raise UserError("the prompt is empty; give at least one token of text.")
  return prompt


def encode_prompt(tokenizer, text: str, chat: bool) -> list[int]:
  """Token ids of the prompt, through the model's chat template with `chat`."""
  if chat:
    if not getattr(tokenizer, "chat_template", None):
      raise UserError("--chat was given but the target's tokenizer has no chat template.")
    text = tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False).input_ids
  return tokenizer(text).input_ids
