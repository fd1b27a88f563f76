"""Draft training: data, loss, sharded steps, checkpoints and the `python -m train.run` CLI.

The choices a run is configured with live here, free of JAX, so the CLI offers them
before it imports anything heavy.
"""

POSITION_KINDS = ("anchor_offset", "vanilla")
# What the draft learns to predict: the frozen target's next-token distribution (what
# acceptance is measured against), or the data's next token (the paper's loss).
LABEL_KINDS = ("target", "data")
