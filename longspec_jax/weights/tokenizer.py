"""Tokenizers for a target: a HF model directory's own, or one built from a GGUF file's
metadata with the `tokenizers` library, without torch.

A GGUF carries no `tokenizer.json`; llama.cpp stores the vocabulary, merges, token
types, special ids and chat template as metadata. transformers can convert that, but its
GGUF reader needs torch, which the main job (`python -m infer.generate`) never installs.
So the two vocabulary kinds our targets use are rebuilt here:

- `gpt2`: byte-level BPE (Llama 3, Qwen2, SmolLM2), split before merging with the
  regular expression named by `tokenizer.ggml.pre` as llama.cpp does;
- `llama`: SentencePiece BPE with byte fallback (Llama 2, Vicuna, LongChat, Mistral),
  merges recovered from the pieces' scores when the file lists none.

The result is a `transformers.PreTrainedTokenizerFast` (the same interface as a model
directory's tokenizer: call, `decode`, `apply_chat_template`), cached on disk by the
file's path, size and modification time, since reading a 50k-entry vocabulary out of a
GGUF takes seconds.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from pathlib import Path

from longspec_jax.errors import UserError

# llama.cpp's token types (`tokenizer.ggml.token_type`).
CONTROL, USER_DEFINED = 3, 4
# transformers' names of the special tokens -> llama.cpp's (`tokenizer.ggml.<name>_token_id`).
SPECIAL_IDS = {"bos": "bos", "eos": "eos", "unk": "unknown", "pad": "padding"}
# Bumped when the tokenizer built from a GGUF changes, so that cached ones are rebuilt.
BUILD_VERSION = 2

_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3_SPLIT = (
  r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
  r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
  r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
  r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# `tokenizer.ggml.pre` -> (split digits one by one first, split expression): llama.cpp's
# pre-tokenizers (src/llama-vocab.cpp). Unnamed kinds get GPT-2's expression.
PRE_TOKENIZERS = {
  "default": (False, _GPT2_SPLIT),
  "gpt2": (False, _GPT2_SPLIT),
  "smollm": (True, _GPT2_SPLIT),
  "llama3": (False, _LLAMA3_SPLIT),
  "llama-v3": (False, _LLAMA3_SPLIT),
  "llama-bpe": (False, _LLAMA3_SPLIT),
  "smaug-bpe": (False, _LLAMA3_SPLIT),
  "qwen2": (False, _QWEN2_SPLIT),
  "deepseek-r1-qwen": (False, _QWEN2_SPLIT),
}


def _byte_alphabet() -> dict[int, str]:
  """GPT-2's printable spelling of each byte, in which byte-level vocabularies are written."""
  printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
  spelling, extra = {}, 0
  for byte in range(256):
    if byte in printable:
      spelling[byte] = chr(byte)
    else:
      spelling[byte] = chr(256 + extra)
      extra += 1
  return spelling


def _byte_level(meta: dict):
  from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

  spelling = _byte_alphabet()
  alphabet = set(spelling.values())
  # (Tokens spelled outside the byte alphabet, e.g. raw UTF-8 in some files, are respelled.)
  vocab = {
    token if set(token) <= alphabet else "".join(spelling[b] for b in token.encode()): i
    for i, token in enumerate(meta["tokens"])
  }
  merges = [tuple(m.split(" ", 1)) for m in meta["merges"]]
  tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
  digits, split = PRE_TOKENIZERS.get(meta.get("pre"), PRE_TOKENIZERS["default"])
  tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
    ([pre_tokenizers.Digits(individual_digits=True)] if digits else [])
    + [
      pre_tokenizers.Split(Regex(split), behavior="isolated"),
      pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ]
  )
  tokenizer.decoder = decoders.ByteLevel()
  return tokenizer


