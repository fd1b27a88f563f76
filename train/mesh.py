"""One device mesh for training, from one GPU to many hosts: a `data` axis (batch split
across devices) and a `model` axis (parameters split along their last dimension).

Multi-host: call `jax.distributed.initialize()` first (on each host, e.g. under SLURM it
reads the environment); `jax.devices()` then lists every host's devices and the same mesh
spans them all.
"""

from __future__ import annotations

import jax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

DATA, MODEL = "data", "model"


def make_mesh(model: int = 1, devices=None) -> Mesh:
  """A (data, model) mesh over all devices: `model` devices share each parameter."""
  devices = jax.devices() if devices is None else devices
  if len(devices) % model:
    raise ValueError(f"{len(devices)} devices do not split into model groups of {model}.")
  # Auto axes: shardings of intermediates are left to the compiler (GSPMD propagation).
  return jax.make_mesh((len(devices) // model, model), (DATA, MODEL), devices=devices,
                       axis_types=(jax.sharding.AxisType.Auto,) * 2)


def param_shardings(mesh: Mesh, tree):
  """Per leaf: split the last dimension over `model` when it divides evenly (matrices,
  and the optimizer moments shaped like them), else replicate."""
  size = mesh.shape[MODEL]

  def spec(leaf):
    shape = getattr(leaf, "shape", ())
    if len(shape) >= 2 and shape[-1] % size == 0 and size > 1:
      return NamedSharding(mesh, P(*([None] * (len(shape) - 1)), MODEL))
    return NamedSharding(mesh, P())

  return jax.tree.map(spec, tree)


def batch_sharding(mesh: Mesh) -> NamedSharding:
  """Token batches [B, T]: sequences split over `data`."""
  return NamedSharding(mesh, P(DATA, None))
