"""Continuous batching: requests admitted into free slots between chunks of rounds, each
writing the tokens it writes alone."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from longspec_jax.batching import Slots, _powers_of_two, batch_axes
from longspec_jax.decoding.compiles import Compiles
from longspec_jax.engine import PAD_ID, Decoding, generate
from longspec_jax.methods.factory import make_proposer
from longspec_jax.methods.registry import Method, ProposerOptions
from longspec_jax.models.config import DraftConfig, DraftKind, HeadsConfig
from longspec_jax.models.draft import random_draft
from longspec_jax.models.heads import random_heads

from helpers import tiny_target


@pytest.fixture(scope="module")
def tiny():
  return tiny_target("llama")


def proposer(target, method: Method):
  """`method`'s proposer and params on `target`, with random drafts of small trees."""
  options = ProposerOptions(tree_widths=(2, 2), copy_tokens=4)
  if method is Method.TOKENSWIFT:
    heads = random_heads(HeadsConfig.for_target(target.config, gamma=2, tree_widths=(1, 2, 2)), jnp.float32)
    return make_proposer(method, heads, ProposerOptions(tree_widths=(1, 2, 2)))
  if method in (Method.LONGSPEC, Method.GLIDE, Method.AUTO):
    kind = DraftKind.GLIDE if method is Method.GLIDE else DraftKind.LONGSPEC
    draft = random_draft(DraftConfig.for_target(target.config, kind=kind, window=8), jnp.float32)
    return make_proposer(method, draft, options)
  return make_proposer(method, None, options if method is Method.PLD else ProposerOptions())


def drain(slots, count: int, admit, released=lambda request: None) -> dict[int, list[int]]:
  """Requests 0..count-1 through `slots` in chunks of three rounds, each admitted into a free
  slot by `admit(slot, request)` (its first token) and released when done (then
  `released(request)`): the tokens each wrote."""
  waiting, running, written = list(range(count)), {}, {}
  while waiting or running:
    for slot in slots.free:
      if waiting:
        request = waiting.pop(0)
        written[request] = [admit(slot, request)]
        running[slot] = request
    tokens, done = slots.run(3)
    for slot, request in list(running.items()):
      written[request] += [int(t) for t in tokens[slot] if t != PAD_ID]
      if done[slot]:
        slots.release(slot)
        del running[slot]
        released(request)
  return written


def test_the_batch_axis_of_each_leaf_is_read_off_two_batch_sizes():
  one = {"rows": np.zeros((1, 5)), "cache": np.zeros((3, 1, 7)), "shared": np.zeros(4), "count": np.zeros(())}
  two = {"rows": np.zeros((2, 5)), "cache": np.zeros((3, 2, 7)), "shared": np.zeros(4), "count": np.zeros(())}
  assert batch_axes(one, two) == (1, None, 0, None)  # (leaves in key order: cache, count, rows, shared)


