"""The GEMM choice: one compilation per choice, the same results off a GPU."""

import jax
import jax.numpy as jnp
import numpy as np

from longspec_jax.engine import generate
from longspec_jax.models.config import TargetConfig
from longspec_jax.models.target import random_model
from longspec_jax.ops import gemm
from longspec_jax.ops.gemm import Compilation, Gemm

TINY = TargetConfig(
  vocab_size=97,
  hidden_size=32,
  intermediate_size=48,
  num_layers=2,
  num_heads=4,
  num_kv_heads=2,
  head_dim=8,
  max_position_embeddings=128,
  tie_word_embeddings=True,
)


def test_one_compilation_per_choice_computes_the_same():
  @gemm.jit(static_argnames=("scale",))
  def product(x, w, scale):
    return scale * x @ w

  assert set(product) == {Compilation(choice, exact) for choice in Gemm for exact in (False, True)}
  x, w = jax.random.normal(jax.random.key(0), (3, 5)), jax.random.normal(jax.random.key(1), (5, 7))
  for compilation in product:
    np.testing.assert_allclose(product[compilation](x, w, scale=2.0), 2.0 * x @ w, rtol=1e-6)


def test_options_and_default():
  assert Gemm.XLA.compiler_options() is None
  assert Gemm.CUBLAS.compiler_options() == {"xla_gpu_enable_triton_gemm": False}
  assert Compilation(Gemm.XLA).compiler_options() is None
  assert Compilation(Gemm.CUBLAS, exact=True).compiler_options() == {
    "xla_gpu_enable_triton_gemm": False,
    "xla_allow_excess_precision": False,
  }
  assert Gemm.default() is (Gemm.CUBLAS if jax.default_backend() == "gpu" else Gemm.XLA)


def test_the_engine_runs_the_models_choice():
  model = random_model(TINY, jnp.bfloat16)
  assert model.gemm is Gemm.default()
  tokens = {}
  for choice in Gemm:
    tokens[choice] = generate(model.with_numerics(gemm=choice), [[1, 2, 3, 4, 5]], 6).token_ids
  assert tokens[Gemm.XLA] == tokens[Gemm.CUBLAS]


def test_logits_round_like_transformers():
  """bf16 logits are the bf16 product (float32 accumulation), widened afterwards."""
  model = random_model(TINY, jnp.bfloat16)
  hidden = jax.random.normal(jax.random.key(2), (3, TINY.hidden_size), jnp.bfloat16)
  logits = model.logits(hidden)
  assert logits.dtype == jnp.float32
  np.testing.assert_array_equal(logits, (hidden @ model.embed[...].T).astype(jnp.float32))
