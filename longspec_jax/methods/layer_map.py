"""SpecAttn's layer mapping (specattn.md, section 3.3 and appendix B): for each target
layer, the draft layer whose attention over the context stands in for its own.

Offline, on calibration text, each pair (draft layer i, target layer j) is scored by how
well the draft's attention distributions predict the target's: S[i, j] = -KL(A^v_j ||
A^d_i), averaged over the rows (queries x heads) both attended from (`kl_similarity`).
The mapping f maximises the total score under monotonicity, f(j) <= f(j') for j < j'
(attention patterns change in the same direction up both stacks), draft layers skipped
or repeated as the score asks (`monotone_map`: the paper's dynamic time warping, here
as its equivalent, a prefix maximum per target layer). A one-layer draft (this project's
LongSpec and GLIDE drafts) maps every target layer to its one layer.
"""

from __future__ import annotations

import numpy as np


def kl_similarity(target: np.ndarray, draft: np.ndarray, eps: float = 1e-9) -> np.ndarray:
  """target [Lt, N, S], draft [Ld, N, S]: each layer's attention distributions over S
  context positions for the same N rows (each sums to 1). Returns S [Ld, Lt], S[i, j] =
  -mean over rows of KL(target_j || draft_i) (0 where they agree; eps keeps a position
  the draft gives no weight finite)."""
  target, draft = np.asarray(target, np.float64), np.asarray(draft, np.float64)
  if target.shape[1:] != draft.shape[1:]:
    raise ValueError(
      f"the layers' attention must cover the same rows and positions, got {target.shape[1:]} and {draft.shape[1:]}."
    )
  plogp = np.sum(target * np.log(np.maximum(target, eps)), axis=-1)  # [Lt, N]
  cross = np.einsum("jns,ins->ijn", target, np.log(np.maximum(draft, eps)))  # [Ld, Lt, N]
  return -(plogp[None] - cross).mean(axis=-1)


def monotone_map(score: np.ndarray) -> tuple[int, ...]:
  """score [m, n] (draft layer i, target layer j) -> f, the draft layer for each target
  layer, non-decreasing, with the largest total score sum_j score[f(j), j] (of equal
  totals: the smaller draft layer, from the last target layer back)."""
  score = np.asarray(score, np.float64)
  m, n = score.shape
  best = np.empty((n, m))  # best[j, i]: the best total of target layers 0..j with f(j) = i
  best[0] = score[:, 0]
  for j in range(1, n):
    best[j] = score[:, j] + np.maximum.accumulate(best[j - 1])
  mapping = [int(np.argmax(best[-1]))]
  for j in range(n - 1, 0, -1):  # each layer's draft layer: the best at or below the next one's
    mapping.append(int(np.argmax(best[j - 1, : mapping[-1] + 1])))
  return tuple(reversed(mapping))
