"""`infer.plots`: what each kind of result draws."""

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from infer.plots import _methods, joined  # noqa: E402


def rows(lengths, state):
  return [
    {
      "set": "code",
      "method": method,
      "prefill_tokens": length,
      "speedup_vs_ar": 1.5,
      "tau": 2.0,
      "draft_state_mib": state(method, length),
    }
    for method in ("ar", "longspec", "glide")
    for length in lengths
  ]


def test_methods_over_several_lengths_also_draw_the_drafts_state():
  grows = lambda method, length: {"ar": 0.0, "longspec": 0.4}.get(method, length / 1024)
  fig = _methods({"rows": rows((1024, 4096), grows)}, plt)
  assert [ax.get_title() for ax in fig.axes] == ["code: decode speedup vs AR", "code: tau", "code: draft state"]
  assert list(fig.axes[2].lines[2].get_ydata()) == [1.0, 4.0]  # GLIDE's, growing with the context
  one_length = _methods({"rows": rows((4096,), grows)}, plt)  # (bars per method: no state row)
  assert len(one_length.axes) == 2
  plt.close("all")


def test_a_batch_sweep_draws_each_method_against_the_batch():
  sweep = [
    {"set": "code", "method": m, "prefill_tokens": 4096, "batch": b, "speedup_vs_ar": x, "tau": 2.0}
    | {"tokens_per_second": 100.0 * b * x}
    for m, x in (("ar", 1.0), ("pld", 2.0))
    for b in (1, 4, 16)
  ]
  fig = _methods({"rows": sweep}, plt)
  titles = [ax.get_title() for ax in fig.axes]
  assert titles == ["code: decode speedup vs AR", "code: tau", "code: tokens/s over the batch"]
  assert list(fig.axes[2].lines[1].get_xdata()) == [1, 4, 16] and fig.axes[2].get_xlabel() == "batch"
  assert list(fig.axes[2].lines[1].get_ydata()) == [200.0, 800.0, 3200.0]
  plt.close("all")


def test_runs_at_other_lengths_join_into_one_comparison():
  first = {"target": "t", "rows": rows((1024, 4096), lambda m, n: 0.0)}
  second = {"target": "u", "rows": [dict(r, tau=3.0) for r in rows((4096, 7680), lambda m, n: 0.0)]}
  result = joined([first, second])
  assert result["target"] == "t" and len(result["rows"]) == 9  # 3 methods x 3 lengths
  assert {r["tau"] for r in result["rows"] if r["prefill_tokens"] == 4096} == {3.0}  # the later run's
  assert joined([first], sets=["docs"])["rows"] == []
