"""`python -m infer.serve`: an OpenAI-compatible HTTP server with continuous batching.

`POST /v1/completions` and `POST /v1/chat/completions` (the model's chat template), each
streaming as server-sent events with `stream: true`; `GET /v1/models`, `GET /health`.
`--max-batch` slots decode as one batch (`longspec_jax.batching.Slots`) with the method
the flags choose, a chunk of rounds computing the rows up to the last busy slot (a lone
request pays for one row, not the batch's; each count of rows is compiled at startup, for
greedy requests: the first to draw, or to cut to a top-p below 1, compiles that program
for its count once). A request waits in a bounded queue (full: HTTP 429), joins a free
slot between chunks of rounds (those waiting together in one prefill call, whose programs
for each count of requests are compiled at startup too), streams its
text as each chunk ends, and leaves when it is done, when one of its `stop` strings
appears, or when its client goes away. One thread runs the model; the HTTP side only
queues requests and reads their text. A bad request gets HTTP 400 and one sentence. On
SIGTERM the server takes no new connections, finishes the requests it holds (for up to
`--shutdown-seconds`) and exits 0. `max_tokens`, `temperature`, `top_p`, `seed` and `stop`
are per request (the sampling flags give the defaults; draws are keyed by position, so a
request's text is a function of its prompt, settings and seed whatever else the batch
holds). A response's `usage` also holds the prompt tokens its slot's cache held already
(`prompt_tokens_details.cached_tokens`) and `rounds`: the verify passes its completion
took. Every `--log-every` seconds of activity the server logs a line of load and
throughput (running and waiting requests, prompt and generated tokens a second);
`--log-level debug` adds a line per queued request, admission, chunk of rounds and
finished request, each with its time (where a burst of requests spends its wall time).
"""

import asyncio
import dataclasses
import json
import logging
import queue
import signal
import sys
import threading
import time
import uuid
from collections import deque

from infer import decoder
from infer.cli import add_copy_flags, add_draft_vocab_flag, add_past_flag, add_sampling_flags, add_tree_flags, plural
from longspec_jax.cli import (
  ArgumentParser,
  add_attention_flag,
  add_batch_invariant_flag,
  check_batch_invariant,
  method_type,
  nonnegative_float,
  positive_int,
  run_main,
)
from longspec_jax.errors import UserError
from longspec_jax.methods.registry import Method
from longspec_jax.weights import default

CHUNK_SECONDS = 0.1  # device time between two looks at the queue and two streamed pieces of text
# Requests sent at once reach an idle server's queue some milliseconds apart (each parsed
# and tokenized in turn): each waits this long for the next, so that they start in one
# prefill call (`Slots.admit_together`) instead of one after another.
GATHER_SECONDS = 0.01
# Prompt tokens a pass while other requests decode: between passes they run a chunk of rounds.
PREFILL_CHUNK = 2048
# Requests starting together are prefilled in passes padded to a power of two: how many
# arrive together follows the rounds' timing, and a program not met before compiled on the
# requests' path (1.4 s for four SmolLM2 prompts on an H200); with one width an octave,
# every count's programs are compiled at startup (`Slots.compile_group`).
GROUP_WIDTHS_PER_OCTAVE = 1

log = logging.getLogger("infer.serve")


def pass_tokens(model, prompts: int, running: bool) -> int | None:
  """Each of `prompts` prompts' tokens a prefill pass takes: while others stream
  (`running`), `PREFILL_CHUNK` over them all (a power of two each, at least 64), so that
  the others' chunks come between shorter passes; else None, the engine's. A
  batch-invariant target's passes are generate's whatever the load, so that a request's
  bits do not depend on it."""
  from longspec_jax.engine import prefill_chunk_tokens

  if not running or model.batch_invariant:
    return None
  return max(64, min(PREFILL_CHUNK, prefill_chunk_tokens(1)) >> (prompts - 1).bit_length())


