"""`python -m infer.serve` in a subprocess, asked through the official `openai` client and
raw HTTP: every answer is what `infer.generate` writes for the same prompt, alone or among
concurrent requests; bad requests get HTTP 400 and the server goes on; a client gone
mid-stream frees its slot; SIGTERM lets the request in flight finish and exits 0."""

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

from infer.generate import main as generate_main
from lab.bench_serve import free_port
from lab.bench_serve import get_json as get

from helpers import run_cli

pytestmark = pytest.mark.xdist_group("serve")  # (one worker: the module's server starts once)


def post(url: str, body: bytes) -> tuple[int, dict]:
  request = urllib.request.Request(url, body, {"content-type": "application/json"})
  try:
    with urllib.request.urlopen(request, timeout=60) as response:
      return response.status, json.loads(response.read())
  except urllib.error.HTTPError as e:
    return e.code, json.loads(e.read())


@pytest.fixture(scope="module")
def server(tiny_with_tokenizer):
  port = free_port()
  command = [sys.executable, "-m", "infer.serve", "--target", str(tiny_with_tokenizer), "--port", str(port)]
  process = subprocess.Popen(
    [*command, "--max-batch", "4", "--max-queue", "16", "--served-model-name", "tiny"],
    stderr=subprocess.PIPE,
    text=True,
  )
  base = f"http://127.0.0.1:{port}"
  deadline = time.monotonic() + 300
  while True:
    try:
      assert get(f"{base}/health")["status"] == "ok"
      break
    except (urllib.error.URLError, ConnectionError):
      if process.poll() is not None or time.monotonic() > deadline:
        raise AssertionError(f"the server did not start: {process.stderr.read()}") from None
      time.sleep(0.5)
  yield process, base
  if process.poll() is None:
    process.kill()


@pytest.fixture(scope="module")
def client(server):
  from openai import OpenAI

  return OpenAI(base_url=f"{server[1]}/v1", api_key="none")


def alone(target, prompt: str, tokens: int, chat: bool = False, flags: tuple[str, ...] = ()) -> str:
  """What `infer.generate` writes for `prompt` (with more of its `flags`)."""
  import io
  from contextlib import redirect_stdout

  out = io.StringIO()
  with redirect_stdout(out):
    argv = ["--target", str(target), "--prompt", prompt, "--max-new-tokens", str(tokens), "--json"]
    argv += ["--chat"] if chat else []
    assert run_cli(generate_main, argv + list(flags), "python -m infer.generate") == 0
  return json.loads(out.getvalue().strip().splitlines()[-1])["text"]


PROMPTS = ["def main():", "The quick brown fox", "import numpy as np\n", "Once upon a time", "x = 1\ny = 2\n"]


def test_completions_chat_and_streams_write_what_generate_writes(server, client, tiny_with_tokenizer):
  assert [m.id for m in client.models.list().data] == ["tiny"]
  completion = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=9)
  assert completion.choices[0].text == alone(tiny_with_tokenizer, PROMPTS[0], 9)
  assert completion.choices[0].finish_reason == "length" and completion.usage.completion_tokens == 9
  chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hello"}], max_tokens=7)
  assert chat.choices[0].message.content == alone(tiny_with_tokenizer, "Hello", 7, chat=True)
  stream = client.chat.completions.create(
    model="tiny", messages=[{"role": "user", "content": "Hello"}], max_tokens=7, stream=True
  )
  pieces = [c.choices[0] for c in stream]
  assert "".join(p.delta.content or "" for p in pieces) == chat.choices[0].message.content
  assert pieces[-1].finish_reason == "length"
  streamed = list(
    client.completions.create(
      model="tiny", prompt=PROMPTS[1], max_tokens=12, stream=True, stream_options={"include_usage": True}
    )
  )
  assert "".join(c.choices[0].text for c in streamed if c.choices) == alone(tiny_with_tokenizer, PROMPTS[1], 12)
  assert streamed[-1].choices == [] and streamed[-1].usage.completion_tokens == 12  # (usage last, when asked)
  assert 1 <= streamed[-1].usage.rounds <= 11  # (the verify passes of the tokens after the first)


def test_concurrent_requests_each_write_their_own_text(server, client, tiny_with_tokenizer):
  asks = [(PROMPTS[i % len(PROMPTS)], 5 + 2 * i) for i in range(16)]  # (16 clients, 4 slots: most wait)

  def ask(prompt_tokens):
    prompt, tokens = prompt_tokens
    return client.completions.create(model="tiny", prompt=prompt, max_tokens=tokens).choices[0].text

  with ThreadPoolExecutor(16) as pool:
    answers = list(pool.map(ask, asks))
  assert answers == [alone(tiny_with_tokenizer, prompt, tokens) for prompt, tokens in asks]


