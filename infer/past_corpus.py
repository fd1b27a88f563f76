"""`--corpus`: files a user names, written into the ring of past outputs that prompt lookup
searches (`longspec_jax.methods.past`) before the first request, each tokenized once: the
token ids are cached by the tokenizer's vocabulary and the file's text."""

from __future__ import annotations

import functools
import hashlib
import io
import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from infer.cli import read_text
from longspec_jax.files import cache_root, write_whole
from longspec_jax.methods.past import Past


@functools.cache
def _vocabulary_digest(tokenizer) -> str:
  return hashlib.sha256(json.dumps(tokenizer.get_vocab(), sort_keys=True).encode()).hexdigest()


def tokenized(path: Path, tokenizer, directory: Path | None = None) -> np.ndarray:
  """The token ids [N] int32 of the text of `path` (no special tokens), from the cache in
  `directory` (default `files.cache_root() / "corpus"`) where it holds them."""
  text = read_text(path, "the corpus file")
  key = hashlib.sha256((_vocabulary_digest(tokenizer) + "\0" + text).encode()).hexdigest()
  cached = (directory or cache_root() / "corpus") / f"{key}.npy"
  if cached.exists():
    return np.load(cached)
  ids = np.asarray(tokenizer(text, add_special_tokens=False).input_ids, np.int32)
  buffer = io.BytesIO()
  np.save(buffer, ids)
  write_whole(cached, buffer.getvalue())
  return ids


def fill(past: Past, paths: Sequence[Path], tokenizer, directory: Path | None = None) -> int:
  """Writes each file's tokens into `past`, in order (each followed by a separator, as an
  output is: the latest files are the last evicted). Returns the tokens written."""
  written = 0
  for path in paths:
    ids = tokenized(path, tokenizer, directory)
    past.append(ids)
    written += len(ids)
  return written
