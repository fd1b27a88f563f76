"""Plots of benchmark results: every benchmark writes a PNG beside its JSON.

`plot(result_json)` recognises what a JSON holds (a method comparison from
`infer.benchmark`, a target suite from `lab.bench_target`, a profile from
`lab.profile`, kernel suites from `lab.bench_kernels`, a tree search from
`infer.tree_search`, auto's rounds from `lab.bench_auto`, long outputs from
`lab.bench_long`, sparse verification's quality from `lab.sparse_quality`, the draft's
training step from `lab.bench_step`, the server against generate from `lab.bench_serve`)
and draws it;
`python -m infer.plots FILE.json ... [--out-dir DIR]` redraws saved results (those in
docs/results included); `--join OUT.png` draws several method comparisons
(e.g. runs at different prompt lengths) as one.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path


def _pyplot():
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  return plt


def _title(result: dict, what: str) -> str:
  device = result.get("device", "")
  extra = ", ".join(str(result[k]) for k in ("dtype", "attention") if result.get(k))
  return f"{what} ({device}{', ' + extra if extra else ''})"


def _log_x(ax, xs) -> None:
  """A log x axis labelled at the measured points only."""
  xs = sorted(set(xs))
  ax.set_xscale("log")
  ax.set_xticks(xs, [f"{x:,}" for x in xs])
  ax.minorticks_off()


def _methods(result: dict, plt):
  """Speedup over AR and tau, one column per prompt set, against prefill length, or with
  several batch sizes against the batch (beside tokens/s over the batch); with several
  lengths also the drafts' state (GLIDE's grows with the context, LongSpec's does not)."""
  rows = result["rows"]
  sets = sorted({r["set"] for r in rows})
  sweep = "batch" if len({r.get("batch", 1) for r in rows}) > 1 else "prefill_tokens"
  several_lengths = len({r["prefill_tokens"] for r in rows}) > 1
  titles = {"speedup_vs_ar": "decode speedup vs AR", "tau": "tau", "tokens_per_second": "tokens/s over the batch"}
  titles["draft_state_mib"] = "draft state"
  units = {"speedup_vs_ar": "x AR tokens/s", "tau": "tokens per target forward", "tokens_per_second": "tokens/s"}
  units["draft_state_mib"] = "MiB"
  keys = ["speedup_vs_ar", "tau"] + (["tokens_per_second"] if sweep == "batch" else [])
  if sweep == "prefill_tokens" and several_lengths and any(r.get("draft_state_mib") for r in rows):
    keys.append("draft_state_mib")
  fig, axes = plt.subplots(len(keys), len(sets), figsize=(5 * len(sets), 3.25 * len(keys)), squeeze=False)
  for column, set_name in enumerate(sets):
    by_line = defaultdict(list)
    for r in rows:
      if r["set"] == set_name:
        apart = sweep == "batch" and several_lengths  # (a line per method and length)
        by_line[f"{r['method']} @ {r['prefill_tokens']:,}" if apart else r["method"]].append(r)
    xs = sorted({r.get(sweep, 1) for r in rows if r["set"] == set_name})
    for index, (label, points) in enumerate(by_line.items()):
      points.sort(key=lambda r: r.get(sweep, 1))
      for ax, key in zip(axes[:, column], keys):
        if len(xs) > 1:
          ax.plot([r.get(sweep, 1) for r in points], [r[key] for r in points], marker="o", label=label)
        else:  # one prefill length and batch: a bar per method
          ax.bar(index, points[0][key], label=label, color=f"C{index}")
    axes[0, column].axhline(1.0, color="grey", lw=0.8, ls="--")
    for ax, key in zip(axes[:, column], keys):
      ax.set(title=f"{set_name}: {titles[key]}", ylabel=units[key])
      if len(xs) > 1:
        _log_x(ax, xs)
      else:
        ax.set_xticks(range(len(by_line)), list(by_line), fontsize=7)
      ax.grid(alpha=0.3)
    what = "batch" if sweep == "batch" else "prefill tokens"
    axes[-1, column].set(xlabel=what if len(xs) > 1 else f"method, {xs[0]:,} {what}")
    axes[0, column].legend(fontsize=8)
  temperature = (result.get("sampling") or {}).get("temperature", 0.0)
  fig.suptitle(_title(result, f"{result.get('target', '')} methods, T = {temperature}"), fontsize=9)
  return fig


