"""Training checkpoints with orbax's CheckpointManager: draft parameters, optimizer state
and the loop's own state (step, data position, PRNG seed) as JSON, saved periodically and
at the end. Orbax writes each step to a temporary directory and renames it when complete,
so a killed run never leaves a half-written checkpoint behind; `restore_latest` resumes
from the newest one that reads back whole, setting aside damaged newer ones (a disk
fault, a copy cut short).
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import shutil
import sys
import time
from pathlib import Path

import jax
import orbax.checkpoint as ocp


def _abstract(tree):
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None)), tree)


@contextlib.contextmanager
def _quiet_failed_reads():
  """Silences what a failed restore leaves behind: orbax's other reads of that step fail
  too, and tensorstore's threads print their tracebacks (and asyncio logs their futures)
  as they finish after the first error. The block's stderr goes to /dev/null, and on
  failure it waits for those reads to settle before stderr comes back, so a fallback
  costs the one warning line the caller prints."""
  asyncio_log = logging.getLogger("asyncio")
  disabled, asyncio_log.disabled = asyncio_log.disabled, True
  sys.stderr.flush()
  saved = os.dup(2)
  null = os.open(os.devnull, os.O_WRONLY)
  os.dup2(null, 2)
  try:
    yield
  except Exception:
    gc.collect()
    time.sleep(0.5)
    raise
  finally:
    os.dup2(saved, 2)
    os.close(saved)
    os.close(null)
    asyncio_log.disabled = disabled


class Checkpoints:
  """Periodic, atomic training checkpoints in `directory` (the newest `keep` are kept)."""

  def __init__(self, directory: Path, every: int, keep: int = 3):
    self.every = every
    self.directory = Path(directory).resolve()
    self.manager = ocp.CheckpointManager(
      Path(directory).resolve(),
      options=ocp.CheckpointManagerOptions(max_to_keep=keep, save_interval_steps=1, create=True),
    )

  def maybe_save(self, step: int, params, opt_state, loop_state: dict, final: bool = False) -> bool:
    """Saves after every `every` steps, and at the end (`final`)."""
    if not final and step % self.every:
      return False
    return self.manager.save(
      step,
      args=ocp.args.Composite(
        params=ocp.args.StandardSave(params),
        opt_state=ocp.args.StandardSave(opt_state),
        loop=ocp.args.JsonSave(loop_state),
      ),
      force=final,
    )

  def latest_step(self) -> int | None:
    return self.manager.latest_step()

  def all_steps(self) -> list[int]:
    return sorted(self.manager.all_steps())

  def restore_latest(self, params, opt_state):
    """(params, opt_state, loop_state) of the newest intact checkpoint, laid out like the
    given params and optimizer state (shapes, dtypes, shardings); None if there is none.
    A damaged newer checkpoint gets one warning line on stderr and is deleted, so that the
    resumed run can save that step again; if none is intact, a `UserError` names the
    newest damaged one."""
    from longspec_jax.errors import UserError

    damaged = []
    for step in sorted(self.manager.all_steps(), reverse=True):
      try:
        with _quiet_failed_reads():
          restored = self.manager.restore(
            step,
            args=ocp.args.Composite(
              params=ocp.args.StandardRestore(_abstract(params)),
              opt_state=ocp.args.StandardRestore(_abstract(opt_state)),
              loop=ocp.args.JsonRestore(),
            ),
          )
      except Exception as e:  # orbax, tensorstore and json raise many types for damaged files
        damaged.append((step, type(e).__name__))  # (the message: the storage layer's internals)
        continue
      if damaged:
        print(
          f"warning: checkpoint step {', '.join(str(s) for s, _ in damaged)} in {self.directory} is damaged"
          f" ({damaged[0][1]}); resuming from step {step} and deleting the damaged one.",
          file=sys.stderr,
        )
        for bad, _ in damaged:
          shutil.rmtree(self.directory / str(bad), ignore_errors=True)
        self.manager.reload()
      return restored["params"], restored["opt_state"], restored["loop"]
    if damaged:
      step, reason = damaged[0]
      raise UserError(f"no intact checkpoint in {self.directory}: the newest, step {step}, is damaged ({reason}).")
    return None

  def close(self) -> None:
    self.manager.wait_until_finished()
    self.manager.close()