@dataclasses.dataclass
class Job:
  """One request as the model thread serves it: its prompt ids, limits and stop strings,
  and the queue (on the HTTP side's event loop) its pieces of text go to, each (text,
  finish reason or None); `cancelled` once its client is gone."""

  prompt: list[int]
  max_tokens: int
  seed: int
  temperature: float | None  # None: the server's
  top_p: float | None
  stop: tuple[str, ...]
  loop: asyncio.AbstractEventLoop
  events: asyncio.Queue
  cancelled: bool = False
  reused: int = 0  # prompt tokens a slot's cache held already
  rounds: int = 0  # the target's passes its tokens took (set when it ends)
  ids: list[int] = dataclasses.field(default_factory=list)
  sent: int = 0  # characters of the text handed on

  def put(self, text: str, finish: str | None) -> None:
    """Hands (text, finish) to the HTTP side's loop; where that loop is closed (the server
    shutting down), the job is given up instead of the model thread failing."""
    try:
      self.loop.call_soon_threadsafe(self.events.put_nowait, (text, finish))
    except RuntimeError:  # (the loop is closed)
      self.cancelled = True


@dataclasses.dataclass
class Activity:
  """What the model thread did since the last stats line."""

  since: float = dataclasses.field(default_factory=time.monotonic)
  prompt_tokens: int = 0  # prefilled (a slot's cached tokens not counted)
  generated: int = 0  # tokens handed to requests
  finished: int = 0  # requests ended

  def line(self, running: int, waiting: int) -> str:
    seconds = max(time.monotonic() - self.since, 1e-9)
    return (
      f"{running} running, {waiting} waiting; prompt {self.prompt_tokens / seconds:,.0f} tokens/s, generation"
      f" {self.generated / seconds:,.0f} tokens/s, {self.finished} finished over the last {seconds:.1f} s"
    )


