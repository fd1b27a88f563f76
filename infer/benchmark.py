"""`python -m infer.benchmark`: decoding methods compared on real prompt sets.

For each prompt set (`code`: complete a source file; `docs`: summarize a document) and
prefill length, every method decodes the same prompts with the same target, cache and
attention; the table gives tau (tokens per target forward, bonus included), decode
tokens/s, the speedup over AR measured in the same run decode-only and end to end (prefill
included), the split of decode time into drafting, verification and the rest, and whether
the method wrote AR's text; the JSON also holds each row's acceptance per tree depth
(`engine.acceptance_by_depth`), and with `--keep-texts` each prompt and its AR text. Each
configuration is warmed up (compiled) once before it is timed, and a timed generation that
still compiled runs again, the second run timed (the JSON keeps what it compiled). Writes
JSON with `--out`.

Methods are compared on identical text: in bfloat16 the rounds run batch-invariant by
default (every lossless method then writes AR's text, bit for bit, greedy or sampled with
the default `--draw position`), and AR with the fastest kernels runs beside as a row of
its own, `ar+fast-numerics`, the price of that; float32 needs nothing.
`--no-batch-invariant` times the fastest kernels instead, whose texts leave AR's at logit
ties (each row says where).

  python -m infer.benchmark --methods ar pld longspec --draft random --sets code docs \
      --lengths 1024 4096 7680 --out bench.json

A copying method may take its own prompt-lookup continuations, METHOD:TOKENSxMATCHES:
`--methods ar pld pld:16x4 auto` compares prompt lookup as published (one continuation of
10 tokens) with four of 16 merged as a trie, and `auto` with its defaults.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
from pathlib import Path
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from infer import plots
from infer.cli import (
  MethodSpec,
  add_copy_flags,
  add_draft_vocab_flag,
  add_sampling_flags,
  add_tree_flags,
  batch_tree_choice,
  check_tree,
  method_spec,
  sampling_config,
  sparse_fraction,
  tree_choice,
)
from infer.prompts import HELD_OUT, HELD_OUT_NAME, PROMPT_SETS, set_names
from infer.timing import Compiles, environment, phase_seconds, warmed_up
from longspec_jax import backend, cli
from longspec_jax.decoding.sampling import Draw
from longspec_jax.engine import Decoding, acceptance_by_depth, check_capacity, generate, prefill
from longspec_jax.methods.factory import make_proposer
from longspec_jax.methods.registry import Method, ProposerOptions
from longspec_jax.models.config import CapeConfig, DraftKind, SparseVerify
from longspec_jax.models.draft import Draft
from longspec_jax.ops import sharding
from longspec_jax.weights import default, load_target, load_tokenizer, read_target_config, resolve_target
from longspec_jax.weights.drafts import load_draft, resolve_draft

PHASES = ("draft_seconds", "verify_seconds", "other_seconds")


class Variant(NamedTuple):
  """One configuration a benchmark runs: its label, the method, its tree (beam widths,
  CAPE's; both None: the draft's own), prompt lookup's continuations, the draft's
  vocabulary subset (None: the draft's own) and sparse verification."""

  label: str
  method: Method
  tree: tuple[tuple[int, ...] | None, CapeConfig | None]
  copies: int | None
  matches: int | None
  vocab: int | None = None
  sparse: SparseVerify | None = None
  fast: bool = False  # the target's fastest numerics, not batch-invariant ones (the price row)
  drafted: bool = True  # False: `auto` without the named draft (its row beside auto with it)


def batches(prompts: list[list[int]], batch: int) -> list[list[list[int]]]:
  """The prompts in consecutive batches of `batch`, the last filled up by repeating the
  prompts from the first (so that every batch is full: a sweep's rows compare batch sizes,
  not leftovers)."""
  count = -(-len(prompts) // batch) * batch
  cycled = [prompts[i % len(prompts)] for i in range(count)]
  return [cycled[i : i + batch] for i in range(0, count, batch)]


def run_config(
  target, decoding: Decoding, draft_params, prompts: list[list[int]], new_tokens: int, seed: int, batch: int = 1
) -> dict:
  """One method on every prompt, `batch` prompts a generation (after warm-up runs): tau,
  tokens/s (over the batch), and the split of decode time into drafting, verification and
  the rest (the phases are timed apart from the run, on its final state,
  `infer.timing.phase_seconds`). `auto` warms up until its round prices are measured (once
  per machine and shape: they are kept on disk)."""
  groups = batches(prompts, batch)
  warmed_up(lambda: generate(target.model, groups[0], new_tokens, decoding, draft_params, seed=seed))
  stats, token_ids, phases, rounds, compiles = [], [], dict.fromkeys(PHASES[:2], 0.0), 0, []
  adaptive = decoding.multi_kind  # (its rounds differ: no one draft and verify phase)
  for group in groups:
    # Nothing runs between the generations, and none runs while another's caches are
    # held: other programs (the phases' timing, once after every prompt) move the
    # buffers, and the next generation paid a rewrite of its loop's CUDA graphs (PLD
    # 1.30 ms a round on the first prompt, ~1.6 on the others; H100, SmolLM2).
    # A generation that compiled (a program its prompt needs that the warm-up's did not)
    # timed the compiler (a 9 s stall in a 0.3 s generation: GLIDE, 7.7k, H100): it runs
    # once more, with the same seed, and that run is the one timed; the compile is kept.
    first_compile = 0.0
    for _ in range(2):
      result = None
      with Compiles() as compiled:
        result = generate(target.model, group, new_tokens, decoding, draft_params, seed=seed)
      if not compiled.seconds:
        break
      first_compile = first_compile or compiled.seconds
    stats.append(result.stats)
    compiles.append((first_compile, compiled.seconds))
    token_ids += result.token_ids
    rounds += int(result.state.rounds)
  if not adaptive:  # (the prompts are of about one length: the last one's round stands for all)
    per_round = phase_seconds(target.model, decoding, draft_params, result.state)
    for phase, seconds in zip(PHASES[:2], per_round):
      phases[phase] = seconds * rounds
  del result  # (its caches)
  decode = sum(s.decode_seconds for s in stats)
  # The phases' sum can exceed the run's decode time by timing noise; shares are of the
  # larger of the two, so each lies in [0, 1] and they sum to 1.
  whole = max(decode, sum(phases.values()))
  phases[PHASES[2]] = whole - sum(phases.values())
  kinds = [s.rounds_by_kind for s in stats if s.rounds_by_kind]
  return {
    **(
      {
        "rounds_by_kind": {kind: sum(k[kind] for k in kinds) for kind in kinds[0]},
        # (None for a kind whose price no generation finished measuring)
        "round_ms_by_kind": {
          kind: None if s is None else 1e3 * s for kind, s in (stats[-1].round_seconds_by_kind or {}).items()
        }
        or None,
      }
      if kinds
      else {}
    ),
    "tau": sum(s.num_new_tokens - batch for s in stats) / sum(s.rounds for s in stats),
    "acceptance_by_depth": acceptance_by_depth(np.sum([s.rounds_by_length for s in stats], axis=0)),
    # (the share of the cached K/V the verifier read, over every round: 1.0 when dense)
    "kv_fraction_read": sum(s.kv_fraction_read * s.rounds for s in stats) / sum(s.rounds for s in stats),
    "tokens_per_second": statistics.median(s.tokens_per_second for s in stats),
    "end_to_end_tokens_per_second": statistics.median(s.end_to_end_tokens_per_second for s in stats),
    "time_to_first_token_seconds": statistics.median(s.time_to_first_token_seconds for s in stats),
    # (one entry a generation: a prompt, or with a batch its prompts; compile_seconds: XLA
    # compiled during the timed generation, its speed includes it; rerun_after_compile_seconds:
    # what a first try compiled, which was then run again)
    "per_prompt": [
      {
        "tokens_per_second": s.tokens_per_second,
        "end_to_end_tokens_per_second": s.end_to_end_tokens_per_second,
        "time_to_first_token_seconds": s.time_to_first_token_seconds,
        "rounds": s.rounds,
        "new_tokens": s.num_new_tokens,
        "chunks": s.chunks,
        "compile_seconds": timed,
        "rerun_after_compile_seconds": first,
        **({"rounds_by_kind": s.rounds_by_kind} if s.rounds_by_kind else {}),
      }
      for s, (first, timed) in zip(stats, compiles)
    ],
    "prefill_seconds": statistics.median(s.prefill_seconds for s in stats),
    "max_stream_gap_seconds": max(s.max_stream_gap_seconds for s in stats),
    **{f"{phase}_share": None if adaptive else seconds / whole for phase, seconds in phases.items()},
    "kv_cache_mib": max(s.kv_cache_bytes for s in stats) / 2**20,
    "draft_state_mib": max(s.proposer_state_bytes for s in stats) / 2**20,
    "token_ids": token_ids,
  }


def divergence(target, prompt: list[int], reference: list[int], other: list[int]) -> dict:
  """Where `other` first leaves the AR output `reference`, and the target's logit margin
  there of the AR token over the other one, from a fresh forward over the AR prefix: a
  margin within rounding of the dtype means the two tokens tie (DESIGN: lossless in bf16
  except at such ties)."""
  index = next((i for i, (a, b) in enumerate(zip(reference, other)) if a != b), min(len(reference), len(other)))
  if index == min(len(reference), len(other)):
    return {"index": index, "logit_margin": None}  # one stopped early (EOS or limit)
  prefix = list(prompt) + reference[:index]
  _, hidden = prefill(target.model, [prefix], -(-len(prefix) // 128) * 128)
  logits = target.model.logits(hidden)[0]
  return {"index": index, "logit_margin": float(logits[reference[index]] - logits[other[index]])}


def same_tokens(row: dict) -> str:
  if row["same_tokens_as_ar"] is None:
    return "n/a (stream draws)"
  if row["same_tokens_as_ar"]:
    return "yes"
  if "divergences" not in row:  # (sampled)
    return "no"
  margins = [d["logit_margin"] for d in row["divergences"] if d["logit_margin"] is not None]
  return f"no: {len(row['divergences'])} prompts, largest AR logit margin {max(margins, default=0.0):.3g}"


def main(argv=None):
  p = cli.ArgumentParser(prog="python -m infer.benchmark", description=__doc__.splitlines()[0])
  p.add_argument(
    "--methods",
    nargs="+",
    type=method_spec,
    default=[MethodSpec(Method.AR), MethodSpec(Method.PLD)],
    help=f"of {', '.join(m.value for m in Method)}; METHOD:TOKENSxMATCHES gives a copying method its own"
    " prompt-lookup continuations (e.g. pld:16x4)",
  )
  p.add_argument(
    "--draft",
    help="draft for longspec and auto: 'default' (shipped for the target; longspec's default),"
    " 'random', a checkpoint dir, or 'none'; auto uses one only when named, and then runs"
    " twice, without it (`auto`) and with it (`auto+draft`)",
  )
  p.add_argument("--glide-draft", help="GLIDE's draft for glide: 'default' (the default), 'random' or a checkpoint dir")
  p.add_argument(
    "--heads", help="TokenSwift's heads for tokenswift: 'default' (the default), 'random' or a checkpoint dir"
  )
  add_tree_flags(p, many=True)
  add_draft_vocab_flag(p, many=True)
  add_copy_flags(p, many=True)
  p.add_argument(
    "--sets",
    nargs="+",
    choices=[*sorted(PROMPT_SETS), HELD_OUT_NAME],
    default=["code", "docs"],
    help=f"prompt sets; {HELD_OUT_NAME}: all that no training data holds ({', '.join(HELD_OUT)})",
  )
  p.add_argument("--lengths", type=cli.positive_int, nargs="+", default=[1024, 4096, 7680], help="prefill tokens")
  p.add_argument("--num-prompts", type=cli.positive_int, default=3, help="prompts per set and length")
  p.add_argument(
    "--batch",
    type=cli.positive_int,
    nargs="+",
    default=[1],
    help="prompts decoded together (the last batch filled up by repeating prompts); several: one run of every"
    " method each, against AR at the same batch (tokens/s over the batch and per sequence); without"
    " --tree-widths a draft's tree is the one priced for the batch where the table of trees has one",
  )
  p.add_argument("--new-tokens", type=cli.positive_int, default=256, help="tokens each run decodes")
  p.add_argument(
    "--target",
    default=default.NAME,
    help="'smollm2-135m' (the embedded default), a Hugging Face model directory, or a .gguf file",
  )
  p.add_argument(
    "--dtype", choices=("float32", "bfloat16"), help="compute dtype (default: bfloat16 on a GPU, float32 elsewhere)"
  )
  cli.add_attention_flag(p)
  p.add_argument(
    "--batch-invariant",
    action=argparse.BooleanOptionalAction,
    help="rounds compute each token's logits the same bits whatever else the call holds, so every"
    " lossless method writes AR's text and rows compare speeds on identical text, with AR on the"
    " fastest kernels beside (default: on in bfloat16 on one device without --sparse-verify)",
  )
  add_sampling_flags(p)
  p.add_argument(
    "--sparse-verify",
    type=sparse_fraction,
    nargs="+",
    metavar="P",
    help="longspec, glide: also run each with SpecAttn's sparse verification at each P (lossy: its"
    " tokens differ from AR's), labelled +sparseP",
  )
  cli.add_devices_flag(p)
  p.add_argument("--out", type=Path, help="results JSON (a PNG of them is written beside it)")
  p.add_argument(
    "--keep-texts",
    action="store_true",
    help="the JSON keeps each prompt and its AR text (the ar row's prompt_ids, token_ids), for lab.replay_auto",
  )
  args = p.parse_args(argv)
  names = [m for m, _, _ in args.methods]
  said = " ".join(map(str, names))
  if not any(m.draft_kind for m in names):
    for flag, value in (("--draft", args.draft), ("--glide-draft", args.glide_draft), ("--heads", args.heads)):
      if value is not None:
        p.error(f"{flag} shapes a draft method, but --methods {said} has none")
  # The draft each method runs (`auto`: LongSpec's, when --draft names one); trees shape those.
  named = {Method.GLIDE: args.glide_draft, Method.TOKENSWIFT: args.heads}
  specs = {m: m.draft_spec(named.get(m, args.draft)) for m in [Method.AR, *names]}
  treed = {m for m, spec in specs.items() if spec is not None and m is not Method.TOKENSWIFT}  # (its tree: its heads')
  if args.tree_widths is not None and not treed:
    p.error(
      f"--tree-widths shapes a draft's trees, but none of --methods {said} runs a draft"
      " (auto runs one only when --draft names it)"
    )
  if args.draft_vocab is not None and not treed:
    p.error(
      f"--draft-vocab sets what a block draft scores, but none of --methods {said} runs one"
      " (auto runs one only when --draft names it)"
    )
  if not any(m.copies for m in names):
    for flag, value in (("--copy-tokens", args.copy_tokens), ("--copy-matches", args.copy_matches)):
      if value is not None:
        p.error(f"{flag} shapes prompt lookup's continuations, but --methods {said} has none")
  if args.draft == "none" and Method.LONGSPEC in names:
    p.error("--draft none leaves longspec without a draft")
  if args.sparse_verify and not any(m.reads_sparsely for m in names):
    p.error(
      f"--sparse-verify reads what a draft's cross-attention selects, but --methods {said} has"
      " neither longspec nor glide"
    )
  cli.check_batch_invariant(p, args)
  if args.out:
    cli.output_path(args.out)
  methods = [MethodSpec(Method.AR)] + [
    m for m in args.methods if m[0] is not Method.AR
  ]  # AR first: the baseline of every ratio
  # A draft method once per tree and vocabulary subset (and per --sparse-verify P), each
  # copying method once per continuation length and number; `auto` with a draft also once
  # without it, so that one run says what the draft adds.
  variants, undrafted = [], set()
  for m, own_copies, own_matches in methods:
    if not m.copies:
      variants.append(Variant(m.value, m, (None, None), 0, None))
      continue
    for spec in (args.tree_widths or [None]) if m in treed else [None]:
      for vocab in (args.draft_vocab or [None]) if m in treed else [None]:
        for copies in [own_copies] if own_copies else args.copy_tokens or [None]:
          for matches in [own_matches] if own_matches else args.copy_matches or [None]:
            shape = "" if spec is None else f"[{spec if isinstance(spec, str) else ','.join(map(str, spec))}]"
            shape += "" if vocab is None else f"+vocab{vocab}"
            # (TokenSwift's continuations are its n-grams, their length 0 none of them)
            grams = m is Method.TOKENSWIFT and copies is not None
            suffix = (f"+gram{copies}" if grams else f"+copy{copies}" if copies else "") + (
              f"x{matches}" if matches else ""
            )
            if m is Method.AUTO and m in treed:
              if (copies, matches) not in undrafted:
                undrafted.add((copies, matches))
                variants.append(Variant(m.value + suffix, m, (None, None), copies, matches, drafted=False))
              shape = "+draft" + shape
            label = m.value + shape + suffix
            variants.append(Variant(label, m, tree_choice(spec, args), copies, matches, vocab=vocab))
            for fraction in (args.sparse_verify or ()) if m.reads_sparsely else ():
              variants.append(
                Variant(
                  f"{label}+sparse{fraction:g}",
                  m,
                  tree_choice(spec, args),
                  copies,
                  matches,
                  vocab,
                  SparseVerify(fraction),
                )
              )
  sampling = sampling_config(args)
  mesh = cli.device_mesh(args.devices)  # (before JAX runs anything: a CPU's devices are made for it)
  dtype = cli.resolve_dtype(args.dtype)
  if args.batch_invariant is None:  # identical text by default where bf16 would tie
    args.batch_invariant = dtype == jnp.bfloat16 and not args.sparse_verify and args.devices == 1
  if args.batch_invariant:  # its price: AR with the fastest kernels, second
    variants.insert(1, Variant("ar+fast-numerics", Method.AR, (None, None), 0, None, fast=True))
  path = resolve_target(args.target)  # every input is checked before the weights load
  config = read_target_config(path)
  check_capacity(config, [[0] * max(args.lengths)], args.new_tokens)
  for flag, value, method in (("--glide-draft", args.glide_draft, "glide"), ("--heads", args.heads, "tokenswift")):
    if value == "none":
      p.error(f"{flag} none leaves {method} without a draft")
  kinds = {m.draft_kind: spec for m, spec in specs.items() if spec is not None}
  for kind, spec in kinds.items():
    resolve_draft(spec, args.target, kind)
  for v in variants:
    check_tree(*v.tree, config.vocab_size, (v.copies or 0) * (v.matches or 1))
    if v.vocab is not None and v.vocab > config.vocab_size:
      p.error(f"--draft-vocab {v.vocab} exceeds the target's vocabulary of {config.vocab_size} tokens")
  with jax.set_mesh(mesh):  # (with --devices: the models placed split, the programs traced for it)
    measure(args, path, dtype, sampling, specs, kinds, variants)


def measure(args, path, dtype, sampling, specs, kinds, variants) -> None:
  """Loads the target and drafts, then runs every variant on every set and length,
  printing a row and saving the JSON after each."""
  backend.keep_compiled_programs()  # (a later run of the same shapes compiles nothing)
  impl = cli.attention_impl(args.attention)
  args.attention = impl.value
  target = load_target(path, dtype, load_tokenizer(path), numerics=cli.numerics(args))
  fast = dataclasses.replace(target, model=target.model.with_numerics(batch_invariant=False))
  vocabs = {v.vocab for v in variants}
  drafts = {  # by kind and vocabulary subset (None: the draft's own)
    (kind, vocab): sharding.placed(
      load_draft(spec, target.config, dtype, args.target, attention=impl, kind=kind, vocab_subset=vocab)
    )
    for kind, spec in kinds.items()
    for vocab in (vocabs if kind is not DraftKind.TOKENSWIFT else {None})
  }
  device = jax.devices()[0].device_kind
  print(
    f"device: {device}, target {args.target}, {jnp.dtype(target.model.dtype).name}, attention {args.attention}"
    f"{', batch-invariant rounds' if args.batch_invariant else ''}"
    f"{f', over {args.devices} devices' if args.devices > 1 else ''}"
  )
  print(
    "set  | prefill | batch | method         | tau  | tokens/s | speedup vs AR | end to end | draft/verify/other"
    " | cache MiB target+draft | stream gap s | same tokens as AR",
    flush=True,
  )
  rows, written = [], []

  def save() -> None:  # after every row: a crash loses nothing measured
    if not args.out:
      return
    result = {
      **environment(),
      "argv": sys.argv[1:],
      "target": args.target,
      "dtype": jnp.dtype(target.model.dtype).name,
      "attention": args.attention,
      "batch_invariant": args.batch_invariant,
      "devices": args.devices,
      "draft": kinds.get(DraftKind.LONGSPEC),
      "glide_draft": kinds.get(DraftKind.GLIDE),
      "heads": kinds.get(DraftKind.TOKENSWIFT),
      "new_tokens": args.new_tokens,
      "num_prompts": args.num_prompts,
      "sampling": dataclasses.asdict(sampling),
      "seed": args.seed,
      "rows": rows,
    }
    plots.save(result, args.out)
    written.append(args.out)

  one_text = sampling.greedy or sampling.draw is Draw.POSITION  # (each lossless row can be checked against AR's)
  for set_name in set_names(args.sets):
    for length in args.lengths:
      prompts = PROMPT_SETS[set_name](target.tokenizer, length, args.num_prompts)
      for batch in args.batch:
        baseline = None
        for label, method, (widths, cape), copies, matches, vocab, sparse, on_fast, drafted in variants:
          draft = drafts[method.draft_kind, vocab] if specs[method] is not None and drafted else None
          if draft is not None:  # (a batch decodes with its own tree where one is priced)
            widths, copies = batch_tree_choice(target.config, method, batch, widths, cape, copies)
          proposer, draft_params = make_proposer(
            method,
            draft,
            ProposerOptions(
              tree_widths=widths,
              copy_tokens=copies,
              cape=cape,
              copy_matches=matches,
              sampling=sampling,
              sparse=sparse,
              batch=batch,
            ),
          )
          decoding = Decoding(proposer=proposer, sampling=sampling)  # (no EOS: every run decodes new_tokens)
          result = run_config(
            fast if on_fast else target, decoding, draft_params, prompts, args.new_tokens, args.seed, batch
          )
          baseline = baseline or result
          row = {
            "set": set_name,
            "prefill_tokens": length,
            "batch": batch,
            "method": label,
            **proposer.describe(),
            "draft_vocab": draft.vocab_rows if isinstance(draft, Draft) else None,
            **({"sparse_verify": dataclasses.asdict(sparse)} if sparse else {}),
            **{key: result[key] for key in ("rounds_by_kind", "round_ms_by_kind") if key in result},
            "tau": result["tau"],
            "acceptance_by_depth": result["acceptance_by_depth"],
            "kv_fraction_read": result["kv_fraction_read"],
            "tokens_per_second": result["tokens_per_second"],
            "tokens_per_second_per_sequence": result["tokens_per_second"] / batch,
            "end_to_end_tokens_per_second": result["end_to_end_tokens_per_second"],
            "time_to_first_token_seconds": result["time_to_first_token_seconds"],
            "per_prompt": result["per_prompt"]
            if method is not Method.AR or on_fast or not args.keep_texts or batch > 1
            else [
              {**one, "prompt_ids": prompt, "token_ids": ids}
              for one, prompt, ids in zip(result["per_prompt"], prompts, result["token_ids"])
            ],
            "prefill_seconds": result["prefill_seconds"],
            "max_stream_gap_seconds": result["max_stream_gap_seconds"],
            **{f"{phase}_share": result[f"{phase}_share"] for phase in PHASES},
            "kv_cache_mib": result["kv_cache_mib"],
            "draft_state_mib": result["draft_state_mib"],
            "speedup_vs_ar": result["tokens_per_second"] / baseline["tokens_per_second"],
            "end_to_end_speedup_vs_ar": result["end_to_end_tokens_per_second"]
            / baseline["end_to_end_tokens_per_second"],
            "batch_invariant": args.batch_invariant and not on_fast,
            # (greedy, or sampled with draws keyed by position: every lossless method writes
            # AR's text; other draws consume the random stream as each method's rounds do)
            "same_tokens_as_ar": result["token_ids"] == baseline["token_ids"] if one_text else None,
          }
          if row["same_tokens_as_ar"] is False and sampling.greedy:  # (where AR's logits decide)
            row["divergences"] = [
              divergence(target, prompt, ref, got)
              for prompt, ref, got in zip(
                [p for group in batches(prompts, batch) for p in group], baseline["token_ids"], result["token_ids"]
              )
              if ref != got
            ]
          rows.append(row)
          save()
          split = "/".join(
            "-" if row[f"{phase}_share"] is None else f"{100 * row[f'{phase}_share']:.0f}" for phase in PHASES
          )
          print(
            f"{set_name:4} | {length:7} | {batch:5} | {label:14} | {row['tau']:4.2f} |"
            f" {row['tokens_per_second']:8.1f} |"
            f" {row['speedup_vs_ar']:12.2f}x | {row['end_to_end_speedup_vs_ar']:9.2f}x | {split:>17}% |"
            f" {row['kv_cache_mib']:12.1f} +"
            f" {row['draft_state_mib']:5.2f} | {row['max_stream_gap_seconds']:12.2f} | {same_tokens(row)}",
            flush=True,
          )
          compiled = [p["compile_seconds"] for p in row["per_prompt"] if p["compile_seconds"]]
          if compiled:
            print(
              f"  note: {len(compiled)} of its timed generations compiled ({sum(compiled):.1f} s):"
              " its speed includes the compiler",
              flush=True,
            )
          rerun = [p["rerun_after_compile_seconds"] for p in row["per_prompt"] if p["rerun_after_compile_seconds"]]
          if rerun:
            print(
              f"  note: {len(rerun)} of its generations compiled ({sum(rerun):.1f} s) and were run again:"
              " a user's first such prompt stalls that long",
              flush=True,
            )
  if written:
    print(f"wrote {args.out} and {args.out.with_suffix('.png')}")


if __name__ == "__main__":
  cli.run_main(main, "python -m infer.benchmark")
