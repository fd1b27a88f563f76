"""`python -m lab.bench_target`: AR speed of the target, ours vs transformers, and the
decode step of a model shape (Llama-3.1-8B by default) against the memory-bandwidth floor,
and the vocabulary top-k of the draft's beam search (`jax.lax.top_k` vs two-stage chunks;
the LM head's product fused with it vs not).

Every timing is a median after warm-up; ratios are taken between rows of one run.
Prints tables and writes JSON (`--out`).

  python -m lab.bench_target --suite smollm2 --prompt-lengths 512 2048 7900 --out smollm2.json
  python -m lab.bench_target --suite floor --shape llama-3.1-8b --contexts 4096 32768 --out llama8b.json
  python -m lab.bench_target --suite floor --shape llama-3.1-70b --devices 2 --contexts 32768 --out tp.json
  python -m lab.bench_target --suite topk --out topk.json
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from infer import plots
from infer.cli import MethodSpec, method_spec
from infer.prompts import code_prompts
from infer.timing import (
  draft_seconds,
  environment,
  loop_seconds,
  measure_bandwidth,
  measure_peak_flops,
  measure_read_bandwidth,
  median_seconds,
)
from infer.tree_search import tree_spec
from lab import round_floor
from lab.shapes import LLAMA_31_8B, SHAPES, SMOLLM2_135M
from longspec_jax import cli
from longspec_jax.engine import Decoding, decode_chunk, generate
from longspec_jax.methods.registry import Method

STEPS = 32  # --suite floor: rounds per timed call


def bench_ours(target, prompt: list[int], new_tokens: int, repeats: int) -> dict:
  runs = []
  for i in range(repeats + 1):  # the first run compiles
    result = generate(target.model, [prompt], new_tokens)  # (no EOS: new_tokens tokens)
    if i:
      runs.append(result.stats)
  prefill = statistics.median(r.prefill_seconds for r in runs)
  return {
    "prefill_ms": prefill * 1e3,
    "prefill_tokens_per_second": len(prompt) / prefill,
    "decode_tokens_per_second": statistics.median(r.tokens_per_second for r in runs),
    "token_ids": result.token_ids[0],
  }


def load_transformers(gguf_path: Path, dtype_name: str):
  import torch
  import transformers

  device = "cuda" if torch.cuda.is_available() else "cpu"
  dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype_name]
  return (
    transformers.AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, dtype=dtype)
    .to(device)
    .eval()
  )


def bench_transformers(
  model, prompts: list[list[int]], new_tokens: int, repeats: int, caches=("dynamic", "static")
) -> dict:
  """transformers `generate`, greedy, on a batch of equal-length prompts, per cache
  (default and static, compiled): prefill tokens/s, decode tokens/s per sequence (runs of
  1 and of `new_tokens` tokens, the difference excludes the prefill) and the first
  sequence's tokens."""
  import torch

  device = model.device.type
  ids = torch.tensor(prompts, device=model.device)
  results = {}
  for cache in caches:
    kwargs = dict(do_sample=False, eos_token_id=None, min_new_tokens=None)
    if cache == "static":
      kwargs["cache_implementation"] = "static"

    def run(n):
      if device == "cuda":
        torch.cuda.synchronize()
      t = time.perf_counter()
      with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, **kwargs)
      if device == "cuda":
        torch.cuda.synchronize()
      return time.perf_counter() - t, out

    run(new_tokens)  # warm-up; the static cache compiles here
    prefill = statistics.median(run(1)[0] for _ in range(repeats))
    full = [run(new_tokens) for _ in range(repeats)]
    total = statistics.median(t for t, _ in full)
    results[cache] = {
      "prefill_tokens_per_second": ids.numel() / prefill,
      "decode_tokens_per_second": (new_tokens - 1) / max(total - prefill, 1e-9),
      "token_ids": full[0][1][0, ids.shape[1] :].tolist(),
    }
  return results


