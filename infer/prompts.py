"""Benchmark prompt sets from real local text (no dataset hub needed).

- `code`: complete a Python source file from a long prefix (files of this interpreter's
  standard library, longest first);
- `docs`: summarize a long document through the chat template (licenses and package
  documentation under /usr/share, then the standard library's module docstrings);
- `c-code`: complete a C header from a long prefix (/usr/include, longest first);
- `pod-docs`: summarize a Perl POD document through the chat template;
- `pod-qa`: answer a question about a Perl POD document through the chat template; the
  question names a section heading of the part of the document the prompt holds;
- `cpp-code`: complete a header of the C++ standard library (/usr/include/c++);
- `perl-code`: complete a Perl module (the Perl library's `.pm` files);
- `perl-explain`: explain a Perl module through the chat template.

Three more are sequences of requests whose answers repeat earlier answers, for prompt
lookup over past outputs (`--past-tokens`), decoded in their order:
- `doc-questions`: questions about different sections of one Perl POD document;
- `code-edits`: one Python source rewritten whole, each time with another name renamed;
- `json-records`: the functions and classes of parts of Python sources as JSON lines of
  one schema.

All but `code` and `docs` are held out (`HELD_OUT`): the project never trains on
/usr/include or the Perl library and its documentation (`train.corpus`), so they measure
a draft on text unlike its training data, in six kinds: C, C++ and Perl to complete,
document summaries, questions about a document, and code explained in a chat.
"""

from __future__ import annotations

import re
import sysconfig
from collections.abc import Callable, Iterable
from pathlib import Path

DOC_GLOBS = ("/usr/share/common-licenses/*", "/usr/share/doc/*/README*", "/usr/share/doc/*/*.txt")
POD_GLOBS = (
  "/usr/share/perl/*/pod/*.pod",
  "/usr/share/perl/*/*.pod",
  "/usr/share/perl/*/*/*.pod",
  "/usr/share/perl/*/*/*/*.pod",
)
PERL_GLOBS = ("/usr/share/perl/**/*.pm", "/usr/lib/*/perl*/**/*.pm")
CPP_GLOBS = ("/usr/include/c++/*/*", "/usr/include/c++/*/bits/*")
SUMMARY_REQUEST = "Summarize the following document in a few paragraphs.\n\n"
EXPLAIN_REQUEST = "Explain what the following code does, part by part.\n\n"
QUESTION = (
  "Read the document below, then answer the question after it.\n\n{document}\n\nQuestion: what does the"
  ' document say under the heading "{heading}"? Answer in a few sentences.'
)
POD_HEADING = re.compile(r"^=head[1-4]\s+(.+)$", re.MULTILINE)
EDIT_REQUEST = (
  "Rewrite the whole file below with `{old}` renamed to `{new}` everywhere; answer with the file alone.\n\n"
)
RECORDS_REQUEST = (
  "List every function and class the code below defines, one JSON object a line with the keys"
  ' "name", "kind", "arguments" and "summary".\n\n'
)
PYTHON_DEFINITION = re.compile(r"^(?:def|class)\s+([A-Za-z_]\w*)", re.MULTILINE)


def _read(path: Path) -> str | None:
  try:
    return path.read_text()
  except (UnicodeDecodeError, OSError):
    return None


def _paths(patterns: Iterable[str]) -> list[Path]:
  """The files the glob patterns match, longest first."""
  return sorted(
    {p for pattern in patterns for p in Path("/").glob(pattern.lstrip("/")) if p.is_file()},
    key=lambda p: (-p.stat().st_size, str(p)),
  )


def _files(patterns: Iterable[str], min_chars: int = 2000) -> list[str]:
  """The readable texts of the files the glob patterns match, longest file first, each
  text once (packages install the same license or README under several names)."""
  return list(dict.fromkeys(t for t in map(_read, _paths(patterns)) if t and len(t) > min_chars))


def _python_sources() -> list[str]:
  files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"), key=lambda p: -p.stat().st_size)
  return [t for t in map(_read, files) if t]


def _completion_prompts(texts: list[str], what: str, tokenizer, length: int, count: int) -> list[list[int]]:
  """`count` prompts of exactly `length` tokens, each the start of a different text (short
  texts are joined with the next ones)."""
  prompts, pending = [], []
  for text in texts:
    pending.extend(tokenizer(text).input_ids)
    if len(pending) >= length:
      prompts.append(pending[:length])
      pending = []
      if len(prompts) == count:
        return prompts
  raise RuntimeError(f"not enough local {what} for {count} prompts of {length} tokens")


def _chat_prompts(
  texts: list[str], what: str, request: Callable[[str], str | None], tokenizer, length: int, count: int
) -> list[list[int]]:
  """`count` chat prompts of about `length` tokens, each `request(document)` for a
  different document, truncated (or joined with the next) to fit; `request` may turn a
  document down (None)."""
  template = tokenizer.apply_chat_template(
    [{"role": "user", "content": request("") or ""}], tokenize=False, add_generation_prompt=True
  )
  budget = length - len(tokenizer(template, add_special_tokens=False).input_ids)
  prompts, pending = [], []
  for text in texts:
    pending.extend(tokenizer(text, add_special_tokens=False).input_ids)
    if len(pending) < budget:
      continue
    content = request(tokenizer.decode(pending[:budget]))
    pending = []
    if content is None:
      continue
    chat = tokenizer.apply_chat_template(
      [{"role": "user", "content": content}], tokenize=False, add_generation_prompt=True
    )
    prompts.append(tokenizer(chat, add_special_tokens=False).input_ids)
    if len(prompts) == count:
      return prompts
  raise RuntimeError(f"not enough local {what} for {count} prompts of {length} tokens")