@pytest.mark.parametrize("method", list(Method))
def test_requests_joining_and_leaving_slots_write_what_they_write_alone(tiny, method):
  """Five requests of different lengths and limits through two slots, in chunks of two
  rounds: each joins the first free slot, one is given up after its first chunk, and the
  tokens of every other equal its generation alone."""
  rng = np.random.default_rng(3)
  prompt = lambda n: (rng.integers(3, 60, size=n // 2).tolist() * 2)[:n]  # (repeats: prompt lookup copies)
  requests = [(prompt(n), limit) for n, limit in [(21, 9), (9, 4), (30, 12), (14, 1), (17, 7)]]
  given_up = 2
  proposer_, params = proposer(tiny, method)
  decoding = Decoding(proposer=proposer_)
  slots = Slots.open(tiny, decoding, params, slots=2, positions=256)
  waiting, running, written = list(range(len(requests))), {}, {}
  while waiting or running:
    for slot in slots.free:
      if not waiting:
        break
      request = waiting.pop(0)
      first, done, _ = slots.admit(slot, *requests[request])
      written[request] = [first]
      if done:
        slots.release(slot)
      else:
        running[slot] = request
    if not running:
      continue
    tokens, done = slots.run(2)
    for slot, request in list(running.items()):
      written[request] += [int(t) for t in tokens[slot] if t != PAD_ID]
      if done[slot] or request == given_up:
        slots.release(slot)
        del running[slot]
  for request, (ids, limit) in enumerate(requests):
    alone = generate(tiny, [ids], limit, decoding, params).token_ids[0]
    if request == given_up:
      assert written[request] == alone[: len(written[request])] and len(written[request]) < limit
    else:
      assert written[request] == alone, request


def test_a_slot_in_use_and_a_prompt_too_long_are_refused(tiny):
  slots = Slots.open(tiny, Decoding(), None, slots=2, positions=128)
  slots.admit(0, [5, 6, 7], 4)
  with pytest.raises(ValueError, match="slot 0 holds a request"):
    slots.admit(0, [5, 6], 4)
  with pytest.raises(Exception, match="need a cache of 256 positions; this one holds 128"):
    slots.admit(1, [5] * 100, 40)
  assert slots.free == [1]


@pytest.mark.parametrize("answers_eos", [False, True])
def test_autos_prices_are_measured_at_the_slots_shape_when_they_open(tiny, answers_eos, tmp_path):
  """Measured whatever the target writes: one that answers every prompt with an EOS (here:
  every token is one) still runs the rounds the prices are taken from."""
  from longspec_jax import engine
  from longspec_jax.methods import prices
  from longspec_jax.methods.auto import CHOOSE

  proposer_, params = proposer(tiny, Method.AUTO)
  decoding = Decoding(proposer=proposer_, eos_ids=tuple(range(tiny.config.vocab_size)) if answers_eos else ())
  memory = engine.Memory(prices=prices.PriceBook(directory=tmp_path))  # (none measured before)
  slots = Slots.open(tiny, decoding, params, slots=2, positions=256, memory=memory)
  (table,) = memory.prices.measured.values()
  assert table.complete and slots.free == [0, 1]
  costs = np.asarray(slots.state.proposal.costs)
  np.testing.assert_allclose(costs, np.float32(table.seconds[:-1]))  # (the batch chooses by them)
  assert int(slots.state.proposal.force) == CHOOSE


def test_autos_next_request_starts_from_the_gains_the_slots_learnt(tiny, tmp_path):
  """Once a request is released, the next one admitted starts from the gains the slots'
  rows showed (a generation starts from the previous one's), not from unseen ones; what
  the calibration's repeated prompt showed is not learnt."""
  from longspec_jax import engine
  from longspec_jax.methods import prices

  proposer_, params = proposer(tiny, Method.AUTO)
  memory = engine.Memory(prices=prices.PriceBook(directory=tmp_path))
  slots = Slots.open(tiny, Decoding(proposer=proposer_), params, slots=2, positions=256, memory=memory)
  assert np.isnan(slots.carried["learnt"].copy_gain).all() and not memory.learnt  # (calibrated, nothing learnt)
  pattern = list(range(3, 12))
  slots.admit(0, pattern * 4, 24)
  while not np.asarray(slots.state.done)[0]:
    slots.run(4)
  slots.release(0)
  learnt = slots.carried["learnt"]
  assert not np.isnan(learnt.copy_gain).all()
  assert memory.learnt[slots.decoding, tiny.config] is learnt  # (later slots and generations start from it)
  slots.admit(1, list(range(40, 60)), 4)
  np.testing.assert_array_equal(np.asarray(slots.state.proposal.copy_gain)[1], learnt.copy_gain)


def test_a_chunk_is_sized_by_the_rounds_the_last_one_ran(tiny, monkeypatch):
  """A chunk of ten rounds whose request ends after three took (by a fake clock) a second:
  a round is a third of a second, so a two-second chunk is six rounds (not twenty), and
  a chunk asked for less than a round runs one."""
  from longspec_jax import batching, engine

  slots = Slots.open(tiny, Decoding(), None, slots=1, positions=128)
  slots.admit(0, list(range(3, 20)), 4)  # (its first token, then three rounds of one)
  slots.round_time = 0.2
  clock = iter([0.0, 1.0])
  monkeypatch.setattr(batching.time, "perf_counter", lambda: next(clock))
  slots.step(2.0)
  assert int(slots.state.rounds) == 3 and slots.round_time == 1 / 3
  assert engine.rounds_in(slots.round_time, 2.0) == 6 and engine.rounds_in(slots.round_time, 0.1) == 1


def test_the_other_slots_run_between_the_passes_of_a_prefill(tiny):
  """A 40-token prompt prefilled in passes of 16 while another request decodes: the other
  runs a chunk after each pass but the last, and both write what they write alone."""
  decoding = Decoding()
  slots = Slots.open(tiny, decoding, None, slots=2, positions=128)
  first = list(range(3, 14))
  written = {0: [slots.admit(0, first, 20)[0]]}
  second = np.random.default_rng(5).integers(3, 200, size=40).tolist()

  def between():
    tokens, _ = slots.run(1)
    written[0] += [int(t) for t in tokens[0] if t != PAD_ID]

  written[1] = [slots.admit(1, second, 6, prefill_chunk=16, between=between)[0]]
  assert len(written[0]) == 3  # (its first token, then one round after each of two passes)
  while not all(np.asarray(slots.state.done)):
    tokens, _ = slots.run(4)
    for slot in (0, 1):
      written[slot] += [int(t) for t in tokens[slot] if t != PAD_ID]
  assert written[0] == generate(tiny, [first], 20).token_ids[0]
  assert written[1] == generate(tiny, [second], 6).token_ids[0]


@pytest.mark.parametrize("method", [Method.AR, Method.AUTO])
def test_a_release_and_the_next_request_compile_nothing(tiny, method):
  """A slot's release runs what the slots compiled when they opened, and the next request
  of the same length runs the programs the first compiled: a server's next request does
  not wait for a compilation."""
  proposer_, params = proposer(tiny, method)
  decoding = Decoding(proposer=proposer_)
  slots = Slots.open(tiny, decoding, params, slots=2, positions=128)
  first, second = np.random.default_rng(3).integers(3, 200, size=(2, 30)).tolist()

  slots.admit(0, first, 6)
  while not np.asarray(slots.state.done)[0]:
    slots.run(3)
  with Compiles() as compiles:
    slots.release(0)
    written = [slots.admit(0, second, 6).first]
    while not np.asarray(slots.state.done)[0]:
      tokens, _ = slots.run(3)
      written += [int(t) for t in tokens[0] if t != PAD_ID]
    slots.release(0)
  assert compiles.count == 0
  assert written == generate(tiny, [second], 6, decoding, params).token_ids[0]


def test_the_other_slots_run_between_the_passes_of_a_group_which_starts_after_its_last(tiny, monkeypatch):
  """Three prompts admitted together (calls of two and one, in 16-token passes: the call of
  two takes three) while another request decodes: the other runs a chunk after each pass
  but the group's last, the group's slots emit nothing until all are admitted, and every
  request writes what it writes alone."""
  slots = Slots.open(tiny, Decoding(), None, slots=4, positions=128)
  first = list(range(3, 14))
  written = {0: [slots.admit(0, first, 20).first]}
  rng = np.random.default_rng(9)
  group = [rng.integers(3, 200, size=n).tolist() for n in (40, 33, 10)]
  monkeypatch.setattr("longspec_jax.engine.prefill_chunk_tokens", lambda batch: 16)

  def between():
    assert not slots.busy[1:].any()
    tokens, _ = slots.run(1)
    assert (tokens[1:] == PAD_ID).all()
    written[0] += [int(t) for t in tokens[0] if t != PAD_ID]

  for slot, admitted in zip((1, 2, 3), slots.admit_together([1, 2, 3], group, [6, 6, 6], [0, 0, 0], between=between)):
    written[slot] = [admitted.first]
  assert len(written[0]) == 4  # (its first token, then one round after each of three passes)
  while not all(np.asarray(slots.state.done)):
    tokens, _ = slots.run(4)
    for slot in written:
      written[slot] += [int(t) for t in tokens[slot] if t != PAD_ID]
  assert written[0] == generate(tiny, [first], 20).token_ids[0]
  for slot, prompt in zip((1, 2, 3), group):
    assert written[slot] == generate(tiny, [prompt], 6).token_ids[0], slot


def test_a_group_compiled_before_it_arrives_compiles_nothing_when_it_does(tiny):
  """After `compile_group` for counts of one and two (passes padded to a power of two; the
  first slot left free), three prompts of any lengths up to the longest admitted together, idle or in passes of the
  chunk compiled, compile nothing and each writes what it writes alone."""
  slots = Slots.open(tiny, Decoding(), None, slots=4, positions=128)
  assert slots.group_counts == [1, 2, 4]
  for count in (1, 2):
    slots.compile_group(count, 100, (None, 32), per_octave=1)
  slots.compile()
  assert not slots.busy.any() and np.asarray(slots.state.done).all()
  rng = np.random.default_rng(4)
  prompts = [rng.integers(3, 200, size=n).tolist() for n in (50, 17, 100, 90, 33, 8)]
  written = {}
  with Compiles() as compiles:
    for group, chunk in ((prompts[:3], None), (prompts[3:], 32)):
      admitted = slots.admit_together([0, 1, 2], group, [5] * 3, [0] * 3, prefill_chunk=chunk, per_octave=1)
      written.update({tuple(prompt): [one.first] for prompt, one in zip(group, admitted)})
      while not np.asarray(slots.state.done)[:3].all():
        tokens, _ = slots.run(4)
        for slot, prompt in enumerate(group):
          written[tuple(prompt)] += [int(t) for t in tokens[slot] if t != PAD_ID]
      for slot in (0, 1, 2):
        slots.release(slot)
  assert compiles.count == 0
  for prompt in prompts:
    assert written[tuple(prompt)] == generate(tiny, [prompt], 5).token_ids[0]


@pytest.mark.parametrize("method, count", [(Method.AR, 3), (Method.LONGSPEC, 3), (Method.AUTO, 3), (Method.PLD, 1)])
def test_the_next_turn_reuses_the_slot_holding_the_conversation(tiny, method, count):
  """A prompt that extends a finished request's prompt and answer goes to that request's
  slot, prefills only its new tokens, and writes what it writes alone (also where the slots
  are one: the row is the whole batch)."""
  proposer_, params = proposer(tiny, method)
  decoding = Decoding(proposer=proposer_)
  slots = Slots.open(tiny, decoding, params, slots=count, positions=256)
  rng = np.random.default_rng(9)
  turn = rng.integers(3, 200, size=30).tolist()
  if count > 1:
    slots.admit(0, rng.integers(3, 200, size=12).tolist(), 3)  # (another conversation, in slot 0)
  slot = slots.choose(turn)
  assert slot == (1 if count > 1 else 0)  # (nothing held anywhere: the first free slot)
  answer = [slots.admit(slot, turn, 10).first]
  while not np.asarray(slots.state.done)[slot]:
    tokens, _ = slots.run(3)
    answer += [int(t) for t in tokens[slot] if t != PAD_ID]
  slots.release(slot)
  assert answer == generate(tiny, [turn], 10, decoding, params).token_ids[0]
  assert slots.held(slot, turn[:20] + [1, 2, 3]) == 0  # (too little in common to be worth a pass of its own)
  following = turn + answer + rng.integers(3, 200, size=7).tolist()
  assert slots.choose(following) == slot
  again = slots.admit(slot, following, 8)
  assert again.reused == len(turn) + len(answer) - 1  # (all but the answer's last token, never fed back)
  written = [again.first]
  while not np.asarray(slots.state.done)[slot]:
    tokens, _ = slots.run(3)
    written += [int(t) for t in tokens[slot] if t != PAD_ID]
  assert written == generate(tiny, [following], 8, decoding, params).token_ids[0]


def test_a_batch_invariant_target_prefills_every_prompt_whole(tiny):
  """No slot's cache is reused under batch-invariant numerics: a pass over a prompt's rest
  would give its K/V other bits than a whole prefill, and the tokens would depend on what
  the slot held before."""
  slots = Slots.open(tiny.with_numerics(batch_invariant=True), Decoding(), None, slots=1, positions=128)
  turn = list(range(3, 60))
  slots.admit(0, turn, 1)
  slots.release(0)
  assert slots.held(0, turn + [7, 8]) == 0 and slots.admit(0, turn + [7, 8], 1).reused == 0


@pytest.mark.parametrize("method", [Method.AR, Method.PLD, Method.LONGSPEC])
def test_each_request_samples_with_its_own_temperature_top_p_and_seed(tiny, method):
  """Requests of one batch ask for their own temperature, top-p and seed (greedy among
  them): each writes what a generation alone with those settings writes."""
  from longspec_jax.decoding.sampling import SamplingConfig

  rng = np.random.default_rng(5)
  requests = [
    (rng.integers(3, 60, size=n).tolist(), 8, seed, temperature, top_p)
    for n, seed, temperature, top_p in [(13, 1, 0.8, 0.9), (20, 2, 0.0, 1.0), (9, 3, 1.2, 1.0), (16, 4, 0.6, 0.5)]
  ]
  proposer_, params = proposer(tiny, method)
  slots = Slots.open(tiny, Decoding(proposer=proposer_), params, slots=2, positions=128, per_sequence_sampling=True)

  def admit(slot, request):
    prompt, limit, seed, temperature, top_p = requests[request]
    first = slots.admit(slot, prompt, limit, seed, temperature=temperature, top_p=top_p).first
    drawing = np.asarray(slots.state.rows.temperature)[slots.busy] > 0  # (the rounds' program: with draws or not)
    assert slots.state.rows.sampled == bool(drawing.any())
    return first

  written = drain(slots, len(requests), admit)
  assert not slots.state.rows.sampled  # (every request released: greedy rounds)
  for request, (prompt, limit, seed, temperature, top_p) in enumerate(requests):
    alone = Decoding(proposer=proposer_, sampling=SamplingConfig(temperature=temperature, top_p=top_p))
    assert written[request] == generate(tiny, [prompt], limit, alone, params, seed=seed).token_ids[0], request


@pytest.mark.parametrize("method", [Method.PLD, Method.AUTO])
def test_slots_that_shrink_run_the_rows_up_to_the_last_busy_one(tiny, method):
  """With `shrink`, a chunk computes the rows up to the last busy slot (a power of two): a
  lone request in the first of four slots runs one row, one in the third four; every
  request writes what it writes alone, and a free slot past the rows keeps its state (the
  cache of a request it held, for a chat's next turn)."""
  proposer_, params = proposer(tiny, method)
  slots = Slots.open(tiny, Decoding(proposer=proposer_), params, slots=4, positions=128, shrink=True)
  slots.compile()
  rng = np.random.default_rng(7)
  prompts = [rng.integers(3, 60, size=n).tolist() for n in (11, 17, 8)]
  alone = [generate(tiny, [p], 12, Decoding(proposer=proposer_), params).token_ids[0] for p in prompts]

  def finish(slot, request) -> list[int]:
    written = [slots.admit(slot, prompts[request], 12).first]
    while not np.asarray(slots.state.done)[slot]:
      tokens, _ = slots.run(2)
      written += [int(t) for t in tokens[slot] if t != PAD_ID]
    slots.release(slot)
    return written

  assert slots.live_rows == 4  # (none busy: every row)
  slots.admit(2, prompts[0], 12)
  assert slots.live_rows == 4
  slots.release(2)
  assert finish(3, 0) == alone[0]
  kept = np.asarray(slots.state.cache.k)[:, 3]
  slots.admit(0, prompts[1], 12)
  assert slots.live_rows == 1
  slots.release(0)
  assert finish(0, 1) == alone[1]
  assert finish(1, 2) == alone[2]
  np.testing.assert_array_equal(np.asarray(slots.state.cache.k)[:, 3], kept)


def test_slots_that_shrink_weigh_autos_kinds_at_the_prices_of_the_rows_they_run(tiny, tmp_path):
  """`auto` in slots that shrink has prices for each count of rows a chunk may run, measured
  when they open, and a chunk of one row chooses by one row's prices, of all four by four's."""
  from longspec_jax import engine
  from longspec_jax.methods import prices

  proposer_, params = proposer(tiny, Method.AUTO)
  memory = engine.Memory(prices=prices.PriceBook(directory=tmp_path))  # (none measured before)
  slots = Slots.open(tiny, Decoding(proposer=proposer_), params, slots=4, positions=128, memory=memory, shrink=True)
  assert sorted(slots.seconds_by_rows) == [1, 2, 4] and len(memory.prices.measured) == 3 and slots.free == [0, 1, 2, 3]

  def priced(rows):
    seconds = slots.seconds_by_rows[rows]
    np.testing.assert_allclose(np.asarray(slots.state.proposal.costs), np.float32(seconds[:-1]))
    np.testing.assert_allclose(float(slots.state.proposal.switch), np.float32(seconds[-1]))

  slots.admit(0, list(range(5, 20)), 6)
  slots.run(1)
  priced(1)
  slots.admit(3, list(range(9, 30)), 6)
  slots.run(1)
  priced(4)


def test_released_requests_outputs_are_kept_in_release_order_and_read_by_every_slot(tiny):
  """Prompt lookup over past outputs in two slots: each released request's output goes into
  the ring in the order they end (a ring of 40 tokens: the oldest dropped), the running
  slot reads the ring as it is then, and every request writes what it writes alone."""
  from longspec_jax import engine
  from longspec_jax.methods.past import SEPARATOR

  decoding = Decoding(proposer=make_proposer(Method.PLD, None, ProposerOptions(past_tokens=40))[0])
  memory = engine.Memory()
  slots = Slots.open(tiny, decoding, None, slots=2, positions=256, memory=memory)
  rng = np.random.default_rng(5)
  requests = [(rng.integers(3, 60, size=n).tolist(), limit) for n, limit in [(12, 9), (7, 14), (20, 6), (9, 11)]]
  ended = []

  buffers = lambda: [leaf.unsafe_buffer_pointer() for leaf in jax.tree.leaves(slots.state.proposal)]
  held = buffers()

  def released(request):
    ended.append(request)
    searched = np.asarray(slots.state.proposal.tokens)
    np.testing.assert_array_equal(searched, memory.past[tiny.config, 40].tokens)  # (the running slots read it at once)
    assert buffers() == held  # (written where the rounds read them: a GPU's graphs of the rounds stay valid)

  written = drain(slots, len(requests), lambda slot, request: slots.admit(slot, *requests[request]).first, released)
  stream = [SEPARATOR] * 40
  for request in ended:
    stream += written[request] + [SEPARATOR]
  ring = memory.past[tiny.config, 40]
  assert ring.tokens[(np.arange(40) + ring.written) % 40].tolist() == stream[-40:]
  for request, (ids, limit) in enumerate(requests):
    assert written[request] == generate(tiny, [ids], limit, Decoding()).token_ids[0], request


def test_a_group_is_prefilled_in_calls_of_powers_of_two():
  assert [_powers_of_two(n) for n in (1, 6, 7, 13, 16)] == [[1], [4, 2], [4, 2, 1], [8, 4, 1], [16]]


@pytest.mark.parametrize("method", [Method.AR, Method.PLD, Method.AUTO])
def test_prompts_admitted_together_write_what_each_writes_alone(tiny, method):
  """Three prompts of different lengths and limits prefilled in one call into three slots
  (calls of two and one), a fourth admitted alone once one ends: each writes what it
  writes alone."""
  rng = np.random.default_rng(7)
  requests = [((rng.integers(3, 60, size=n // 2).tolist() * 2)[:n], limit) for n, limit in [(23, 8), (6, 12), (15, 5)]]
  requests.append((rng.integers(3, 60, size=11).tolist(), 9))
  proposer_, params = proposer(tiny, method)
  decoding = Decoding(proposer=proposer_)
  slots = Slots.open(tiny, decoding, params, slots=3, positions=256)
  together = slots.admit_together([2, 0, 1], *zip(*requests[:3]), [3, 4, 5])
  assert slots.free == [] and slots.group == 65536 // 256
  written = {request: [admitted.first] for request, admitted in enumerate(together)}
  running, waiting = {2: 0, 0: 1, 1: 2}, [3]
  while running:
    tokens, done = slots.run(2)
    for slot, request in list(running.items()):
      written[request] += [int(t) for t in tokens[slot] if t != PAD_ID]
      if done[slot]:
        slots.release(slot)
        del running[slot]
        if waiting:
          request = waiting.pop()
          written[request] = [slots.admit(slot, *requests[request], 6).first]
          running[slot] = request
  seeds = [3, 4, 5, 6]
  for request, (ids, limit) in enumerate(requests):
    alone = generate(tiny, [ids], limit, decoding, params, seed=seeds[request]).token_ids[0]
    assert written[request] == alone, request
