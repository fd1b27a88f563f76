"""The server's model thread without a model: text handed on in pieces, held back where a
stop string may be starting, cut at one, and a full queue refused."""

import asyncio
import logging
import queue
import time

import pytest

from infer.serve import GATHER_SECONDS, PREFILL_CHUNK, Activity, Job, Worker
from longspec_jax import batching
from longspec_jax.engine import prefill_chunk_tokens

LOOPS: list[asyncio.AbstractEventLoop] = []  # the jobs' loops, closed after each test


@pytest.fixture(autouse=True)
def close_loops():
  yield
  while LOOPS:
    LOOPS.pop().close()


class Slots:
  busy = [False, False]

  def __init__(self):
    self.released = []

  def release(self, slot):
    self.released.append(slot)

  def sequence_stats(self, slot):
    return {"rounds": 1}


class Letters:
  """A tokenizer whose token i is the character chr(i) (EOS 0 decodes to nothing)."""

  def decode(self, ids, skip_special_tokens=True):
    return "".join(chr(i) for i in ids if i)


def job(stop=(), max_tokens=50):
  loop = asyncio.new_event_loop()
  LOOPS.append(loop)
  return Job([1], max_tokens, 0, None, None, stop, loop, asyncio.Queue()), loop


def pieces(job, loop):
  loop.run_until_complete(asyncio.sleep(0))  # (the pieces were scheduled on the job's loop)
  out = []
  while not job.events.empty():
    out.append(job.events.get_nowait())
  return out


def test_text_is_handed_on_and_cut_at_a_stop_string():
  worker = Worker(Slots(), Letters(), eos_ids=(0,), max_queue=4)
  j, loop = job(stop=("END",))
  worker.running[1] = j
  worker._hand_on(1, j, [ord(c) for c in "abcE"], done=False)
  assert pieces(j, loop) == [("ab", None)]  # ("cE" held: "END" may be starting)
  worker._hand_on(1, j, [ord(c) for c in "Nxy"], done=False)
  assert pieces(j, loop) == [("cEN", None)]  # ("xy" held)
  worker._hand_on(1, j, [ord(c) for c in "ENDzz"], done=False)
  assert pieces(j, loop) == [("xy", None), ("", "stop")] and worker.slots.released == [1] and not worker.running


def test_a_finished_job_gives_its_reason():
  worker = Worker(Slots(), Letters(), eos_ids=(0,), max_queue=4)
  for ids, reason in (([104, 105, 0], "stop"), ([104, 105], "length")):
    j, loop = job()
    worker.running[0] = j
    worker._hand_on(0, j, ids, done=True)
    assert pieces(j, loop) == [("hi", None), ("", reason)]


def test_a_job_given_up_frees_its_slot_silently():
  worker = Worker(Slots(), Letters(), eos_ids=(0,), max_queue=4)
  j, loop = job()
  worker.running[0], j.cancelled = j, True
  worker._hand_on(0, j, [104], done=False)
  assert pieces(j, loop) == [] and worker.slots.released == [0]


def test_a_job_whose_loop_is_closed_is_given_up():
  j, loop = job()
  loop.close()
  j.put("text", None)
  assert j.cancelled


def test_a_full_queue_refuses_and_a_given_up_job_is_skipped():
  worker = Worker(Slots(), Letters(), eos_ids=(0,), max_queue=2)
  first, _ = job()
  second, _ = job()
  assert worker.submit(first) and worker.submit(second) and not worker.submit(job()[0])
  first.cancelled = True
  assert worker._next() is second and worker._next() is None


class Admitting(Slots):
  """Four free slots; slot 3 holds the start of prompt [9, 9]; what each admission took."""

  group = 8
  model = type("Model", (), {"batch_invariant": False})()

  def __init__(self):
    super().__init__()
    self.free, self.calls = [0, 1, 2, 3], []

  def held(self, slot, prompt):
    return 2 if slot == 3 and prompt[:2] == [9, 9] else 0

  def choose(self, prompt):
    return 3 if prompt[:2] == [9, 9] else self.free[0]

  groupable = batching.Slots.groupable  # (the rule under test, over this fake's slots)

  def admit_together(self, slots, prompts, limits, seeds, temperatures, top_ps, prefill_chunk, between, per_octave):
    self.calls.append(("together", list(slots), [p[0] for p in prompts]))
    self.chunk, self.between = prefill_chunk, between
    self.free = [s for s in self.free if s not in slots]
    return [type("Admitted", (), {"first": 104, "done": False})() for _ in slots]

  def admit(self, slot, prompt, *args, **kwargs):
    self.calls.append(("alone", slot, prompt[0]))
    self.free.remove(slot)
    return type("Admitted", (), {"first": 104, "done": False, "reused": 2})()