def _one_document_prompts(
  texts: list[str], what: str, requests: Callable[[str], list[str]], tokenizer, length: int, count: int
) -> list[list[int]]:
  """`count` chat prompts of about `length` tokens about one document: the first of
  `texts` (truncated to fit) for which `requests(document)` gives `count` requests or more
  (`requests("")`: the longest request's text without a document, to size the budget)."""
  template = tokenizer.apply_chat_template(
    [{"role": "user", "content": requests("")[0]}], tokenize=False, add_generation_prompt=True
  )
  budget = length - len(tokenizer(template, add_special_tokens=False).input_ids)
  for text in texts:
    document = tokenizer.decode(tokenizer(text, add_special_tokens=False).input_ids[:budget])
    contents = requests(document)[:count]
    if len(contents) < count:
      continue
    chats = [
      tokenizer.apply_chat_template([{"role": "user", "content": c}], tokenize=False, add_generation_prompt=True)
      for c in contents
    ]
    return [tokenizer(chat, add_special_tokens=False).input_ids for chat in chats]
  raise RuntimeError(f"no local {what} long enough for {count} requests of {length} tokens")


def _questions(document: str) -> list[str]:
  """A question about each distinct section heading of the POD document."""
  if not document:
    return [QUESTION.format(document="", heading="")]
  headings = dict.fromkeys(h.strip() for h in POD_HEADING.findall(document) if h.strip())
  return [QUESTION.format(document=document, heading=heading) for heading in headings]


def _edits(document: str) -> list[str]:
  """A request to rewrite the Python source with one of its top-level names renamed, per
  distinct name."""
  if not document:
    return [EDIT_REQUEST.format(old="", new="")]
  names = dict.fromkeys(PYTHON_DEFINITION.findall(document))
  return [EDIT_REQUEST.format(old=name, new=f"{name}_v2") + document for name in names]


def _question(document: str) -> str | None:
  """The question about a heading from the middle of the document's headings (None for
  a document without one, or the empty document the template is measured with)."""
  if not document:
    return QUESTION.format(document="", heading="")
  headings = [h.strip() for h in POD_HEADING.findall(document) if h.strip()]
  if not headings:
    return None
  return QUESTION.format(document=document, heading=headings[len(headings) // 2])


def code_prompts(tokenizer, length: int, count: int) -> list[list[int]]:
  return _completion_prompts(_python_sources(), "Python source", tokenizer, length, count)


def document_prompts(tokenizer, length: int, count: int) -> list[list[int]]:
  return _chat_prompts(
    _files(DOC_GLOBS) + _python_sources(), "text", lambda d: SUMMARY_REQUEST + d, tokenizer, length, count
  )


def c_code_prompts(tokenizer, length: int, count: int) -> list[list[int]]:
  return _completion_prompts(_files(["/usr/include/*.h", "/usr/include/*/*.h"]), "C headers", tokenizer, length, count)


def pod_document_prompts(tokenizer, length: int, count: int) -> list[list[int]]:
  return _chat_prompts(_files(POD_GLOBS), "Perl documentation", lambda d: SUMMARY_REQUEST + d, tokenizer, length, count)


def pod_question_prompts(tokenizer, length: int, count: int) -> list[list[int]]:
  return _chat_prompts(_files(POD_GLOBS), "Perl documentation", _question, tokenizer, length, count)


def cpp_code_prompts(tokenizer, length: int, count: int) -> list[list[int]]:
  return _completion_prompts(_files(CPP_GLOBS), "C++ headers", tokenizer, length, count)


def perl_code_prompts(tokenizer, length: int, count: int) -> list[list[int]]:
  return _completion_prompts(_files(PERL_GLOBS), "Perl modules", tokenizer, length, count)


def perl_explain_prompts(tokenizer, length: int, count: int) -> list[list[int]]:
  return _chat_prompts(_files(PERL_GLOBS), "Perl modules", lambda d: EXPLAIN_REQUEST + d, tokenizer, length, count)


def doc_question_prompts(tokenizer, length: int, count: int) -> list[list[int]]:
  return _one_document_prompts(_files(POD_GLOBS), "Perl documentation", _questions, tokenizer, length, count)


def code_edit_prompts(tokenizer, length: int, count: int) -> list[list[int]]:
  return _one_document_prompts(_python_sources(), "Python source", _edits, tokenizer, length, count)


def json_record_prompts(tokenizer, length: int, count: int) -> list[list[int]]:
  return _chat_prompts(_python_sources(), "Python source", lambda d: RECORDS_REQUEST + d, tokenizer, length, count)


PROMPT_SETS = {
  "code": code_prompts,
  "docs": document_prompts,
  "c-code": c_code_prompts,
  "pod-docs": pod_document_prompts,
  "pod-qa": pod_question_prompts,
  "cpp-code": cpp_code_prompts,
  "perl-code": perl_code_prompts,
  "perl-explain": perl_explain_prompts,
  "doc-questions": doc_question_prompts,
  "code-edits": code_edit_prompts,
  "json-records": json_record_prompts,
}
# The sets of text no training data of the project holds (`train.corpus` leaves it out).
HELD_OUT = ("c-code", "cpp-code", "perl-code", "pod-docs", "pod-qa", "perl-explain")
HELD_OUT_NAME = "held-out"  # what `--sets` takes for all of them


def set_names(names: Iterable[str]) -> list[str]:
  """`--sets` as prompt set names: `HELD_OUT_NAME` stands for every held-out set."""
  expanded = [n for name in names for n in (HELD_OUT if name == HELD_OUT_NAME else (name,))]
  return list(dict.fromkeys(expanded))
