"""Draft checkpoints: a directory with `draft_config.json`, the parameters saved by orbax
and, for a draft that scores a subset of the vocabulary, `vocab_ranking.npy` (token ids by
their frequency in the training text, the most frequent first, `train.rank_vocab`).

`--draft` specs: `random` (a random-init draft shaped for the target: useful to check the
machinery, it proposes noise), `default` (the draft shipped in the package for the
embedded target), or a checkpoint directory. Each spec names a draft of one kind
(`DraftKind`: LongSpec's or GLIDE's block, or TokenSwift's heads), the kind the method
runs.
"""

from __future__ import annotations

import dataclasses
import io
import json
import os
import shutil
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from longspec_jax.errors import UserError
from longspec_jax.files import write_whole
from longspec_jax.models.config import (
  DraftConfig,
  DraftKind,
  HeadsConfig,
  TargetConfig,
  check_tree_widths,
  draft_config_from_dict,
)
from longspec_jax.models.draft import Draft, VocabSubset, random_draft
from longspec_jax.models.heads import Heads, random_heads
from longspec_jax.ops.attention import Impl

CONFIG_NAME = "draft_config.json"
PARAMS_DIR = "params"
RANKING_NAME = "vocab_ranking.npy"
# Drafts shipped with the package, by target spec.
SHIPPED = Path(__file__).resolve().parent.parent / "drafts"
# LongSpec's trees priced at target shapes (`python -m infer.tree_search --prices ... --store`):
# a new draft for a target of a listed shape starts from its tree.
TREES = SHIPPED / "trees.json"
# The dimensions that make a target's shape (what a round's price depends on).
SHAPE_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads", "head_dim")


def save_draft(path: Path, draft: Draft | Heads) -> None:
  """Writes the draft to the directory `path`, replacing what is there: everything is
  written to a temporary directory beside it and renamed into place, so `path` always
  holds a whole draft. One process writes it alone, also in a multi-process run (orbax
  would otherwise wait for the other processes)."""
  import orbax.checkpoint as ocp

  path = Path(path).resolve()
  path.parent.mkdir(parents=True, exist_ok=True)
  tmp = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}."))
  alone = ocp.options.MultiprocessingOptions(primary_host=jax.process_index(), active_processes={jax.process_index()})
  with ocp.StandardCheckpointer(multiprocessing_options=alone) as checkpointer:
    checkpointer.save(tmp / PARAMS_DIR, nnx.state(draft, nnx.Param))
  (tmp / CONFIG_NAME).write_text(json.dumps(draft.config.to_dict(), indent=1))
  if isinstance(getattr(draft, "vocab", None), VocabSubset):
    np.save(tmp / RANKING_NAME, np.asarray(draft.vocab[...]))
  if path.exists():
    old = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}.old."))
    os.replace(path, old / "draft")
    shutil.rmtree(old)
  os.replace(tmp, path)


def store_tree(path: Path, widths: tuple[int, ...], copy_tokens: int) -> None:
  """Makes `widths` with `copy_tokens` grafted in the default tree of the draft in the
  directory `path` (its config is rewritten whole, by a rename)."""
  file = Path(path) / CONFIG_NAME
  config = DraftConfig.from_dict(json.loads(file.read_text()))
  updated = dataclasses.replace(config, tree_widths=tuple(widths), copy_tokens=copy_tokens)  # (checked)
  write_whole(file, json.dumps(updated.to_dict(), indent=1))


def target_shape(config: TargetConfig) -> dict[str, int]:
  """The target's shape: its `SHAPE_FIELDS`."""
  return {name: getattr(config, name) for name in SHAPE_FIELDS}


def _priced_trees(path: Path | None) -> list[dict]:
  """The table of trees at `path` (None: `TREES`), [] where there is no file."""
  path = Path(path or TREES)
  try:
    return json.loads(path.read_text())["trees"] if path.exists() else []
  except (ValueError, KeyError, TypeError) as e:
    raise UserError(f"the table of trees {path} is unreadable ({e}).") from None


