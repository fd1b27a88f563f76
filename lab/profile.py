"""`python -m lab.profile`: where a decoding method's device time goes, kernel by kernel.

Runs one method on one prompt under the JAX profiler, then adds up the device time of
every operation of the decode loop (`engine._decode_chunk`) and charges it to the
engine's named scopes: `propose` (the draft), `verify` (the target over the tree),
`accept` (the walk over the tree) and `commit` (cache, history and output updates).
Ops are named from XLA's own HLO dump of the loop, written beside the trace; ops XLA
emits without a source (e.g. its GPU top-k) are "unattributed". Also reports how much of
the loop's span the device sat idle (launch gaps, host syncs), and where the host's
threads spent their time in that span, by event (on a GPU, XLA steps while loops and
conditionals from the host: graph launches and updates, reads of a loop's condition or a
switch's index, show up there). Inside a CUDA graph (XLA's command buffers) the profiler
names the graph as each kernel's op; a kernel XLA generated is charged to its own
instruction by its name, a library's (cuBLAS) stays the graph's. A table of the graphs
gives each one's device time and scopes, its launches and how often the host updated
it (a graph whose buffers moved since its last launch is rewritten: milliseconds).
`--generations N` profiles N generations one after another, each on prompts of its own,
as the benchmark runs them, and lists each one's decode time and graph updates: a graph
rewritten at the start of every generation costs each of them (what the profile of one
generation after the warm-up cannot tell from a rewrite that only the first one pays).
Writes `profile.json`, `profile.png` and the raw trace under --out. `--shape` profiles a
random-weight model of a real model's shape (e.g. Llama-3.1-8B) on random prompt tokens,
with a random draft: what a round costs at that size (its tau means nothing).

  python -m lab.profile --method longspec --draft default --set code --length 4096 --out prof/
  python -m lab.profile --method longspec --shape llama-3.1-8b --draft random --draft-vocab 32768 \
    --length 32768 --out prof8b/
"""

from __future__ import annotations

import collections
import glob
import json
import os
import re
import sys
from pathlib import Path

from infer.cli import add_copy_flags, add_past_flag, add_sampling_flags, add_tree_flags, sampling_config, tree_choice
from infer.plots import plot
from infer.prompts import PROMPT_SETS
from lab.shapes import SHAPES
from longspec_jax.cli import (
  ArgumentParser,
  add_attention_flag,
  add_batch_invariant_flag,
  add_gemm_flag,
  attention_impl,
  method_type,
  nonnegative_int,
  number_type,
  numerics,
  output_path,
  positive_int,
  resolve_dtype,
  run_main,
)
from longspec_jax.errors import UserError
from longspec_jax.methods.registry import Method

SETS = tuple(PROMPT_SETS)

SCOPES = ("propose", "verify", "accept", "commit")
LOOP = "decode_chunk"  # the jitted decode loop's module name contains this
GRAPH = "command_buffer_"  # XLA's name for a command buffer (CUDA graph) op, and its host event
UPDATE = "command_buffer::update"  # the host rewriting a graph's buffer addresses
_ITERATION = re.compile(r"\[iter=\d+\]")
_INSTRUCTION = re.compile(r'^\s*(?:ROOT )?%?([\w.\-]+) = .*?metadata=\{[^}]*op_name="([^"]+)"')


def op_names(dump_dir: Path) -> dict[str, str]:
  """HLO instruction name -> the JAX op path it came from (e.g. `.../while/body/verify/
  dot_general`), from the optimized HLO of the decode loop; each name also as its kernel
  is named (`loop_add_fusion.3` -> `loop_add_fusion_3`)."""
  names = {}
  for path in glob.glob(str(dump_dir / f"*{LOOP}*after_optimizations.txt")):
    for line in Path(path).read_text().splitlines():
      if match := _INSTRUCTION.match(line):
        for name in (match.group(1), re.sub(r"[.\-]", "_", match.group(1))):
          names.setdefault(name, match.group(2))
  return names


def scope_of(op_name: str | None) -> str:
  parts = (op_name or "").split("/")
  return next((part for part in parts if part in SCOPES), "unattributed")


# A round's parts, in the order tables list them: the verify pass's and the draft's
# products, heads, attention kernels and the rest, and the walk over the tree and the
# commit (with what no scope claims).
PARTS = (
  "verify_matmul",
  "verify_head",
  "verify_attention",
  "verify_other",
  "draft_matmul",
  "draft_head",
  "draft_attention",
  "draft_other",
  "accept_commit",
)
_ATTENTION = ("hybrid_attention", "flash_decode", "tree_attention", "sparse_decode")
_HEAD = ("...e,ev->...v", "...e,ve->...v", "head_top_k")  # the LM head's product (either layout), its fused top-k


