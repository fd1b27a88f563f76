"""Batch files: records read and checked line by line, results appended and resumed."""

import json

import pytest

from infer.batch_file import Output, read_records
from longspec_jax.errors import UserError


def write(path, *lines):
  path.write_text("".join(line + "\n" for line in lines))
  return path


def test_records_keep_their_fields_and_lines(tmp_path):
  path = write(
    tmp_path / "in.jsonl",
    json.dumps({"prompt": "a", "id": 7, "tag": [1]}),
    "",  # (blank lines are skipped, the numbering goes on)
    json.dumps({"prompt": "b", "chat": True, "max_new_tokens": 5, "seed": 3}),
  )
  first, second = read_records(path)
  assert (first.line, first.prompt, first.fields["tag"], first.key) == (1, "a", [1], ("id", "7"))
  assert (second.line, second.key) == (3, ("line", 3))
  assert (second.chat(False), second.max_new_tokens(64), second.seed(0)) == (True, 5, 3)
  assert (first.chat(True), first.max_new_tokens(64), first.seed(9)) == (True, 64, 9)  # (the flags' defaults)


@pytest.mark.parametrize(
  "lines, message",
  [
    ([], "holds no records"),
    (["", "  "], "holds no records"),
    (['{"prompt": "a"}', "{oops"], "line 2 is not JSON"),
    (['["a"]'], "line 1 is not a JSON object"),
    (['{"text": "a"}'], 'line 1 has no "prompt"'),
    (['{"prompt": ""}'], '"prompt" must be a non-empty string'),
    (['{"prompt": 3}'], '"prompt" must be a non-empty string'),
    (['{"prompt": "a", "chat": "yes"}'], '"chat" must be true or false'),
    (['{"prompt": "a", "max_new_tokens": 0}'], '"max_new_tokens" must be an integer >= 1, got 0'),
    (['{"prompt": "a", "max_new_tokens": true}'], '"max_new_tokens" must be an integer >= 1'),
    (['{"prompt": "a", "seed": 1.5}'], '"seed" must be an integer'),
    (['{"prompt": "a", "temperature": -0.5}'], '"temperature" must be a number >= 0'),
    (['{"prompt": "a", "top_p": 0}'], '"top_p" must be a number in (0, 1]'),
    (['{"prompt": "a", "top_p": "high"}'], '"top_p" must be a number in (0, 1]'),
    (['{"prompt": "a", "id": "x"}', '{"prompt": "b", "id": "x"}'], 'line 2: its "id" repeats line 1\'s'),
  ],
)
def test_a_bad_record_is_one_sentence_naming_its_line(tmp_path, lines, message):
  with pytest.raises(UserError, match=message.replace("(", r"\(").replace("[", r"\[")):
    read_records(write(tmp_path / "in.jsonl", *lines))


def test_a_missing_input_is_one_sentence(tmp_path):
  with pytest.raises(UserError, match="does not exist"):
    read_records(tmp_path / "none.jsonl")


def test_the_output_resumes_and_drops_a_line_cut_off(tmp_path):
  path = tmp_path / "out.jsonl"
  output = Output(path)
  assert output.done == set()
  output.append([{"id": "a", "line": 1, "text": "x"}, {"line": 2, "text": "y"}])
  output.close()
  with path.open("a") as f:
    f.write('{"line": 3, "te')  # (a write cut off by a crash)
  again = Output(path)
  assert again.done == {("id", '"a"'), ("line", 2)}
  again.append([{"line": 3, "text": "z"}])
  again.close()
  assert [json.loads(line)["line"] for line in path.read_text().splitlines()] == [1, 2, 3]


def test_an_unwritable_or_foreign_output_is_one_sentence(tmp_path):
  with pytest.raises(UserError, match="cannot write the output"):
    Output(tmp_path)  # (a directory)
  with pytest.raises(UserError, match="cannot write the output"):
    Output(tmp_path / "no" / "such" / "dir" / "out.jsonl")
  foreign = write(tmp_path / "foreign.jsonl", "not json")
  with pytest.raises(UserError, match="holds a line that is not JSON"):
    Output(foreign)
  keyless = write(tmp_path / "keyless.jsonl", '{"text": "x"}')
  with pytest.raises(UserError, match='neither "id" nor "line"'):
    Output(keyless)
