"""The directory the project caches files in, and files written whole or not at all."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def write_whole(path: Path, content: str | bytes) -> None:
  """Writes `content` (text or bytes) to `path` through a file of its own beside it,
  renamed into place: a reader sees the old file or the new one, whole, and writers at
  the same time (two processes measuring `auto`'s prices) never write into one
  temporary file."""
  path = Path(path)
  path.parent.mkdir(parents=True, exist_ok=True)
  fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
  try:
    with os.fdopen(fd, "wb" if isinstance(content, bytes) else "w") as f:
      f.write(content)
    os.replace(tmp, path)
  except BaseException:
    Path(tmp).unlink(missing_ok=True)
    raise


def cache_root() -> Path:
  """$LONGSPEC_CACHE, else $XDG_CACHE_HOME/longspec_jax, else ~/.cache/longspec_jax."""
  if root := os.environ.get("LONGSPEC_CACHE"):
    return Path(root)
  xdg = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
  return Path(xdg) / "longspec_jax"
