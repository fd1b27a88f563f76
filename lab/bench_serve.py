"""`python -m lab.bench_serve`: the server against `infer.generate` on the same prompts.

Starts `python -m infer.serve` in a process of its own with the flags after `--`, and
streams each prompt's completion from it (`/v1/completions`, greedy unless the flags say
otherwise, its usage in the last chunk): the time from the request to the first streamed
text (the first token's time, prefill included) and the decode rate after it. One client
at a time first, each prompt after a warm-up request; then, for each `--concurrency` C
above one, C clients at once (prompts cycled), their tokens over the wall time, after C
clients with other prompts of the same length (what their groups run compiled). The server
is then stopped and the same prompts run through the library in this process, as
`infer.generate` runs them with those flags (`engine.generate`, a warm-up first): one
prompt at a time, and the C prompts as one batch; and one slot of `batching.Slots` driven
as the server's model thread drives them (the server's engine path without HTTP). Reports
per prompt the server's decode rate over `generate`'s, the slot's, its first-token time
beyond `generate`'s prefill, the tokens a round each wrote and whether the server wrote
the same text; per C the two total rates; and how long the server took from its start to
its first answer (loading and compiling). Writes JSON and a plot with `--out`, and beside
them each set's server log at `--log-level debug` (`OUT.SET.server.log`: every admission,
chunk and finished request, with its time).

  python -m lab.bench_serve --sets code --length 4096 --new-tokens 256 --concurrency 1 4 --out serve.json \\
    -- --method auto --max-batch 4
"""

from __future__ import annotations

import json
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from infer import serve
from infer.prompts import PROMPT_SETS
from longspec_jax import cli
from longspec_jax.errors import UserError

NAME = "bench"  # the served model's name
STARTUP_SECONDS = 900  # loading and compiling a large target's programs


def free_port() -> int:
  """A TCP port free on this machine now."""
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def get_json(url: str) -> dict:
  """The JSON a GET of `url` answers."""
  with urllib.request.urlopen(url, timeout=10) as response:
    return json.loads(response.read())


def stream(base: str, prompt: str, max_tokens: int) -> dict:
  """One streamed completion: its text, completion tokens (the usage the server reports
  last), seconds to the first text and to the end."""
  body = {"model": NAME, "prompt": prompt, "max_tokens": max_tokens, "stream": True}
  request = urllib.request.Request(
    f"{base}/v1/completions",
    json.dumps({**body, "stream_options": {"include_usage": True}}).encode(),
    {"content-type": "application/json"},
  )
  started, first, parts, usage = time.perf_counter(), None, [], None
  with urllib.request.urlopen(request, timeout=3600) as response:
    for line in response:
      line = line.strip()
      if not line.startswith(b"data: {"):
        continue
      event = json.loads(line[6:])
      if "error" in event:
        raise UserError(f"the server failed a request: {event['error']['message']}")
      for choice in event.get("choices", []):
        if choice["text"] and first is None:
          first = time.perf_counter()
        parts.append(choice["text"])
      usage = event.get("usage") or usage
  end = time.perf_counter()
  return {
    "text": "".join(parts),
    "tokens": usage["completion_tokens"],
    "rounds": usage["rounds"],
    "first_seconds": (first or end) - started,
    "seconds": end - started,
  }


