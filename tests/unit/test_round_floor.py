import pytest

from lab.round_floor import Round, layer_params, prefill_flops
from longspec_jax.models.config import DraftConfig, TargetConfig

TARGET = TargetConfig(
  vocab_size=100, hidden_size=8, intermediate_size=16, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=2
)


def test_a_rounds_floor_terms_by_hand():
  """A 2-layer target (E 8, F 16, 4 heads and 2 KV heads of 2, vocabulary 100) in bf16 at
  10 cached positions; a one-layer draft with a ring of 4; a 5-node tree, 2 draft passes
  and 3 head reads of a 20-token subset; 1000 bytes/s and 1000 FLOP/s, so a term's ms is
  its bytes or FLOPs."""
  assert layer_params(TARGET) == 8 * 8 * 2 + 4 * 2 * 8 + 3 * 8 * 16 == 576
  draft = DraftConfig.for_target(TARGET, window=4)
  r = Round(TARGET, 2, batch=1, context=10, nodes=5, draft=draft, draft_passes=2, head_reads=3, head_rows=20)
  assert r.target_weight_bytes == (2 * 576 + 100 * 8) * 2 == 3904
  assert r.kv_bytes == 2 * 10 * 2 * 2 * 2 * 2 == 320  # layers x slots x (k, v) x heads x D x bytes
  # its layer and cross q/o (2 x 8 x 4 x 2), the target layer's K/V of 10 slots, the ring of 4
  assert r.draft_pass_bytes == (576 + 128) * 2 + 10 * 16 + 4 * 16 == 1632
  assert r.head_bytes == 20 * 8 * 2 == 320
  assert r.verify_gemm_flops == 2 * 5 * 1952
  assert r.verify_attention_flops == 4 * 5 * 15 * 4 * 2 * 2  # nodes x (context + nodes) x heads x D x layers
  terms = r.terms_ms(1e3, 1e3)
  assert terms == pytest.approx(
    {
      "draft_ms": 2 * 1632,
      "head_ms": 3 * 320,
      "verify_bytes_ms": 4224,
      "verify_gemm_ms": 19520,
      "verify_attention_ms": 4800,
      "floor_ms": 2 * 1632 + 3 * 320 + 19520 + 4800,  # the verify pass at its FLOPs, the larger
    }
  )


def test_an_ar_step_reads_the_whole_head_and_tensor_parallelism_splits_every_term():
  step = Round(TARGET, 2, batch=1, context=10)
  assert step.head_bytes == 100 * 8 * 2 and step.draft_pass_bytes == 0
  one, two = step.terms_ms(1e3, 1e9), Round(TARGET, 2, batch=1, context=10, devices=2).terms_ms(1e3, 1e9)
  assert one["floor_ms"] == pytest.approx(4224) and two["floor_ms"] == pytest.approx(one["floor_ms"] / 2)


def test_tokenswifts_drafting_pass_reads_the_target_and_its_partial_cache():
  r = Round(TARGET, 2, batch=1, context=10, nodes=4, self_draft_slots=6, draft_passes=1)
  assert r.draft_pass_bytes == 3904 + 2 * 6 * 16


def test_a_prefills_flops_by_hand():
  """6 tokens: every layer's matmuls over 6 rows, causal attention over 21 (query, key)
  pairs per head and layer (QK and PV: 4 x D FLOPs each), one row of the LM head."""
  assert prefill_flops(TARGET, 6) == 2 * 6 * 2 * 576 + 4 * 4 * 2 * 2 * 21 + 2 * 100 * 8