def _smollm2(result: dict, plt):
  rows = sorted(result["rows"], key=lambda r: r["prompt_tokens"])
  x = [r["prompt_tokens"] for r in rows]
  fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
  series = {"ours": lambda r: r["ours"]}
  for name in rows[0].get("transformers") or {}:
    series[f"transformers {name}"] = lambda r, n=name: r["transformers"][n]
  for label, get in series.items():
    axes[0].plot(x, [get(r)["decode_tokens_per_second"] for r in rows], marker="o", label=label)
    axes[1].plot(x, [get(r)["prefill_tokens_per_second"] for r in rows], marker="o", label=label)
  axes[0].set(title="AR decode", ylabel="tokens/s", xlabel="prompt tokens")
  axes[1].set(title="prefill", ylabel="tokens/s", xlabel="prompt tokens", yscale="log")
  for ax in axes:
    _log_x(ax, x)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
  fig.suptitle(_title(result, "SmolLM2-135M, ours vs transformers"))
  return fig


def _floor(result: dict, plt):
  """Per (batch, context): each method's round, the AR step's bytes floor and, where it
  ran, transformers' step; the AR bar is labelled with its share of the floor."""
  rows = result["rows"]
  groups = list(dict.fromkeys((r["batch"], r["context"]) for r in rows))
  methods = list(dict.fromkeys(r["method"] for r in rows))
  bars = [*methods, "floor", "transformers"]
  width = 0.8 / len(bars)
  fig, ax = plt.subplots(figsize=(max(6.0, 1.6 + 1.4 * len(groups)), 3.8))
  for i, bar in enumerate(bars):
    heights = []
    for group in groups:
      at = [r for r in rows if (r["batch"], r["context"]) == group]
      ar = next((r for r in at if r["method"] == "ar"), at[0])
      value = {"floor": ar["floor_ms"], "transformers": ar.get("transformers_step_ms")}.get(
        bar, next((r["round_ms"] for r in at if r["method"] == bar), None)
      )
      heights.append(value or 0.0)
    xs = [g + (i - (len(bars) - 1) / 2) * width for g in range(len(groups))]
    label = {"floor": "AR bytes / bandwidth", "transformers": "transformers static cache"}.get(bar, f"{bar} round")
    ax.bar(xs, heights, width, label=label)
    if bar == "ar":
      for x, group in zip(xs, groups):
        r = next(r for r in rows if (r["batch"], r["context"]) == group and r["method"] == "ar")
        ax.text(x, r["round_ms"], f"{r['fraction_of_floor']:.0%}", ha="center", va="bottom", fontsize=7)
  ax.set(
    xticks=list(range(len(groups))),
    xticklabels=[f"B={b}\n{c:,}" for b, c in groups],
    xlabel="batch, context",
    ylabel="ms",
    title=_title(result, f"{result.get('shape', '')} decode ({result.get('gemm', '')} GEMMs)"),
  )
  ax.legend(fontsize=7)
  ax.grid(alpha=0.3, axis="y")
  return fig


def _topk(result: dict, plt):
  rows = result["rows"]
  fig, ax = plt.subplots(figsize=(6, 3.8))
  for vocab in sorted({r["vocab"] for r in rows}):
    points = sorted((r for r in rows if r["vocab"] == vocab), key=lambda r: r["rows"])
    x = [r["rows"] for r in points]
    ax.plot(x, [r["lax_us"] for r in points], marker="o", label=f"lax.top_k, V={vocab}")
    for chunk in result.get("chunks", [])[:1]:
      ax.plot(x, [r[f"chunk_{chunk}_us"] for r in points], marker="s", ls="--", label=f"two-stage/{chunk}, V={vocab}")
  ax.set(xscale="log", yscale="log", xlabel="rows", ylabel="us", title=_title(result, "vocabulary top-k"))
  ax.legend(fontsize=7)
  ax.grid(alpha=0.3)
  return fig


