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
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np

from longspec_jax.errors import UserError


@dataclasses.dataclass(frozen=True)
class Packed:
  tokens: np.ndarray  # [N, length] int32
  loss_mask: np.ndarray  # [N, length] bool: the token is a prediction target


def load_records(sources: str | Sequence[str], split: str = "train"):
  """A `datasets.Dataset` from globs of text/code files (`text` column, one document per
  file), JSONL files (`*.jsonl`), or hub dataset names; several sources are concatenated
  (files and hub datasets of one kind: text or records)."""
  import datasets

  sources = [sources] if isinstance(sources, str) else list(sources)
  text_files, json_files, parts = [], [], []
  for source in sources:
    paths = sorted(glob.glob(str(Path(source).expanduser()), recursive=True))
    paths = [p for p in paths if Path(p).is_file()]
    if paths:
      for path in paths:
        (json_files if path.endswith((".jsonl", ".json")) else text_files).append(path)
    elif any(ch in source for ch in "*?[") or Path(source).expanduser().exists():
      raise UserError(f"no training files match {source!r}.")
    else:
      try:
        parts.append(datasets.load_dataset(source, split=split))
      except Exception as e:  # network, missing dataset, bad split
        raise UserError(f"could not load dataset {source!r} ({type(e).__name__}: {e}).") from None
  if json_files:
    parts.insert(0, datasets.load_dataset("json", data_files=json_files, split="train"))
  if text_files:  # (undecodable bytes become U+FFFD rather than failing the whole load)
    parts.insert(0, datasets.load_dataset("text", data_files=text_files, sample_by="document", split="train",
                                          encoding_errors="replace", num_proc=_workers(len(text_files))))
  if len(parts) == 1:
    return parts[0]
  try:
    return datasets.concatenate_datasets(parts)
  except ValueError as e:
    raise UserError(f"the data sources have different columns and cannot be mixed ({e}).") from None


def _workers(files: int) -> int | None:
  """Processes for `datasets` to read many files with (None: one, for a few files)."""
  return min(os.cpu_count() or 1, 16) if files >= 1000 else None


def chat_tokens(tokenizer, messages: list[dict]) -> tuple[list[int], list[bool]]:
  """A conversation rendered with the chat template, and which tokens the assistant wrote
  (found by character spans, so tokenization across turn boundaries does not matter)."""
  render = lambda msgs, prompt: tokenizer.apply_chat_template(  # noqa: E731
      msgs, tokenize=False, add_generation_prompt=prompt)
  text = render(messages, False)
  spans = [(len(render(messages[:i], True)), len(render(messages[: i + 1], False)))
           for i, message in enumerate(messages) if message["role"] == "assistant"]
  encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
  targets = [any(start <= a < end for start, end in spans) for a, _ in encoded["offset_mapping"]]
  return list(encoded["input_ids"]), targets


def record_tokens(tokenizer, records: dict[str, list]) -> list[tuple[list[int], list[bool]]]:
  """(tokens, targets) of each record in a batch of records (columns -> lists); plain
  documents are tokenized together, which runs in parallel in the fast tokenizer."""
  count = len(next(iter(records.values())))
  rows = [{name: column[i] for name, column in records.items()} for i in range(count)]
  # (`datasets` gives every record every column of the file, None where absent.)
  texts = {i: r.get("text") for i, r in enumerate(rows)
           if r.get("messages") is None and (r.get("prompt") is None or r.get("response") is None)}
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
      out.append(chat_tokens(tokenizer, [{"role": "user", "content": record["prompt"]},
                                         {"role": "assistant", "content": record["response"]}]))
  return out


def pack(records, tokenizer, length: int, eos_id: int, max_tokens: int | None = None, seed: int = 0,
         batch: int = 256) -> Packed:
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


def batches(data: Packed, batch: int, seed: int, start: int = 0, host: int = 0, hosts: int = 1,
            ) -> Iterator[tuple[np.ndarray, np.ndarray]]:
  """This host's batches [batch, length] from batch index `start` on, epoch after epoch:
  rows in a seeded order per epoch, host h taking every `hosts`-th row. The same seed and
  start always give the same batches, so a resumed run sees the data an uninterrupted one
  would."""
  per_epoch = len(data.tokens) // hosts // batch
  if per_epoch == 0:
    raise UserError(f"{len(data.tokens)} rows cannot fill a batch of {batch} on each of {hosts} hosts.")
  index = start
  while True:
    epoch, position = divmod(index, per_epoch)
    order = np.random.default_rng([seed, epoch]).permutation(len(data.tokens))[host::hosts]
    rows = order[position * batch : (position + 1) * batch]
    yield data.tokens[rows], data.loss_mask[rows]
    index += 1