def _priced_entry(config: TargetConfig, batch: int, path: Path | None) -> dict | None:
  """The table's entry for the target's shape priced at the largest batch size up to
  `batch` (an entry without one: batch 1), or None."""
  shape = target_shape(config)
  entries = [e for e in _priced_trees(path) if e["shape"] == shape and e.get("batch", 1) <= batch]
  return max(entries, key=lambda e: e.get("batch", 1), default=None)


def _tree_fields(entry: dict | None) -> dict:
  return {} if entry is None else {"tree_widths": tuple(entry["tree_widths"]), "copy_tokens": entry["copy_tokens"]}


def priced_tree(config: TargetConfig, path: Path | None = None) -> dict:
  """The tree priced for the target's shape at batch 1 in the table at `path` (None:
  `TREES`), as DraftConfig fields (`tree_widths`, `copy_tokens`); {} where the table lists
  none."""
  return _tree_fields(_priced_entry(config, 1, path))


def batch_tree(config: TargetConfig, batch: int, path: Path | None = None) -> dict:
  """The tree priced for the target's shape at a batch of more than one sequence, the
  largest such batch size up to `batch`, as `priced_tree` gives it; {} where the table has
  none (a draft then keeps its own tree, the one priced at batch 1). A batch of trees is
  batch x nodes rows through every product: where those become compute-bound, a smaller
  tree pays more."""
  entry = _priced_entry(config, batch, path)
  return _tree_fields(entry) if entry is not None and entry.get("batch", 1) > 1 else {}


def store_priced_tree(
  name: str,
  shape: dict,
  context: int,
  widths: tuple[int, ...],
  copy_tokens: int,
  batch: int = 1,
  path: Path | None = None,
) -> None:
  """Makes `widths` with `copy_tokens` the tree of targets of `shape` (named `name`,
  priced at `context` tokens) for batches of `batch` sequences and more, up to the next
  batch size priced, in the table at `path` (None: `TREES`), replacing the shape's earlier
  entry for that batch size; the file is rewritten whole, by a rename."""
  check_tree_widths(tuple(widths), copy_tokens=copy_tokens)
  entry = {
    "name": name,
    "shape": shape,
    "context": context,
    "batch": batch,
    "tree_widths": list(widths),
    "copy_tokens": copy_tokens,
  }
  trees = [e for e in _priced_trees(path) if (e["shape"], e.get("batch", 1)) != (shape, batch)] + [entry]
  table = sorted(trees, key=lambda e: (e["name"], e.get("batch", 1)))
  write_whole(Path(path or TREES), json.dumps({"trees": table}, indent=1) + "\n")


def new_draft_config(target_config: TargetConfig, **overrides) -> DraftConfig:
  """A new block draft's config for the target: the target's shapes, LongSpec's tree
  priced for the target's shape where the table lists one (`priced_tree`), then
  `overrides` (num_layers, kind, ...)."""
  kind = overrides.get("kind", DraftKind.LONGSPEC)
  tree = priced_tree(target_config) if kind is DraftKind.LONGSPEC else {}
  return DraftConfig.for_target(target_config, **(tree | overrides))


def store_vocab(path: Path, ranking: np.ndarray, size: int) -> None:
  """Stores `ranking` (token ids, the most frequent first) with the block draft in the
  directory `path` and makes it score the first `size` (0: the whole vocabulary); both
  files are rewritten whole, by a rename."""
  path = Path(path)
  file = path / CONFIG_NAME
  config = DraftConfig.from_dict(json.loads(file.read_text()))
  updated = dataclasses.replace(config, vocab_subset=size)  # (checked)
  _check_ranking(np.asarray(ranking), config.vocab_size, size, path / RANKING_NAME)
  saved = io.BytesIO()
  np.save(saved, np.asarray(ranking, np.int32))
  write_whole(path / RANKING_NAME, saved.getvalue())
  write_whole(file, json.dumps(updated.to_dict(), indent=1))


def _shipped(target_name: str, kind: DraftKind) -> Path:
  """Where the package keeps the draft of `kind` for a target (LongSpec's under the
  target's name, GLIDE's and TokenSwift's heads under `<name>-glide`, `<name>-tokenswift`)."""
  return SHIPPED / (target_name if kind is DraftKind.LONGSPEC else f"{target_name}-{kind.value}")


