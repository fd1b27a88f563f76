"""`python -m infer.generate`: generate text from a prompt with the target model.

Text streams to stdout as it is made; a progress line goes to stderr; with --json the
last stdout line is one JSON object with the token ids and timing statistics. With
--input, the prompts of a JSON Lines file are decoded in batches and their results
appended to --output (`infer.batch_file`).
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from pathlib import Path

from infer import batch_file, decoder
from infer.cli import (
  CompileNotice,
  add_copy_flags,
  add_draft_vocab_flag,
  add_past_flag,
  add_sampling_flags,
  add_tree_flags,
  encode_prompt,
  plural,
  read_prompt,
  sparse_fraction,
)
from longspec_jax.cli import (
  ArgumentParser,
  add_attention_flag,
  add_batch_invariant_flag,
  add_devices_flag,
  attention_impl,
  check_batch_invariant,
  device_mesh,
  method_type,
  positive_int,
  run_main,
)
from longspec_jax.errors import UserError
from longspec_jax.methods.registry import Method
from longspec_jax.weights import default

BATCH = 8  # --input's prompts decoded together by default
CHUNK_SECONDS = 0.2  # --input: rounds between two looks at which records finished


def parse_args(argv=None):
  p = ArgumentParser(prog="python -m infer.generate", description=__doc__.splitlines()[0])
  src = p.add_mutually_exclusive_group(required=True)
  src.add_argument("--prompt", help="the prompt text")
  src.add_argument("--prompt-file", help="read the prompt from this file ('-' = stdin)")
  src.add_argument(
    "--input",
    type=Path,
    help='a JSON Lines file of prompts, one object a line: {"prompt": ..., "chat": bool, "max_new_tokens":'
    ' int, "seed": int, "temperature": float, "top_p": float, "id": ...} (all but prompt optional; the flags'
    " give the rest), decoded in batches",
  )
  p.add_argument(
    "--output",
    type=Path,
    help="with --input: the JSON Lines file each record's result is appended to as it finishes (its"
    " fields, line, text, token_ids and stats); records already in it are skipped, so a rerun resumes",
  )
  p.add_argument(
    "--batch",
    type=positive_int,
    help=f"with --input: records decoded together, each joining as another finishes (default {BATCH})",
  )
  p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
  p.add_argument("--target", default=default.NAME, help=f"'{default.NAME}' (default), a HF model dir, or a .gguf file")
  p.add_argument(
    "--draft",
    help="draft for longspec, glide, tokenswift and auto: 'default' (shipped for the target; the draft"
    " methods' default), 'random', 'none', or a checkpoint dir (glide: a GLIDE draft; tokenswift:"
    " TokenSwift's heads, `train.run --draft-kind tokenswift`); auto uses one only when named",
  )
  p.add_argument(
    "--method",
    type=method_type,
    choices=list(Method),
    default=Method.AUTO,
    help="decoding method; auto (default) chooses each round among AR, prompt lookup's continuations"
    " and, with --draft, the draft's tree, by their measured cost and recent gain",
  )
  add_tree_flags(p)
  add_draft_vocab_flag(p)
  add_copy_flags(p)
  add_past_flag(p)
  p.add_argument("--max-new-tokens", type=positive_int, default=256, help="tokens to generate at most")
  p.add_argument(
    "--sparse-verify",
    type=sparse_fraction,
    metavar="P",
    help="longspec, glide: verify each tree reading, per KV head, only the chunks of the cache that hold"
    " P of the draft's cross-attention (SpecAttn; the first two layers read everything). LOSSY:"
    " outputs then differ from the target's own (SmolLM2, P = 0.95: 16-25%% of the K/V read for"
    " +9-43%% perplexity; docs/results.md). Off by default",
  )
  add_sampling_flags(p)
  p.add_argument("--dtype", choices=("float32", "bfloat16"), help="default: bfloat16 on GPU, float32 on CPU")
  add_attention_flag(p)
  add_batch_invariant_flag(p)
  add_devices_flag(p)
  p.add_argument("--json", action="store_true", help="end stdout with one JSON line of results")
  args = p.parse_args(argv)
  if args.input is not None and args.output is None:
    p.error("--input needs --output, the file its results are appended to")
  if args.input is None:
    for flag, value in (("--output", args.output), ("--batch", args.batch)):
      if value is not None:
        p.error(f"{flag} goes with --input")
  if args.input is not None and args.json:
    p.error("--json prints one prompt's results; with --input each record's are in --output")
  if args.method in (Method.AR, Method.PLD):
    copy_flags = (("--copy-tokens", args.copy_tokens or None), ("--copy-matches", args.copy_matches))
    for flag, value in (
      ("--draft", args.draft),
      ("--tree-widths", args.tree_widths),
      *(copy_flags if args.method is Method.AR else ()),
    ):
      if value is not None and value != "none":
        p.error(f"--method {args.method} uses no draft tree, but {flag} was given")
  if args.draft == "none" and args.method.needs_draft:
    p.error(f"--method {args.method} needs a draft, but --draft none was given")
  check_batch_invariant(p, args)
  if args.sparse_verify is not None and not args.method.reads_sparsely:
    p.error(
      "sparse verification selects what the target reads from a draft's cross-attention: --method longspec or"
      f" glide, not {args.method}"
    )
  if args.draft == "none" and args.tree_widths:
    p.error("--tree-widths shapes a draft's tree, but --draft none was given")
  return args


class TextStream:
  """Decodes the growing token list and writes only the new text (multi-byte safe)."""

  def __init__(self, tokenizer):
    self.tokenizer = tokenizer
    self.ids: list[int] = []
    self.written = ""

  def __call__(self, chunk) -> None:
    from longspec_jax.engine import PAD_ID

    self.ids.extend(int(t) for t in chunk[0] if t != PAD_ID)
    text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
    if text.endswith("\ufffd"):  # an incomplete UTF-8 sequence: wait for the next token
      return
    sys.stdout.write(text[len(self.written) :])
    sys.stdout.flush()
    self.written = text


def json_stats(stats) -> dict:
  """The engine's stats under the JSON's documented names (rounds are `steps`)."""
  import dataclasses

  record = dataclasses.asdict(stats)
  record["steps"] = record.pop("rounds")
  record["acceptance_by_depth"] = stats.acceptance_by_depth
  return record


class PrefillBar:
  """A tqdm bar on stderr for prefill, shown only when prefill runs in more than one chunk
  (an `on_prefill` callback for `engine.generate`)."""

  def __init__(self):
    self.bar = None

  def __enter__(self):
    return self

  def __call__(self, done: int, total: int) -> None:
    from tqdm import tqdm

    if self.bar is None:
      if done >= total:
        return
      self.bar = tqdm(total=total, desc="prefill", unit="tok", file=sys.stderr, leave=False)
    self.bar.update(done - self.bar.n)

  def __exit__(self, *exc):
    if self.bar is not None:
      self.bar.close()


def main(argv=None) -> None:
  args = parse_args(argv)
  if args.input is not None:
    records = batch_file.read_records(args.input)
    output = batch_file.Output(args.output)  # (unwritable: said now, before the weights load)
    todo = [r for r in records if r.key not in output.done]
    if len(todo) < len(records):
      print(
        f"skipping {plural(len(records) - len(todo), 'record')} of {len(records)} already in {args.output}",
        file=sys.stderr,
      )
    if not todo:
      return
  else:
    prompt_text = read_prompt(args.prompt, args.prompt_file)
  mesh = device_mesh(args.devices)  # (before JAX runs anything: a CPU's devices are made for it)
  import jax
  import jax.numpy as jnp  # after argument checks: bad flags fail fast

  from longspec_jax import backend
  from longspec_jax.engine import check_capacity, generate
  from longspec_jax.weights import load_tokenizer, read_target_config, resolve_target

  method = args.method
  # Everything the prompt and flags can get wrong is checked before the weights load.
  path = resolve_target(args.target)
  config = read_target_config(path)
  tokenizer = load_tokenizer(path)
  if args.input is not None:
    prompts = [encode_prompt(tokenizer, r.prompt, r.chat(args.chat)) for r in todo]
    for record, prompt in zip(todo, prompts):
      try:
        check_capacity(config, [prompt], record.max_new_tokens(args.max_new_tokens))
      except UserError as e:
        raise UserError(f"{args.input} line {record.line}: {e}") from None
  else:
    prompt = encode_prompt(tokenizer, prompt_text, args.chat)
    check_capacity(config, [prompt], args.max_new_tokens)
  together = 1 if args.input is None else min(args.batch or BATCH, len(todo))  # (sequences decoded at once)
  plan = decoder.check_flags(args, config, together)
  t0 = time.perf_counter()
  devices = f", over {args.devices} devices" if args.devices > 1 else ""
  print(f"loading target {args.target} ({jnp.dtype(plan.dtype).name}{devices}) ...", file=sys.stderr, flush=True)
  notice = CompileNotice(backend.keep_compiled_programs())
  with notice, jax.set_mesh(mesh):  # (with --devices: the weights placed split, the programs traced for it)
    loaded = decoder.load(args, plan, path, tokenizer)
    decoder.fill_past(args, loaded)
    target, decoding, draft_params, sparse = loaded.target, loaded.decoding, loaded.draft_params, loaded.sparse
    what = plural(len(todo), "record") if args.input is not None else f"prompt {plural(len(prompt), 'token')}"
    print(f"loaded in {time.perf_counter() - t0:.1f} s; {what}; method {method}", file=sys.stderr, flush=True)
    if args.input is not None:
      decode_file(args, target, decoding, draft_params, todo, prompts, output)
      return
    stream = TextStream(target.tokenizer)
    with PrefillBar() as on_prefill:
      result = generate(
        target.model,
        [prompt],
        args.max_new_tokens,
        decoding,
        draft_params,
        seed=args.seed,
        on_tokens=stream,
        on_prefill=on_prefill,
      )
  stats = result.stats
  print(file=sys.stdout)
  print(
    f"[{method}] {plural(stats.num_new_tokens, 'token')}, {stats.tokens_per_second:.1f} tokens/s decode,"
    f" {stats.end_to_end_tokens_per_second:.1f} end to end, first token after"
    f" {stats.time_to_first_token_seconds:.2f} s, tau {stats.mean_accepted_length:.2f}"
    + (
      f", K/V read {100 * stats.kv_fraction_read:.0f}% (sparse verification: output differs from the target's)"
      if sparse
      else ""
    )
    + (f"; rounds {', '.join(f'{k} {n}' for k, n in stats.rounds_by_kind.items())}" if stats.rounds_by_kind else ""),
    file=sys.stderr,
  )
  if args.json:
    token_ids = result.token_ids[0]
    record = {
      "method": method.value,
      **json_stats(stats),
      "target": args.target,
      "dtype": jnp.dtype(plan.dtype).name,
      "attention": attention_impl(args.attention).value,
      "batch_invariant": args.batch_invariant,
      "devices": args.devices,
      "draft": plan.draft,
      **loaded.proposer.describe(),
      "sparse_verify": None if sparse is None else dataclasses.asdict(sparse),
      "sampling": dataclasses.asdict(plan.sampling),
      "prompt_tokens": len(prompt),
      "text": target.tokenizer.decode(token_ids, skip_special_tokens=True),
      "token_ids": token_ids,
    }
    print(json.dumps(record))


def decode_file(args, target, decoding, draft_params, records, prompts, output) -> dict:
  """Decodes `records` (their token ids: `prompts`) in `args.batch` slots (continuous
  batching: a record joins as another finishes, in the slot whose cache holds the most of
  its prompt, so records over one document prefill it once), appending each record's
  result to `output` as it finishes. Returns the tokens generated, the seconds taken (the
  slots opened, every prefill included), the seconds of those spent prefilling, and for
  `auto` its rounds by kind and their prices."""
  from tqdm import tqdm

  from longspec_jax.batching import Slots
  from longspec_jax.engine import cache_length

  limits = [r.max_new_tokens(args.max_new_tokens) for r in records]
  positions = cache_length(prompts, limits, decoding.proposer)
  own = any(r.samples_its_own_way for r in records)  # (each record then carries its own temperature and top-p)
  batch = min(args.batch or BATCH, len(records))
  slots = Slots.open(target.model, decoding, draft_params, batch, positions, per_sequence_sampling=own)
  waiting, running, tokens, prefilling, started = list(range(len(records))), {}, 0, 0.0, time.perf_counter()

  def finish(slot: int) -> None:
    nonlocal tokens
    index, admitted_at = running.pop(slot)
    record, seconds = records[index], time.perf_counter() - admitted_at
    ids = slots.tokens[slot][len(prompts[index]) :]  # (what it emitted)
    stats = slots.sequence_stats(slot)
    slots.release(slot)
    output.append(
      [
        {
          **record.fields,
          "line": record.line,
          "method": args.method.value,
          "prompt_tokens": len(prompts[index]),
          "text": target.tokenizer.decode(ids, skip_special_tokens=True),
          "token_ids": ids,
          **{("steps" if k == "rounds" else k): v for k, v in stats.items()},
          "seconds": seconds,  # (from its admission, its prefill included, beside the others in the batch)
          "tokens_per_second": len(ids) / seconds,
        }
      ]
    )
    tokens += len(ids)
    bar.update(1)

  with tqdm(total=len(records), desc="records", unit="record", file=sys.stderr) as bar:
    while waiting or running:
      while waiting and slots.free:
        admitting = time.perf_counter()
        group = slots.groupable([prompts[i] for i in waiting[: len(slots.free)]])
        if not group:  # (alone, from what its slot holds of its prompt)
          slot = slots.choose(prompts[waiting[0]])
          index, record = waiting[0], records[waiting.pop(0)]
          sampling = dict(temperature=record.temperature(), top_p=record.top_p()) if own else {}
          admitted = {slot: slots.admit(slot, prompts[index], limits[index], record.seed(args.seed), **sampling)}
          indices = {slot: index}
        else:  # (as many as there are free slots, in one prefill)
          indices = dict(zip(slots.free, waiting[:group]))
          del waiting[:group]
          chosen = [records[i] for i in indices.values()]
          sampling = (
            dict(temperatures=[r.temperature() for r in chosen], top_ps=[r.top_p() for r in chosen]) if own else {}
          )
          admitted = dict(
            zip(
              indices,
              slots.admit_together(
                list(indices),
                [prompts[i] for i in indices.values()],
                [limits[i] for i in indices.values()],
                [r.seed(args.seed) for r in chosen],
                **sampling,
              ),
            )
          )
        prefilling += time.perf_counter() - admitting  # (it waits for the first tokens)
        for slot, index in indices.items():
          running[slot] = (index, time.perf_counter())
          if admitted[slot].done:
            finish(slot)
      if not running:
        continue
      _, done = slots.step(CHUNK_SECONDS)
      for slot in [slot for slot in running if done[slot]]:
        finish(slot)
  output.close()
  seconds = time.perf_counter() - started
  kinds = slots.kind_stats()
  print(
    f"[{args.method}] {plural(len(records), 'record')}, {plural(tokens, 'token')} in {seconds:.1f} s"
    f" ({tokens / seconds:.1f} tokens/s end to end)"
    + (f"; rounds {', '.join(f'{k} {n}' for k, n in kinds['rounds_by_kind'].items())}" if kinds else "")
    + f"; appended to {args.output}",
    file=sys.stderr,
  )
  return {"tokens": tokens, "seconds": seconds, "prefill_seconds": prefilling, **kinds}


if __name__ == "__main__":
  run_main(main, "python -m infer.generate")
