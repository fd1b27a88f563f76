"""longspec-jax: lossless speculative decoding for long contexts in JAX.

The public API, in the order a program uses it:

  import longspec_jax as ls

  target = ls.load_target("smollm2-135m", jnp.float32)  # the model, its config and tokenizer
  draft = ls.load_draft("default", target.config, jnp.float32, "smollm2-135m")
  proposer, params = ls.make_proposer(ls.Method.LONGSPEC, draft)
  result = ls.generate(target.model, [prompt_ids], 256, ls.Decoding(proposer=proposer), params)
  result.token_ids, result.stats.mean_accepted_length

Names load on first use (PEP 562), so importing the package, or a JAX-free part of it such
as `methods.registry`, does not start JAX.
"""

import importlib

__version__ = "0.1.0"

_EXPORTS = {
  "Decoding": "longspec_jax.engine",
  "GenerationResult": "longspec_jax.engine",
  "GenerationStats": "longspec_jax.engine",
  "Memory": "longspec_jax.engine",
  "generate": "longspec_jax.engine",
  "start": "longspec_jax.engine",
  "decode_chunk": "longspec_jax.engine",
  "Slots": "longspec_jax.batching",
  "Method": "longspec_jax.methods.registry",
  "ProposerOptions": "longspec_jax.methods.registry",
  "make_proposer": "longspec_jax.methods.factory",
  "SamplingConfig": "longspec_jax.decoding.sampling",
  "SparseVerify": "longspec_jax.models.config",
  "CapeConfig": "longspec_jax.models.config",
  "DraftKind": "longspec_jax.models.config",
  "load_target": "longspec_jax.weights",
  "load_tokenizer": "longspec_jax.weights",
  "load_draft": "longspec_jax.weights.drafts",
  "UserError": "longspec_jax.errors",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
  if name not in _EXPORTS:
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
  return getattr(importlib.import_module(_EXPORTS[name]), name)


def __dir__():
  return sorted([*globals(), *_EXPORTS])