def suite_smollm2(args) -> dict:
  from longspec_jax.weights import load_target, resolve_target

  dtype = cli.resolve_dtype(args.dtype)
  dtype_name = jnp.dtype(dtype).name
  target = load_target("smollm2-135m", dtype, numerics=cli.numerics(args))
  hf_model = load_transformers(resolve_target("smollm2-135m"), dtype_name) if args.transformers else None
  rows = []
  for length in args.prompt_lengths:
    prompt = code_prompts(target.tokenizer, length, 1)[0]
    ours = bench_ours(target, prompt, args.new_tokens, args.repeats)
    theirs = bench_transformers(hf_model, [prompt], args.new_tokens, args.repeats) if hf_model else {}
    best = max(theirs.values(), key=lambda r: r["decode_tokens_per_second"], default=None)
    rows.append(
      {
        "prompt_tokens": length,
        "ours": {k: v for k, v in ours.items() if k != "token_ids"},
        "transformers": {k: {m: v for m, v in r.items() if m != "token_ids"} for k, r in theirs.items()},
        "decode_speedup_vs_best_transformers": (
          best and ours["decode_tokens_per_second"] / best["decode_tokens_per_second"]
        ),
        "prefill_speedup_vs_best_transformers": best
        and ours["prefill_tokens_per_second"] / max(r["prefill_tokens_per_second"] for r in theirs.values()),
        "greedy_tokens_equal": {k: r["token_ids"] == ours["token_ids"] for k, r in theirs.items()},
      }
    )
    print(_smollm2_row(rows[-1]), flush=True)
  return {"dtype": dtype_name, "new_tokens": args.new_tokens, "attention": args.attention, "rows": rows}


def _smollm2_row(row) -> str:
  t = row["transformers"]
  cells = [
    f"{row['prompt_tokens']:>6}",
    f"{row['ours']['prefill_tokens_per_second']:>10.0f}",
    f"{row['ours']['decode_tokens_per_second']:>8.1f}",
  ]
  for cache in ("dynamic", "static"):
    r = t.get(cache)
    cells.append(f"{r['decode_tokens_per_second']:>8.1f}" if r else f"{'-':>8}")
  ratio = row["decode_speedup_vs_best_transformers"]
  cells.append(f"{ratio:>6.2f}x" if ratio else "")
  return " | ".join(cells)


def suite_floor(args) -> dict:
  """Decode rounds of a random-weight model of a known shape, per batch, context and method
  (AR; PLD; LongSpec with a random draft and its 69-node tree; TokenSwift with random
  heads, its drafting pass also timed alone over its partial cache, steady and when it
  selects its positions again), against the bytes an AR step must read over the measured
  memory bandwidth (a copy's and a read-only pass's), and each round against its own floor
  term by term (`round_floor`: the draft's passes and head reads, the verify pass's bytes
  and FLOPs at the measured read rate and matmul peak), with the drafting's measured time
  beside it (timed alone; the rest of the round is the verification's); prefill speed;
  and transformers' static-cache decoding of the same shape, compiled, as a peer (run
  first, before JAX takes the GPU). With `--devices N` the model is split over N devices
  (tensor parallelism, `longspec_jax.ops.sharding`) and the floor is each device's share
  of the bytes over one device's bandwidth; transformers is then not run (it would need
  the whole model on one device)."""
  config = SHAPES[args.shape]
  dtype = cli.resolve_dtype(args.dtype)
  peers = {}
  if args.transformers and args.devices == 1:
    for batch in args.batches:
      for context in args.contexts:
        peers[batch, context] = transformers_decode(config, jnp.dtype(dtype).name, batch, context, 2 * STEPS)
        step_ms = peers[batch, context]["step_ms"]
        print(
          f"transformers static cache, batch {batch}, context {context}: "
          + (f"{step_ms:.2f} ms a step" if step_ms else peers[batch, context]["error"]),
          flush=True,
        )
  # One device's rates, before the model takes its memory: a copy's, a read-only pass's
  # over a buffer of its share of the weights, and a matmul's.
  itemsize = jnp.dtype(dtype).itemsize
  rates = {
    "bandwidth_bytes_per_second": measure_bandwidth(),
    "read_bandwidth_bytes_per_second": measure_read_bandwidth(
      round_floor.Round(config, itemsize, 1, 0).target_weight_bytes // args.devices
    ),
    "peak_flops": measure_peak_flops(dtype),
  }
  print(
    f"copy {rates['bandwidth_bytes_per_second'] / 1e12:.2f} TB/s,"
    f" read {rates['read_bandwidth_bytes_per_second'] / 1e12:.2f} TB/s,"
    f" matmul {rates['peak_flops'] / 1e12:.0f} TFLOP/s",
    flush=True,
  )
  impl = cli.attention_impl(args.attention)
  with jax.set_mesh(args.mesh):  # (--devices: each device makes its share of the weights; programs split)
    return _floor_rows(args, config, dtype, impl, rates, peers)


