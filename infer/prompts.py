"""Benchmark prompt sets from real local text (no dataset hub needed).

- `code`: complete a Python source file from a long prefix (files of this interpreter's
  standard library, longest first);
- `docs`: summarize a long document through the chat template (licenses and package
  documentation under /usr/share, then the standard library's module docstrings).
"""

from __future__ import annotations

import sysconfig
from pathlib import Path

DOC_GLOBS = ("/usr/share/common-licenses/*", "/usr/share/doc/*/README*", "/usr/share/doc/*/*.txt")
SUMMARY_REQUEST = "Summarize the following document in a few paragraphs.\n\n"


def _read(path: Path) -> str | None:
  try:
    return path.read_text()
  except (UnicodeDecodeError, OSError):
    return None


def _python_sources() -> list[str]:
  files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"), key=lambda p: -p.stat().st_size)
  return [t for t in map(_read, files) if t]


def _documents() -> list[str]:
  paths = sorted({p for pattern in DOC_GLOBS for p in Path("/").glob(pattern.lstrip("/")) if p.is_file()},
                 key=lambda p: -p.stat().st_size)
  return [t for t in map(_read, paths) if t and len(t) > 2000]


def code_prompts(tokenizer, length: int, count: int) -> list[list[int]]:
  """`count` prompts of exactly `length` tokens, each the start of a different source file
  (short files are joined with the next ones)."""
  prompts, pending = [], []
  for text in _python_sources():
    pending.extend(tokenizer(text).input_ids)
    if len(pending) >= length:
      prompts.append(pending[:length])
      pending = []
      if len(prompts) == count:
        return prompts
  raise RuntimeError(f"not enough local Python source for {count} prompts of {length} tokens")


def document_prompts(tokenizer, length: int, count: int) -> list[list[int]]:
  """`count` chat prompts of about `length` tokens asking for a summary of a document
  (documents are truncated, or joined, to fit)."""
  empty = tokenizer.apply_chat_template([{"role": "user", "content": SUMMARY_REQUEST}], tokenize=False,
                                        add_generation_prompt=True)
  budget = length - len(tokenizer(empty, add_special_tokens=False).input_ids)
  prompts, pending = [], []
  for text in _documents() + _python_sources():
    pending.extend(tokenizer(text, add_special_tokens=False).input_ids)
    if len(pending) >= budget:
      document = tokenizer.decode(pending[:budget])
      chat = tokenizer.apply_chat_template([{"role": "user", "content": SUMMARY_REQUEST + document}],
                                           tokenize=False, add_generation_prompt=True)
      prompts.append(tokenizer(chat, add_special_tokens=False).input_ids)
      pending = []
      if len(prompts) == count:
        return prompts
  raise RuntimeError(f"not enough local text for {count} document prompts of {length} tokens")


PROMPT_SETS = {"code": code_prompts, "docs": document_prompts}