def _profile(result: dict, plt):
  rounds = max(result.get("rounds", 1), 1)
  scopes = list(result["by_scope"].items())
  fig, ax = plt.subplots(figsize=(6, 3.2))
  ax.barh([s for s, _ in scopes], [row["ms"] / rounds for _, row in scopes])
  ax.invert_yaxis()
  ax.set(
    xlabel="device ms per round",
    title=_title(result, f"{result['method']}: tau {result['tau']:.2f}, idle {result['idle_share_of_span']:.0%}"),
  )
  ax.grid(alpha=0.3, axis="x")
  return fig


def _kernels(result: dict, plt):
  """The kernel suites: the grid (hybrid over cudnn, prefix pass bandwidth), the floor,
  the 8B verify step, the sweep, the few-row matmuls and the sparse prefix pass."""
  panels = [k for k in ("grid", "floor", "verify", "sweep", "matmul") if result.get(k)]
  if any("kept" in r for r in result.get("sparse", ())):
    panels.append("sparse")
  count = len(panels) + ("grid" in panels)
  fig, axes = plt.subplots(1, count, figsize=(5 * count, 3.8), squeeze=False)
  axes = list(axes[0])
  if "grid" in panels:
    groups = defaultdict(list)
    for r in result["grid"]:
      groups[(r["heads"], r["batch"], r["T"])].append(r)
    ax_speed, ax_bw = axes.pop(0), axes.pop(0)
    for (heads, batch, steps), points in sorted(groups.items()):
      points.sort(key=lambda r: r["S"])
      style = dict(marker=".", label=f"{heads} b{batch} T{steps}", ls="-" if heads.startswith("llama") else "--")
      ax_speed.plot([r["S"] for r in points], [r.get("cudnn_over_hybrid") for r in points], **style)
      ax_bw.plot([r["S"] for r in points], [r.get("prefix_fraction_of_copy") for r in points], **style)
    ax_speed.set(xscale="log", xlabel="prefix length S", ylabel="cudnn time / hybrid time", title="hybrid vs cudnn")
    ax_bw.set(xscale="log", xlabel="prefix length S", ylabel="fraction of copy bandwidth", title="prefix pass")
    ax_bw.axhline(0.8, color="grey", lw=0.8, ls="--")
    ax_speed.legend(fontsize=5, ncol=2)
    for ax in (ax_speed, ax_bw):
      ax.grid(alpha=0.3)
  if "floor" in panels:
    ax = axes.pop(0)
    rows = result["floor"]
    for key in ("pass_us", "xla_read_us", "pallas_read_us", "copy_bandwidth_us"):
      points = [(r["S"], r[key]) for r in rows if r.get(key) is not None and r["T"] == rows[0]["T"]]
      ax.plot(*zip(*points), marker=".", label=key.removesuffix("_us"))
    ax.set(xscale="log", yscale="log", xlabel="prefix length S", ylabel="us", title="prefix pass vs reads of its bytes")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
  if "verify" in panels:
    ax = axes.pop(0)
    rows = result["verify"]
    labels = [f"{r['context']:,}/{r['nodes']}" for r in rows]
    # Bars per context: the dense kernels, the reference (where run), sparse at each kept fraction.
    bars = [("pallas", [r["pallas_ms"] for r in rows]), ("reference", [r.get("reference_ms") for r in rows])]
    fractions = sorted({s["kept"] for r in rows for s in r.get("sparse", ())})
    bars += [
      (f"sparse, {f:.0%} kept", [next((s["ms"] for s in r.get("sparse", ()) if s["kept"] == f), None) for r in rows])
      for f in fractions
    ]
    bars = [(name, heights) for name, heights in bars if any(h is not None for h in heights)]
    width = 0.8 / len(bars)
    for index, (name, heights) in enumerate(bars):
      ax.bar(
        [x + (index - (len(bars) - 1) / 2) * width for x in range(len(rows))],
        [h or 0 for h in heights],
        width,
        label=name,
      )
    ax.set(
      xticks=list(range(len(rows))),
      xticklabels=labels,
      xlabel="context / tree nodes",
      ylabel="ms",
      title="8B verify step",
    )
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3, axis="y")
  if "sweep" in panels:  # each shape's timings over the swept settings, the table's marked
    ax = axes.pop(0)
    groups = defaultdict(list)
    for r in result["sweep"]:
      groups[f"{r['heads'][:6]} b{r['batch']} S{r['S'] // 1024}k T{r['T']}"].append(r)
    for y, (_, points) in enumerate(sorted(groups.items())):
      best = min(r["prefix_us"] for r in points)
      ax.scatter([r["prefix_us"] / best for r in points], [y] * len(points), s=8, color="tab:blue")
      ax.scatter(
        [r["prefix_us"] / best for r in points if r.get("table")],
        [y] * sum(bool(r.get("table")) for r in points),
        s=30,
        color="tab:red",
        marker="x",
      )
    ax.set(
      yticks=range(len(groups)),
      yticklabels=sorted(groups),
      xlabel="time / best setting",
      title="sweep (x: the tuning table's choice)",
    )
    ax.tick_params(axis="y", labelsize=6)
    ax.grid(alpha=0.3)
  if "matmul" in panels:  # achieved fraction of the weight-read floor, by rows
    ax = axes.pop(0)
    for i, name in enumerate(dict.fromkeys(r["name"] for r in result["matmul"])):
      points = [r for r in result["matmul"] if r["name"] == name]
      for impl, style in (("pallas", "-"), ("xla", "--"), ("torch", ":")):
        if f"{impl}_of_floor" in points[0]:
          ax.plot(
            [r["rows"] for r in points],
            [r[f"{impl}_of_floor"] for r in points],
            ls=style,
            marker=".",
            color=f"C{i}",
            label=f"{name} {impl}",
          )
    ax.set(xscale="log", xlabel="rows", ylabel="weight bytes / bandwidth / time", title="few-row matmuls")
    ax.legend(fontsize=5, ncol=3)
    ax.grid(alpha=0.3)
  if "sparse" in panels:  # the sparse pass's gain over the dense one, by the fraction of chunks kept
    ax = axes.pop(0)
    groups = defaultdict(list)
    for r in result["sparse"]:
      if "kept" in r:
        groups[f"S{r['S'] // 1024}k T{r['T']} chunk {r['chunk']}"].append(r)
    for label, points in sorted(groups.items()):
      ax.plot([r["kept"] for r in points], [r["dense_over_sparse"] for r in points], marker=".", label=label)
    ax.plot([0.05, 1], [20, 1], color="grey", lw=0.8, ls="--", label="bytes read")
    ax.set(
      xscale="log",
      yscale="log",
      xlabel="fraction of chunks kept",
      ylabel="dense time / sparse time",
      title="sparse prefix pass",
    )
    ax.legend(fontsize=5)
    ax.grid(alpha=0.3)
  fig.suptitle(_title(result, "kernels"))
  return fig


