"""Command-line plumbing every CLI of the project uses (`infer` and `train` alike): argparse
that reports a bad flag as one sentence, checked number types, one-line errors with exit
code 2 (a `UserError`, or a missing optional package named with the extra that installs
it), Ctrl-C that ends a command at once, and the dtype, attention-code, GEMM-code,
batch-invariance and device-count flags.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn

from longspec_jax.errors import UserError
from longspec_jax.methods.registry import Method

# The values of `longspec_jax.ops.attention.Impl` that decode (FLASH is the draft's training
# passes only), listed here free of JAX so that flags are checked before JAX is imported
# (tests/test_cli.py keeps the two equal).
ATTENTION = ("reference", "pallas")
GEMM = ("xla", "cublas")  # likewise `longspec_jax.ops.gemm.Gemm`
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130
# Optional packages -> the extra that installs them (pyproject.toml).
EXTRAS = {
  "optax": "train",
  "datasets": "train",
  "matplotlib": "bench",
  "fastapi": "serve",
  "uvicorn": "serve",
  "sse_starlette": "serve",
  "scipy": "dev",
  "torch": None,
}
# transformers announces at import that it found no torch; the commands never need it.
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")


class HelpFormatter(argparse.HelpFormatter):
  """Help that names each flag's default, where it has one its text does not name."""

  def _get_help_string(self, action: argparse.Action) -> str:
    text = action.help or ""
    unset = action.default is None or action.default is False or action.default == argparse.SUPPRESS
    if unset or "default" in text or not action.option_strings:
      return text
    default = action.default
    shown = " ".join(map(str, default)) if isinstance(default, list) else str(default)
    return f"{text} (default: {shown.replace('%', '%%')})".lstrip()


class ArgumentParser(argparse.ArgumentParser):
  """argparse that reports a bad flag as one sentence on stderr (no usage dump) and names
  defaults in its help."""

  def __init__(self, *args, **kwargs):
    kwargs.setdefault("formatter_class", HelpFormatter)
    super().__init__(*args, **kwargs)

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


def method_type(text: str) -> Method | str:
  """An argparse type for `--method` (with `choices=list(Method)`): the method, or the text
  unchanged where it names none, which argparse's choices then refuse, listing them."""
  try:
    return Method(text)
  except ValueError:
    return text


positive_int = number_type(int, lambda x: x >= 1, "an integer >= 1")
nonnegative_int = number_type(int, lambda x: x >= 0, "an integer >= 0")
positive_float = number_type(float, lambda x: x > 0, "a finite number > 0")
nonnegative_float = number_type(float, lambda x: x >= 0, "a finite number >= 0")
any_int = number_type(int, lambda x: True, "an integer")


def output_path(path: Path, kind: str = "file") -> Path:
  """Checks before any work that `path` can be written as a `kind` ('file' or 'directory'),
  and makes the directories it lies in, so that the work's end cannot fail for want of them."""
  if kind == "file" and path.is_dir():
    raise UserError(f"the output {path} is a directory; give a file name.")
  if kind == "directory" and path.exists() and not path.is_dir():
    raise UserError(f"the output {path} is a file; give a directory.")
  parent = path if kind == "directory" and path.exists() else path.parent
  while not parent.exists():
    parent = parent.parent
  if not parent.is_dir() or not os.access(parent, os.W_OK):
    raise UserError(f"cannot write {path}: {parent} is not a writable directory.")
  path.parent.mkdir(parents=True, exist_ok=True)
  return path


def add_attention_flag(p: argparse.ArgumentParser) -> None:
  p.add_argument("--attention", choices=ATTENTION, help="attention code: pallas (default on GPU) or reference (jnp)")


def attention_impl(name: str | None):
  """The `attention.Impl` a flag names; None: the default for this backend."""
  from longspec_jax.ops.attention import Impl

  return Impl(name) if name else Impl.default()


def add_gemm_flag(p: argparse.ArgumentParser) -> None:
  p.add_argument(
    "--gemm",
    choices=GEMM,
    help="GEMM code on a GPU: XLA's Triton fusions or cuBLAS (the default; longspec_jax/ops/gemm.py)",
  )


def numerics(args: argparse.Namespace):
  """The target's `numerics.Numerics` as the flags name them (`--attention`, `--gemm`,
  `--batch-invariant`, where a command has them; the backend's defaults otherwise),
  decided once before the target loads."""
  from longspec_jax.ops.gemm import Gemm
  from longspec_jax.ops.numerics import Numerics

  chosen = {"attention": attention_impl(getattr(args, "attention", None))}
  if name := getattr(args, "gemm", None):
    chosen["gemm"] = Gemm(name)
  return Numerics(**chosen, batch_invariant=getattr(args, "batch_invariant", False))


def add_batch_invariant_flag(p: argparse.ArgumentParser) -> None:
  p.add_argument(
    "--batch-invariant",
    action="store_true",
    help="decoding rounds compute each token's logits the same bits whatever else the call holds"
    " (verification = AR steps, bit for bit), so bf16 speculative output equals bf16 AR output;"
    " costs 4-10%% of an AR step at 8B (docs/methods.md)",
  )


def add_devices_flag(p: argparse.ArgumentParser) -> None:
  p.add_argument(
    "--devices",
    type=positive_int,
    default=1,
    help="split the models over this many devices (tensor parallelism: weights by attention head, MLP"
    " column and vocabulary, K/V caches by KV head); on a CPU, that many host devices",
  )


def device_mesh(count: int):
  """The mesh a command loads and runs its models on, split over `count` devices
  (`longspec_jax.ops.sharding`; enter it with `jax.set_mesh`): the first `count` devices, or
  None for one. On a CPU `count` host devices are made for it, so call this before JAX
  runs anything."""
  import jax

  if count == 1:
    return None
  try:
    jax.config.update("jax_num_cpu_devices", count)  # (only the CPU backend reads it)
  except RuntimeError:  # JAX has run already (a test calling main): its devices are what they are
    pass
  devices = jax.devices()
  if len(devices) < count:
    raise UserError(
      f"--devices {count} asks for more devices than this machine's {len(devices)}"
      f" {devices[0].platform.upper()} device{'s' if len(devices) > 1 else ''}."
    )
  from longspec_jax.ops.sharding import make_mesh

  return make_mesh(model=count, devices=devices[:count])


def check_batch_invariant(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
  """The flags `--batch-invariant` cannot run with (`--sparse-verify`, `--devices` > 1),
  each a one-line error."""
  if not args.batch_invariant:
    return
  if args.sparse_verify:
    p.error("--batch-invariant makes each round compute AR's bits, which --sparse-verify gives up: choose one")
  if args.devices > 1:
    p.error(
      "--batch-invariant runs on one device: split over devices, each layer ends in a sum across them whose"
      " order depends on the call's size"
    )


def resolve_dtype(name: str | None):
  """`None` means bfloat16 on GPU, float32 elsewhere. float32 also makes matrix products
  float32 (GPUs otherwise round their inputs to TF32), so that float32 runs are exact."""
  import jax
  import jax.numpy as jnp

  if name is None:
    from longspec_jax import backend

    name = "bfloat16" if backend.on_gpu() else "float32"
  if name == "float32":
    jax.config.update("jax_default_matmul_precision", "highest")
  return {"float32": jnp.float32, "bfloat16": jnp.bfloat16}[name]
