"""A round's device time by part, from `lab.profile`'s op names (no device)."""

import json

import pytest

from lab.profile import PARTS, part_of
from lab.profile_table import main, row

LOOP = "jit(_decode_chunk)/while/body"


@pytest.mark.parametrize(
  "hlo_op, op_name, part",
  [
    ("custom-call.3", f"{LOOP}/verify/eval_jaxpr/dot_general", "verify_matmul"),
    ("cublas-lt-matmul.1", f"{LOOP}/verify/eval_jaxpr/dot_general", "verify_matmul"),
    ("custom-call.9", f"{LOOP}/verify/...e,ev->...v/dot_general", "verify_head"),
    ("pallas_call.2", f"{LOOP}/verify/eval_jaxpr/hybrid_attention/pallas_call", "verify_attention"),
    ("loop_multiply_fusion.4", f"{LOOP}/verify/eval_jaxpr/mul", "verify_other"),
    ("pallas_call.7", f"{LOOP}/propose/eval_jaxpr/head_top_k/pallas_call", "draft_head"),
    ("pallas_call.8", f"{LOOP}/propose/eval_jaxpr/matmul/pallas_call", "draft_matmul"),
    ("pallas_call.5", f"{LOOP}/propose/eval_jaxpr/tree_attention/pallas_call", "draft_attention"),
    ("input_scatter_fusion", f"{LOOP}/commit/scatter", "accept_commit"),
    ("while", None, "accept_commit"),
  ],
)
def test_each_op_goes_to_its_part(hlo_op, op_name, part):
  assert part_of(hlo_op, op_name) == part


def report(**changes):
  return {
    "method": "ar",
    "prefill_tokens": 4096,
    "batch": 1,
    "rounds": 2,
    "kernel_ms": 1.0,
    "device": "test",
    "jax": "0",
    "top_ops": [
      {"hlo_op": "custom-call.1", "op_name": f"{LOOP}/verify/x/dot_general", "ms": 0.6},
      {"hlo_op": "loop_add_fusion", "op_name": f"{LOOP}/verify/x/add", "ms": 0.2},
    ],
    **changes,
  }


def test_a_run_listing_its_top_ops_only_sums_them_and_names_the_rest():
  entry = row(report())
  assert entry["verify_matmul_us"] == pytest.approx(300) and entry["verify_other_us"] == pytest.approx(100)
  assert entry["not_listed_us"] == pytest.approx(100) and entry["kernel_us"] == pytest.approx(500)


def test_a_run_with_its_parts_takes_them_and_every_run_is_a_row(tmp_path):
  parts = dict.fromkeys(PARTS, 0.0) | {"verify_matmul": 0.7, "verify_other": 0.3}
  runs = []
  for name, changes in (("a", {}), ("b", {"by_part_ms": parts, "label": "ar+fast"})):
    (tmp_path / name).mkdir()
    (tmp_path / name / "profile.json").write_text(json.dumps(report(**changes)))
    runs.append(str(tmp_path / name))
  main([*runs, "--out", str(tmp_path / "table.json")])
  rows = json.loads((tmp_path / "table.json").read_text())["rows"]
  assert [r["method"] for r in rows] == ["ar", "ar+fast"]
  assert rows[1]["verify_matmul_us"] == pytest.approx(350) and rows[1]["not_listed_us"] == 0
