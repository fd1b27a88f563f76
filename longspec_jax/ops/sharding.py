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

Inference runs under a mesh set with `jax.set_mesh` (`infer.generate --devices N`): the
weights placed by `param_shardings`, the caches made split by KV head (`CACHE_AXES`,
`zeros`), XLA's partitioner (GSPMD) splitting the products and adding the reductions,
and what it cannot split itself run per device by `per_device` (`shard_map`): the Pallas
kernels, each device on its own sequences and KV heads; the vocabulary-split embedding
lookup and top-k (`layers.embed_tokens`, `topk.top_k`). Without a mesh every function
here is the identity or a plain call, so one device runs the code as it always did.

Multi-host: call `jax.distributed.initialize()` first (on each host, e.g. under SLURM it
reads the environment); `jax.devices()` then lists every host's devices and the same mesh
spans them all.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
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
  # the draft's fused target features: per feature layer, the cache's values' shape
  "feature_norm": ("features", "kv_heads", "head_dim"),
  "feature_proj": ("features", "kv_heads", "head_dim", "embed"),
  "parent_proj": ("embed", "embed_out"),
  # TokenSwift's heads: one residual linear map per token ahead (small: replicated)
  "input_norm": ("ahead", "embed"),
  "linear": ("ahead", "embed", "embed_out"),
  "output_norm": ("ahead", "embed"),
}

# K/V caches [L, B, S, K, D]: the target's, a draft's ring, TokenSwift's partial cache.
CACHE_AXES = ("layers", "batch", "length", "kv_heads", "head_dim")


def make_mesh(model: int = 1, devices=None) -> Mesh:
  """A (data, model) mesh over all devices: `model` devices share each parameter."""
  devices = jax.devices() if devices is None else devices
  if len(devices) % model:
    raise ValueError(f"{len(devices)} devices do not split into model groups of {model}.")
  # Auto axes: shardings of intermediates are left to the compiler (GSPMD propagation).
  return jax.make_mesh(
    (len(devices) // model, model), (DATA, MODEL), devices=devices, axis_types=(jax.sharding.AxisType.Auto,) * 2
  )


def current_mesh():
  """The mesh set by `jax.set_mesh` (tensor-parallel inference runs under one), as seen
  while tracing; None without one, with one device, or inside `per_device`'s function
  (whose code runs per device already)."""
  mesh = jax.sharding.get_abstract_mesh()
  return None if mesh.empty or mesh.size == 1 or mesh.manual_axes else mesh


def splits(axis: str, size: int) -> int:
  """How many devices of the current mesh split a dimension of logical `axis` and `size`
  (1: none, or no mesh)."""
  mesh, mesh_axis = current_mesh(), RULES.get(axis)
  if mesh is None or mesh_axis is None or size % mesh.shape[mesh_axis]:
    return 1
  return mesh.shape[mesh_axis]


def _padded(axes: Sequence[str | None] | None, ndim: int) -> tuple[str | None, ...]:
  """Logical axes naming the trailing dimensions of an `ndim`-dimensional array, as one
  name per dimension (None for the leading ones; `axes` None: all None)."""
  axes = () if axes is None else tuple(axes)[max(len(axes) - ndim, 0) :]
  return (None,) * (ndim - len(axes)) + axes


def trailing(axes: Sequence[str | None] | None, shape: tuple[int, ...], mesh) -> P:
  """The partition of an array of `shape` whose trailing dimensions are the logical `axes`
  (the leading ones whole; None: all whole)."""
  return partition(_padded(axes, len(shape)), shape, mesh)


def zeros(shape: tuple[int, ...], dtype, axes: Sequence[str | None]) -> jax.Array:
  """Zeros laid out over the current mesh as their trailing logical `axes` say, each
  device making only its share (a long context's K/V cache is never whole on one
  device); plain zeros without a mesh."""
  mesh = current_mesh()
  return _zeros_program(tuple(shape), jnp.dtype(dtype), None if mesh is None else trailing(axes, shape, mesh))()


@functools.cache
def _zeros_program(shape: tuple[int, ...], dtype, partition: P | None):
  """A program making zeros laid out by `partition` over the mesh it runs under (None:
  on the default device): called eagerly, each device fills its share, in one dispatch
  (plain `jnp.zeros` is two); inside another program, a layout for the zeros there. One
  per shape (a generation's cache compiles once, not once per generation)."""
  make = lambda: jnp.zeros(shape, dtype)
  return jax.jit(make) if partition is None else jax.jit(make, out_shardings=partition)


def per_device(fn: Callable, args: Sequence, in_axes: Sequence, out_axes):
  """fn(*args) with each device running fn on its share of the arguments (`shard_map`),
  each argument split by its logical axes (`in_axes`: a tuple of names per argument, for
  its trailing dimensions; None for one every device reads whole), the outputs put
  together by `out_axes` (a tuple of names per output). For code XLA's partitioner cannot
  split, a Pallas kernel being one opaque call: left to it, every device would gather the
  whole inputs and compute all of it. Split by sequence and KV head, each device attends
  with its own heads over its own sequences' cache, no communication. Without a mesh:
  fn(*args)."""
  mesh = current_mesh()
  if mesh is None:
    return fn(*args)
  in_specs = tuple(trailing(axes, getattr(arg, "shape", ()), mesh) for arg, axes in zip(args, in_axes))
  # An output's logical axis is split as the arguments' axis of that name was.
  split = {
    name: mesh_axis
    for axes, spec in zip(in_axes, in_specs)
    if axes is not None
    for name, mesh_axis in zip(tuple(axes)[::-1], tuple(spec)[::-1])
    if mesh_axis is not None
  }
  # (check_vma off: a Pallas call's outputs carry no record of how they vary over devices)
  run = lambda out_specs: jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)
  local = jax.eval_shape(run(P()), *args)  # (each output's rank)
  out_specs = jax.tree.map(
    lambda s, axes: P(*(split.get(name) for name in _padded(axes, s.ndim))),
    local,
    out_axes,
    is_leaf=lambda x: isinstance(x, jax.ShapeDtypeStruct),
  )
  return run(out_specs)(*args)


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


def traced_under(mesh: Mesh, fn: Callable) -> Callable:
  """fn traced with `mesh` as the current mesh, so that `per_device` splits over it: for
  a program jitted with shardings and called outside `jax.set_mesh` (training's step,
  whose frozen target runs the Pallas kernels on each device's sequences)."""

  @functools.wraps(fn)
  def traced(*args, **kwargs):
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
      return fn(*args, **kwargs)

  return traced


def put(tree):
  """A parameter tree (or a model's `nnx.State`), numpy or JAX arrays, on the current
  mesh by the rules, each device sent its share only (a 70B target's weights are never
  whole on one device); on the default device without a mesh."""
  if current_mesh() is None:
    return jax.tree.map(jnp.asarray, tree)
  return jax.device_put(tree, param_shardings(jax.sharding.get_mesh(), tree))


def placed(module):
  """A model (`nnx.Module`: a target, a draft) with its parameters moved by `put`, in
  place; returned for chaining."""
  from flax import nnx

  nnx.update(module, put(nnx.state(module)))
  return module


def batch_sharding(mesh: Mesh) -> NamedSharding:
  """Token batches [B, T]: sequences split over `data`."""
  return NamedSharding(mesh, P(RULES["batch"], None))
