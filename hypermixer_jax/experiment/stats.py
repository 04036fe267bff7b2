"""Seeds turned into the numbers and verdicts of a table."""
from __future__ import annotations

import math
from typing import Sequence


def mean_sd(values: Sequence[float]) -> tuple[float, float]:
  """Mean and sample standard deviation (ddof=1; 0 for a single value)."""
  values = [float(v) for v in values]
  if not values:
    raise ValueError("mean_sd needs at least one value.")
  mean = sum(values) / len(values)
  if len(values) == 1:
    return mean, 0.0
  var = sum((v - mean) ** 2 for v in values) / (len(values) - 1)
  return mean, math.sqrt(var)


def fmt_mean_sd(values: Sequence[float], scale: float = 1.0,
                digits: int = 1) -> str:
  """``'81.3 ± 0.4 (n=3)'`` of ``scale * values``; ``'81.3 (n=1)'`` for one
  value (it has no spread); '' for no values."""
  if not values:
    return ""
  mean, sd = mean_sd([scale * v for v in values])
  if len(values) == 1:
    return f"{mean:.{digits}f} (n=1)"
  return f"{mean:.{digits}f} ± {sd:.{digits}f} (n={len(values)})"


MIN_SEEDS = 3     # seeds a side before ``verdict`` decides anything


def verdict(ours: Sequence[float], other: Sequence[float],
            paper_says_higher: bool) -> str:
  """Whether seeds of two settings back a paper's claim "ours > other"
  (``paper_says_higher``) or "ours < other".

  'agrees' / 'disagrees' when the difference of the means exceeds the seed
  spread (the sum of the two sample standard deviations), with at least
  ``MIN_SEEDS`` seeds on each side; 'not decided' otherwise. (Two seeds are
  too few: on MNLI a Transformer at 44.4 / 44.6 was ahead of HyperMixer's
  three seeds beyond the spread, and its third seed, 42.4, undid that.)
  """
  if len(ours) < MIN_SEEDS or len(other) < MIN_SEEDS:
    return "not decided"
  (m1, s1), (m2, s2) = mean_sd(ours), mean_sd(other)
  if abs(m1 - m2) <= s1 + s2:
    return "not decided"
  return "agrees" if (m1 > m2) == paper_says_higher else "disagrees"
