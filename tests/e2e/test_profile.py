"""`python -m lab.profile` end to end on a tiny target (its own process: it sets XLA's
dump flags before JAX starts)."""

import json
import subprocess
import sys

import pytest

from lab.profile import back_to_back, busy_ns, graph_updates, host_summary, scope_of, summarize


@pytest.mark.slow  # (the lab tool's whole run; its trace arithmetic: below)
def test_profile_charges_the_loop_to_the_engine_scopes(tiny_with_tokenizer, tmp_path):
  out = tmp_path / "prof"
  proc = subprocess.run(
    [
      sys.executable,
      "-m",
      "lab.profile",
      "--target",
      str(tiny_with_tokenizer),
      "--method",
      "longspec",
      "--draft",
      "random",
      "--tree-widths",
      "2,2",
      "--length",
      "48",
      "--new-tokens",
      "6",
      "--generations",
      "2",
      "--dtype",
      "float32",
      "--top",
      "5",
      "--out",
      str(out),
    ],
    capture_output=True,
    text=True,
    timeout=600,
  )
  assert proc.returncode == 0, proc.stderr[-3000:]
  report = json.loads((out / "profile.json").read_text())
  assert report["kernel_ms"] > 0 and 0 <= report["idle_share_of_span"] < 1
  assert {"propose", "verify", "accept", "commit"} <= set(report["by_scope"])
  assert abs(sum(s["share"] for s in report["by_scope"].values()) - 1) < 1e-6
  assert len(report["top_ops"]) == 5 and "verify" in proc.stdout
  assert 0 < len(report["host_events"]) <= 5 and all(row["ms"] >= 0 for row in report["host_events"])
  assert len(report["generations"]) == 2 and report["rounds"] == sum(g["rounds"] for g in report["generations"])
  assert "generation | decode ms" in proc.stdout


def test_bad_input_is_one_line(tmp_path):
  proc = subprocess.run(
    [sys.executable, "-m", "lab.profile", "--new-tokens", "1", "--out", str(tmp_path)],
    capture_output=True,
    text=True,
    timeout=300,
  )
  assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "--new-tokens" in proc.stderr


def test_scopes_and_busy_time():
  assert scope_of("jit(_decode_chunk)/while/body/verify/dot_general") == "verify"
  assert scope_of(None) == "unattributed"
  assert busy_ns([(0, 10, "a"), (5, 10, "b"), (30, 5, "c")]) == 20


def test_host_summary_totals_the_events_inside_the_span():
  events = [
    (0, 5, "main", "launch"),
    (10, 5, "main", "launch"),
    (12, 2, "main", "[iter=3]"),
    (20, 1, "main", "[iter=4]"),
    (40, 5, "main", "launch"),
  ]
  rows = host_summary(events, 0, 30, top=5)
  assert rows == [
    {"thread": "main", "event": "launch", "ms": 10e-6, "calls": 2},
    {"thread": "main", "event": "[iter]", "ms": 3e-6, "calls": 2},
  ]


def test_kernels_inside_a_cuda_graph_are_charged_to_their_own_instructions():
  names = {
    "loop_add_fusion.3": "jit(_decode_chunk)/while/body/verify/add",
    "loop_add_fusion_3": "jit(_decode_chunk)/while/body/verify/add",
    "fusion.7": "jit(_decode_chunk)/while/body/propose/mul",
  }
  events = [
    (0, 10, "command_buffer_5", "loop_add_fusion_3"),  # XLA's kernel in a graph: its instruction
    (10, 4, "command_buffer_5", "nvjet_sm90_gemm"),  # a library's kernel: the graph's
    (20, 6, "fusion.7", "fusion_7"),
  ]  # outside a graph: the op as named
  report = summarize(events, names, top=5, updates={"command_buffer_5": [3, 1, 2e6]})
  assert report["by_scope"]["verify"]["ms"] == 10e-6 and report["by_scope"]["propose"]["ms"] == 6e-6
  assert report["by_scope"]["unattributed"]["ms"] == 4e-6
  assert [row["hlo_op"] for row in report["top_ops"]] == ["loop_add_fusion_3", "fusion.7", "command_buffer_5"]
  assert report["graphs"] == [
    {
      "graph": "command_buffer_5",
      "ms": 14e-6,
      "scopes": {"verify": 10e-6, "unattributed": 4e-6},
      "launches": 3,
      "updates": 1,
      "update_ms": 2.0,
    }
  ]


def test_a_graph_update_is_charged_to_the_graph_around_it():
  events = [
    (0, 100, "main", "command_buffer_1"),
    (0, 30, "main", "command_buffer::update"),  # same start
    (40, 10, "main", "cuGraphLaunch"),
    (200, 50, "main", "command_buffer_2"),
    (210, 20, "main", "command_buffer::update"),
    (300, 40, "main", "command_buffer_1"),
    (400, 5, "main", "command_buffer::update"),  # in no graph: not charged
    (500, 5, "main", "command_buffer::update"),
  ]  # outside the span
  assert graph_updates(events, 0, 450) == {"command_buffer_1": [2, 1, 30.0], "command_buffer_2": [1, 1, 20.0]}


def test_generations_are_laid_back_to_back_with_their_host_events():
  first = ([(100, 10, "op", "k"), (120, 5, "op", "k")], [(101, 2, "main", "launch")])
  second = ([(1000, 4, "op", "k")], [(999, 1, "main", "early"), (1001, 2, "main", "launch")])
  device, host = back_to_back([first, second])
  assert device == [(0, 10, "op", "k"), (20, 5, "op", "k"), (25, 4, "op", "k")]
  assert host == [(1, 2, "main", "launch"), (24, 1, "main", "early"), (26, 2, "main", "launch")]
  assert busy_ns(device) == 19