def part_of(hlo_op: str, op_name: str | None) -> str:
  """The part of a round (`PARTS`) an op's device time belongs to: by its scope, then by
  what it is (a GEMM, cuBLAS's or the Pallas matmul; the LM head's product; a Pallas
  attention kernel; anything else)."""
  scope, name = scope_of(op_name), op_name or ""
  if scope not in ("verify", "propose"):
    return "accept_commit"
  side = "verify" if scope == "verify" else "draft"
  if any(head in name for head in _HEAD):
    return f"{side}_head"
  if hlo_op.startswith(("custom-call", "cublas")) or "matmul/pallas_call" in name:
    return f"{side}_matmul"
  if any(kernel in name for kernel in _ATTENTION):
    return f"{side}_attention"
  return f"{side}_other"


def read_trace(folder: Path):
  """The latest trace `jax.profiler.trace` wrote under `folder` (`jax.profiler.ProfileData`)."""
  import jax

  xspace = sorted(glob.glob(str(folder / "**" / "*.xplane.pb"), recursive=True))
  if not xspace:
    raise UserError(f"the profiler wrote no trace under {folder}.")
  return jax.profiler.ProfileData.from_file(xspace[-1])


def device_events(data, module: str = LOOP):
  """(start ns, duration ns, hlo op, kernel name) of every device event in a trace
  (`jax.profiler.ProfileData`) of the programs whose module name holds `module` (default
  the decode loop; "": every program). Device planes on an accelerator; the host's XLA
  thunks on a CPU-only machine."""
  planes = [p for p in data.planes if p.name.startswith("/device:")] or [
    p for p in data.planes if p.name == "/host:CPU"
  ]
  for plane in planes:
    for line in plane.lines:
      for event in line.events:
        stats = dict(event.stats)
        if module in str(stats.get("hlo_module", "")) and "hlo_op" in stats:
          yield event.start_ns, event.duration_ns, str(stats["hlo_op"]), event.name


def host_events(data):
  """(start ns, duration ns, thread, event name) of every host event in a trace: XLA's
  runtime (thunks, graph launches and updates, host syncs) and the Python side of a call."""
  for plane in data.planes:
    if plane.name.startswith("/host:"):
      for line in plane.lines:
        for event in line.events:
          yield event.start_ns, event.duration_ns, line.name, event.name


def host_summary(events, start_ns: float, end_ns: float, top: int) -> list[dict]:
  """The host events inside [start_ns, end_ns] totalled by (thread, name), the longest
  first. Events nest (a call holds its launches), so the rows overlap and do not sum."""
  by_name = collections.defaultdict(lambda: [0.0, 0])
  for start, duration, thread, name in events:
    if start >= start_ns and start + duration <= end_ns:
      name = _ITERATION.sub("[iter]", name)  # (XLA names a loop's iterations by number)
      by_name[thread, name][0] += duration
      by_name[thread, name][1] += 1
  ranked = sorted(by_name.items(), key=lambda item: -item[1][0])[:top]
  return [{"thread": thread, "event": name, "ms": ns / 1e6, "calls": calls} for (thread, name), (ns, calls) in ranked]


def graph_updates(events, start_ns: float, end_ns: float) -> dict[str, list]:
  """Graph -> [launches, updates, update ns] from the host events inside [start_ns,
  end_ns]: each update is charged to the graph event around it on its thread."""
  by_graph = collections.defaultdict(lambda: [0, 0, 0.0])
  inside = sorted(
    (event for event in events if event[0] >= start_ns and event[0] + event[1] <= end_ns),
    key=lambda event: (event[0], -event[1]),
  )  # (an event before those it holds)
  open_graphs = collections.defaultdict(list)  # thread -> the graph events around now
  for start, duration, thread, name in inside:
    stack = open_graphs[thread]
    while stack and stack[-1][0] + stack[-1][1] < start + duration:
      stack.pop()
    if name.startswith(GRAPH):
      by_graph[name][0] += 1
      stack.append((start, duration, name))
    elif name == UPDATE and stack:
      by_graph[stack[-1][2]][1] += 1
      by_graph[stack[-1][2]][2] += duration
  return by_graph


