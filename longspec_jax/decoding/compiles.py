"""Counting XLA's compilations: a timed region that compiles times the compiler, not the
work (13 s inside a LongSpec generation of 0.2 s, once, on an H200), so the engine
reports what compiled inside its decode time and the benchmarks what compiled in theirs."""

from __future__ import annotations

import jax


class Compiles:
  """Counts XLA's compilations, and the seconds they took, while its `with` block runs."""

  def __init__(self):
    self.count, self.seconds = 0, 0.0

  def _heard(self, event: str, seconds: float, **_) -> None:
    if "backend_compile" in event:
      self.count += 1
      self.seconds += seconds

  def __enter__(self) -> Compiles:
    jax.monitoring.register_event_duration_secs_listener(self._heard)
    return self

  def __exit__(self, *exc) -> None:
    jax.monitoring.unregister_event_duration_listener(self._heard)