def _tree_search(result: dict, plt):
  """`infer.tree_search`: tau and tokens/s of every tree measured against its size, the
  chosen tree marked."""
  points = sorted(result["evaluations"], key=lambda e: e["nodes"])
  best = result.get("best")
  fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
  for ax, key, what in zip(axes, ("tau", "tokens_per_second"), ("tau (tokens per round)", "decode tokens/s")):
    ax.scatter([e["nodes"] for e in points], [e[key] for e in points], color="C0")
    for e in points:
      label = ",".join(map(str, e["tree_widths"])) + (f"+c{e['copy_tokens']}" if e["copy_tokens"] else "")
      ax.annotate(label, (e["nodes"], e[key]), fontsize=6, xytext=(3, 2), textcoords="offset points")
    chosen = [
      e for e in points if best and e["tree_widths"] == best["tree_widths"] and e["copy_tokens"] == best["copy_tokens"]
    ]
    if chosen:
      ax.scatter([chosen[0]["nodes"]], [chosen[0][key]], s=120, facecolors="none", edgecolors="C3", label="chosen")
      ax.legend()
    ax.set(xlabel="nodes verified a round", ylabel=what, title=what)
  fig.suptitle(_title(result, f"tree search, {', '.join(result['sets'])} at {result['length']:,} tokens"))
  return fig