def back_to_back(generations: list[tuple[list, list]]) -> tuple[list, list]:
  """The (device, host) events of several traced generations (start ns first) on one time
  line: each generation's shifted to begin where the previous one's device events ended,
  so that the gaps between generations (prefill, host work outside the decode loop) do
  not count as the loop's idle time."""
  device, host, end = [], [], 0
  for on_device, on_host in generations:
    if on_device:
      shift = end - min(event[0] for event in on_device)
      device += [(start + shift, *rest) for start, *rest in on_device]
      host += [(start + shift, *rest) for start, *rest in on_host]
      end = max(start + duration for start, duration, *_ in device)
  return device, host


def kernel_op(hlo_op: str, kernel: str, names: dict[str, str]) -> str:
  """The HLO instruction a kernel ran: its op, or inside a CUDA graph (whose kernels all
  name the graph as their op) the kernel's own instruction where XLA generated it."""
  return kernel if hlo_op.startswith(GRAPH) and kernel in names else hlo_op


def busy_ns(events) -> float:
  """Length of the union of the events' intervals (concurrent kernels count once)."""
  total, end = 0.0, float("-inf")
  for start, duration, *_ in sorted(events):
    total += max(0.0, start + duration - max(start, end))
    end = max(end, start + duration)
  return total


def summarize(events: list, names: dict[str, str], top: int, updates: dict[str, list] | None = None) -> dict:
  """Device time by op and by scope, the idle share of the loop's span, and per CUDA
  graph its device time by scope with its launches and updates (`graph_updates`)."""
  by_op = collections.defaultdict(lambda: [0.0, 0])
  graphs = collections.defaultdict(collections.Counter)  # graph -> scope -> ns
  for _, duration, hlo_op, kernel in events:
    op = kernel_op(hlo_op, kernel, names)
    by_op[op][0] += duration
    by_op[op][1] += 1
    if hlo_op.startswith(GRAPH):
      graphs[hlo_op][scope_of(names.get(op))] += duration
  total = sum(d for d, _ in by_op.values()) or 1.0
  by_scope, by_part = collections.Counter(), collections.Counter({part: 0.0 for part in PARTS})
  for op, (duration, _) in by_op.items():
    by_scope[scope_of(names.get(op))] += duration
    by_part[part_of(op, names.get(op))] += duration
  span = (max(s + d for s, d, *_ in events) - min(s for s, *_ in events)) if events else 0.0
  updates = updates or {}
  ranked = sorted(by_op.items(), key=lambda item: -item[1][0])[:top]
  return {
    "kernel_ms": total / 1e6,
    "span_ms": span / 1e6,
    "idle_share_of_span": 1 - busy_ns(events) / span if span else 0.0,
    "by_scope": {scope: {"ms": ns / 1e6, "share": ns / total} for scope, ns in by_scope.most_common()},
    "by_part_ms": {part: by_part[part] / 1e6 for part in PARTS},
    "top_ops": [
      {
        "hlo_op": op,
        "ms": ns / 1e6,
        "share": ns / total,
        "calls": calls,
        "scope": scope_of(names.get(op)),
        "op_name": names.get(op),
      }
      for op, (ns, calls) in ranked
    ],
    "graphs": [
      graph_row(graph, scopes, *updates.get(graph, (0, 0, 0.0)))
      for graph, scopes in sorted(graphs.items(), key=lambda item: -sum(item[1].values()))
    ],
  }


def graph_row(graph: str, scopes: collections.Counter, launches: int, updates: int, update_ns: float) -> dict:
  """A CUDA graph's row: its device time in all and by scope, launches and updates."""
  return {
    "graph": graph,
    "ms": sum(scopes.values()) / 1e6,
    "scopes": {scope: ns / 1e6 for scope, ns in scopes.most_common()},
    "launches": launches,
    "updates": updates,
    "update_ms": update_ns / 1e6,
  }