def has_shipped_draft(target_name: str, kind: DraftKind = DraftKind.LONGSPEC) -> bool:
  return (_shipped(target_name, kind) / CONFIG_NAME).is_file()


def resolve_draft(spec: str, target_name: str = "", kind: DraftKind = DraftKind.LONGSPEC) -> Path | None:
  """The checkpoint directory a draft spec names (None for `random`), checked to be one
  without reading it, so that a wrong spec is reported before any weights load."""
  if spec == "random":
    return None
  if spec == "default":
    if not has_shipped_draft(target_name, kind):
      raise UserError(
        f"no default {kind.value} draft is shipped for target {target_name!r}; use a random draft"
        f" ('random') or a draft checkpoint directory (`python -m train.run --draft-kind {kind.value}`)."
      )
    return _shipped(target_name, kind).resolve()
  path = Path(spec).expanduser().resolve()
  if not path.exists():
    raise UserError(f"the draft {spec!r} does not exist; give 'default', 'random' or a draft checkpoint directory.")
  if not (path / CONFIG_NAME).is_file():
    raise UserError(f"{path} is not a draft checkpoint (it has no {CONFIG_NAME}).")
  return path


def load_draft(
  spec: str,
  target_config: TargetConfig,
  dtype,
  target_name: str = "",
  attention: Impl | None = None,
  kind: DraftKind = DraftKind.LONGSPEC,
  vocab_subset: int | None = None,
) -> Draft | Heads:
  """The draft of `kind` a spec names (`resolve_draft`), in `dtype`, checked against the
  target's config; `attention` is a block draft's attention code (default:
  `Impl.default()`; TokenSwift's heads have none); `vocab_subset` the tokens a block
  draft scores, the most frequent first (0: all; None: the draft's own setting)."""
  if vocab_subset and kind is DraftKind.TOKENSWIFT:
    raise UserError("TokenSwift's heads score the whole vocabulary: a vocabulary subset is for a block draft.")
  path = resolve_draft(spec, target_name, kind)
  if path is None:
    if kind is DraftKind.TOKENSWIFT:
      return random_heads(HeadsConfig.for_target(target_config), dtype)
    config = new_draft_config(target_config, kind=kind, vocab_subset=vocab_subset or 0)
    return random_draft(config, dtype, attention=attention)
  draft = _restore(path, target_config, dtype, attention, vocab_subset)
  if draft.config.kind is not kind:
    raise UserError(f"{path} holds {draft.config.kind.value}'s draft, where {kind.value}'s is needed.")
  return draft


def _restore(
  path: Path, target_config: TargetConfig, dtype, attention: Impl | None = None, vocab_subset: int | None = None
) -> Draft | Heads:
  import orbax.checkpoint as ocp

  try:
    config = draft_config_from_dict(json.loads((path / CONFIG_NAME).read_text()))
  except (ValueError, TypeError) as e:
    raise UserError(f"the draft config {path / CONFIG_NAME} is unreadable ({e}).") from None
  config.check_matches(target_config)
  ranking = None
  if isinstance(config, HeadsConfig):
    build = lambda: Heads(config, dtype, rngs=nnx.Rngs(0))
  else:
    if vocab_subset is not None:
      config = dataclasses.replace(config, vocab_subset=vocab_subset)  # (checked)
    if config.vocab_subset:
      ranking = _ranking(path, config.vocab_size, config.vocab_subset)
    build = lambda: Draft(config, dtype, rngs=nnx.Rngs(0), attention=attention, ranking=ranking)
  graphdef, abstract, rest = nnx.split(nnx.eval_shape(build), nnx.Param, ...)
  # Restored onto the device: without a sharding orbax returns host (numpy) arrays, which
  # every jitted call then copies to the device again (~1 ms a call on an H100 for
  # SmolLM2's draft).
  device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=device), abstract)
  try:
    with ocp.StandardCheckpointer() as checkpointer:
      fused = _saved_fused(checkpointer.metadata(path / PARAMS_DIR))
      state = checkpointer.restore(path / PARAMS_DIR, _on_qkv(abstract, _fused_shape) if fused else abstract)
  except Exception as e:  # orbax raises many types for missing or damaged files
    raise UserError(f"could not read the draft parameters in {path / PARAMS_DIR} ({type(e).__name__}: {e}).") from None
  if fused:
    state = _on_qkv(state, lambda x: _grouped(x, config.num_kv_heads))
  rest = jax.tree.map(lambda x: jax.device_put(ranking[: x.shape[0]], device), rest)  # (the subset, if any)
  return nnx.merge(graphdef, state, rest)


