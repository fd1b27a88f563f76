"""`python -m infer.profile` end to end on a tiny target (its own process: it sets XLA's
dump flags before JAX starts)."""

import json
import subprocess
import sys

from infer.profile import busy_ns, host_summary, scope_of


def test_profile_charges_the_loop_to_the_engine_scopes(tiny_with_tokenizer, tmp_path):
  out = tmp_path / "prof"
  proc = subprocess.run([sys.executable, "-m", "infer.profile", "--target", str(tiny_with_tokenizer), "--method",
                         "longspec", "--draft", "random", "--tree-widths", "2,2", "--length", "48", "--new-tokens", "6",
                         "--dtype", "float32", "--top", "5", "--out", str(out)],
                        capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  report = json.loads((out / "profile.json").read_text())
  assert report["kernel_ms"] > 0 and 0 <= report["idle_share_of_span"] < 1
  assert {"propose", "verify", "accept", "commit"} <= set(report["by_scope"])
  assert abs(sum(s["share"] for s in report["by_scope"].values()) - 1) < 1e-6
  assert len(report["top_ops"]) == 5 and "verify" in proc.stdout
  assert 0 < len(report["host_events"]) <= 5 and all(row["ms"] >= 0 for row in report["host_events"])


def test_bad_input_is_one_line(tmp_path):
  proc = subprocess.run([sys.executable, "-m", "infer.profile", "--new-tokens", "1", "--out", str(tmp_path)],
                        capture_output=True, text=True, timeout=300)
  assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "--new-tokens" in proc.stderr


def test_scopes_and_busy_time():
  assert scope_of("jit(_decode_chunk)/while/body/verify/dot_general") == "verify"
  assert scope_of(None) == "unattributed"
  assert busy_ns([(0, 10, "a"), (5, 10, "b"), (30, 5, "c")]) == 20


def test_host_summary_totals_the_events_inside_the_span():
  events = [(0, 5, "main", "launch"), (10, 5, "main", "launch"), (12, 2, "main", "[iter=3]"),
            (20, 1, "main", "[iter=4]"), (40, 5, "main", "launch")]
  rows = host_summary(events, 0, 30, top=5)
  assert rows == [{"thread": "main", "event": "launch", "ms": 10e-6, "calls": 2},
                  {"thread": "main", "event": "[iter]", "ms": 3e-6, "calls": 2}]