class Worker(threading.Thread):
  """The model thread: admits queued jobs into free slots, runs chunks of rounds, hands
  each job its new text, and frees a slot when its job is done, stopped or given up. Every
  `log_every` seconds in which something ran (None: never), a stats line (`Activity`)."""

  def __init__(self, slots, tokenizer, eos_ids, max_queue: int, log_every: float | None = None):
    super().__init__(daemon=True, name="model")
    self.slots, self.tokenizer, self.eos_ids = slots, tokenizer, set(eos_ids)
    self.queue: queue.Queue[Job] = queue.Queue(maxsize=max_queue)
    self.waiting: deque[Job] = deque()
    self.running: dict[int, Job] = {}
    self.stopping = threading.Event()
    self.log_every, self.activity = log_every, Activity()

  def submit(self, job: Job) -> bool:
    """Queues `job`; False when the queue is full."""
    try:
      self.queue.put_nowait(job)
      return True
    except queue.Full:
      return False

  @property
  def queued(self) -> int:
    return self.queue.qsize() + len(self.waiting)

  def run(self) -> None:
    while not self.stopping.is_set():
      self._log_stats()
      self._admit()
      if not self.running:
        self._wait_for_work()
        continue
      self._step()

  def _log_stats(self) -> None:
    """The stats line, where `log_every` seconds have passed and something ran in them."""
    if self.log_every is None or time.monotonic() - self.activity.since < self.log_every:
      return
    if self.activity.prompt_tokens or self.activity.generated or self.running:
      log.info(self.activity.line(len(self.running), self.queued))
    self.activity = Activity()

  def _wait_for_work(self) -> None:
    """Idle: the next job, then each arriving within `GATHER_SECONDS` of the one before,
    up to a free slot each (at most 50 ms when none comes, to look at `stopping`)."""
    try:
      self.waiting.append(self.queue.get(timeout=0.05))
    except queue.Empty:
      return
    while len(self.waiting) < len(self.slots.free):
      try:
        self.waiting.append(self.queue.get(timeout=GATHER_SECONDS))
      except queue.Empty:
        return

  def _step(self) -> None:
    """A chunk of rounds for the running jobs, sized to take about `CHUNK_SECONDS`."""
    started = time.perf_counter()
    try:
      tokens, done = self.slots.step(CHUNK_SECONDS)
    except Exception as e:  # (the model failed: every running job is told, the server goes on)
      for slot, job in list(self.running.items()):
        self._finish(slot, job, f"error: {e}")
      return
    ran, generated = len(self.running), 0
    for slot, job in list(self.running.items()):
      new = [int(t) for t in tokens[slot] if t >= 0]
      generated += len(new)
      self._hand_on(slot, job, new, bool(done[slot]))
    self.activity.generated += generated
    ms = 1e3 * (time.perf_counter() - started)
    log.debug("chunk: %s, %s in %.1f ms", plural(ran, "request"), plural(generated, "token"), ms)

  def _admit(self) -> None:
    """Queued jobs into free slots, prefilled in passes between which the running jobs go
    on: those waiting that no slot holds part of in one prefill call (`Slots.admit_together`),
    and one alone into the slot whose cache holds the most of its prompt (the conversation
    a chat's next turn extends: only the new turn is prefilled; `Slots.choose`, `admit`)."""
    while self.slots.free:
      between = self._step if self.running else None
      if self._admit_together(between):
        continue
      job = self._next()
      if job is None:
        return
      slot = self.slots.choose(job.prompt)
      started = time.perf_counter()
      try:
        admitted = self.slots.admit(
          slot,
          job.prompt,
          job.max_tokens,
          job.seed,
          temperature=job.temperature,
          top_p=job.top_p,
          prefill_chunk=pass_tokens(self.slots.model, 1, between is not None),
          between=between,
        )
      except Exception as e:  # (its prefill failed: it is told, the others go on)
        job.put("", f"error: {e}")
        continue
      job.reused = admitted.reused
      self._admitted([slot], [job], started, reused=admitted.reused)
      self._hand_on(slot, job, [admitted.first], admitted.done)

  def _admitted(self, slots: list[int], jobs: list[Job], started: float, reused: int = 0) -> None:
    """`jobs` now run in `slots`, admitted in one call begun at `started` (perf_counter)."""
    prompt_tokens = sum(len(job.prompt) for job in jobs) - reused
    self.activity.prompt_tokens += prompt_tokens
    self.activity.generated += len(jobs)  # (their first tokens)
    for slot, job in zip(slots, jobs):
      self.running[slot] = job
    log.debug(
      "admitted %s into slot%s %s: %s prefilled (%d cached) in %.1f ms, %d waiting",
      plural(len(jobs), "request"),
      "s" if len(jobs) > 1 else "",
      ", ".join(map(str, slots)),
      plural(prompt_tokens, "prompt token"),
      reused,
      1e3 * (time.perf_counter() - started),
      self.queued,
    )

  def _admit_together(self, between) -> bool:
    """The waiting jobs, as many as free slots (and a group) take, up to the first whose
    chosen slot holds part of its prompt, in one prefill call (`between` after its passes);
    fewer than two are left waiting, for `_admit`'s own path. Whether it admitted any."""
    jobs = []
    while len(jobs) < min(len(self.slots.free), self.slots.group) and (job := self._next()) is not None:
      jobs.append(job)
    group = self.slots.groupable([job.prompt for job in jobs])
    group = group if group >= 2 else 0
    self.waiting.extendleft(reversed(jobs[group:]))
    jobs = jobs[:group]
    if not jobs:
      return False
    slots = self.slots.free[: len(jobs)]
    started = time.perf_counter()
    try:
      admitted = self.slots.admit_together(
        slots,
        [job.prompt for job in jobs],
        [job.max_tokens for job in jobs],
        [job.seed for job in jobs],
        temperatures=[job.temperature for job in jobs],
        top_ps=[job.top_p for job in jobs],
        prefill_chunk=pass_tokens(self.slots.model, len(jobs), between is not None),
        between=between,
        per_octave=GROUP_WIDTHS_PER_OCTAVE,
      )
    except Exception as e:  # (their prefill failed: each is told, the server goes on)
      for job in jobs:
        job.put("", f"error: {e}")
      return True
    self._admitted(slots, jobs, started)
    for slot, job, one in zip(slots, jobs, admitted):
      self._hand_on(slot, job, [one.first], one.done)
    return True

  def _next(self) -> Job | None:
    while True:
      if self.waiting:
        job = self.waiting.popleft()
      else:
        try:
          job = self.queue.get_nowait()
        except queue.Empty:
          return None
      if not job.cancelled:
        return job

  def _hand_on(self, slot: int, job: Job, new: list[int], done: bool) -> None:
    """The job's text since the last piece, held back where a stop string may be starting
    or a character is incomplete; the slot freed when the job ends."""
    if job.cancelled:
      self._finish(slot, job, None)
      return
    job.ids += new
    text = self.tokenizer.decode(job.ids, skip_special_tokens=True)
    cut = min((i for i in (text.find(s, max(0, job.sent - len(s) + 1)) for s in job.stop) if i >= 0), default=-1)
    if cut >= 0:
      self._piece(job, text[job.sent : cut])
      self._finish(slot, job, "stop")
      return
    if done:
      self._piece(job, text[job.sent :])
      self._finish(slot, job, "stop" if job.ids[-1] in self.eos_ids else "length")
      return
    hold = max((len(s) - 1 for s in job.stop), default=0)
    end = len(text) - hold if not text.endswith("\ufffd") else len(text.rstrip("\ufffd")) - hold
    if end > job.sent:
      self._piece(job, text[job.sent : end])

  def _piece(self, job: Job, text: str) -> None:
    if text:
      job.sent += len(text)
      job.put(text, None)

  def _finish(self, slot: int, job: Job, reason: str | None) -> None:
    """Ends the job's stream, then frees its slot: what a release does besides (the gains
    `auto` learnt, the past outputs' ring) is not the client's wait."""
    job.rounds = self.slots.sequence_stats(slot)["rounds"]
    del self.running[slot]
    if reason is not None:
      job.put("", reason)
    self.slots.release(slot)
    self.activity.finished += 1
    ended = reason or "given up"
    log.debug("slot %d done (%s): %s in %s", slot, ended, plural(len(job.ids), "token"), plural(job.rounds, "round"))


