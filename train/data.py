"""Training data: documents or chat records -> packed fixed-length token rows with loss
masks, in a deterministic order, split across hosts.

Sources go through `datasets`: local text/code globs (one document per file), JSONL
files, or a hub dataset name. Plain documents are tokenized, joined with EOS and cut into
rows of `length` tokens (every token is a target). Chat records (`messages` lists, or
`prompt`/`response` pairs) are rendered with the tokenizer's chat template and only the
assistant's tokens are targets.
"""

from __future__ import annotations

import dataclasses
import glob
from pathlib import Path
from typing import Iterator

import numpy as np

from longspec_jax.errors import UserError


@dataclasses.dataclass(frozen=True)
class Packed:
  tokens: np.ndarray  # [N, length] int32
  loss_mask: np.ndarray  # [N, length] bool: the token is a prediction target


def load_records(source: str, split: str = "train"):
  """A `datasets.Dataset` from a glob of text/code files (`text` column, one document
  per file), JSONL files (`*.jsonl`), or a hub dataset name."""
  import datasets

  paths = sorted(glob.glob(str(Path(source).expanduser()), recursive=True))
  if paths and all(p.endswith((".jsonl", ".json")) for p in paths):
    return datasets.load_dataset("json", data_files=paths, split="train")
  if paths:
    return datasets.load_dataset("text", data_files=paths, sample_by="document", split="train")
  if any(ch in source for ch in "*?[") or Path(source).expanduser().exists():
    raise UserError(f"no training files match {source!r}.")
  try:
    return datasets.load_dataset(source, split=split)
  except Exception as e:  # network, missing dataset, bad split
    raise UserError(f"could not load dataset {source!r} ({type(e).__name__}: {e}).") from None


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


def record_tokens(tokenizer, record: dict) -> tuple[list[int], list[bool]]:
  # (`datasets` gives every record every column of the file, None where absent.)
  if record.get("messages") is not None:
    return chat_tokens(tokenizer, record["messages"])
  if record.get("prompt") is not None and record.get("response") is not None:
    return chat_tokens(tokenizer, [{"role": "user", "content": record["prompt"]},
                                   {"role": "assistant", "content": record["response"]}])
  text = record.get("text")
  if not isinstance(text, str):
    raise UserError(f"a training record needs 'text', 'messages' or 'prompt'/'response'; got keys {sorted(record)}.")
  tokens = tokenizer(text, add_special_tokens=False).input_ids
  return tokens, [True] * len(tokens)


def pack(records, tokenizer, length: int, eos_id: int) -> Packed:
  """Concatenates every record (EOS after each) and cuts rows of `length`; the tail that
  does not fill a row is dropped."""
  stream, targets = [], []
  for record in records:
    tokens, mask = record_tokens(tokenizer, record)
    stream += tokens + [eos_id]
    targets += mask + [mask[-1] if mask else False]  # EOS is a target where the record's end is
  rows = len(stream) // length
  if rows == 0:
    raise UserError(f"the data holds {len(stream)} tokens, fewer than one row of {length}.")
  cut = rows * length
  return Packed(tokens=np.asarray(stream[:cut], np.int32).reshape(rows, length),
                loss_mask=np.asarray(targets[:cut], bool).reshape(rows, length))


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
