"""Sharding rules by logical axis, in one place, for training and inference.

One device mesh of two axes: `data` (sequences of a batch split across devices) and
`model` (each weight split across devices, tensor parallelism). Every parameter's
dimensions are named by meaning in `PARAM_AXES` (by the parameter's name; a stacked
layer's leading axis is `layers`), and `RULES` says which logical axes a mesh axis splits:
Megatron's pairs, the first product of each pair split by its output (q/k/v by KV head
group, gate/up by the intermediate dimension) and the second by its input (o by query
head, down by the intermediate dimension), so each layer needs one reduction after each
pair; the embedding and LM head split by vocabulary; norms, and what is too small to be
worth it (TokenSwift's heads), replicated. A dimension the mesh axis does not divide
stays whole (GQA with fewer KV heads than devices: q/k/v and o replicated, the MLP still
split).

q/k/v are stored grouped by KV head, [E, K, G + 2, D] (`layers.DecoderLayer.qkv`), so
that a split of the K axis gives each device its query heads with their keys and values;
`o [H, D, E]` split by H then gives each device the same heads (H = K x G, head h in
group h // G).

Multi-host: call `jax.distributed.initialize()` first (on each host, e.g. under SLURM it
reads the environment); `jax.devices()` then lists every host's devices and the same mesh
spans them all.
"""

from __future__ import annotations

import jax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

DATA, MODEL = "data", "model"

# Logical axes -> the mesh axis that splits them (absent: never split).
RULES = {"batch": DATA, "vocab": MODEL, "heads": MODEL, "kv_heads": MODEL, "mlp": MODEL}

# Each parameter's dimensions by meaning (after a stacked module's leading `layers` axis).
PARAM_AXES = {
    "embed": ("vocab", "embed"),
    "lm_head": ("embed", "vocab"),
    "final_norm": ("embed",),
    "attn_norm": ("embed",),
    "mlp_norm": ("embed",),
    "qkv": ("embed", "kv_heads", "q_k_v", "head_dim"),
    "qkv_bias": ("kv_heads", "q_k_v", "head_dim"),
    "o": ("heads", "head_dim", "embed"),
    "gate_up": ("embed", "gate_up", "mlp"),
    "down": ("mlp", "embed"),
    # the draft's cross-attention over the target's cache
    "cross_norm": ("embed",),
    "cross_q": ("embed", "heads", "head_dim"),
    "cross_o": ("heads", "head_dim", "embed"),
    # TokenSwift's heads: one residual linear map per token ahead (small: replicated)
    "input_norm": ("ahead", "embed"),
    "linear": ("ahead", "embed", "embed_out"),
    "output_norm": ("ahead", "embed"),
}


def make_mesh(model: int = 1, devices=None) -> Mesh:
  """A (data, model) mesh over all devices: `model` devices share each parameter."""
  devices = jax.devices() if devices is None else devices
  if len(devices) % model:
    raise ValueError(f"{len(devices)} devices do not split into model groups of {model}.")
  # Auto axes: shardings of intermediates are left to the compiler (GSPMD propagation).
  return jax.make_mesh((len(devices) // model, model), (DATA, MODEL), devices=devices,
                       axis_types=(jax.sharding.AxisType.Auto,) * 2)


def partition(axes: tuple[str | None, ...], shape: tuple[int, ...], mesh: Mesh) -> P:
  """The partition of an array of `shape` whose dimensions are the logical `axes`: each
  split over its rule's mesh axis where that axis divides it (and is not used already)."""
  used, spec = set(), []
  for axis, size in zip(axes, shape):
    mesh_axis = RULES.get(axis)
    if mesh_axis is None or mesh_axis in used or mesh.shape[mesh_axis] == 1 or size % mesh.shape[mesh_axis]:
      spec.append(None)
    else:
      used.add(mesh_axis)
      spec.append(mesh_axis)
  return P(*spec)


def param_axes(name: str, ndim: int) -> tuple[str, ...]:
  """A parameter's logical axes from its name: `PARAM_AXES`, after `layers` for a stacked
  one (one dimension more)."""
  axes = PARAM_AXES[name]
  if ndim == len(axes) + 1:
    return ("layers", *axes)
  if ndim != len(axes):
    raise ValueError(f"parameter {name!r} has {ndim} dimensions, its rule names {len(axes)}.")
  return axes


def param_shardings(mesh: Mesh, tree):
  """Per leaf of a parameter tree (or of an optimizer state shaped like one: its moments
  sit under the same names), its sharding by `PARAM_AXES` and `RULES`; leaves under no
  parameter name (step counts) are replicated."""

  def sharding(path, leaf):
    shape = getattr(leaf, "shape", ())
    names = [getattr(key, "key", getattr(key, "name", None)) for key in path]
    name = next((n for n in reversed(names) if n in PARAM_AXES), None)
    if name is None or not shape:
      return NamedSharding(mesh, P())
    return NamedSharding(mesh, partition(param_axes(name, len(shape)), shape, mesh))

  return jax.tree_util.tree_map_with_path(sharding, tree)


def batch_sharding(mesh: Mesh) -> NamedSharding:
  """Token batches [B, T]: sequences split over `data`."""
  return NamedSharding(mesh, P(RULES["batch"], None))