def spm_merges(tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
  """BPE merges equivalent to a SentencePiece vocabulary: every split of a piece into two
  pieces of the vocabulary, ranked by the merged piece's score (best first), ties by the
  longer left then right part, then by vocabulary order."""
  index = {token: i for i, token in enumerate(tokens)}
  merges = []
  for token, score in zip(tokens, scores):
    pairs = [(token[:k], token[k:]) for k in range(1, len(token)) if token[:k] in index and token[k:] in index]
    pairs.sort(key=lambda p: (index[p[0]], index[p[1]]))
    merges += [(score, left, right) for left, right in pairs]
  merges.sort(key=lambda m: (-m[0], -len(m[1]), -len(m[2])))  # stable: ties keep vocabulary order
  return [(left, right) for _, left, right in merges]


def _sentencepiece(meta: dict):
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers

  tokens = meta["tokens"]
  merges = (
    [tuple(m.split(" ", 1)) for m in meta["merges"]] if meta.get("merges") else spm_merges(tokens, meta["scores"])
  )
  unk = meta.get("unk_token_id")
  tokenizer = Tokenizer(
    models.BPE(
      vocab={t: i for i, t in enumerate(tokens)},
      merges=merges,
      fuse_unk=True,
      byte_fallback=True,
      unk_token=None if unk is None else tokens[unk],
    )
  )
  prefix = meta.get("add_space_prefix", True)
  tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(
    replacement="▁", prepend_scheme="first" if prefix else "never", split=False
  )
  tokenizer.decoder = decoders.Sequence(
    [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    + ([decoders.Strip(content=" ", left=1)] if prefix else [])
  )
  return tokenizer


BUILDERS = {"gpt2": _byte_level, "llama": _sentencepiece}


def gguf_metadata(reader, path: Path) -> dict:
  """The tokenizer's fields of an open `gguf.GGUFReader`, under short names."""

  def field(key, default=None):
    f = reader.fields.get(f"tokenizer.{key}")
    return default if f is None else f.contents()

  kind = field("ggml.model")
  if kind is None:
    raise UserError(f"{path} has no tokenizer in its metadata (tokenizer.ggml.model).")
  if kind not in BUILDERS:
    raise UserError(f"{path}: GGUF tokenizer kind {kind!r} is not supported; supported are {', '.join(BUILDERS)}.")
  meta = {
    "model": kind,
    "tokens": field("ggml.tokens"),
    "token_type": field("ggml.token_type") or [],
    "merges": field("ggml.merges"),
    "scores": field("ggml.scores"),
    "pre": field("ggml.pre"),
    "chat_template": field("chat_template"),
    "add_space_prefix": field("ggml.add_space_prefix", True),
    # llama.cpp adds BOS to SentencePiece vocabularies unless the file says otherwise
    "add_bos": field("ggml.add_bos_token", kind == "llama"),
    "add_eos": field("ggml.add_eos_token", False),
  }
  for name, key in SPECIAL_IDS.items():
    meta[f"{name}_token_id"] = field(f"ggml.{key}_token_id")
  if not meta["tokens"] or (meta["merges"] is None and meta["scores"] is None):
    raise UserError(f"{path}: the GGUF tokenizer metadata lacks its tokens, merges or scores.")
  return meta


def tokenizer_from_gguf_metadata(meta: dict):
  """A `PreTrainedTokenizerFast` for the metadata of `gguf_metadata`."""
  from tokenizers import AddedToken, processors
  from transformers import PreTrainedTokenizerFast

  tokenizer = BUILDERS[meta["model"]](meta)
  tokens = meta["tokens"]
  types = list(meta["token_type"])
  # Control tokens (<|im_start|>, <s>) are matched whole and are special (skipped when
  # decoding with skip_special_tokens); user-defined ones are matched whole, not special.
  # In a byte-level vocabulary a "control" token spelled outside the byte alphabet is a
  # mislabel of llama.cpp's converter; it is left as an ordinary token.
  alphabet = set(_byte_alphabet().values()) if meta["model"] == "gpt2" else None
  tokenizer.add_special_tokens(
    [
      AddedToken(t, special=True, normalized=False)
      for t, k in zip(tokens, types)
      if k == CONTROL and (alphabet is None or set(t) <= alphabet)
    ]
  )
  tokenizer.add_tokens(
    [AddedToken(t, special=False, normalized=False) for t, k in zip(tokens, types) if k == USER_DEFINED]
  )
  special = {name: tokens[meta[f"{name}_token_id"]] for name in SPECIAL_IDS if meta[f"{name}_token_id"] is not None}
  added = [name for name in ("bos", "eos") if meta[f"add_{name}"] and name in special]  # around each sequence
  if added:
    before = f"{special['bos']} " if "bos" in added else ""
    after = f" {special['eos']}" if "eos" in added else ""
    tokenizer.post_processor = processors.TemplateProcessing(
      single=f"{before}$A{after}",
      pair=f"{before}$A{after} {before}$B{after}",
      special_tokens=[(special[name], meta[f"{name}_token_id"]) for name in added],
    )
  return PreTrainedTokenizerFast(
    tokenizer_object=tokenizer,
    chat_template=meta.get("chat_template"),
    clean_up_tokenization_spaces=False,
    **{f"{name}_token": token for name, token in special.items()},
  )


def load_tokenizer(path: Path):
  """The tokenizer of a model directory or a GGUF file (chat template included)."""
  if path.suffix != ".gguf":
    from transformers import AutoTokenizer  # heavy (it imports torch where torch is installed)

    try:
      return AutoTokenizer.from_pretrained(str(path))
    except Exception as e:  # missing files, or a tokenizer class that needs a package we lack
      reason = " ".join(str(e).split())[:300]
      raise UserError(f"could not read the tokenizer of {path} ({type(e).__name__}: {reason}).") from None
  stat = path.stat()
  key = hashlib.sha1(f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}|{BUILD_VERSION}".encode()).hexdigest()[:16]
  from longspec_jax.files import cache_root

  cached = cache_root() / "tokenizers" / key
  if cached.is_dir():  # (one built from GGUF metadata: a fast tokenizer, read without AutoTokenizer's imports)
    from transformers import PreTrainedTokenizerFast

    try:
      return PreTrainedTokenizerFast.from_pretrained(str(cached))
    except Exception:  # a damaged cache entry: rebuild it
      shutil.rmtree(cached, ignore_errors=True)
  from longspec_jax.weights.gguf_file import open_gguf

  tokenizer = tokenizer_from_gguf_metadata(gguf_metadata(open_gguf(path), path))
  cached.parent.mkdir(parents=True, exist_ok=True)
  tmp = Path(tempfile.mkdtemp(dir=cached.parent))
  tokenizer.save_pretrained(str(tmp))
  try:
    os.replace(tmp, cached)
  except OSError:  # another process cached it first
    shutil.rmtree(tmp, ignore_errors=True)
  return tokenizer