class Server:
  """`python -m infer.serve` with `flags` in a process of its own, until `stop`, its log
  (`--log-level debug`) written to `log`."""

  def __init__(self, flags: list[str], context: int, log: Path):
    self.port = free_port()
    command = [sys.executable, "-m", "infer.serve", *flags, "--port", str(self.port)]
    command += ["--served-model-name", NAME, "--context", str(context), "--log-level", "debug"]
    with open(log, "w") as stderr:  # (the process holds its own copy of the file)
      self.process = subprocess.Popen(command, stderr=stderr, text=True)
    self.base = f"http://127.0.0.1:{self.port}"
    began = time.monotonic()
    deadline = began + STARTUP_SECONDS
    while True:
      try:
        if get_json(f"{self.base}/health")["status"] == "ok":
          self.startup_seconds = time.monotonic() - began  # (loading, compiling, up to its first answer)
          return
      except (urllib.error.URLError, ConnectionError):
        pass
      if self.process.poll() is not None:
        raise UserError(f"the server did not start: {log.read_text().strip().splitlines()[-1:]}")
      if time.monotonic() > deadline:
        self.stop()
        raise UserError(f"the server did not answer within {STARTUP_SECONDS} s.")
      time.sleep(0.5)

  def stop(self) -> None:
    if self.process.poll() is None:
      self.process.send_signal(signal.SIGTERM)
      try:
        self.process.wait(timeout=120)
      except subprocess.TimeoutExpired:
        self.process.kill()


def measure_server(
  flags,
  context: int,
  log: Path,
  warm_up: str,
  texts: list[str],
  new_tokens: int,
  concurrency: list[int],
  others: list[str],
):
  """Per prompt one client's `stream`; per C > 1, C clients at once: (tokens, wall seconds);
  and the server's startup seconds.
  `warm_up` runs first, a prompt of its own (a slot holding a measured prompt would serve
  it again from its cache); before C clients, C others at once with prompts of their own
  of the same length (`others`): the programs their groups' prefills run are compiled then,
  as generate's batch is warmed up before it is timed. The server's log goes to `log`."""
  server = Server(flags, context, log)
  try:
    stream(server.base, warm_up, new_tokens)  # (the first request's compilations)
    alone = [stream(server.base, text, new_tokens) for text in texts]
    together = {}
    for clients in (c for c in concurrency if c > 1):
      asks = [texts[i % len(texts)] for i in range(clients)]
      with ThreadPoolExecutor(clients) as pool:
        list(pool.map(lambda text: stream(server.base, text, new_tokens), others[:clients]))
        started = time.perf_counter()
        answers = list(pool.map(lambda text: stream(server.base, text, new_tokens), asks))
      together[clients] = (sum(a["tokens"] for a in answers), time.perf_counter() - started)
  finally:
    server.stop()
  return alone, together, server.startup_seconds