def _tree_prices(result: dict, plt):
  """`infer.tree_search --prices`: each tree's tau here and its projected tokens/s at the
  priced shape per context against its size, an AR step's as a line, the chosen tree
  marked."""
  rows = [r for r in result["rows"] if r["tree"] != "ar"]
  best = result.get("best") or {}
  fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
  by_tree = {r["tree"]: r for r in rows}
  axes[0].scatter([r["nodes"] for r in by_tree.values()], [r["tau"] for r in by_tree.values()], color="C0")
  for r in by_tree.values():
    axes[0].annotate(r["tree"], (r["nodes"], r["tau"]), fontsize=6, xytext=(3, 2), textcoords="offset points")
  axes[0].set(xlabel="nodes verified a round", ylabel="tau (tokens per round)", title="tau, measured here")
  chosen = {b["batch"]: b for b in result.get("best_by_batch") or []} or {1: best}
  priced = sorted({(r["context"], r.get("batch", 1)) for r in result["rows"]})
  for i, (context, batch) in enumerate(priced):
    at = lambda r: (r["context"], r.get("batch", 1)) == (context, batch)
    points = sorted((r for r in rows if at(r)), key=lambda r: r["nodes"])
    ar = next(r for r in result["rows"] if at(r) and r["tree"] == "ar")
    color = f"C{i}"
    axes[1].scatter([r["nodes"] for r in points], [r["projected_tokens_per_second"] for r in points], color=color)
    label = f"AR, {context:,} tokens" + (f", batch {batch}" if len(priced) > len({c for c, _ in priced}) else "")
    axes[1].axhline(ar["projected_tokens_per_second"], color=color, ls="--", lw=0.8, label=label)
    mark = chosen.get(batch, {})
    for r in points:
      if r["tree_widths"] == mark.get("tree_widths") and r["copy_tokens"] == mark.get("copy_tokens"):
        if context == result["price_context"]:
          axes[1].scatter([r["nodes"]], [r["projected_tokens_per_second"]], s=120, facecolors="none", edgecolors="C3")
  axes[1].set(
    xlabel="nodes verified a round", ylabel="projected tokens/s a sequence", title=f"at {result['shape']}'s prices"
  )
  axes[1].legend(fontsize=7)
  fig.suptitle(_title(result, f"trees priced at {result['shape']}, tau on {', '.join(result['sets'])}"))
  return fig


def _auto_rounds(result: dict, plt):
  """`lab.bench_auto`: milliseconds per round of each variant, one panel per prompt
  set, the part its measured prices account for shaded; prompt lookup's as a line."""
  sets = result["sets"]
  fig, axes = plt.subplots(1, len(sets), figsize=(max(9, 6 * len(sets)), 3.8), squeeze=False)
  for ax, (set_name, data) in zip(axes[0], sets.items()):
    rows = data["summary"]
    labels = list(rows)
    ax.barh(labels, [rows[k]["ms_per_round"] for k in labels], color="C0", label="per round")
    over = [rows[k]["ms_per_round_over_prices"] for k in labels]
    ax.barh(
      labels,
      [rows[k]["ms_per_round"] - (o or 0) if o is not None else 0 for k, o in zip(labels, over)],
      color="C2",
      label="at its measured prices",
    )
    ax.axvline(rows["pld"]["ms_per_round"], color="grey", lw=0.8, ls="--")
    ax.invert_yaxis()
    ax.set(
      xlabel="ms per round (median over generations)",
      title=set_name,
      xlim=(0, 1.45 * max(rows[k]["ms_per_round"] for k in labels)),
    )  # (room for the legend)
    ax.legend(fontsize=7, loc="upper right")
  fig.suptitle(_title(result, f"auto's rounds against prompt lookup's, {result['length']:,} tokens"))
  return fig


