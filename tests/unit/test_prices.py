"""`auto`'s prices: read from the timed chunks, kept as JSON."""

import pytest

from longspec_jax.methods import prices
from longspec_jax.methods.prices import Prices


def test_a_price_is_read_from_the_fastest_chunks_and_counts_chunks_cut_short():
  late = [(1, 8.5), (1, 15.0), (1, 8.6), (9, 20.5), (9, 30.0), (5, 14.5)]  # (a late 1- and 9-round chunk)
  assert prices.price(late, switch=False, repeats=3) == 1.5
  assert prices.price(late[:5], switch=False, repeats=3) is None  # (2 longer chunks: not yet)
  assert prices.price([(1, 3.0)] * 3 + [(9, 2.0)] * 3, switch=True, repeats=3) == 0.0  # (a change costs nothing)
  # A difference lost in the chunks' jitter (below a quarter of a round's share): that share.
  assert prices.price([(1, 10.0)] * 3 + [(9, 10.8)] * 3, switch=False, repeats=3) == pytest.approx(1.2)


def test_a_table_reads_back_from_json():
  table = Prices(seconds=(1.1, None, 2.0, None), chunks=((), ((1, 3.0), (9, 13.5)), (), ()))
  assert Prices.from_json(table.to_json()) == table and not table.complete
  older = {"seconds": [1.1, 1.2, 2.0, 0.1], "chunks": [[]] * 4, "realized": [[[3, 4, 5], 9.0]]}
  assert Prices.from_json(older) == Prices(seconds=(1.1, 1.2, 2.0, 0.1), chunks=((),) * 4)
  assert Prices.from_json({"seconds": [1.0, 2.0]}) is None  # (another form: measured again)