def main(argv=None):
  p = ArgumentParser(prog="python -m lab.profile", description=__doc__.splitlines()[0])
  p.add_argument("--method", type=method_type, choices=list(Method), default=Method.LONGSPEC)
  p.add_argument(
    "--draft",
    help="draft for longspec, glide, tokenswift (its heads) and auto: 'default' (theirs),"
    " 'random', a checkpoint dir; auto uses one only when named",
  )
  p.add_argument(
    "--draft-vocab",
    type=nonnegative_int,
    help="the tokens a block draft scores, the most frequent first (0: all; default: the draft's own setting)",
  )
  add_tree_flags(p)
  add_copy_flags(p)
  add_past_flag(p, corpus=False)
  p.add_argument("--set", default="code", choices=SETS, help="prompt set")
  p.add_argument("--length", type=positive_int, default=4096, help="prefill tokens")
  p.add_argument("--new-tokens", type=number_type(int, lambda x: x >= 2, "an integer >= 2"), default=128)
  p.add_argument("--target", default=None, help="default: the embedded SmolLM2-135M-Instruct")
  p.add_argument("--shape", choices=sorted(SHAPES), help="a random-weight target of this shape, random prompt tokens")
  p.add_argument("--batch", type=positive_int, default=1, help="sequences decoded together")
  p.add_argument(
    "--generations",
    type=positive_int,
    default=1,
    help="generations profiled one after another, each on prompts of its own",
  )
  p.add_argument("--dtype", choices=("float32", "bfloat16"))
  add_attention_flag(p)
  add_gemm_flag(p)
  add_batch_invariant_flag(p)
  p.add_argument("--top", type=positive_int, default=25, help="how many ops to list")
  add_sampling_flags(p)
  p.add_argument("--out", type=Path, required=True, help="a directory: profile.json, profile.png, the trace, HLO")
  args = p.parse_args(argv)
  if args.shape and args.target:
    p.error("give --target or --shape, not both")
  output_path(args.out, "directory")
  dump_dir = args.out / "hlo"
  if "jax" in sys.modules:
    raise UserError("run `python -m lab.profile` as its own process: it sets XLA's dump flags before JAX starts.")
  os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + f" --xla_dump_to={dump_dir} --xla_dump_hlo_as_text"
    f" --xla_dump_hlo_module_re=.*{LOOP}.*"
  ).strip()

  import jax
  import numpy as np

  from infer.timing import Compiles, warmed_up
  from longspec_jax.engine import Decoding, generate
  from longspec_jax.methods.factory import make_proposer
  from longspec_jax.methods.registry import ProposerOptions
  from longspec_jax.models.target import random_model
  from longspec_jax.weights.drafts import load_draft

  spec = args.method.draft_spec(args.draft)
  if args.shape and spec not in (None, "random"):
    p.error("a --shape target has random weights: its draft must be --draft random")
  impl = attention_impl(args.attention)
  dtype = resolve_dtype(args.dtype)
  if args.shape:  # (no weights to read: the GGUF reader is not imported)
    target_name = f"random {args.shape}"
    config = SHAPES[args.shape]
    model = random_model(config, dtype, numerics=numerics(args))
    prompts = (
      np.random.default_rng(args.seed)
      .integers(0, config.vocab_size, (args.generations * args.batch, args.length))
      .tolist()
    )
  else:
    from longspec_jax.weights import default, load_target

    target_name = args.target or default.NAME
    target = load_target(target_name, dtype, numerics=numerics(args))
    model, config = target.model, target.config
    prompts = PROMPT_SETS[args.set](target.tokenizer, args.length, args.generations * args.batch)
  draft = (
    load_draft(
      spec, config, dtype, target_name, attention=impl, kind=args.method.draft_kind, vocab_subset=args.draft_vocab
    )
    if spec is not None
    else None
  )
  widths, cape = tree_choice(args.tree_widths, args)
  sampling = sampling_config(args, args.method)
  proposer, proposer_params = make_proposer(
    args.method,
    draft,
    ProposerOptions(
      tree_widths=widths,
      copy_tokens=args.copy_tokens,
      cape=cape,
      copy_matches=args.copy_matches,
      past_tokens=args.past_tokens,
      sampling=sampling,
      batch=args.batch,
    ),
  )
  decoding = Decoding(proposer=proposer, sampling=sampling)

  def run(generation: int):
    batch = prompts[generation * args.batch : (generation + 1) * args.batch]
    return generate(model, batch, args.new_tokens, decoding, proposer_params, seed=args.seed)

  warmed_up(lambda: run(0))  # compiles (and `auto` measures its round prices)
  names = op_names(dump_dir)
  traced, generations = [], []
  for generation in range(args.generations):
    trace_dir = args.out / "trace" / str(generation)
    with jax.profiler.trace(str(trace_dir)), Compiles() as compiled:
      result = run(generation)
    trace = read_trace(trace_dir)
    events = list(device_events(trace))
    span = (min(s for s, *_ in events), max(s + d for s, d, *_ in events)) if events else (0, 0)
    on_host = [event for event in host_events(trace) if event[0] >= span[0] and event[0] + event[1] <= span[1]]
    updates = graph_updates(on_host, *span)
    stats = result.stats
    generations.append(
      {
        "decode_ms": 1e3 * stats.decode_seconds,
        "rounds": stats.rounds,
        "tau": stats.mean_accepted_length,
        "new_tokens": stats.num_new_tokens,
        "graph_launches": sum(row[0] for row in updates.values()),
        "graph_updates": sum(row[1] for row in updates.values()),
        "update_ms": sum(row[2] for row in updates.values()) / 1e6,
        "compile_seconds": compiled.seconds,
      }
    )
    traced.append((events, on_host))
    del result  # (its caches: each generation starts as the benchmark's do)
  events, on_host = back_to_back(traced)
  span = (min(s for s, *_ in events), max(s + d for s, d, *_ in events)) if events else None
  summary = summarize(events, names, args.top, graph_updates(on_host, *span) if span else None)
  if span:  # the host's work while the loop ran
    summary["host_events"] = host_summary(on_host, *span, args.top)
  rounds = sum(row["rounds"] for row in generations)
  report = {
    "device": jax.devices()[0].device_kind,
    "jax": jax.__version__,
    "method": args.method.value,
    "label": args.method.value
    + (f"[{','.join(map(str, widths))}]" if widths else "")
    + (f"+vocab{args.draft_vocab}" if args.draft_vocab is not None else ""),
    "target": target_name,
    "set": None if args.shape else args.set,
    "batch": args.batch,
    "prefill_tokens": len(prompts[0]),
    "new_tokens": sum(row["new_tokens"] for row in generations),
    "rounds": rounds,
    "tau": sum(row["tau"] * row["rounds"] for row in generations) / max(rounds, 1),
    "decode_ms": sum(row["decode_ms"] for row in generations),
    "generations": generations,
    **summary,
  }
  (args.out / "profile.json").write_text(json.dumps(report, indent=1))
  plot(report, args.out / "profile.png")

  rounds = max(rounds, 1)
  print(
    f"{args.method} on {report['device']}: {len(prompts[0])} prefill tokens, {report['new_tokens']} new in"
    f" {rounds} rounds over {args.generations} generation(s) (tau {report['tau']:.2f}); decode"
    f" {report['decode_ms']:.1f} ms, device kernels {summary['kernel_ms']:.1f} ms, idle"
    f" {100 * summary['idle_share_of_span']:.0f}% of the loop's span"
  )
  if args.generations > 1:
    print("generation | decode ms | rounds | tau  | graph launches | updates | update ms")
    for index, row in enumerate(generations):
      print(
        f"{index:10d} | {row['decode_ms']:9.1f} | {row['rounds']:6d} | {row['tau']:4.2f} |"
        f" {row['graph_launches']:14d} | {row['graph_updates']:7d} | {row['update_ms']:9.2f}"
      )
  print("part             | us per round")
  for part, ms in summary["by_part_ms"].items():
    print(f"{part:16} | {1e3 * ms / rounds:12.1f}")
  print("scope    | ms per round | share")
  for scope, row in summary["by_scope"].items():
    print(f"{scope:8} | {row['ms'] / rounds:12.3f} | {100 * row['share']:4.1f}%")
  print("op                                  | scope    | us per round | calls/round | share | from")
  for row in summary["top_ops"]:
    origin = (row["op_name"] or "").split("/")[-3:]
    print(
      f"{row['hlo_op'][:35]:35} | {row['scope']:8} | {1e3 * row['ms'] / rounds:12.1f} |"
      f" {row['calls'] / rounds:11.1f} | {100 * row['share']:4.1f}% | {'/'.join(origin)}"
    )
  if summary["graphs"]:
    print("CUDA graph           | device us/round | launches | updates | update ms | scopes (device ms)")
    for row in summary["graphs"]:
      scopes = ", ".join(f"{scope} {ms:.1f}" for scope, ms in row["scopes"].items())
      print(
        f"{row['graph'][:20]:20} | {1e3 * row['ms'] / rounds:15.1f} | {row['launches']:8d} | {row['updates']:7d} |"
        f" {row['update_ms']:9.2f} | {scopes}"
      )
  if summary.get("host_events"):
    print("host thread          | event                               | us per round | calls/round")
    for row in summary["host_events"]:
      print(
        f"{row['thread'][:20]:20} | {row['event'][:35]:35} | {1e3 * row['ms'] / rounds:12.1f} |"
        f" {row['calls'] / rounds:11.1f}"
      )


if __name__ == "__main__":
  run_main(main, "python -m lab.profile")
