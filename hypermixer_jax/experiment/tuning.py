"""The expected best score of a random search after n trials (Dodge et al.
2019, "Show your work"), and a paired bootstrap interval of the gap between
two models that share the trials' hyperparameter draws.

With a model's scores v_(1) <= ... <= v_(T) over T trials,

    E[max of n] = sum_i v_(i) [ (i/T)^n - ((i-1)/T)^n ].
"""
from __future__ import annotations

import numpy as np

from hypermixer_jax.experiment import stats

BOOTSTRAP = 2000
# Fewer trials than this leave the bootstrap too coarse for a verdict.
MIN_TRIALS = 10


def expected_max(values, n: int) -> float:
  """Expected maximum of ``n`` draws (with replacement) from ``values``."""
  v = np.sort(np.asarray(values, np.float64))
  t = len(v)
  i = np.arange(1, t + 1)
  return float(np.sum(v * ((i / t) ** n - ((i - 1) / t) ** n)))


def gap_interval(ours, other, n: int, samples: int = BOOTSTRAP,
                 seed: int = 0) -> tuple[float, float]:
  """95% percentile interval of ``expected_max(ours, n) -
  expected_max(other, n)`` over bootstrap resamples of the trials (paired:
  trial t of both models is the same hyperparameter draw)."""
  from scipy import stats as scipy_stats  # pylint: disable=g-import-not-at-top
  ours, other = np.asarray(ours, np.float64), np.asarray(other, np.float64)
  if ours.shape != other.shape:
    raise ValueError(f"gap_interval: {len(ours)} and {len(other)} trials; "
                     "the models must share the draws.")
  ci = scipy_stats.bootstrap(
      (ours, other), lambda a, b: expected_max(a, n) - expected_max(b, n),
      paired=True, vectorized=False, n_resamples=samples,
      confidence_level=1 - stats.ALPHA, method="percentile",
      rng=np.random.default_rng(seed)).confidence_interval
  return float(ci.low), float(ci.high)


def interval_verdict(low: float, high: float, trials: int) -> str:
  """'agrees' (ours above, as the paper has it) where the interval is above
  0, 'disagrees' below it, 'not decided' where it holds 0 or where there are
  fewer than ``MIN_TRIALS`` trials."""
  if trials < MIN_TRIALS:
    return f"not decided ({trials} < {MIN_TRIALS} trials)"
  if low > 0:
    return "agrees"
  return "disagrees" if high < 0 else "not decided"
