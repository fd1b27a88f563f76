"""`auto`'s price table: the prices corrected by the generations that chose by them."""

import numpy as np
import pytest

from longspec_jax.methods import prices
from longspec_jax.methods.prices import Prices, realized_prices

MEASURED = (1.1, 1.2, 2.0)  # seconds a round of AR, CHAIN and COPY, as measured at the start


def generations(true, fixed, count, seed=0):
  """`count` generations of random mixes of rounds, each costing `fixed` plus its rounds at `true`."""
  rng = np.random.default_rng(seed)
  rounds = rng.integers(0, 60, size=(count, len(true)))
  return tuple((tuple(r.tolist()), fixed + float(np.dot(r, true))) for r in rounds)


def test_generations_move_the_measured_prices_to_those_they_paid():
  true = (1.0, 1.2, 2.4)
  assert realized_prices(MEASURED, ()) == list(MEASURED)
  np.testing.assert_allclose(realized_prices(MEASURED, generations(true, fixed=3.0, count=40)), true, rtol=0.03)
  # (a few generations move them part of the way)
  few = realized_prices(MEASURED, generations(true, fixed=3.0, count=2))
  assert MEASURED[2] < few[2] < true[2]


def test_a_price_stays_within_half_and_twice_its_measurement():
  dear = realized_prices(MEASURED, generations((1.1, 1.2, 20.0), fixed=0.0, count=40))
  assert dear[2] == pytest.approx(2 * MEASURED[2])
  cheap = realized_prices(MEASURED, generations((1.1, 0.01, 2.0), fixed=0.0, count=40))
  assert cheap[1] == pytest.approx(MEASURED[1] / 2)


def test_a_table_keeps_its_latest_generations_and_reads_back_from_json():
  table = Prices(seconds=(*MEASURED, 0.1), chunks=((),) * 4)
  assert table.current() == (*MEASURED, 0.1)  # (none realized yet; the change of kind as measured)
  for rounds, seconds in generations((1.0, 1.2, 2.4), fixed=3.0, count=prices.REALIZED_KEPT + 5):
    table = table.with_generation(rounds, seconds)
  assert len(table.realized) == prices.REALIZED_KEPT
  assert Prices.from_json(table.to_json()) == table
  older = {"seconds": [*MEASURED, 0.1], "chunks": [[]] * 4}  # (a file written before generations were kept)
  assert Prices.from_json(older) == Prices(seconds=(*MEASURED, 0.1), chunks=((),) * 4)
  np.testing.assert_allclose(table.current()[:3], (1.0, 1.2, 2.4), rtol=0.03)
  assert table.current()[3] == 0.1