def test_requests_sample_with_their_own_temperature_top_p_and_seed(server, client, tiny_with_tokenizer):
  """Sampled and greedy requests at once, each with its own settings: each writes what
  `generate` writes with them (draws keyed by position: the batch does not matter)."""
  asks = [
    (PROMPTS[i % len(PROMPTS)], 0.0 if i % 3 == 0 else 0.6 + 0.2 * i, 0.8 if i % 2 else 1.0, 10 + i) for i in range(6)
  ]

  def ask(settings):
    prompt, temperature, top_p, seed = settings
    answer = client.completions.create(
      model="tiny", prompt=prompt, max_tokens=8, temperature=temperature, top_p=top_p, seed=seed
    )
    return answer.choices[0].text

  with ThreadPoolExecutor(6) as pool:
    answers = list(pool.map(ask, asks))
  flags = lambda t, p, seed: ("--temperature", str(t), "--top-p", str(p), "--seed", str(seed))
  assert answers == [alone(tiny_with_tokenizer, prompt, 8, flags=flags(*rest)) for prompt, *rest in asks]


def test_a_stop_string_ends_the_text_before_it(server, client, tiny_with_tokenizer):
  whole = alone(tiny_with_tokenizer, PROMPTS[2], 20)
  stop = whole[len(whole) // 2 : len(whole) // 2 + 3]
  cut = client.completions.create(model="tiny", prompt=PROMPTS[2], max_tokens=20, stop=[stop]).choices[0]
  assert cut.text == whole[: whole.index(stop)] and cut.finish_reason == "stop"


def test_a_chats_next_turn_prefills_only_what_is_new(server, client):
  hello = [{"role": "user", "content": "Hello"}]
  first = client.chat.completions.create(model="tiny", messages=hello, max_tokens=6)
  answer = {"role": "assistant", "content": first.choices[0].message.content}
  turn = [*hello, answer, {"role": "user", "content": "Go on"}]
  second = client.chat.completions.create(model="tiny", messages=turn, max_tokens=4)
  assert second.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens  # (the first turn's, held)
  assert first.usage.prompt_tokens_details.cached_tokens < first.usage.prompt_tokens


@pytest.mark.parametrize(
  "path, body, message",
  [
    ("completions", b"{oops", "not valid JSON"),
    ("completions", b'{"model": "tiny"}', "prompt: Field required"),
    ("completions", b'{"model": "tiny", "prompt": "a", "max_tokens": "many"}', "max_tokens"),
    ("completions", b'{"model": "tiny", "prompt": "a", "max_tokens": 0}', "max_tokens must be at least 1"),
    ("completions", b'{"model": "gpt-4", "prompt": "a"}', "unknown model 'gpt-4'; this server serves 'tiny'"),
    ("completions", b'{"model": "tiny", "prompt": "a", "top_p": 1.5}', "top_p must be in (0, 1]"),
    ("completions", b'{"model": "tiny", "prompt": "a", "temperature": -1}', "temperature must be finite and >= 0"),
    ("completions", b'{"model": "tiny", "prompt": ["a", "b"]}', "prompt must be one string"),
    ("completions", json.dumps({"model": "tiny", "prompt": "hi " * 600}).encode(), "exceed this server's 512"),
    ("chat/completions", b'{"model": "tiny", "messages": []}', "messages"),
  ],
)
def test_a_bad_request_is_400_with_one_sentence(server, path, body, message):
  status, answer = post(f"{server[1]}/v1/{path}", body)
  assert status == 400 and message in answer["error"]["message"], answer
  assert get(f"{server[1]}/health")["status"] == "ok"


def test_a_client_gone_mid_stream_frees_its_slot(server):
  body = json.dumps({"model": "tiny", "prompt": PROMPTS[3], "max_tokens": 400, "stream": True}).encode()
  request = urllib.request.Request(f"{server[1]}/v1/completions", body, {"content-type": "application/json"})
  with urllib.request.urlopen(request, timeout=60) as response:
    assert response.readline().startswith(b"data: ")  # (it runs)
  deadline = time.monotonic() + 30
  while get(f"{server[1]}/health")["busy"]:
    assert time.monotonic() < deadline, "the slot was not freed"
    time.sleep(0.2)


def test_sigterm_lets_the_request_in_flight_finish_and_exits_0(server):
  process, base = server
  body = json.dumps({"model": "tiny", "prompt": PROMPTS[4], "max_tokens": 60, "stream": True}).encode()
  request = urllib.request.Request(f"{base}/v1/completions", body, {"content-type": "application/json"})
  with urllib.request.urlopen(request, timeout=60) as response:
    lines = [response.readline()]
    os.kill(process.pid, signal.SIGTERM)
    lines += response.read().splitlines()
  lines = [line.strip() for line in lines if line.strip()]
  events = [json.loads(line[6:]) for line in lines if line.startswith(b"data: {")]
  assert events[-1]["choices"][0]["finish_reason"] == "length" and lines[-1] == b"data: [DONE]"
  assert process.wait(timeout=60) == 0