def slots_rates(loaded, prompts: list[list[int]], new_tokens: int) -> list[float]:
  """Each prompt's decode rate (tokens after the first a second) in one slot of
  `batching.Slots` driven as the server's model thread drives them (chunks of
  `serve.CHUNK_SECONDS`, each request's own sampling settings), in this process: the
  server's engine path without HTTP."""
  from longspec_jax.batching import Slots
  from longspec_jax.engine import verified_size

  context = max(map(len, prompts)) + new_tokens
  positions = -(-(context + verified_size(loaded.proposer)) // 128) * 128  # (as the server sizes its cache)
  slots = Slots.open(
    loaded.target.model, loaded.decoding, loaded.draft_params, 1, positions, per_sequence_sampling=True
  )
  rates = []
  for prompt in prompts:
    slots.admit(0, prompt, new_tokens)
    started = time.perf_counter()
    while not np.asarray(slots.state.done)[0]:
      slots.step(serve.CHUNK_SECONDS)
    rates.append((len(slots.tokens[0]) - len(prompt) - 1) / (time.perf_counter() - started))
    slots.release(0)
  return rates


def measure_generate(args, path, tokenizer, warm_up: str, texts: list[str], new_tokens: int, concurrency: list[int]):
  """The library as `infer.generate` runs these flags: per prompt its stats, and per C > 1
  the C prompts as one batch: (tokens, seconds end to end)."""
  from infer import decoder
  from infer.timing import warmed_up
  from longspec_jax.engine import generate
  from longspec_jax.weights import read_target_config

  plan = decoder.check_flags(args, read_target_config(path), args.max_batch)  # (the server's tree)
  loaded = decoder.load(args, plan, path, tokenizer)
  model, decoding, params = loaded.target.model, loaded.decoding, loaded.draft_params
  ids = [tokenizer(text).input_ids for text in texts]
  run = lambda batch: generate(model, batch, new_tokens, decoding, params, seed=args.seed)
  warmed_up(lambda: run([tokenizer(warm_up).input_ids]))
  alone = [run([prompt]) for prompt in ids]
  slots_alone = slots_rates(loaded, [tokenizer(warm_up).input_ids, *ids], new_tokens)[1:]
  together = {}
  for clients in (c for c in concurrency if c > 1):
    batch = [ids[i % len(ids)] for i in range(clients)]
    warmed_up(lambda: run(batch))
    stats = run(batch).stats
    together[clients] = (stats.num_new_tokens, stats.prefill_seconds + stats.decode_seconds)
  return alone, slots_alone, together


def _ratio(value: float | None) -> str:
  """A ratio as the table prints it ('-' where there is none: an answer of one token)."""
  return "-" if value is None else f"{value:.2f}"


def main(argv=None):
  argv = sys.argv[1:] if argv is None else argv
  ours, flags = (argv[: argv.index("--")], argv[argv.index("--") + 1 :]) if "--" in argv else (argv, [])
  p = cli.ArgumentParser(prog="python -m lab.bench_serve", description=__doc__.splitlines()[0])
  p.add_argument("--sets", nargs="+", choices=sorted(PROMPT_SETS), default=["code"], help="prompt sets")
  p.add_argument("--length", type=cli.positive_int, default=4096, help="prefill tokens")
  p.add_argument("--num-prompts", type=cli.positive_int, default=3, help="prompts a set")
  p.add_argument("--new-tokens", type=cli.positive_int, default=256)
  p.add_argument(
    "--concurrency", type=cli.positive_int, nargs="+", default=[1], help="clients at once (1: one after another)"
  )
  p.add_argument("--out", type=Path, help="results JSON (a PNG of them is written beside it)")
  args = p.parse_args(ours)
  if args.out:
    cli.output_path(args.out)
  if "--max-batch" not in flags:
    flags = [*flags, "--max-batch", str(max(args.concurrency))]
  server_args = serve.parse_args(flags)  # (the server's own checks, before anything runs)

  from infer import plots
  from infer.timing import environment
  from longspec_jax.weights import load_tokenizer, resolve_target

  path = resolve_target(server_args.target)
  tokenizer = load_tokenizer(path)
  rows, totals, startup = [], [], {}
  logs = None if args.out else Path(tempfile.mkdtemp(prefix="bench_serve_"))  # (the servers' logs, kept)
  for set_name in args.sets:
    # Text both sides tokenize alike: the set's prompts decoded, then read back as the server reads them.
    # The set's prompts, then the warm-up's, then those of the bursts before the timed ones.
    others = max(args.concurrency) if max(args.concurrency) > 1 else 0
    prompts = PROMPT_SETS[set_name](tokenizer, args.length, args.num_prompts + 1 + others)
    decoded = [tokenizer.decode(ids) for ids in prompts]
    texts, warm_up, bursts = decoded[: args.num_prompts], decoded[args.num_prompts], decoded[args.num_prompts + 1 :]
    context = max(len(tokenizer(text).input_ids) for text in decoded) + args.new_tokens
    measured = (warm_up, texts, args.new_tokens, args.concurrency)
    log = args.out.with_suffix(f".{set_name}.server.log") if args.out else logs / f"{set_name}.server.log"
    print(f"[{set_name}] the server ... (its log: {log})", file=sys.stderr, flush=True)
    served, served_together, startup[set_name] = measure_server(flags, context, log, *measured, bursts)
    print(f"[{set_name}] the library ...", file=sys.stderr, flush=True)
    alone, slots_alone, alone_together = measure_generate(server_args, path, tokenizer, *measured)
    for index, (server, result, slots_rate) in enumerate(zip(served, alone, slots_alone)):
      stats = result.stats
      decode_rate = (server["tokens"] - 1) / max(server["seconds"] - server["first_seconds"], 1e-9)
      rows.append(
        {
          "set": set_name,
          "prompt": index,
          "prompt_tokens": len(tokenizer(texts[index]).input_ids),
          "new_tokens": server["tokens"],
          "server_first_token_s": server["first_seconds"],
          "server_decode_tokens_per_second": decode_rate,
          "generate_first_token_s": stats.time_to_first_token_seconds,
          "generate_prefill_s": stats.prefill_seconds,
          "generate_decode_tokens_per_second": stats.tokens_per_second,
          "decode_ratio": decode_rate / stats.tokens_per_second if stats.tokens_per_second else None,
          # (the server's engine path alone: `Slots` in chunks as the model thread runs them, no HTTP)
          "slots_decode_tokens_per_second": slots_rate,
          # (tokens a verify pass: where `auto` chose other kinds of round in the server, they differ)
          "server_tau": (server["tokens"] - 1) / server["rounds"] if server["rounds"] else 1.0,
          "generate_tau": stats.mean_accepted_length,
          "first_token_beyond_prefill_ms": 1e3 * (server["first_seconds"] - stats.prefill_seconds),
          "same_text": server["text"] == tokenizer.decode(result.token_ids[0], skip_special_tokens=True),
        }
      )
    for clients, (tokens, seconds) in served_together.items():
      generated, generate_seconds = alone_together[clients]
      totals.append(
        {
          "set": set_name,
          "concurrency": clients,
          "server_tokens_per_second": tokens / seconds,
          "generate_tokens_per_second": generated / generate_seconds,
          "ratio": (tokens / seconds) / (generated / generate_seconds),
        }
      )
  ratios = [r["decode_ratio"] for r in rows if r["decode_ratio"] is not None]
  result = {
    "kind": "serve",
    **environment(),
    "argv": argv,
    "target": server_args.target,
    "method": server_args.method.value,
    "length": args.length,
    "new_tokens": args.new_tokens,
    "rows": rows,
    "concurrent": totals,
    "server_startup_seconds": startup,
    "median_decode_ratio": statistics.median(ratios) if ratios else None,
    "median_first_token_beyond_prefill_ms": statistics.median(r["first_token_beyond_prefill_ms"] for r in rows),
  }
  if args.out:
    plots.save(result, args.out)
    print(f"wrote {args.out} and {args.out.with_suffix('.png')}", file=sys.stderr)
  print(
    "set | prompt | tokens | server first s | generate prefill s | beyond ms | server tok/s | generate tok/s | x"
    " | slots tok/s | server tau | generate tau"
  )
  for r in rows:
    print(
      f"{r['set']} | {r['prompt']} | {r['new_tokens']} | {r['server_first_token_s']:.3f}"
      f" | {r['generate_prefill_s']:.3f} | {r['first_token_beyond_prefill_ms']:.1f}"
      f" | {r['server_decode_tokens_per_second']:.1f} | {r['generate_decode_tokens_per_second']:.1f}"
      f" | {_ratio(r['decode_ratio'])} | {r['slots_decode_tokens_per_second']:.1f} | {r['server_tau']:.2f}"
      f" | {r['generate_tau']:.2f}" + ("" if r["same_text"] else " | other text")
    )
  for set_name, seconds in startup.items():
    print(f"{set_name} | the server answered {seconds:.1f} s after it was started")
  for t in totals:
    print(
      f"{t['set']} | {t['concurrency']} clients | server {t['server_tokens_per_second']:.1f} tok/s | generate"
      f" {t['generate_tokens_per_second']:.1f} tok/s (one batch) | {t['ratio']:.2f}"
    )


if __name__ == "__main__":
  cli.run_main(main, "python -m lab.bench_serve")