def _long_generation(result: dict, plt):
  """`lab.bench_long`: speedup over AR and tau against the output's length, cumulative
  (lines) and per segment (dashed), one column per contextual penalty."""
  rows = result["rows"]
  penalties = sorted({r["penalty"] for r in rows})
  fig, axes = plt.subplots(2, len(penalties), figsize=(5.5 * len(penalties), 6.5), squeeze=False)
  for column, penalty in enumerate(penalties):
    by_method = defaultdict(list)
    for r in rows:
      if r["penalty"] == penalty:
        by_method[r["method"]].append(r)
    for index, (method, points) in enumerate(by_method.items()):
      xs = [r["output_tokens"] for r in points]
      for ax, key in zip(axes[:, column], ("speedup_vs_ar", "tau")):
        ax.plot(xs, [r[key] for r in points], marker="o", color=f"C{index}", label=method)
        ax.plot(xs, [r[f"segment_{key}"] for r in points], ls="--", color=f"C{index}", alpha=0.6)
    axes[0, column].set(title=f"penalty {penalty:g}: speedup vs AR (dashed: per segment)", ylabel="x AR tokens/s")
    axes[1, column].set(title=f"penalty {penalty:g}: tau", ylabel="tokens per target forward", xlabel="output tokens")
    axes[0, column].legend(fontsize=7)
    for ax in axes[:, column]:
      ax.grid(alpha=0.3)
  fig.suptitle(_title(result, f"long generation, {result['prompt_tokens']:,}-token prompt ({result['set']})"))
  return fig


def _sparse_quality(result: dict, plt):
  """`lab.sparse_quality`: the perplexity increase over dense against the share of the
  K/V the verifier read, one panel per document set, a line per chunk size and guide
  (the draft's attention; dashed: each layer's own, the oracle), each point labelled
  with its p (the paper's Table 1 as a trade-off curve)."""
  by_set = defaultdict(list)
  for r in result["rows"]:
    if r["chunk"] is not None:
      by_set[r["set"]].append(r)
  fig, axes = plt.subplots(1, len(by_set), figsize=(5 * len(by_set), 4), squeeze=False)
  for ax, (set_name, rows) in zip(axes[0], by_set.items()):
    series = sorted({(r.get("guide") or "draft", r["chunk"]) for r in rows})
    for index, (guide, chunk) in enumerate(series):
      points = sorted(
        (r for r in rows if (r.get("guide") or "draft", r["chunk"]) == (guide, chunk)),
        key=lambda r: r["kv_fraction_read"],
      )
      xs, ys = [100 * r["kv_fraction_read"] for r in points], [100 * r["relative_increase"] for r in points]
      ax.plot(
        xs,
        ys,
        marker="o",
        color=f"C{index}",
        ls="--" if guide == "oracle" else "-",
        label=f"{chunk}-slot chunks" + (", each layer's own attention (oracle)" if guide == "oracle" else ""),
      )
      for x, y, r in zip(xs, ys, points):
        ax.annotate(f"p={r['p']:g}", (x, y), textcoords="offset points", xytext=(4, 4), fontsize=7)
    ax.axhline(0, color="grey", lw=0.8)
    ax.set(
      title=f"{set_name} (dense perplexity {rows[0]['dense_perplexity']:.2f})",
      xlabel="K/V read, % of dense",
      ylabel="perplexity increase over dense, %",
      xlim=(0, 100),
    )
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
  fig.suptitle(_title(result, f"sparse verification's cost, {result['length']:,}-token documents"))
  return fig


def _train_step(result: dict, plt):
  """`lab.bench_step`: tokens/s of the draft's training step, of its floor (a draft
  that costs nothing) and of the frozen target's forward alone, per batch x length."""
  rows = result["rows"]
  labels = [f"{r['batch']} x {r['length']:,}" for r in rows]
  fig, ax = plt.subplots(figsize=(1.8 * len(rows) + 3, 4))
  parts = (("step", "the step"), ("floor", "its floor: target forward + shared head"), ("target", "target forward"))
  for index, (key, label) in enumerate(parts):
    xs = [i + (index - 1) * 0.27 for i in range(len(rows))]
    bars = ax.bar(xs, [r[f"{key}_tokens_per_second"] / 1e3 for r in rows], width=0.27, color=f"C{index}", label=label)
    ax.bar_label(bars, fmt=lambda v: f"{v:.3g}k", fontsize=7)
  ax.set_xticks(range(len(rows)), labels)
  ax.set(xlabel="sequences x tokens", ylabel="thousand tokens/s")
  ax.legend(fontsize=7)
  ax.grid(alpha=0.3, axis="y")
  fig.suptitle(_title(result, f"draft training step, {result['shape']} target"))
  return fig