def _ranking(path: Path, vocab_size: int, needed: int) -> np.ndarray:
  """The draft's vocabulary ranking (`RANKING_NAME`), checked to hold at least `needed`
  distinct ids of a vocabulary of `vocab_size`."""
  file = path / RANKING_NAME
  if not file.is_file():
    raise UserError(
      f"the draft {path} has no vocabulary ranking ({RANKING_NAME}) to take a subset from; rank its training text"
      " with `python -m train.rank_vocab`, or score the whole vocabulary (a subset of 0)."
    )
  try:
    ranking = np.load(file)
  except (ValueError, OSError) as e:
    raise UserError(f"the vocabulary ranking {file} is unreadable ({e}).") from None
  _check_ranking(ranking, vocab_size, needed, file)
  return ranking.astype(np.int32)


def _check_ranking(ranking: np.ndarray, vocab_size: int, needed: int, file: Path) -> None:
  """Raises UserError unless `ranking` lists at least `needed` distinct ids below `vocab_size`."""
  if (
    ranking.ndim != 1 or len(np.unique(ranking)) != len(ranking) or not np.all((ranking >= 0) & (ranking < vocab_size))
  ):
    raise UserError(f"the vocabulary ranking {file} is not a list of distinct token ids below {vocab_size}.")
  if len(ranking) < needed:
    raise UserError(f"the vocabulary ranking {file} ranks {len(ranking)} tokens, fewer than the {needed} asked for.")


# Drafts saved before q, k and v were grouped by KV head (`layers.DecoderLayer.qkv`) hold
# them side by side, [..., H + 2K, D]: read as they are, then regrouped.
QKV_NAMES = frozenset({"qkv", "qkv_bias"})


def _names(path) -> set:
  """The dict keys and attribute names along a pytree path."""
  return {getattr(key, "key", getattr(key, "name", None)) for key in path}


def _on_qkv(tree, fn):
  """`tree` with `fn` applied to its q/k/v weights and biases (leaves under those names)."""
  return jax.tree_util.tree_map_with_path(lambda path, leaf: fn(leaf) if _names(path) & QKV_NAMES else leaf, tree)


def _saved_fused(metadata) -> bool:
  """Whether a checkpoint's q/k/v weights are in the fused layout [L, E, H + 2K, D] (one
  axis fewer than the grouped [L, E, K, G + 2, D])."""
  tree = getattr(metadata, "item_metadata", metadata)
  leaves = jax.tree_util.tree_leaves_with_path(tree, is_leaf=lambda x: hasattr(x, "shape"))
  return any("qkv" in _names(path) and len(leaf.shape) == 4 for path, leaf in leaves if hasattr(leaf, "shape"))


def _fused_shape(x: jax.ShapeDtypeStruct) -> jax.ShapeDtypeStruct:
  """The fused layout's shape of a grouped q/k/v leaf [..., K, G + 2, D]."""
  *lead, k, g2, d = x.shape
  return jax.ShapeDtypeStruct((*lead, k * g2, d), x.dtype, sharding=x.sharding)


def _grouped(x: jax.Array, kv_heads: int) -> jax.Array:
  """[..., H + 2K, D] (all q heads, all k, all v) -> [..., K, G + 2, D] (per KV head its
  G query heads, its key, its value)."""
  *lead, n, d = x.shape
  heads = n - 2 * kv_heads
  q = x[..., :heads, :].reshape(*lead, kv_heads, heads // kv_heads, d)
  k, v = x[..., heads : heads + kv_heads, None, :], x[..., heads + kv_heads :, None, :]
  return jnp.concatenate([q, k, v], axis=-2)
