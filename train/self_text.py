"""`python -m train.self_text`: the target's own text, to train a draft on.

A draft predicts what the target will write, so its last stage of training should read
the target's own writing, as the LongSpec paper's final stage trains on its target's
long answers. This takes documents of a corpus (`train.corpus`'s JSONL, or any `--data`
that `train.data` reads), and for each either continues a prefix of it (plain text, as
the target would go on) or asks the target, through its chat template, one of a few
instructions about it (summarize, explain, list the main points, answer a question), and
writes what the target generated with this project's engine (`--method`: `auto` by
default, lossless, so the text is the target's) greedily and sampled (`--temperatures`,
one per batch in turn). Records go to a JSONL file batch by batch: a crash keeps what
was written, `--resume` goes on from it and `--time-limit` stops between batches.
Continuations are `{"text": prefix + continuation}`, answers `{"messages": [user,
assistant]}`, each with its `domain`, `source`, `temperature` and `kind`; both forms
train with `train.run --stage sft --data FILE` (loss on the assistant's tokens of
answers, on every token of continuations).

  python -m train.self_text --data corpus/train.jsonl --out self.jsonl --samples 2000 --new-tokens 512
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from longspec_jax.cli import (
  ArgumentParser,
  method_type,
  nonnegative_float,
  output_path,
  positive_float,
  positive_int,
  resolve_dtype,
  run_main,
)
from longspec_jax.errors import UserError
from longspec_jax.methods.registry import Method

INSTRUCTIONS = (
  "Summarize this document.",
  "What is this text about? Answer in a few sentences.",
  "List the main points of this text.",
  "Which questions does this text answer? Answer them briefly.",
)
CODE_INSTRUCTIONS = (
  "Explain what this code does.",
  "Summarize this source file.",
  "List the functions or definitions in this code and what each one is for.",
  "How would you use this code? Give a short example.",
)
CODE_DOMAINS = {"python", "c_cpp", "shell", "javascript", "go", "rust", "java", "ruby", "lua", "sql"}


def parse_args(argv=None):
  p = ArgumentParser(prog="python -m train.self_text", description=__doc__.splitlines()[0])
  p.add_argument("--data", nargs="+", required=True, help="the documents: JSONL with 'text' (train.corpus), or files")
  p.add_argument("--out", type=Path, required=True, help="the JSONL file to write")
  p.add_argument("--overwrite", action="store_true", help="replace --out if it exists")
  p.add_argument(
    "--resume",
    action="store_true",
    help="continue --out: keep its records, skip the documents they used, write the rest",
  )
  p.add_argument("--time-limit", type=positive_float, help="seconds: stop after the first batch past this")
  p.add_argument(
    "--target",
    default="smollm2-135m",
    help="'smollm2-135m' (the embedded default), a Hugging Face model directory, or a .gguf file",
  )
  p.add_argument(
    "--method",
    type=method_type,
    choices=list(Method),
    default=Method.AUTO,
    help="how the engine decodes (all are lossless)",
  )
  p.add_argument(
    "--draft",
    help="for longspec, glide (a GLIDE draft) and auto: 'default' (longspec's and glide's"
    " default), a checkpoint dir; auto uses one only when named",
  )
  p.add_argument("--samples", type=positive_int, default=1000, help="records to write")
  p.add_argument("--prompt-tokens", type=positive_int, default=1024, help="document tokens in each prompt, at most")
  p.add_argument("--new-tokens", type=positive_int, default=512, help="tokens the target writes per record, at most")
  p.add_argument(
    "--chat-share",
    type=nonnegative_float,
    default=0.5,
    help="share of records that are answers to an instruction (the rest: continuations)",
  )
  p.add_argument(
    "--temperatures",
    type=nonnegative_float,
    nargs="+",
    default=[0.0, 0.8],
    help="sampling temperature of each batch in turn (0: greedy)",
  )
  p.add_argument("--batch", type=positive_int, default=8, help="prompts decoded together")
  p.add_argument(
    "--dtype", choices=("float32", "bfloat16"), help="compute dtype (default: bfloat16 on a GPU, float32 elsewhere)"
  )
  p.add_argument("--seed", type=int, default=0, help="document order and sampling draws")
  args = p.parse_args(argv)
  if args.chat_share > 1:
    p.error(f"--chat-share must be in [0, 1], got {args.chat_share}")
  if args.resume and args.overwrite:
    p.error("--resume continues --out and --overwrite replaces it; give one")
  return args


def prompt_for(tokenizer, text: str, domain: str | None, chat: bool, prompt_tokens: int, rng) -> tuple[list[int], dict]:
  """A prompt's token ids and the record it starts: a prefix of the document to continue,
  or an instruction about it through the chat template."""
  ids = tokenizer(text).input_ids[:prompt_tokens]
  document = tokenizer.decode(ids, skip_special_tokens=True)
  if not chat:
    return ids, {"kind": "continuation", "text": document}
  instructions = CODE_INSTRUCTIONS if domain in CODE_DOMAINS else INSTRUCTIONS
  content = f"{instructions[rng.integers(len(instructions))]}\n\n{document}"
  rendered = tokenizer.apply_chat_template(
    [{"role": "user", "content": content}], tokenize=False, add_generation_prompt=True
  )
  return tokenizer(rendered, add_special_tokens=False).input_ids, {"kind": "answer", "content": content}


def finished_record(start: dict, written: str, meta: dict) -> dict:
  if start["kind"] == "continuation":
    return {"text": start["text"] + written, **meta, "kind": "continuation"}
  return {
    "messages": [{"role": "user", "content": start["content"]}, {"role": "assistant", "content": written}],
    **meta,
    "kind": "answer",
  }


def main(argv=None) -> None:
  args = parse_args(argv)
  if args.out.exists() and not (args.overwrite or args.resume):
    raise UserError(f"{args.out} exists; pass --resume to continue it or --overwrite to replace it.")
  output_path(args.out)

  from train.data import load_records, resolve_sources

  sources = resolve_sources(args.data)
  import numpy as np

  from longspec_jax.decoding.sampling import SamplingConfig
  from longspec_jax.engine import Decoding, check_capacity, generate
  from longspec_jax.methods.factory import make_proposer
  from longspec_jax.weights import load_target, read_target_config, resolve_target
  from longspec_jax.weights.drafts import load_draft, resolve_draft

  path = resolve_target(args.target)
  config = read_target_config(path)
  room = args.prompt_tokens + 64  # (the chat template's and the instruction's tokens)
  check_capacity(config, [[0] * room], args.new_tokens)
  spec = args.method.draft_spec(args.draft)
  if spec is not None:
    resolve_draft(spec, args.target, args.method.draft_kind)
  records = load_records(sources)
  if "text" not in records.column_names:
    raise UserError(f"the data has no 'text' column (columns: {', '.join(records.column_names)}).")
  target = load_target(path, resolve_dtype(args.dtype))
  if args.chat_share and not getattr(target.tokenizer, "chat_template", None):
    raise UserError("--chat-share asks for answers, but the target's tokenizer has no chat template.")
  draft = (
    load_draft(spec, target.config, target.model.dtype, args.target, kind=args.method.draft_kind)
    if spec is not None
    else None
  )
  proposer, params = make_proposer(args.method, draft)
  eos = tuple(target.config.eos_token_ids or (target.tokenizer.eos_token_id,))
  rng = np.random.default_rng(args.seed)
  order = iter(rng.permutation(len(records)))
  kept = len(args.out.read_text().splitlines()) if args.resume and args.out.exists() else 0
  written, tokens, seconds, batch_index = 0, 0, 0.0, 0
  deadline = time.perf_counter() + (args.time_limit or float("inf"))
  with open(args.out, "a" if args.resume else "w") as out:
    while written < args.samples and time.perf_counter() < deadline:
      temperature = args.temperatures[batch_index % len(args.temperatures)]
      prompts, starts = [], []
      for index in order:
        record = records[int(index)]
        if not isinstance(record.get("text"), str) or not record["text"].strip():
          continue
        ids, start = prompt_for(
          target.tokenizer,
          record["text"],
          record.get("domain"),
          rng.random() < args.chat_share,
          args.prompt_tokens,
          rng,
        )
        if len(ids) + args.new_tokens > config.max_position_embeddings:
          continue  # (a long chat template: no room)
        prompts.append(ids)
        starts.append(
          (start, {"domain": record.get("domain"), "source": record.get("source"), "temperature": temperature})
        )
        if len(prompts) == min(args.batch, args.samples - written):
          break
      if not prompts:
        break  # every document used
      if written + len(prompts) <= kept:  # (written before: the same documents, drawn again, skipped)
        written += len(prompts)
        batch_index += 1
        continue
      decoding = Decoding(proposer=proposer, sampling=SamplingConfig(temperature=temperature), eos_ids=eos)
      result = generate(target.model, prompts, args.new_tokens, decoding, params, seed=args.seed + batch_index)
      for (start, meta), ids in zip(starts, result.token_ids):
        text = target.tokenizer.decode([t for t in ids if t not in eos], skip_special_tokens=True)
        out.write(json.dumps(finished_record(start, text, {**meta, "new_tokens": len(ids)})) + "\n")
      out.flush()
      written += len(prompts)
      tokens += result.stats.num_new_tokens
      seconds += result.stats.decode_seconds
      batch_index += 1
      print(
        f"{written}/{args.samples} records, {tokens} tokens written by the target,"
        f" {tokens / max(seconds, 1e-9):.0f} tokens/s ({args.method}, tau"
        f" {result.stats.mean_accepted_length:.2f})",
        file=sys.stderr,
        flush=True,
      )
  if written < args.samples:
    why = "--time-limit" if time.perf_counter() >= deadline else "the data ran out"
    print(f"{why}: {written} of {args.samples} records in {args.out}.", file=sys.stderr)


if __name__ == "__main__":
  run_main(main, "python -m train.self_text")
