"""How a target computes, decided once when it is built or loaded: its attention code
(`attention.Impl`), the code of its matrix products on a GPU (`gemm.Gemm`), and whether its
decoding rounds compute batch-invariantly (each token's logits the bits an AR step gives)."""

from __future__ import annotations

import dataclasses

from longspec_jax.ops.attention import Impl
from longspec_jax.ops.gemm import Gemm


@dataclasses.dataclass(frozen=True)
class Numerics:
  """A target's numerics (static under jit). The defaults: the Pallas kernels and cuBLAS on
  a GPU, the jnp reference and XLA elsewhere, rounds as fast as they come."""

  attention: Impl = dataclasses.field(default_factory=Impl.default)
  gemm: Gemm = dataclasses.field(default_factory=Gemm.default)
  batch_invariant: bool = False
