"""Training checkpoints with orbax's CheckpointManager: draft parameters, optimizer state
and the loop's own state (step, data position, PRNG seed) as JSON, saved periodically and
at the end. Orbax writes each step to a temporary directory and renames it when complete,
so a killed run never leaves a half-written checkpoint behind; `restore_latest` resumes
from the newest complete one.
"""

from __future__ import annotations

from pathlib import Path

import jax
import orbax.checkpoint as ocp


def _abstract(tree):
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None)), tree)


class Checkpoints:
  """Periodic, atomic training checkpoints in `directory` (the newest `keep` are kept)."""

  def __init__(self, directory: Path, every: int, keep: int = 3):
    self.every = every
    self.manager = ocp.CheckpointManager(
        Path(directory).resolve(),
        options=ocp.CheckpointManagerOptions(max_to_keep=keep, save_interval_steps=1, create=True),
    )

  def maybe_save(self, step: int, params, opt_state, loop_state: dict, final: bool = False) -> bool:
    """Saves after every `every` steps, and at the end (`final`)."""
    if not final and step % self.every:
      return False
    return self.manager.save(step, args=ocp.args.Composite(
        params=ocp.args.StandardSave(params),
        opt_state=ocp.args.StandardSave(opt_state),
        loop=ocp.args.JsonSave(loop_state),
    ), force=final)

  def latest_step(self) -> int | None:
    return self.manager.latest_step()

  def restore_latest(self, params, opt_state):
    """(params, opt_state, loop_state) of the newest checkpoint, laid out like the given
    params and optimizer state (shapes, dtypes, shardings); None if there is none."""
    step = self.manager.latest_step()
    if step is None:
      return None
    restored = self.manager.restore(step, args=ocp.args.Composite(
        params=ocp.args.StandardRestore(_abstract(params)),
        opt_state=ocp.args.StandardRestore(_abstract(opt_state)),
        loop=ocp.args.JsonRestore(),
    ))
    return restored["params"], restored["opt_state"], restored["loop"]

  def close(self) -> None:
    self.manager.wait_until_finished()
    self.manager.close()
