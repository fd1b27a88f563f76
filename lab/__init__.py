"""Measurement tools for the people who build the library: kernel and model-shape timings,
profiles, checks of batch invariance, traces of `auto`'s choices. Each runs as
`python -m lab.NAME`; the library never imports them."""