def _round(proposer, draft, config, itemsize: int, batch: int, context: int, devices: int) -> round_floor.Round:
  """The floor's picture (`round_floor.Round`) of a proposer's round; `draft` its draft."""
  from longspec_jax.methods.longspec import LongSpecDraft
  from longspec_jax.methods.tokenswift import TokenSwift

  common = dict(
    target=config, itemsize=itemsize, batch=batch, context=context, nodes=proposer.tree_size, devices=devices
  )
  if isinstance(proposer, LongSpecDraft):
    depth = proposer.cape.gamma if proposer.cape else len(proposer.widths)
    return round_floor.Round(
      **common, draft=draft.config, draft_passes=depth, head_reads=depth, head_rows=draft.vocab_rows
    )
  if isinstance(proposer, TokenSwift):
    return round_floor.Round(**common, self_draft_slots=min(proposer.budget, context))
  return round_floor.Round(**common)


def _floor_rows(args, config, dtype, impl, rates: dict, peers: dict) -> dict:
  """`suite_floor`'s rounds, under its mesh."""
  from longspec_jax.engine import prefill, start
  from longspec_jax.methods.factory import make_proposer
  from longspec_jax.methods.longspec import LongSpecDraft
  from longspec_jax.methods.registry import ProposerOptions
  from longspec_jax.models.config import DraftKind, default_feature_layers
  from longspec_jax.models.draft import with_features
  from longspec_jax.models.target import random_model
  from longspec_jax.weights.drafts import load_draft, target_shape

  steps, warmup, iters = STEPS, 2, 5
  model = random_model(config, dtype, numerics=cli.numerics(args))
  itemsize = jnp.dtype(dtype).itemsize
  names = {m for m, _, _ in args.methods}
  # The drafts by method and vocabulary subset (0: the whole vocabulary).
  drafts = {}
  for vocab, inputs in itertools.product(args.draft_vocab, args.draft_inputs) if Method.LONGSPEC in names else ():
    draft = load_draft("random", config, dtype, attention=impl, vocab_subset=vocab)
    fused = inputs == "fused"
    drafts[Method.LONGSPEC, vocab, inputs] = (
      with_features(draft, default_feature_layers(config.num_layers), parents=True) if fused else draft
    )
  if Method.TOKENSWIFT in names:
    drafts[Method.TOKENSWIFT, 0, "plain"] = load_draft("random", config, dtype, kind=DraftKind.TOKENSWIFT)
  proposers = {}  # label -> (proposer, its params, its draft), e.g. "pld:24x4": four continuations of 24 tokens
  for method, copies, matches in args.methods:
    longspec = method is Method.LONGSPEC
    for vocab, tree, inputs in itertools.product(
      args.draft_vocab if longspec else [0],
      (args.trees or [None]) if longspec else [None],
      args.draft_inputs if longspec else ["plain"],
    ):
      label = (
        method.value
        + (f":{copies}x{matches}" if copies else "")
        + (f"[{tree.label}]" if tree else "")
        + (f"+vocab{vocab}" if vocab else "")
        + ("+fused" if inputs == "fused" else "")
      )
      draft = drafts.get((method, vocab, inputs))
      options = ProposerOptions(
        tree_widths=tree and tree.widths, copy_tokens=(tree and tree.copy_tokens) or copies, copy_matches=matches
      )
      proposers[label] = (*make_proposer(method, draft, options), draft)
  rng = np.random.default_rng(0)
  rows = []
  for batch in args.batches:
    for context in args.contexts:
      prompts = rng.integers(0, config.vocab_size, (batch, context)).tolist()
      # An AR step's bytes (a device its share) at the copy rate and at the read rate.
      step = round_floor.Round(config, itemsize, batch, context, devices=args.devices)
      floor, read_floor = (
        step.terms_ms(rates[rate], rates["peak_flops"])["verify_bytes_ms"] / 1e3
        for rate in ("bandwidth_bytes_per_second", "read_bandwidth_bytes_per_second")
      )
      prefill_rate = prefill_floor = None
      if batch == 1:  # (the second run: the first compiles)
        run = lambda: prefill(model, prompts, context + 128)[1]
        prefill_rate = context / median_seconds(run, warmup=1, iters=2)
        prefill_floor = round_floor.prefill_flops(config, context) / rates["peak_flops"] / args.devices
      for method, numerics in itertools.product(proposers, args.numerics):
        model = model.with_numerics(batch_invariant=numerics == "invariant")
        proposer, proposer_params, draft = proposers[method]
        decoding = Decoding(proposer=proposer)
        # A random draft's tokens are rarely accepted; room for 4 tokens a round regardless.
        state = [start(model, prompts, 4 * (warmup + iters + 1) * steps, decoding, proposer_params).state]

        def decode():  # continues from the last state: the context grows with each call
          state[0], tokens, _ = decode_chunk(
            model, state[0], decoding, proposer_params, max_new_tokens=1 << 30, rounds=steps, max_rounds=steps
          )
          return tokens

        seconds = median_seconds(decode, warmup=warmup, iters=iters) / steps
        drafting = draft_pass_ms(model, state[0], proposer.depth + 1) if method.startswith("tokenswift") else {}
        phases = {}
        if method != "ar":  # (the drafting alone, timed on the state the rounds left; the rest verifies)
          draft_s = draft_seconds(model, decoding, proposer_params, state[0])
          phases = {"draft_phase_ms": draft_s * 1e3, "verify_phase_ms": (seconds - draft_s) * 1e3}
        state.clear()  # frees the cache before the next run
        shape = _round(proposer, draft, config, itemsize, batch, context, args.devices)
        terms = shape.terms_ms(rates["read_bandwidth_bytes_per_second"], rates["peak_flops"])
        copy_terms = shape.terms_ms(rates["bandwidth_bytes_per_second"], rates["peak_flops"])
        row = {
          "method": method,
          "numerics": numerics,
          "batch": batch,
          "context": context,
          "round_ms": seconds * 1e3,
          "floor_ms": floor * 1e3,
          "fraction_of_floor": floor / seconds if method == "ar" else None,
          "read_floor_ms": read_floor * 1e3,
          "fraction_of_read_floor": read_floor / seconds if method == "ar" else None,
          "round_floor_ms": terms["floor_ms"],
          "round_floor_copy_ms": copy_terms["floor_ms"],
          "round_over_floor": seconds * 1e3 / terms["floor_ms"],
          **{f"floor_{k}": v for k, v in terms.items() if k != "floor_ms"},  # (floor_draft_ms, ...)
          "tree_nodes": proposer.tree_size,
          **(
            {"tree_widths": list(proposer.widths), "copy_tokens": proposer.copy_tokens}
            if isinstance(proposer, LongSpecDraft) and not proposer.cape
            else {}
          ),
          "head_rows": shape.head_rows,
          **phases,
          "weight_bytes": step.target_weight_bytes,
          "kv_bytes": step.kv_bytes,
          "prefill_tokens_per_second": prefill_rate,
          "prefill_ms": prefill_rate and context / prefill_rate * 1e3,
          "prefill_flop_floor_ms": prefill_floor and prefill_floor * 1e3,
          "prefill_fraction_of_flop_floor": prefill_rate and prefill_floor * prefill_rate / context,
          "transformers_step_ms": (
            peers.get((batch, context), {}).get("step_ms") if method == "ar" and numerics == "fast" else None
          ),
          **drafting,
        }
        rows.append(row)
        print(_floor_row(row), flush=True)
  ar = {(r["batch"], r["context"], r["numerics"]): r["round_ms"] for r in rows if r["method"] == "ar"}
  for r in rows:
    r["ar_steps_per_round"] = r["round_ms"] / ar[r["batch"], r["context"], r["numerics"]]
    if (fast := ar.get((r["batch"], r["context"], "fast"))) is not None:
      r["fast_ar_steps_per_round"] = r["round_ms"] / fast
    if r["transformers_step_ms"]:
      r["speedup_vs_transformers"] = r["transformers_step_ms"] / r["round_ms"]
  return {
    "shape": args.shape,
    "target_shape": target_shape(config),
    "dtype": jnp.dtype(dtype).name,
    "devices": args.devices,
    **rates,
    "draft_vocab": args.draft_vocab,
    "draft_inputs": args.draft_inputs,
    "attention": args.attention,
    "gemm": model.gemm.value,
    "steps_per_measure": steps,
    "transformers": list(peers.values()),
    "rows": rows,
  }


