"""Loading weights: targets by spec (`targets.py`: the embedded default, a Hugging Face
model directory, a GGUF file), their tokenizers (`tokenizer.py`) and draft checkpoints
(`drafts.py`).

The loaders import JAX; `weights.default` (the embedded model's name and file) does not,
so that a CLI can check its flags before JAX starts. The package's own names are
therefore imported on first use (PEP 562).
"""

import importlib

_EXPORTS = {
  "LoadedTarget": "targets",
  "load_target": "targets",
  "read_target_config": "targets",
  "resolve_target": "targets",
  "load_tokenizer": "tokenizer",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
  if name not in _EXPORTS:
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
  return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
