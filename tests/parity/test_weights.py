"""Weight loading: GGUF metadata and the q/k un-permutation, and every bad-weights error."""

import json
import shutil
from types import SimpleNamespace

import jax.numpy as jnp
import numpy as np
import pytest

from longspec_jax.errors import UserError
from longspec_jax.weights import default, load_target, resolve_target
from longspec_jax.weights.gguf_file import load_gguf, unpermute_rows
from longspec_jax.weights.hf import load_hf_dir

from helpers import save_tiny_hf_model


def llama_cpp_permute(w, num_heads):
  """What llama.cpp's convert_hf_to_gguf.py does to Llama q/k rows."""
  return w.reshape(num_heads, 2, w.shape[0] // num_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


@pytest.mark.parametrize("heads", [1, 3, 8])
def test_unpermute_inverts_llama_cpp_permutation(heads):
  w = np.random.default_rng(heads).standard_normal((heads * 16, 24))
  np.testing.assert_array_equal(unpermute_rows(llama_cpp_permute(w, heads), heads), w)


@pytest.mark.xdist_group("smollm2")
def test_smollm2_config_from_gguf(smollm2_float32):
  c = smollm2_float32.config
  assert (c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim) == (30, 576, 9, 3, 64)
  assert c.tie_word_embeddings and not c.qkv_bias
  assert c.rope.theta == 100000.0 and c.vocab_size == 49152 and c.eos_token_ids == (2,)


@pytest.fixture
def tiny_dir(tmp_path):
  return save_tiny_hf_model("llama", tmp_path / "llama")


def test_missing_config(tmp_path):
  with pytest.raises(UserError, match="no config.json"):
    load_hf_dir(tmp_path, jnp.float32)


def test_unsupported_architecture(tiny_dir):
  config = json.loads((tiny_dir / "config.json").read_text())
  (tiny_dir / "config.json").write_text(json.dumps({**config, "model_type": "gpt2"}))
  with pytest.raises(UserError, match="model_type 'gpt2' is not supported"):
    load_hf_dir(tiny_dir, jnp.float32)


def test_truncated_safetensors(tiny_dir):
  path = tiny_dir / "model.safetensors"
  path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
  with pytest.raises(UserError, match="truncated or corrupt"):
    load_hf_dir(tiny_dir, jnp.float32)


def test_missing_tensor(tiny_dir):
  from safetensors.numpy import load_file, save_file

  path = tiny_dir / "model.safetensors"
  tensors = load_file(path)
  del tensors["model.layers.1.mlp.up_proj.weight"]
  save_file(tensors, path, metadata={"format": "pt"})
  with pytest.raises(UserError, match="model.layers.1.mlp.up_proj.weight"):
    load_hf_dir(tiny_dir, jnp.float32)


def test_wrong_shape_is_reported(tiny_dir):
  config = json.loads((tiny_dir / "config.json").read_text())
  (tiny_dir / "config.json").write_text(json.dumps({**config, "intermediate_size": 80}))
  with pytest.raises(UserError, match="shape"):
    load_hf_dir(tiny_dir, jnp.float32)


def test_sharded_safetensors_load_like_single(tiny_dir, tmp_path):
  from safetensors.numpy import load_file, save_file

  tensors = load_file(tiny_dir / "model.safetensors")
  sharded = tmp_path / "sharded"
  shutil.copytree(tiny_dir, sharded)
  (sharded / "model.safetensors").unlink()
  names = sorted(tensors)
  weight_map = {}
  for i, part in enumerate((names[::2], names[1::2])):
    file = f"model-0000{i + 1}-of-00002.safetensors"
    save_file({n: tensors[n] for n in part}, sharded / file, metadata={"format": "pt"})
    weight_map.update({n: file for n in part})
  (sharded / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
  single, _ = load_hf_dir(tiny_dir, jnp.float32)
  split, _ = load_hf_dir(sharded, jnp.float32)
  np.testing.assert_array_equal(np.asarray(single.layers.qkv[...]), np.asarray(split.layers.qkv[...]))


def test_truncated_gguf(smollm2_gguf, tmp_path):
  broken = tmp_path / "broken.gguf"
  with smollm2_gguf.open("rb") as f:
    broken.write_bytes(f.read(1 << 20))
  with pytest.raises(UserError, match="not a readable GGUF file"):
    load_gguf(broken, jnp.float32)


def test_not_a_gguf(tmp_path):
  fake = tmp_path / "fake.gguf"
  fake.write_bytes(b"definitely not gguf" * 100)
  with pytest.raises(UserError, match="not a readable GGUF file"):
    load_gguf(fake, jnp.float32)


def test_target_specs(tmp_path, monkeypatch):
  with pytest.raises(UserError, match="does not exist"):
    resolve_target(str(tmp_path / "nothing-here"))
  (tmp_path / "notes.txt").write_text("x")
  with pytest.raises(UserError, match="neither a Hugging Face model directory nor a .gguf file"):
    resolve_target(str(tmp_path / "notes.txt"))
  monkeypatch.setenv("LONGSPEC_SMOLLM2_GGUF", str(tmp_path / "missing.gguf"))
  with pytest.raises(UserError, match="does not exist"):
    load_target("smollm2-135m", jnp.float32)
  monkeypatch.setenv("LONGSPEC_SMOLLM2_GGUF", str(tmp_path))
  with pytest.raises(UserError, match="is not a file; point it at SmolLM2-135M-Instruct.Q4_1.gguf"):
    resolve_target("smollm2-135m")


def test_the_fetch_shows_pips_progress_where_stderr_has_no_descriptor(tmp_path, monkeypatch, capsys):
  """Under a capture object without a file descriptor (pytest's, a notebook's) pip's
  progress goes to the process's stderr instead of failing the fetch."""
  calls = []
  monkeypatch.setattr(
    default.subprocess, "run", lambda *a, **k: calls.append(k) or SimpleNamespace(returncode=1, stderr="offline")
  )
  with pytest.raises(UserError, match="offline"):
    default._fetch(tmp_path / "model.gguf")
  assert calls[0]["stdout"] == 2


def test_damaged_cached_default_model_is_fetched_again(tmp_path, monkeypatch, capsys):

  monkeypatch.delenv("LONGSPEC_SMOLLM2_GGUF", raising=False)
  monkeypatch.setenv("LONGSPEC_CACHE", str(tmp_path))
  monkeypatch.setattr(default, "_installed_package_gguf", lambda: None)
  fetched = []
  monkeypatch.setattr(default, "_fetch", lambda path: (fetched.append(path), path.write_bytes(b"\0" * 8)))
  cached = tmp_path / "models" / default.GGUF_NAME
  cached.parent.mkdir(parents=True)
  cached.write_bytes(b"GGUF" * 100)  # an interrupted copy
  assert default.default_gguf_path() == cached and fetched == [cached]
  assert "is damaged (400 bytes, expected 98362432); fetching it again" in capsys.readouterr().err


def test_draft_checkpoint_round_trip_and_damage(tmp_path):
  import jax
  from flax import nnx

  from longspec_jax.models.config import DraftConfig, TargetConfig
  from longspec_jax.models.draft import random_draft
  from longspec_jax.weights.drafts import load_draft, save_draft

  target = TargetConfig(
    vocab_size=50, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8
  )
  draft = random_draft(DraftConfig.for_target(target, num_layers=2, window=32), jnp.float32, seed=5)
  save_draft(tmp_path / "d", draft)
  loaded = load_draft(str(tmp_path / "d"), target, jnp.float32)
  assert loaded.config == draft.config
  assert all(isinstance(x, jax.Array) for x in jax.tree.leaves(nnx.state(loaded)))  # on the device, not host arrays
  for a, b in zip(jax.tree.leaves(nnx.state(draft)), jax.tree.leaves(nnx.state(loaded))):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  # A draft saved before q/k/v were grouped by KV head ([L, E, H + 2K, D]: all q heads,
  # all k, all v) loads regrouped.
  import orbax.checkpoint as ocp

  def fused(path, x):
    if "qkv" not in jax.tree_util.keystr(path):
      return x
    *lead, k, g2, d = x.shape
    return jnp.concatenate(
      [x[..., : g2 - 2, :].reshape(*lead, k * (g2 - 2), d), x[..., g2 - 2, :], x[..., g2 - 1, :]], axis=-2
    )

  with ocp.StandardCheckpointer() as checkpointer:
    checkpointer.save(tmp_path / "old" / "params", jax.tree_util.tree_map_with_path(fused, nnx.state(draft)))
  shutil.copy(tmp_path / "d" / "draft_config.json", tmp_path / "old")
  old = load_draft(str(tmp_path / "old"), target, jnp.float32)
  for a, b in zip(jax.tree.leaves(nnx.state(draft)), jax.tree.leaves(nnx.state(old))):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  shutil.rmtree(tmp_path / "d" / "params")
  with pytest.raises(UserError, match="could not read the draft parameters"):
    load_draft(str(tmp_path / "d"), target, jnp.float32)


def test_a_drafts_vocabulary_ranking_is_stored_and_subsets_taken_from_it(tmp_path):
  """`store_vocab` keeps a ranking with the draft and the size it scores; a load takes
  that many of its first ids (or as many as asked, 0: all), and a saved subset draft
  keeps its own ids; a draft without a ranking, a short ranking and a ranking that is
  no list of distinct ids are refused in one sentence."""
  from longspec_jax.models.config import DraftConfig, TargetConfig
  from longspec_jax.models.draft import random_draft
  from longspec_jax.weights.drafts import load_draft, save_draft, store_vocab

  target = TargetConfig(
    vocab_size=50, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8
  )
  save_draft(tmp_path / "d", random_draft(DraftConfig.for_target(target, window=16), jnp.float32))
  with pytest.raises(UserError, match="has no vocabulary ranking"):
    load_draft(str(tmp_path / "d"), target, jnp.float32, vocab_subset=5)
  ranking = np.arange(50)[::-1].copy()
  store_vocab(tmp_path / "d", ranking, 10)
  loaded = load_draft(str(tmp_path / "d"), target, jnp.float32)
  assert loaded.vocab_rows == 10 and np.asarray(loaded.vocab[...]).tolist() == list(range(49, 39, -1))
  assert np.asarray(loaded.subset_tokens()).tolist() == list(range(40, 50))
  assert load_draft(str(tmp_path / "d"), target, jnp.float32, vocab_subset=0).vocab_rows is None
  assert load_draft(str(tmp_path / "d"), target, jnp.float32, vocab_subset=20).vocab_rows == 20
  save_draft(tmp_path / "again", loaded)  # (its 10 ids go with it)
  assert load_draft(str(tmp_path / "again"), target, jnp.float32).vocab_rows == 10
  with pytest.raises(UserError, match="ranks 10 tokens, fewer than the 20 asked for"):
    load_draft(str(tmp_path / "again"), target, jnp.float32, vocab_subset=20)
  with pytest.raises(UserError, match="not a list of distinct token ids below 50"):
    store_vocab(tmp_path / "d", np.asarray([1, 1, 2]), 2)
  with pytest.raises(UserError, match="vocab_subset must be 0 \\(all\\) to 50 tokens"):
    load_draft(str(tmp_path / "d"), target, jnp.float32, vocab_subset=51)