def _serve(result: dict, plt):
  """`lab.bench_serve`: per prompt, the server's decode rate over `generate`'s and its first
  token's time beyond `generate`'s prefill; with several clients, both total rates against
  the number of clients."""
  rows, together = result["rows"], result.get("concurrent", [])
  fig, axes = plt.subplots(1, 3 if together else 2, figsize=(15 if together else 10, 4), squeeze=False)
  labels = [f"{r['set']} {r['prompt']}" for r in rows]
  panels = (
    ("decode_ratio", "server decode tokens/s / generate's", 1.0),
    ("first_token_beyond_prefill_ms", "first token beyond generate's prefill, ms", None),
  )
  for ax, (key, title, line) in zip(axes[0], panels):
    bars = ax.bar(range(len(rows)), [r[key] or 0 for r in rows], color="C0")
    ax.bar_label(bars, fmt="%.2f" if line else "%.0f", fontsize=7)
    if line:
      ax.axhline(line, color="grey", lw=0.8)
    ax.set_xticks(range(len(rows)), labels, rotation=45, ha="right", fontsize=7)
    ax.set(title=title)
    ax.grid(alpha=0.3, axis="y")
  if together:
    ax = axes[0][2]
    for index, key in enumerate(("server_tokens_per_second", "generate_tokens_per_second")):
      for set_name in sorted({t["set"] for t in together}):
        points = sorted((t for t in together if t["set"] == set_name), key=lambda t: t["concurrency"])
        label = f"{'server' if index == 0 else 'generate, one batch'} ({set_name})"
        xs, ys = [t["concurrency"] for t in points], [t[key] for t in points]
        ax.plot(xs, ys, marker="o", color=f"C{index}", label=label)
    ax.set(title="tokens/s over all clients", xlabel="clients at once", ylabel="tokens/s")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
  fig.suptitle(_title(result, f"the server against generate, {result['method']}, {result['length']:,}-token prompts"))
  return fig


def _batch_file(result: dict, plt):
  """`lab.bench_batch_file`: each method's tokens/s over the whole batch file, end to end."""
  rows = result["rows"]
  fig, ax = plt.subplots(figsize=(1.2 * len(rows) + 3, 4))
  bars = ax.bar(range(len(rows)), [r["tokens_per_second"] for r in rows], color="C0")
  ax.bar_label(bars, labels=[f"{r['speedup_vs_ar']:.2f}x" for r in rows], fontsize=8)
  ax.set_xticks(range(len(rows)), [f"{r['set']}\n{r['method']}" if "set" in r else r["method"] for r in rows])
  ax.set(ylabel="tokens/s, end to end")
  ax.grid(alpha=0.3, axis="y")
  records = rows[0]["records"]
  fig.suptitle(
    _title(result, f"a batch file of {records} prompts of {result['length']:,} tokens, {result['batch']} slots")
  )
  return fig


def _past(result: dict, plt):
  """`lab.bench_past`: the ring of past outputs' operations, ms each, per ring size."""
  rows = result["rows"]
  parts = ("index", "release", "copy", "search")
  fig, ax = plt.subplots(figsize=(2.2 * len(rows) + 3, 4))
  for index, part in enumerate(parts):
    xs = [i + (index - 1.5) * 0.2 for i in range(len(rows))]
    bars = ax.bar(xs, [r[f"{part}_ms"] for r in rows], width=0.2, color=f"C{index}", label=part)
    ax.bar_label(bars, fmt="%.3g", fontsize=7)
  ax.set_xticks(range(len(rows)), [f"{r['size']:,} tokens" for r in rows])
  ax.set(ylabel="ms", yscale="log")
  ax.legend(fontsize=7)
  ax.grid(alpha=0.3, axis="y")
  fig.suptitle(_title(result, f"the ring of past outputs, {rows[0]['output_tokens']}-token outputs"))
  return fig