def error(status: int, message: str):
  from fastapi.responses import JSONResponse

  kind = "invalid_request_error" if status == 400 else "server_error"
  return JSONResponse({"error": {"message": message, "type": kind, "code": status}}, status_code=status)


def create_app(
  worker: Worker, tokenizer, model_name: str, context: int, sampling, max_new_tokens: int, shutdown_seconds: float
):
  """The HTTP side: requests checked, queued on `worker`, answered whole or streamed (a
  stream in flight at shutdown goes on for up to `shutdown_seconds`)."""
  from fastapi import FastAPI, Request
  from fastapi.exceptions import RequestValidationError
  from pydantic import BaseModel, ConfigDict, Field
  from sse_starlette.sse import EventSourceResponse

  class StreamOptions(BaseModel):
    include_usage: bool = False

  class Common(BaseModel):
    model_config = ConfigDict(extra="allow")  # (fields this server does not use are ignored)
    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1

  class Completion(Common):
    prompt: str | list[str]

  class Message(BaseModel):
    role: str
    content: str

  class Chat(Common):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = None

  app = FastAPI(title="longspec-jax", docs_url=None, redoc_url=None)

  @app.exception_handler(RequestValidationError)
  async def invalid(_, exc: RequestValidationError):
    first = exc.errors()[0]
    if first.get("type") == "json_invalid":
      return error(400, "the request body is not valid JSON.")
    where = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
    return error(400, f"{where + ': ' if where else ''}{first.get('msg', 'invalid request')}.")

  @app.get("/health")
  async def health():
    busy = len(worker.running)
    return {"status": "ok", "slots": len(worker.slots.busy), "busy": busy, "queued": worker.queued}

  @app.get("/v1/models")
  async def models():
    return {"object": "list", "data": [{"id": model_name, "object": "model", "created": 0, "owned_by": "longspec-jax"}]}

  def check(body: Common, prompt: list[int], limit: int) -> str | None:
    """One sentence for what the server cannot serve as asked, else None."""
    if body.model != model_name:
      return f"unknown model {body.model!r}; this server serves {model_name!r}."
    if body.n != 1:
      return "n must be 1: this server writes one choice a request."
    if limit < 1:
      return f"max_tokens must be at least 1, got {limit}."
    try:
      temperature = sampling.temperature if body.temperature is None else body.temperature
      sampling.check_rows([temperature], [sampling.top_p if body.top_p is None else body.top_p])
    except UserError as e:
      return str(e)
    if not prompt:
      return "the prompt is empty."
    if len(prompt) + limit > context:
      return (
        f"the prompt ({len(prompt)} tokens) and max_tokens {limit} exceed this server's {context} positions a"
        f" request (its --context)."
      )
    return None

  async def encode(text: str, **options) -> list[int]:
    """`text`'s token ids, in a thread of its own: the tokenizer releases the GIL, so that
    requests arriving together are tokenized at once instead of one after another on the
    event loop (~13 ms each for 4,096 tokens, which spread eight requests sent at once
    over 120 ms, too far apart to start in one prefill call)."""
    return (await asyncio.to_thread(tokenizer, text, **options)).input_ids

  async def serve(request: Request, body: Common, prompt: list[int], limit: int, chat: bool, read: float):
    """The request's completion, streamed or whole; `read`: when its handler began (perf_counter)."""
    problem = check(body, prompt, limit)
    if problem:
      return error(400, problem)
    stops = () if body.stop is None else ((body.stop,) if isinstance(body.stop, str) else tuple(body.stop))
    loop = asyncio.get_running_loop()
    stops = tuple(s for s in stops if s)
    job = Job(prompt, limit, body.seed or 0, body.temperature, body.top_p, stops, loop, asyncio.Queue())
    if not worker.submit(job):
      return error(429, f"the server's queue is full ({worker.queue.maxsize} requests waiting); retry later.")
    log.debug(
      "queued a request of %s (%.1f ms after its body was read), %d waiting",
      plural(len(prompt), "prompt token"),
      1e3 * (time.perf_counter() - read),
      worker.queued,
    )
    ident, created = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}", int(time.time())
    kind = "chat.completion" if chat else "text_completion"

    def usage() -> dict:
      return {
        "prompt_tokens": len(prompt),
        "completion_tokens": len(job.ids),
        "total_tokens": len(prompt) + len(job.ids),
        "prompt_tokens_details": {"cached_tokens": job.reused},  # (the OpenAI API's name for them)
        "rounds": job.rounds,  # (ours: the verify passes the completion took; its tau: (completion - 1) / rounds)
      }

    def choice(text: str, finish: str | None, streamed: bool) -> dict:
      if not chat:
        return {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
      key = "delta" if streamed else "message"
      return {"index": 0, key: {"role": "assistant", "content": text}, "finish_reason": finish}

    if body.stream:

      async def events():
        try:
          while True:
            text, finish = await job.events.get()
            if finish is not None and finish.startswith("error"):
              yield {"data": json.dumps({"error": {"message": finish, "type": "server_error"}})}
              break
            piece = {"id": ident, "object": f"{kind}.chunk" if chat else kind, "created": created, "model": model_name}
            yield {"data": json.dumps({**piece, "choices": [choice(text, finish, True)]})}
            if finish is not None:
              if body.stream_options and body.stream_options.include_usage:  # (a last chunk, as the OpenAI API)
                yield {"data": json.dumps({**piece, "choices": [], "usage": usage()})}
              break
          yield {"data": "[DONE]"}
        finally:
          job.cancelled = True  # (a client gone mid-stream frees its slot; a finished job is gone already)

      return EventSourceResponse(events(), shutdown_grace_period=shutdown_seconds)
    parts, finish = [], None
    while finish is None:
      try:
        text, finish = await asyncio.wait_for(job.events.get(), timeout=0.5)
        parts.append(text)
      except TimeoutError:
        if await request.is_disconnected():
          job.cancelled = True
          return error(499, "the client went away.")
    if finish.startswith("error"):
      return error(500, finish)
    return {
      "id": ident,
      "object": kind,
      "created": created,
      "model": model_name,
      "choices": [choice("".join(parts), finish, False)],
      "usage": usage(),
    }

  @app.post("/v1/completions")
  async def completions(request: Request, body: Completion):
    read = time.perf_counter()
    prompts = [body.prompt] if isinstance(body.prompt, str) else body.prompt
    if len(prompts) != 1:
      return error(400, "prompt must be one string: this server writes one completion a request.")
    limit = 16 if body.max_tokens is None else body.max_tokens  # (the OpenAI API's default)
    return await serve(request, body, await encode(prompts[0]), limit, chat=False, read=read)

  @app.post("/v1/chat/completions")
  async def chat(request: Request, body: Chat):
    read = time.perf_counter()
    if not getattr(tokenizer, "chat_template", None):
      return error(400, "this server's model has no chat template; use /v1/completions.")
    messages = [{"role": m.role, "content": m.content} for m in body.messages]
    try:
      text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    except Exception as e:  # (a template that refuses these roles or their order)
      return error(400, f"the chat template refuses these messages: {e}")
    limit = body.max_completion_tokens or body.max_tokens or max_new_tokens
    return await serve(request, body, await encode(text, add_special_tokens=False), limit, chat=True, read=read)

  return app


def parse_args(argv=None):
  p = ArgumentParser(prog="python -m infer.serve", description=__doc__.splitlines()[0])
  p.add_argument("--target", default=default.NAME, help=f"'{default.NAME}' (default), a HF model dir, or a .gguf file")
  p.add_argument(
    "--draft",
    help="draft for longspec, glide, tokenswift and auto: 'default' (shipped for the target), 'random', 'none' or a"
    " checkpoint dir; auto uses one only when named",
  )
  p.add_argument("--method", type=method_type, choices=list(Method), default=Method.AUTO, help="decoding method")
  add_tree_flags(p)
  add_draft_vocab_flag(p)
  add_copy_flags(p)
  add_past_flag(p)
  add_sampling_flags(p)
  p.add_argument("--dtype", choices=("float32", "bfloat16"), help="default: bfloat16 on GPU, float32 on CPU")
  add_attention_flag(p)
  add_batch_invariant_flag(p)
  p.add_argument("--host", default="127.0.0.1", help="address to listen on")
  p.add_argument("--port", type=positive_int, default=8000, help="port to listen on")
  p.add_argument("--max-batch", type=positive_int, default=8, help="slots: requests decoded together")
  p.add_argument("--max-queue", type=positive_int, default=64, help="requests waiting for a slot; beyond: HTTP 429")
  p.add_argument(
    "--context",
    type=positive_int,
    help="positions a request may fill, prompt and new tokens (default: the model's context, at most 4096)",
  )
  p.add_argument(
    "--max-new-tokens", type=positive_int, default=256, help="a chat request's max_tokens when it gives none"
  )
  p.add_argument("--served-model-name", help="the model's name in the API (default: --target)")
  p.add_argument("--shutdown-seconds", type=positive_int, default=30, help="on SIGTERM: how long requests may finish")
  p.add_argument(
    "--log-level",
    choices=("debug", "info", "warning"),
    default="info",
    help="info: a stats line every --log-every seconds of activity; debug: also each admission, chunk and finished"
    " request",
  )
  p.add_argument(
    "--log-every", type=nonnegative_float, default=10.0, help="seconds between stats lines (0: none; default 10)"
  )
  args = p.parse_args(argv)
  args.sparse_verify, args.devices = None, 1
  if args.draft == "none" and args.method.needs_draft:
    p.error(f"--method {args.method} needs a draft, but --draft none was given")
  check_batch_invariant(p, args)
  if args.draw != "position":
    p.error("the server draws by position (--draw position): a request's temperature, top-p and seed decide its text")
  return args


def main(argv=None) -> None:
  args = parse_args(argv)
  import uvicorn

  handler = logging.StreamHandler(sys.stderr)  # (this server's lines alone: the libraries' stay at their levels)
  handler.setFormatter(logging.Formatter("%(asctime)s.%(msecs)03d %(message)s", datefmt="%H:%M:%S"))
  log.addHandler(handler)
  log.setLevel(args.log_level.upper())
  log.propagate = False

  from longspec_jax import backend
  from longspec_jax.batching import Slots
  from longspec_jax.engine import verified_size
  from longspec_jax.weights import load_tokenizer, read_target_config, resolve_target

  path = resolve_target(args.target)
  config = read_target_config(path)
  tokenizer = load_tokenizer(path)
  plan = decoder.check_flags(args, config, args.max_batch)
  context = args.context or min(config.max_position_embeddings, 4096)
  if context > config.max_position_embeddings:
    raise UserError(f"--context {context} exceeds the model's context of {config.max_position_embeddings} tokens.")
  backend.keep_compiled_programs()
  print(f"loading target {args.target} ...", file=sys.stderr, flush=True)
  began = time.perf_counter()
  loaded = decoder.load(args, plan, path, tokenizer)
  decoder.fill_past(args, loaded)
  reserved = verified_size(loaded.proposer)
  positions = -(-(context + reserved) // 128) * 128
  print(
    f"loaded in {time.perf_counter() - began:.1f} s; compiling for {args.max_batch} slots of {context} positions"
    " (a program for each count of busy rows and of requests starting together) ...",
    file=sys.stderr,
    flush=True,
  )
  began = time.perf_counter()
  slots = Slots.open(
    loaded.target.model,
    loaded.decoding,
    loaded.draft_params,
    args.max_batch,
    positions,
    per_sequence_sampling=True,
    shrink=True,
  )
  slots.compile()  # (the decode loops compiled before the first request)
  rounds_seconds, began = time.perf_counter() - began, time.perf_counter()
  for count in slots.group_counts:  # (and the prefills of requests starting together, idle or not)
    chunks = (None, pass_tokens(slots.model, count, running=True))
    slots.compile_group(count, context - 1, chunks, GROUP_WIDTHS_PER_OCTAVE)  # (a request: a new token at least)
  print(
    f"compiled the rounds in {rounds_seconds:.1f} s (with `auto`, its prices measured) and the prefills of"
    f" requests starting together in {time.perf_counter() - began:.1f} s",
    file=sys.stderr,
    flush=True,
  )
  worker = Worker(slots, tokenizer, loaded.target.config.eos_token_ids, args.max_queue, args.log_every or None)
  worker.start()
  name = args.served_model_name or args.target
  app = create_app(worker, tokenizer, name, context, plan.sampling, args.max_new_tokens, args.shutdown_seconds - 0.5)
  print(
    f"serving {name!r} on http://{args.host}:{args.port} ({args.max_batch} slots, method {args.method})",
    file=sys.stderr,
    flush=True,
  )
  # uvicorn shuts down on SIGTERM, then raises it again under the handler it found: this one
  # lets the process end as a finished run (exit 0) instead of dying by the signal.
  signal.signal(signal.SIGTERM, lambda *_: None)
  uvicorn.run(app, host=args.host, port=args.port, log_level="warning", timeout_graceful_shutdown=args.shutdown_seconds)
  worker.stopping.set()


if __name__ == "__main__":
  run_main(main, "python -m infer.serve", interruptible=False)
