"""`python -m lab.bench_past`: the ring of past outputs' operations timed, on small rings."""

import json

from lab.bench_past import main

from helpers import run_cli


def test_each_operation_is_timed_per_ring_size(tmp_path, capsys):
  out = tmp_path / "past.json"
  argv = ["--sizes", "300", "4096", "--output-tokens", "40", "--context", "64", "--iters", "2", "--out", str(out)]
  assert run_cli(main, argv, "python -m lab.bench_past") == 0, capsys.readouterr().err
  result = json.loads(out.read_text())
  assert result["kind"] == "past" and [r["size"] for r in result["rows"]] == [300, 4096]
  for row in result["rows"]:
    assert all(row[f"{part}_ms"] > 0 for part in ("index", "release", "copy", "search"))
  assert out.with_suffix(".png").exists()


def test_the_trace_lists_a_releases_kernels_for_the_largest_ring(tmp_path, capsys):
  out = tmp_path / "past.json"
  argv = ["--sizes", "300", "600", "--output-tokens", "40", "--context", "64", "--iters", "2"]
  argv += ["--trace", str(tmp_path / "trace"), "--out", str(out)]
  assert run_cli(main, argv, "python -m lab.bench_past") == 0, capsys.readouterr().err
  small, large = json.loads(out.read_text())["rows"]
  assert "release_kernels" not in small and large["release_device_ms"] > 0
  kernels = large["release_kernels"]
  assert kernels and all(k["ms"] > 0 for k in kernels) and sum(k["share"] for k in kernels) <= 1 + 1e-9
  assert [k["ms"] for k in kernels] == sorted((k["ms"] for k in kernels), reverse=True)
  assert "a release into 600 tokens: " in capsys.readouterr().out


def test_a_ring_too_small_for_an_output_is_refused(capsys):
  assert run_cli(main, ["--sizes", "100", "--output-tokens", "256"], "python -m lab.bench_past") == 2
  assert "at least 272 tokens" in capsys.readouterr().err