def test_jobs_waiting_while_none_runs_start_together_up_to_one_a_slot_holds():
  worker = Worker(Admitting(), Letters(), eos_ids=(0,), max_queue=8)
  jobs = [job()[0] for _ in range(4)]
  for j, first in zip(jobs, ([5], [6], [9, 9, 1], [7])):
    j.prompt = first
    worker.submit(j)
  worker._admit()
  assert worker.slots.calls == [("together", [0, 1], [5, 6]), ("alone", 3, 9), ("alone", 2, 7)]
  assert sorted(worker.running) == [0, 1, 2, 3] and worker.slots.between is worker.slots.chunk is None


def test_jobs_waiting_while_others_run_start_together_the_others_stepping_between_passes():
  worker = Worker(Admitting(), Letters(), eos_ids=(0,), max_queue=8)
  worker.slots.free = [0, 1, 2]
  worker.running[3] = job()[0]
  jobs = [job()[0] for _ in range(3)]
  for j, first in zip(jobs, ([5], [6], [7])):
    j.prompt = first
    worker.submit(j)
  worker._admit()
  assert worker.slots.calls == [("together", [0, 1, 2], [5, 6, 7])]
  assert worker.slots.between == worker._step and sorted(worker.running) == [0, 1, 2, 3]
  # (passes of PREFILL_CHUNK tokens over the three, a power of two each, as the others stream)
  assert worker.slots.chunk == max(64, min(PREFILL_CHUNK, prefill_chunk_tokens(1)) // 4)


class Arrivals:
  """A queue that hands out its jobs one a call, then is empty; the timeouts it was given."""

  def __init__(self, jobs):
    self.jobs, self.timeouts = list(jobs), []

  def get(self, timeout):
    self.timeouts.append(timeout)
    if not self.jobs:
      raise queue.Empty
    return self.jobs.pop(0)


def test_an_idle_worker_gathers_the_jobs_arriving_each_just_after_the_last_up_to_its_free_slots():
  worker = Worker(Admitting(), Letters(), eos_ids=(0,), max_queue=8)
  jobs = [job()[0] for _ in range(6)]
  worker.queue = Arrivals(jobs)
  worker._wait_for_work()
  assert list(worker.waiting) == jobs[:4]  # (four free slots)
  assert worker.queue.timeouts == [0.05] + 3 * [GATHER_SECONDS]
  worker.waiting.clear()
  worker.queue = Arrivals(jobs[:2])
  worker._wait_for_work()
  assert list(worker.waiting) == jobs[:2] and len(worker.queue.timeouts) == 3  # (then none came)


def test_admissions_chunks_and_ends_are_logged_with_their_times(caplog):
  caplog.set_level(logging.DEBUG, logger="infer.serve")
  worker = Worker(Admitting(), Letters(), eos_ids=(0,), max_queue=8)
  for first in ([5, 1], [6, 1], [9, 9, 1]):
    j = job()[0]
    j.prompt = first
    worker.submit(j)
  worker._admit()
  worker._finish(0, worker.running[0], "stop")
  lines = [r.getMessage() for r in caplog.records]
  assert lines[0].startswith("admitted 2 requests into slots 0, 1: 4 prompt tokens prefilled (0 cached) in ")
  assert lines[1].startswith("admitted 1 request into slot 3: 1 prompt token prefilled (2 cached) in ")
  assert lines[2] == "slot 0 done (stop): 1 token in 1 round"
  assert (worker.activity.prompt_tokens, worker.activity.generated, worker.activity.finished) == (5, 3, 1)


def test_a_stats_line_comes_every_so_often_where_something_ran(caplog):
  caplog.set_level(logging.INFO, logger="infer.serve")
  worker = Worker(Slots(), Letters(), eos_ids=(0,), max_queue=4, log_every=10.0)
  worker._log_stats()  # (not yet 10 s)
  worker.activity = Activity(since=time.monotonic() - 20, prompt_tokens=4000, generated=100, finished=1)
  worker._log_stats()
  worker.activity.since -= 20  # (20 s of nothing)
  worker._log_stats()
  [line] = [r.getMessage() for r in caplog.records]
  assert line.startswith("0 running, 0 waiting; prompt 200 tokens/s, generation 5 tokens/s, 1 finished over the last")
