"""The padded width of a prefill pass (`engine.prefill_width`; generations are in tests/e2e/test_engine.py)."""

from longspec_jax.engine import prefill_width


def test_a_prefill_pads_a_prompt_by_at_most_an_eighth_with_eight_widths_an_octave():
  widths = [prefill_width(n) for n in (1, 16, 17, 100, 512, 513, 3000, 3072, 3073, 32000)]
  assert widths == [16, 16, 32, 112, 512, 576, 3072, 3072, 3328, 32768]
  for tokens in range(129, 40000, 7):  # (below 128: a multiple of 16)
    assert tokens <= prefill_width(tokens) <= tokens * 9 / 8
  assert len({prefill_width(n) for n in range(2049, 4097)}) == 8
