"""The padded width of a prefill pass (`engine.prefill_width`, `prefill_passes`; generations
are in tests/e2e/test_engine.py)."""

from longspec_jax.engine import prefill_passes, prefill_width


def test_a_prefill_pads_a_prompt_by_at_most_an_eighth_with_eight_widths_an_octave():
  widths = [prefill_width(n) for n in (1, 16, 17, 100, 512, 513, 3000, 3072, 3073, 32000)]
  assert widths == [16, 16, 32, 112, 512, 576, 3072, 3072, 3328, 32768]
  for tokens in range(129, 40000, 7):  # (below 128: a multiple of 16)
    assert tokens <= prefill_width(tokens) <= tokens * 9 / 8
  assert len({prefill_width(n) for n in range(2049, 4097)}) == 8


def test_with_one_width_an_octave_a_pass_is_a_power_of_two():
  widths = [prefill_width(n, per_octave=1) for n in (1, 16, 17, 100, 512, 513, 3000)]
  assert widths == [16, 16, 32, 128, 512, 1024, 4096]
  assert {prefill_width(n, per_octave=2) for n in range(2049, 4097)} == {3072, 4096}


def test_the_passes_of_prompts_up_to_a_length_are_each_width_first_and_later():
  assert prefill_passes(100, 512, per_octave=1) == {(16, True), (32, True), (64, True), (128, True)}
  assert prefill_passes(100, 32, per_octave=1) == {(16, True), (32, True), (16, False), (32, False)}
  assert prefill_passes(40, 32, per_octave=1) == {(16, True), (32, True), (16, False)}  # (8 left: a pass of 16)
  assert len(prefill_passes(4096, 32768)) == 16 + 4 * 8  # (multiples of 16 up to 256, then eight an octave)
