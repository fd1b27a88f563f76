"""Files written whole or not at all."""

import pytest

from longspec_jax import files


def test_a_file_is_replaced_whole_and_no_temporary_is_left(tmp_path):
  path = tmp_path / "sub" / "table.json"
  files.write_whole(path, "old")
  files.write_whole(path, "new")
  assert path.read_text() == "new" and [p.name for p in path.parent.iterdir()] == ["table.json"]


def test_a_failed_write_keeps_the_old_file(tmp_path, monkeypatch):
  path = tmp_path / "table.json"
  files.write_whole(path, "old")

  def fail(*_):
    raise OSError("disk full")

  monkeypatch.setattr(files.os, "replace", fail)
  with pytest.raises(OSError):
    files.write_whole(path, "new")
  assert path.read_text() == "old" and [p.name for p in tmp_path.iterdir()] == ["table.json"]
