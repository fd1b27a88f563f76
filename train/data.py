"""Training data: documents or chat records -> packed fixed-length token rows with loss
masks, in a deterministic order, split across hosts.

Sources go through `datasets`: local text/code globs (one document per file), JSONL
files, or hub dataset names, several at once. Plain documents are tokenized, joined with
EOS and cut into rows of `length` tokens (every token is a target). Chat records (`messages` lists, or
`prompt`/`response` pairs) are rendered with the tokenizer's chat template and only the
assistant's tokens are targets.
"""

from __future__ import annotations

import dataclasses
import glob
import os
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np

from longspec_jax.errors import UserError


@dataclasses.dataclass(frozen=True)
class Packed:
  tokens: np.ndarray  # [N, length] int32
  loss_mask: np.ndarray  # [N, length] bool: the token is a prediction target


@dataclasses.dataclass(frozen=True)
class Sources:
  """Training data sources, resolved and checked before anything heavy loads."""

  text_files: tuple[str, ...] = ()
  json_files: tuple[str, ...] = ()
  hub_names: tuple[str, ...] = ()

  @property
  def only_text(self) -> bool:
    return bool(self.text_files) and not self.json_files and not self.hub_names


def _is_binary(path: str) -> bool:
  """A file whose first 8 KiB hold a NUL byte or are not UTF-8 at all (a build artefact,
  an image, a compiled object): not text to train on."""
  with open(path, "rb") as f:
    head = f.read(8192)
  if b"\0" in head:
    return True
  try:
    head.decode("utf-8")
  except UnicodeDecodeError as e:
    return e.start < len(head) - 4  # (a multi-byte character cut at the end of the window is fine)
  return False


def resolve_sources(sources: str | Sequence[str]) -> Sources:
  """Globs of text/code files (one document per file), JSONL files (`*.jsonl`) and hub
  dataset names. A glob that matches nothing, a path that does not exist and binary
  files are refused: binary bytes would train the draft on noise."""
  sources = [sources] if isinstance(sources, str) else list(sources)
  text_files, json_files, hub_names, binary = [], [], [], []
  for source in sources:
    paths = sorted(glob.glob(str(Path(source).expanduser()), recursive=True))
    paths = [p for p in paths if Path(p).is_file()]
    if paths:
      for path in paths:
        if path.endswith((".jsonl", ".json")):
          json_files.append(path)
        elif _is_binary(path):
          binary.append(path)
        else:
          text_files.append(path)
    elif any(ch in source for ch in "*?[") or source.startswith(("/", ".", "~")) or Path(source).expanduser().exists():
      raise UserError(f"no training files match {source!r}.")
    else:
      hub_names.append(source)
  if binary and not (text_files or json_files):
    raise UserError(f"the data holds only binary files (e.g. {binary[0]}); give text, code or JSONL files.")
  if binary:
    raise UserError(
      f"{len(binary)} of the data files are binary, not text (e.g. {binary[0]}); narrow the globs to text and code."
    )
  return Sources(tuple(text_files), tuple(json_files), tuple(hub_names))


def load_records(sources: Sources | str | Sequence[str], split: str = "train"):
  """A `datasets.Dataset` of the sources (`resolve_sources`): a `text` column for files
  (one document per file), the records of JSONL files and hub datasets; several sources
  are concatenated (files and hub datasets of one kind: text or records)."""
  import datasets

  if not isinstance(sources, Sources):
    sources = resolve_sources(sources)
  parts = []
  for name in sources.hub_names:
    try:
      parts.append(datasets.load_dataset(name, split=split))
    except Exception as e:  # network, missing dataset, bad split
      raise UserError(f"could not load dataset {name!r} ({type(e).__name__}: {e}).") from None
  if sources.json_files:
    try:
      parts.insert(0, datasets.load_dataset("json", data_files=list(sources.json_files), split="train"))
    except Exception as e:  # malformed JSON lines
      raise UserError(f"could not read the JSONL data ({type(e).__name__}: {str(e).splitlines()[0]}).") from None
  if sources.text_files:  # (undecodable bytes become U+FFFD rather than failing the whole load)
    parts.insert(
      0,
      datasets.load_dataset(
        "text",
        data_files=list(sources.text_files),
        sample_by="document",
        split="train",
        encoding_errors="replace",
        num_proc=_workers(len(sources.text_files)),
      ),
    )
  if len(parts) == 1:
    return parts[0]
  try:
    return datasets.concatenate_datasets(parts)
  except ValueError as e:
    raise UserError(f"the data sources have different columns and cannot be mixed ({e}).") from None


def has_chat_records(records) -> bool:
  """Whether a dataset holds conversations (`messages`, or `prompt`/`response`)."""
  columns = set(records.column_names)
  return "messages" in columns or {"prompt", "response"} <= columns


