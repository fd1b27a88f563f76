"""TokenSwift's multi-token heads (tokenswift.md, section 3.2).

The target drafts for itself: on its final hidden state h_0 (the LM head's input) sit
`gamma` linear layers chained with residuals, h_i = f_i(h_{i-1}) + h_{i-1}, and the
target's own LM head g reads each: l_i = g(h_i) predicts the token i + 1 places past the
one g(h_0) predicts. Chained, not independent (the paper: "the additional linear layers
should not be independent of each other"), so each head refines the one before, as the
autoregressive model would.

As the authors' code does, each f_i normalises its input (RMSNorm, then the linear map)
and each head's output is normalised again before the LM head; unlike it, h_0 is the
target's normalised final state (what `Transformer.hidden_and_kv` and verification
return) rather than the residual stream before the final norm: with the norms inside
each f_i the two differ by a per-token scale that the linear maps absorb. The linear
maps start at zero, so an untrained head predicts what the target predicts.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from longspec_jax.models.config import HeadsConfig
from longspec_jax.models.layers import build_random, rms_norm


class Heads(nnx.Module):
  """The heads' own parameters: per head an input norm, a linear map and an output norm,
  stacked over the heads [G, ...]; the target supplies h_0 and the LM head."""

  def __init__(self, config: HeadsConfig, dtype=jnp.float32, *, rngs: nnx.Rngs):
    del rngs  # (zero-initialised linear maps: nothing is drawn)
    self.config = config
    g, e = config.gamma, config.hidden_size
    self.input_norm = nnx.Param(jnp.ones((g, e), dtype))
    self.linear = nnx.Param(jnp.zeros((g, e, e), dtype))
    self.output_norm = nnx.Param(jnp.ones((g, e), dtype))

  def __call__(self, hidden: jax.Array) -> jax.Array:
    """hidden [..., E] (the target's final state h_0) -> each head's normalised state
    [..., G, E], for the target's LM head."""
    c = self.config
    h = hidden.astype(self.linear.dtype)
    out = []
    for i in range(c.gamma):  # (gamma is small: 3 in the paper)
      h = h + jnp.einsum("...e,ef->...f", rms_norm(h, self.input_norm[i], c.rms_norm_eps), self.linear[i])
      out.append(rms_norm(h, self.output_norm[i], c.rms_norm_eps))
    return jnp.stack(out, axis=-2)


def random_heads(config: HeadsConfig, dtype, seed: int = 0) -> Heads:
  return build_random(lambda rngs: Heads(config, dtype, rngs=rngs), seed)