def draft_pass_ms(model, state, most: int) -> dict:
  """TokenSwift's drafting pass alone (`tokenswift.draft_pass`), from a decode state of its
  rounds: steady (the positions committed since appended to its partial cache) and
  selecting (every layer ranking the whole cache again, as once per budget - sink
  committed tokens), in ms (medians). An AR step is the same pass over the full cache."""
  from longspec_jax.methods.tokenswift import draft_pass

  graphdef, weights = nnx.split(model)  # (the weights as arguments: closed over, jit embeds them as constants)
  run = jax.jit(
    lambda weights, partial, cache, root: draft_pass(nnx.merge(graphdef, weights), partial, cache, root, most)[0]
  )
  partial = state.proposal.partial
  due = dataclasses.replace(partial, copied=jnp.zeros_like(partial.copied))  # (a selection is due)
  return {
    "draft_pass_ms": median_seconds(lambda: run(weights, partial, state.cache, state.root)) * 1e3,
    "draft_pass_selecting_ms": median_seconds(lambda: run(weights, due, state.cache, state.root)) * 1e3,
    "partial_cache_slots": partial.budget,
  }


def _floor_row(row) -> str:
  fraction = f"{row['fraction_of_read_floor']:6.1%}" if row["fraction_of_read_floor"] else f"{'':6}"
  peer = f"{row['transformers_step_ms']:8.2f} ms" if row["transformers_step_ms"] else f"{'-':>11}"
  rate = (
    f"{row['prefill_tokens_per_second']:9.0f} ({row['prefill_fraction_of_flop_floor']:4.0%} of FLOPs)"
    if row["prefill_tokens_per_second"]
    else f"{'-':>9}"
  )
  return (
    f"{row['method']:12} | {row['numerics']:9} | {row['batch']:5} | {row['context']:7} |"
    f" {row['round_ms']:8.3f} ms | {row['read_floor_ms']:7.3f} ms | {fraction} |"
    f" {row['round_floor_ms']:7.3f} ms | {row['round_over_floor']:5.2f} |"
    f" {row['floor_draft_ms']:6.3f} {row['floor_head_ms']:6.3f} {row['floor_verify_bytes_ms']:6.3f}"
    f" {row['floor_verify_gemm_ms'] + row['floor_verify_attention_ms']:6.3f} |"
    f" {peer} | {rate}"
  )