def kind(result: dict) -> str | None:
  """What a result JSON holds, or None if there is nothing to plot."""
  if "by_scope" in result:
    return "profile"
  if result.get("kind") == "sparse_quality":  # (nothing to draw before a sparse row)
    return result["kind"] if any(r["chunk"] for r in result["rows"]) else None
  if result.get("kind") == "tree_prices":  # (nothing to draw before the projection)
    return result["kind"] if result["rows"] else None
  if result.get("kind") in (
    "tree_search",
    "auto_rounds",
    "long_generation",
    "train_step",
    "serve",
    "batch_file",
    "past",
  ):
    return result["kind"]
  timed = any(result.get(k) for k in ("grid", "floor", "verify", "sweep", "matmul"))
  if (timed or any("kept" in r for r in result.get("sparse", ()))) and "suite" not in result:
    return "kernels"
  if result.get("suite") in ("smollm2", "floor", "topk", "llama8b"):  # (llama8b: the floor suite's old name)
    return {"llama8b": "floor"}.get(result["suite"], result["suite"])
  rows = result.get("rows")
  if isinstance(rows, list) and rows and "speedup_vs_ar" in rows[0]:
    return "methods"
  return None


PLOTS = {
  "methods": _methods,
  "smollm2": _smollm2,
  "floor": _floor,
  "topk": _topk,
  "profile": _profile,
  "kernels": _kernels,
  "tree_search": _tree_search,
  "tree_prices": _tree_prices,
  "auto_rounds": _auto_rounds,
  "long_generation": _long_generation,
  "sparse_quality": _sparse_quality,
  "train_step": _train_step,
  "serve": _serve,
  "batch_file": _batch_file,
  "past": _past,
}


def plot(result: dict | Path, out: Path) -> Path | None:
  """Draws `result` (a dict, or a JSON file) to the PNG `out`; None if it holds nothing
  to plot (e.g. only the kernels' correctness check)."""
  if isinstance(result, Path):
    result = json.loads(result.read_text())
  which = kind(result)
  if which is None:
    return None
  plt = _pyplot()
  fig = PLOTS[which](result, plt)
  fig.tight_layout()
  fig.savefig(out, dpi=110)
  plt.close(fig)
  return out


def save(result: dict, out: Path) -> Path | None:
  """Writes `result` as JSON to `out` and its plot beside it (`out` as a .png, where it
  holds something to draw): how every benchmark keeps what it measured. Returns the PNG's
  path, or None."""
  out.write_text(json.dumps(result, indent=1))
  return plot(result, out.with_suffix(".png"))


def joined(results: list[dict], sets=None) -> dict:
  """Method comparisons from several runs as one: their rows (of `sets` only, if given), a
  later run's row replacing an earlier one's for the same set, method, prompt length and
  batch; the first run's header."""
  rows = {}
  for result in results:
    if kind(result) != "methods":
      raise ValueError("--join draws method comparisons (infer.benchmark's JSON) only.")
    rows.update(
      {
        (r["set"], r["method"], r["prefill_tokens"], r.get("batch", 1)): r
        for r in result["rows"]
        if sets is None or r["set"] in sets
      }
    )
  return {**results[0], "rows": list(rows.values())}


def main(argv=None) -> None:
  from longspec_jax.cli import ArgumentParser
  from longspec_jax.errors import UserError

  p = ArgumentParser(prog="python -m infer.plots", description=__doc__.splitlines()[0])
  p.add_argument("results", nargs="+", type=Path, help="result JSON files")
  p.add_argument("--out-dir", type=Path, help="where the PNGs go (default: beside each JSON)")
  p.add_argument("--join", type=Path, metavar="OUT.png", help="draw the method comparisons given as one figure")
  p.add_argument("--sets", nargs="+", help="with --join: only these prompt sets")
  args = p.parse_args(argv)
  results = []
  for path in args.results:
    try:
      results.append(json.loads(path.read_text()))
    except (OSError, ValueError) as e:
      raise UserError(f"{path} is not a readable result JSON ({type(e).__name__}).") from None
  if args.join:
    try:
      result = joined(results, args.sets)
    except ValueError as e:
      raise UserError(str(e)) from None
    print(f"{len(results)} results -> {plot(result, args.join)}")
    return
  for path, result in zip(args.results, results):
    out = (args.out_dir or path.parent) / path.with_suffix(".png").name
    if args.out_dir:
      args.out_dir.mkdir(parents=True, exist_ok=True)
    print(f"{path} -> {out}" if plot(result, out) else f"{path}: nothing to plot")


if __name__ == "__main__":
  from longspec_jax.cli import run_main

  run_main(main, "python -m infer.plots", interruptible=False)
