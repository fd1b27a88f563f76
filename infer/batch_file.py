"""Batch files for `python -m infer.generate --input ... --output ...`: JSON Lines in, JSON
Lines out, one record a prompt.

An input record is an object with a `prompt` (text) and optionally `chat` (bool: through the
model's chat template), `max_new_tokens` (int >= 1), `seed` (int), `temperature` (>= 0),
`top_p` (in (0, 1]) and `id` (any JSON value, unique in the file); other fields are carried
to the output untouched. An output record is
its input's fields, its `line` in the input, and what was generated. Records are appended
and flushed as each finishes, so an interrupted run keeps every finished one; a run
with the same output skips the records already there (by `id`, or by line without one).
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

from infer.cli import read_text
from longspec_jax.errors import UserError


@dataclasses.dataclass(frozen=True)
class Record:
  """One input record: its line (1-based) and its fields as read."""

  line: int
  fields: dict

  @property
  def prompt(self) -> str:
    return self.fields["prompt"]

  @property
  def key(self) -> tuple:
    """What identifies it across runs: its `id`, else its line."""
    return ("id", json.dumps(self.fields["id"], sort_keys=True)) if "id" in self.fields else ("line", self.line)

  def chat(self, default: bool) -> bool:
    return self.fields.get("chat", default)

  def max_new_tokens(self, default: int) -> int:
    return self.fields.get("max_new_tokens", default)

  def seed(self, default: int) -> int:
    return self.fields.get("seed", default)

  def temperature(self) -> float | None:
    """Its own temperature; None: the flags'."""
    return self.fields.get("temperature")

  def top_p(self) -> float | None:
    """Its own top-p; None: the flags'."""
    return self.fields.get("top_p")

  @property
  def samples_its_own_way(self) -> bool:
    return "temperature" in self.fields or "top_p" in self.fields


def _is_int(value) -> bool:
  return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
  return isinstance(value, int | float) and not isinstance(value, bool)


# The fields a record may set and what each must be.
CHECKS = {
  "prompt": (lambda v: isinstance(v, str) and v.strip() != "", "a non-empty string"),
  "chat": (lambda v: isinstance(v, bool), "true or false"),
  "max_new_tokens": (lambda v: _is_int(v) and v >= 1, "an integer >= 1"),
  "seed": (_is_int, "an integer"),
  "temperature": (lambda v: _is_number(v) and 0 <= v < float("inf"), "a number >= 0"),
  "top_p": (lambda v: _is_number(v) and 0 < v <= 1, "a number in (0, 1]"),
}


def read_records(path: Path) -> list[Record]:
  """The records of the JSON Lines file `path` (blank lines skipped), each checked; a bad
  one is a `UserError` naming its line."""
  records, lines_by_key = [], {}
  for number, line in enumerate(read_text(path, "the input").splitlines(), start=1):
    if not line.strip():
      continue
    try:
      fields = json.loads(line)
    except json.JSONDecodeError as e:
      raise UserError(f"{path} line {number} is not JSON ({e.msg}).") from None
    if not isinstance(fields, dict):
      raise UserError(f"{path} line {number} is not a JSON object.")
    if "prompt" not in fields:
      raise UserError(f'{path} line {number} has no "prompt".')
    for name, (ok, what) in CHECKS.items():
      if name in fields and not ok(fields[name]):
        raise UserError(f'{path} line {number}: "{name}" must be {what}, got {json.dumps(fields[name])[:60]}.')
    record = Record(number, fields)
    if record.key in lines_by_key:
      raise UserError(f'{path} line {number}: its "id" repeats line {lines_by_key[record.key]}\'s.')
    lines_by_key[record.key] = number
    records.append(record)
  if not records:
    raise UserError(f"the input {path} holds no records.")
  return records


class Output:
  """The output file, opened for appending: the keys of the records already in it, and
  `append` writing one record a line, flushed to disk."""

  def __init__(self, path: Path):
    self.path = path
    self.done: set[tuple] = set()
    try:
      self._cut_partial_line()
      if path.exists():
        for line in path.read_text().splitlines():
          if line.strip():
            self.done.add(_key(json.loads(line), path))
      self.file = path.open("a")
    except json.JSONDecodeError:
      raise UserError(f"the output {path} holds a line that is not JSON; give another output file.") from None
    except (OSError, UnicodeDecodeError) as e:
      raise UserError(f"cannot write the output {path} ({type(e).__name__}: {e.strerror or e}).") from None

  def _cut_partial_line(self) -> None:
    """Drops an unfinished last line (a write cut off by a crash): its record runs again."""
    if not self.path.exists() or self.path.stat().st_size == 0:
      return
    data = self.path.read_bytes()
    if not data.endswith(b"\n"):
      with self.path.open("r+b") as f:
        f.truncate(data.rfind(b"\n") + 1)

  def append(self, records: list[dict]) -> None:
    for record in records:
      self.file.write(json.dumps(record) + "\n")
    self.file.flush()
    os.fsync(self.file.fileno())

  def close(self) -> None:
    self.file.close()


def _key(record: dict, path: Path) -> tuple:
  """An output record's key (`Record.key`)."""
  if "id" in record:
    return ("id", json.dumps(record["id"], sort_keys=True))
  if "line" in record:
    return ("line", record["line"])
  raise UserError(f'the output {path} holds a record with neither "id" nor "line"; give another output file.')