def transformers_decode(config, dtype_name: str, batch: int, context: int, new_tokens: int) -> dict:
  """transformers' greedy decoding with its static cache (compiled, `bench_transformers`)
  on a random-weight `LlamaForCausalLM` of `config`'s shape and random prompts:
  milliseconds per decode step."""
  import torch
  import transformers

  rope = config.rope
  scaling = (
    None
    if rope.kind == "default"
    else {
      "rope_type": rope.kind,
      "factor": rope.factor,
      "low_freq_factor": rope.low_freq_factor,
      "high_freq_factor": rope.high_freq_factor,
      "original_max_position_embeddings": rope.original_max_position_embeddings,
    }
  )
  hf = transformers.LlamaConfig(
    vocab_size=config.vocab_size,
    hidden_size=config.hidden_size,
    intermediate_size=config.intermediate_size,
    num_hidden_layers=config.num_layers,
    num_attention_heads=config.num_heads,
    num_key_value_heads=config.num_kv_heads,
    head_dim=config.head_dim,
    rms_norm_eps=config.rms_norm_eps,
    max_position_embeddings=config.max_position_embeddings,
    tie_word_embeddings=config.tie_word_embeddings,
    rope_theta=rope.theta,
    rope_scaling=scaling,
  )
  device = "cuda" if torch.cuda.is_available() else "cpu"
  default_dtype = torch.get_default_dtype()
  torch.set_default_dtype({"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype_name])
  try:
    with torch.device(device):
      model = transformers.LlamaForCausalLM(hf).eval()
  finally:
    torch.set_default_dtype(default_dtype)
  prompts = np.random.default_rng(1).integers(0, config.vocab_size, (batch, context)).tolist()
  row = {
    "batch": batch,
    "context": context,
    "new_tokens": new_tokens,
    "step_ms": None,
    "transformers": transformers.__version__,
    "torch": torch.__version__,
  }
  try:
    static = bench_transformers(model, prompts, new_tokens, repeats=2, caches=("static",))["static"]
    row["step_ms"] = 1e3 / static["decode_tokens_per_second"]
  except torch.OutOfMemoryError:  # e.g. its prefill of 8 x 32k tokens on 80 GB
    row["error"] = "out of memory"
  model = None  # frees the weights before JAX takes the GPU
  if device == "cuda":
    torch.cuda.empty_cache()
  return row


def suite_topk(args) -> dict:
  """Microseconds per top-16 over rows of a vocabulary, in a chained on-device loop."""
  from longspec_jax.ops.topk import top_k

  chunks = (512, 1024, 2048, 4096)
  rows = []
  for vocab in (SMOLLM2_135M.vocab_size, LLAMA_31_8B.vocab_size):
    for batch in (1, 4, 16, 64):
      x = jax.random.normal(jax.random.key(batch), (batch, vocab), jnp.float32)
      row = {"rows": batch, "vocab": vocab, "k": 16}
      for name, fn in [("lax", lambda x: jax.lax.top_k(x, 16))] + [
        (f"chunk_{c}", functools.partial(top_k, k=16, chunk=c)) for c in chunks
      ]:
        row[f"{name}_us"] = 1e6 * loop_seconds(lambda y, fn=fn: y + 1e-30 * fn(y)[0][:, :1], x)
      rows.append(row)
      print(
        f"{vocab:>7} x {batch:>3} | "
        + " | ".join(f"{row[f'{n}_us']:7.1f}" for n in ["lax"] + [f"chunk_{c}" for c in chunks]),
        flush=True,
      )
  return {"chunks": list(chunks), "rows": rows, "head": _head_top_k_rows()}


def _head_top_k_rows() -> list[dict]:
  """Microseconds per draft vocabulary pass (the LM head's product and the top-16
  log-probs of a few rows), unfused (logits, log-softmax, two-stage top-k) and fused
  (`topk.head_top_log_probs`), on SmolLM2's tied and Llama-3.1-8B's separate head, bf16."""
  from longspec_jax.ops.topk import head_top_log_probs, top_k

  rows = []
  for shape, tied in ((SMOLLM2_135M, True), (LLAMA_31_8B, False)):
    e, v = shape.hidden_size, shape.vocab_size
    head = jax.random.normal(jax.random.key(v), (v, e) if tied else (e, v), jnp.bfloat16) * e**-0.5
    spec = "re,ve->rv" if tied else "re,ev->rv"
    unfused = lambda x, w: top_k(jax.nn.log_softmax(jnp.einsum(spec, x, w).astype(jnp.float32), axis=-1), 16)
    fused = lambda x, w: head_top_log_probs(x, w, 16, transposed=tied)
    for count in (1, 4, 16):
      x = jax.random.normal(jax.random.key(count), (count, e), jnp.bfloat16)
      row = {"vocab": v, "hidden": e, "tied": tied, "rows": count, "k": 16}
      for name, fn in (("unfused", unfused), ("fused", fused)):
        step = lambda x, w, fn=fn: x + (1e-30 * fn(x, w)[0][:, :1]).astype(x.dtype)
        row[f"{name}_us"] = 1e6 * loop_seconds(step, x, head)
      rows.append(row)
      print(
        f"head {v:>7} x {e:<5} rows {count:>2}: unfused {row['unfused_us']:7.1f} us | fused {row['fused_us']:7.1f} us",
        flush=True,
      )
  return rows


def main(argv=None):
  p = cli.ArgumentParser(prog="python -m lab.bench_target", description=__doc__.splitlines()[0])
  p.add_argument("--suite", choices=("smollm2", "floor", "topk"), required=True)
  p.add_argument("--shape", choices=sorted(SHAPES), default="llama-3.1-8b", help="model shape for --suite floor")
  p.add_argument("--prompt-lengths", type=cli.positive_int, nargs="+", default=[512, 2048, 7900])
  p.add_argument("--contexts", type=cli.positive_int, nargs="+", default=[4096, 32768])
  p.add_argument("--batches", type=cli.positive_int, nargs="+", default=[1], help="batch sizes for --suite floor")
  p.add_argument(
    "--methods",
    type=method_spec,
    nargs="+",
    default=[MethodSpec(Method.AR), MethodSpec(Method.LONGSPEC)],
    help="methods for --suite floor: ar, pld, longspec (with a random draft), tokenswift (random heads,"
    " its drafting pass also timed alone), each copying one as"
    " METHOD:TOKENSxMATCHES too (e.g. pld:24x4, auto's trie on a GPU); prompt lookup's rounds"
    " verify their whole trees whether or not the random prompt repeats",
  )
  p.add_argument(
    "--numerics",
    choices=("fast", "invariant"),
    nargs="+",
    default=["fast"],
    help="--suite floor: time rounds with the fastest kernels, with batch-invariant ones"
    " (--batch-invariant elsewhere), or both",
  )
  p.add_argument(
    "--draft-vocab",
    type=cli.nonnegative_int,
    nargs="+",
    default=[0],
    help="--suite floor: longspec's random draft scores this many tokens of the vocabulary (FR-Spec's subset;"
    " 0: all); several: one row each",
  )
  p.add_argument(
    "--draft-inputs",
    choices=("plain", "fused"),
    nargs="+",
    default=["plain"],
    help="--suite floor: longspec's random draft as it is, or also reading fused target features (layers 2, L/2,"
    " L-3) and its parents' outputs (+fused); several: one row each",
  )
  p.add_argument(
    "--trees",
    type=tree_spec,
    nargs="+",
    help="--suite floor: longspec's trees, one row each, as beam widths per depth with an optional copy branch"
    " (4,8,8 or 4,8,8+copy10; default: the random draft's own, the one priced for the shape where there is one):"
    " `infer.tree_search --prices` reads them",
  )
  p.add_argument("--new-tokens", type=cli.positive_int, default=256)
  p.add_argument("--repeats", type=cli.positive_int, default=3)
  p.add_argument("--dtype", choices=("float32", "bfloat16"))
  cli.add_attention_flag(p)
  cli.add_gemm_flag(p)
  cli.add_devices_flag(p)
  p.add_argument("--no-transformers", dest="transformers", action="store_false")
  p.add_argument("--out", type=Path, help="results JSON (a PNG of them is written beside it)")
  args = p.parse_args(argv)
  if unknown := {m.value for m, _, _ in args.methods} - {"ar", "pld", "longspec", "tokenswift"}:
    p.error(f"--methods: --suite floor times ar, pld, longspec and tokenswift rounds, not {', '.join(sorted(unknown))}")
  if args.trees and (args.suite != "floor" or Method.LONGSPEC not in {m for m, _, _ in args.methods}):
    p.error("--trees are longspec's trees for --suite floor: add longspec to --methods")
  if args.devices > 1 and (args.suite != "floor" or "invariant" in args.numerics):
    p.error("--devices splits the model of --suite floor's fast rounds (batch-invariant rounds run on one device)")
  args.mesh = cli.device_mesh(args.devices)  # (before JAX runs anything: a CPU's devices are made for it)
  args.attention = cli.attention_impl(args.attention).value
  if args.out:
    cli.output_path(args.out)
  if args.suite == "smollm2":
    context = SMOLLM2_135M.max_position_embeddings
    if max(args.prompt_lengths) + args.new_tokens > context:
      p.error(
        f"--prompt-lengths up to {max(args.prompt_lengths)} plus --new-tokens {args.new_tokens} exceed"
        f" SmolLM2's context of {context} tokens"
      )
  if args.suite == "floor" and max(args.contexts) >= SHAPES[args.shape].max_position_embeddings:
    p.error(f"--contexts must stay below {args.shape}'s context of {SHAPES[args.shape].max_position_embeddings}")
  header = {
    "smollm2": "prompt | ours prefill tok/s | ours decode | HF dynamic | HF static | ours/best HF",
    "floor": "method | numerics | batch | context | round | AR read floor | floor/step | round floor | round/floor"
    " | floor terms ms: draft, head, verify bytes, verify FLOPs | transformers step"
    " | prefill tok/s (share of the FLOP floor)",
    "topk": "vocab x rows | lax.top_k us | two-stage us, chunks of 512 | 1024 | 2048 | 4096",
  }[args.suite]
  print(
    f"device: {jax.devices()[0].device_kind} ({jax.default_backend()}), jax {jax.__version__}"
    + (f", {args.devices} devices" if args.devices > 1 else "")
  )
  print(header, flush=True)
  result = {
    "suite": args.suite,
    **environment(),
    "argv": sys.argv[1:],
  }
  result.update({"smollm2": suite_smollm2, "floor": suite_floor, "topk": suite_topk}[args.suite](args))
  if args.out:
    plots.save(result, args.out)


if __name__ == "__main__":
  cli.run_main(main, "python -m lab.bench_target")
