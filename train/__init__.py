"""Draft training: data, loss, sharded steps, checkpoints and the `python -m train.run` CLI.

The choices a run is configured with live here, free of JAX, so the CLI offers them
before it imports anything heavy.
"""

import enum


class Positions(enum.Enum):
  """RoPE positions of a training sequence: LongSpec's anchor-offset (Algorithm 1: the
  first 4 tokens at 0-3, the rest shifted by a random offset, so short sequences train the
  large positions long contexts reach) or plain 0..T-1."""

  ANCHOR_OFFSET = "anchor_offset"
  VANILLA = "vanilla"


class Labels(enum.Enum):
  """What the draft learns to predict: the frozen target's next-token distribution (what
  acceptance is measured against) or the data's next token (the paper's loss)."""

  TARGET = "target"
  DATA = "data"