def _workers(files: int) -> int | None:
  """Processes for `datasets` to read many files with (None: one, for a few files)."""
  return min(os.cpu_count() or 1, 16) if files >= 1000 else None


def chat_tokens(tokenizer, messages: list[dict]) -> tuple[list[int], list[bool]]:
  """A conversation rendered with the chat template, and which tokens the assistant wrote
  (found by character spans, so tokenization across turn boundaries does not matter)."""
  render = lambda msgs, prompt: tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=prompt)
  text = render(messages, False)
  spans = [
    (len(render(messages[:i], True)), len(render(messages[: i + 1], False)))
    for i, message in enumerate(messages)
    if message["role"] == "assistant"
  ]
  encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
  targets = [any(start <= a < end for start, end in spans) for a, _ in encoded["offset_mapping"]]
  return list(encoded["input_ids"]), targets


def record_tokens(tokenizer, records: dict[str, list]) -> list[tuple[list[int], list[bool]]]:
  """(tokens, targets) of each record in a batch of records (columns -> lists); plain
  documents are tokenized together, which runs in parallel in the fast tokenizer."""
  count = len(next(iter(records.values())))
  rows = [{name: column[i] for name, column in records.items()} for i in range(count)]
  # (`datasets` gives every record every column of the file, None where absent.)
  texts = {
    i: r.get("text")
    for i, r in enumerate(rows)
    if r.get("messages") is None and (r.get("prompt") is None or r.get("response") is None)
  }
  for i, text in texts.items():
    if not isinstance(text, str):
      raise UserError(f"a training record needs 'text', 'messages' or 'prompt'/'response'; got keys {sorted(rows[i])}.")
  encoded = dict(zip(texts, tokenizer(list(texts.values()), add_special_tokens=False).input_ids)) if texts else {}
  out = []
  for i, record in enumerate(rows):
    if i in encoded:
      out.append((encoded[i], [True] * len(encoded[i])))
    elif record.get("messages") is not None:
      out.append(chat_tokens(tokenizer, record["messages"]))
    else:
      out.append(
        chat_tokens(
          tokenizer,
          [{"role": "user", "content": record["prompt"]}, {"role": "assistant", "content": record["response"]}],
        )
      )
  return out


def pack(
  records, tokenizer, length: int, eos_id: int, max_tokens: int | None = None, seed: int = 0, batch: int = 256
) -> Packed:
  """Concatenates the records (EOS after each) and cuts rows of `length`; the tail that
  does not fill a row is dropped. With `max_tokens`, records are taken in a seeded
  random order (so a capped sample spans every source) until that many tokens."""
  if max_tokens is not None:
    records = records.shuffle(seed=seed)
  tokens, targets, total = [], [], 0  # per-document numpy arrays: 100M tokens stay compact
  for start in range(0, len(records), batch):
    for ids, mask in record_tokens(tokenizer, records[start : start + batch]):
      tokens.append(np.asarray(ids + [eos_id], np.int32))
      targets.append(np.asarray(mask + [mask[-1] if mask else False], bool))  # EOS: a target where the end is
      total += len(ids) + 1
    if max_tokens is not None and total >= max_tokens:
      break
  total = min(total, max_tokens or total)
  rows = total // length
  if rows == 0:
    raise UserError(f"the data holds {total} tokens, fewer than one row of {length}.")
  cut = rows * length
  tokens, targets = np.concatenate(tokens)[:cut], np.concatenate(targets)[:cut]
  return Packed(tokens=tokens.reshape(rows, length), loss_mask=targets.reshape(rows, length))


def batches(
  data: Packed,
  batch: int,
  seed: int,
  start: int = 0,
  host: int = 0,
  hosts: int = 1,
) -> Iterator[tuple[np.ndarray, np.ndarray]]:
  """This host's batches [batch, length] from batch index `start` on, epoch after epoch:
  rows in a seeded order per epoch, each global batch of `hosts` x `batch` rows the next
  ones in that order and host h its h-th block of them (the block its devices hold). The
  same seed and start always give the same batches, so a resumed run sees the data an
  uninterrupted one would, and a run of several hosts the batches of one."""
  whole = batch * hosts
  per_epoch = len(data.tokens) // whole
  if per_epoch == 0:
    raise UserError(f"{len(data.tokens)} rows cannot fill a batch of {batch} on each of {hosts} hosts.")
  index = start
  while True:
    epoch, position = divmod(index, per_epoch)
    order = np.random.default_rng([seed, epoch]).permutation(len(data.tokens))
    rows = order[position * whole + host * batch : position * whole + (host + 1) * batch]
    yield data.tokens[rows], data.loss_mask[rows]
    index += 1
