"""The expected best score of a random search after n trials (Dodge et al.
2019, "Show your work"), and the gap between two models that share the
trials' hyperparameter draws: a paired bootstrap interval (a description)
and a paired permutation test (the verdict).

With a model's scores v_(1) <= ... <= v_(T) over T trials,

    E[max of n] = sum_i v_(i) [ (i/T)^n - ((i-1)/T)^n ].

The percentile bootstrap of a statistic that tends to a maximum is not a
valid test: at n near T it rejects equal models more often than its level.
The permutation test is exact whatever n: under "the two models score
alike", each draw's two scores are exchangeable, so swapping them at random
gives the gap's null distribution.

Both see only the draws' variation: every trial is scored on the same
evaluation examples. For accuracies, ``n_eval`` (the evaluation set's size)
adds that set's own noise, as ``stats`` adds it to a comparison of seeds:
the gap carries a normal term of variance p1 (1 - p1) / n_eval + p2 (1 - p2)
/ n_eval (p1, p2: the two expected maxima; conservative, both are scored on
the same examples), added to each permuted gap (its tail probability
integrated exactly) and to each bootstrap resample.
"""
from __future__ import annotations

from typing import Any, Mapping, Sequence

import numpy as np

from hypermixer_jax.experiment import stats

BOOTSTRAP = 2000
PERMUTATIONS = 10_000
# Fewer trials than this leave too few distinct swaps for a verdict.
MIN_TRIALS = 10


def expected_max(values, n: int) -> float:
  """Expected maximum of ``n`` draws (with replacement) from ``values``."""
  v = np.sort(np.asarray(values, np.float64))
  t = len(v)
  i = np.arange(1, t + 1)
  return float(np.sum(v * ((i / t) ** n - ((i - 1) / t) ** n)))


def eval_sd(ours, other, n: int, n_eval: int | None) -> float:
  """The standard deviation the evaluation set's binomial noise gives the
  gap at ``n`` trials (module docstring); 0 without ``n_eval``."""
  if not n_eval:
    return 0.0
  a, b = expected_max(ours, n), expected_max(other, n)
  for value in (a, b):
    if not 0.0 <= value <= 1.0:
      raise ValueError(f"n_eval={n_eval} is for accuracies in [0, 1]; got "
                       f"{value:g} (pass fractions, not percent).")
  return float(np.sqrt((a * (1 - a) + b * (1 - b)) / n_eval))


def gap_interval(ours, other, n: int, samples: int = BOOTSTRAP,
                 seed: int = 0, n_eval: int | None = None
                 ) -> tuple[float, float]:
  """95% percentile interval of ``expected_max(ours, n) -
  expected_max(other, n)`` over bootstrap resamples of the trials (paired:
  trial t of both models is the same hyperparameter draw); with ``n_eval``
  each resample also carries the evaluation set's noise."""
  from scipy import stats as scipy_stats  # pylint: disable=g-import-not-at-top
  ours, other = np.asarray(ours, np.float64), np.asarray(other, np.float64)
  if ours.shape != other.shape:
    raise ValueError(f"gap_interval: {len(ours)} and {len(other)} trials; "
                     "the models must share the draws.")
  rng = np.random.default_rng(seed)
  res = scipy_stats.bootstrap(
      (ours, other), lambda a, b: expected_max(a, n) - expected_max(b, n),
      paired=True, vectorized=False, n_resamples=samples,
      confidence_level=1 - stats.ALPHA, method="percentile", rng=rng)
  sd = eval_sd(ours, other, n, n_eval)
  if not sd:
    return float(res.confidence_interval.low), float(
        res.confidence_interval.high)
  gaps = res.bootstrap_distribution + rng.normal(0.0, sd, samples)
  low, high = np.percentile(gaps, [50 * stats.ALPHA, 100 - 50 * stats.ALPHA])
  return float(low), float(high)


def permutation_p(ours, other, n: int, samples: int = PERMUTATIONS,
                  seed: int = 0, n_eval: int | None = None) -> float:
  """Two-sided p of ``expected_max(ours, n) - expected_max(other, n)`` by a
  paired permutation test: each trial's two scores swapped or not, every
  way where there are at most ``samples`` ways (exact), else ``samples``
  random ways (the observed one counted among them). With ``n_eval`` each
  permuted gap also carries the evaluation set's noise: p is the mean over
  the ways of P(|gap + noise| >= observed)."""
  ours, other = np.asarray(ours, np.float64), np.asarray(other, np.float64)
  if ours.shape != other.shape:
    raise ValueError(f"permutation_p: {len(ours)} and {len(other)} trials; "
                     "the models must share the draws.")
  t = len(ours)
  i = np.arange(1, t + 1)
  weights = (i / t) ** n - ((i - 1) / t) ** n

  def gaps(swap):   # swap: [ways, t] booleans
    a, b = np.where(swap, other, ours), np.where(swap, ours, other)
    return np.sort(a, axis=1) @ weights - np.sort(b, axis=1) @ weights
  observed = abs(expected_max(ours, n) - expected_max(other, n))
  tol = 1e-12 * max(1.0, observed)
  sd = eval_sd(ours, other, n, n_eval)

  def beyond(g):   # P(|g + noise| >= observed), each way
    if not sd:
      return (np.abs(g) >= observed - tol).astype(np.float64)
    from scipy import stats as scipy_stats  # pylint: disable=g-import-not-at-top
    return (scipy_stats.norm.sf((observed - g) / sd)
            + scipy_stats.norm.cdf((-observed - g) / sd))
  if 2 ** t <= samples:
    swap = (np.arange(2 ** t)[:, None] >> np.arange(t)) & 1
    return float(np.mean(beyond(gaps(swap.astype(bool)))))
  swap = np.random.default_rng(seed).random((samples, t)) < 0.5
  # (The observed way counted among them, as beyond its gap: conservative.)
  return float((1 + np.sum(beyond(gaps(swap)))) / (1 + samples))


def gap_verdict(gap: float, p: float, trials: int) -> str:
  """'agrees' (ours above, as the paper has it) where the permutation test
  rejects equal models at ``stats.ALPHA`` and the gap is positive,
  'disagrees' where it rejects with a negative gap, else 'not decided'
  (also with fewer than ``MIN_TRIALS`` trials); with its p."""
  if trials < MIN_TRIALS:
    return f"not decided ({trials} < {MIN_TRIALS} trials)"
  word = ("not decided" if p >= stats.ALPHA
          else "agrees" if gap > 0 else "disagrees")
  return f"{word}, {stats.p_text(p)}"


def gap_cells(ours, other, n: int, n_eval: int | None = None) -> list[str]:
  """A table's two cells for the gap at ``n`` trials, in points: the
  bootstrap interval (none for a single trial) and the permutation test's
  verdict (``n_eval``: with the evaluation set's noise)."""
  if len(ours) < 2:
    return ["-", gap_verdict(0.0, 1.0, len(ours))]
  low, high = gap_interval(ours, other, n, n_eval=n_eval)
  gap = expected_max(ours, n) - expected_max(other, n)
  return [f"{100 * low:+.1f} / {100 * high:+.1f}",
          gap_verdict(gap, permutation_p(ours, other, n, n_eval=n_eval),
                      len(ours))]


def trials(count: int, seed: int = 0) -> list[tuple[float, float]]:
  """``count`` (learning rate, dropout) draws of Mai et al.'s search space:
  log10(lr) ~ U(-8, -1), dropout ~ U(0, 0.5)."""
  rng = np.random.default_rng(seed)
  return [(float(10 ** rng.uniform(-8, -1)), float(rng.uniform(0, 0.5)))
          for _ in range(count)]


def accuracy(run: Mapping[str, Any]) -> float:
  """A recorded trial's evaluation accuracy; a NaN one (diverged) counts
  as 0."""
  value = run["eval"].get("accuracy", float("nan"))
  return value if value == value else 0.0


def paired_trials(by_trial: Mapping[tuple[str, int], float], count: int,
                  models: Sequence[str]) -> dict[str, list[float]]:
  """Each of ``models``' scores over the draws recorded for every one of
  them (in draw order), from ``{(model, draw): score}``."""
  shared = [t for t in range(count)
            if all((m, t) in by_trial for m in models)]
  return {m: [by_trial[m, t] for t in shared] for m in models}


def table_note(done: int, split: str, carved: bool, n_eval: int | None,
               layout: str = "") -> str:
  """The note under a tuning-cost table of ``done`` trials scored on
  ``split`` (``carved``: chosen on carved phrases, the best draws' seeds
  scored on dev); ``layout``: the models and budget, as a phrase."""
  return (
      f"{done} random-search trials per model, log10(lr) ~ U(-8, -1), "
      "dropout ~ U(0, 0.5), the same draws for both models"
      + (f", {layout}" if layout else "")
      + f". {split.capitalize()} accuracy at the last step"
      + ("; best draws' seeds: dev" * carved)
      + "; a diverged trial counts as 0. "
      "Gap: HyperMixer - Transformer, percentiles 2.5 and 97.5 of "
      f"{BOOTSTRAP} paired bootstrap resamples of the trials (a "
      "description: the bootstrap of a maximum is no test). 'HyperMixer "
      "above?': a paired permutation test of the gap at n (each draw's two "
      f"scores swapped at random, {PERMUTATIONS:,} swaps), 'agrees' "
      "(the paper: HyperMixer above) / 'disagrees' where p < 0.05, once at "
      f"least {MIN_TRIALS} trials are recorded. Both cover the draws' "
      + (f"variation and the {split} set's own noise (every trial is scored "
         f"on the same {n_eval:,} sentences{' (their phrases)' * carved}"
         ": each resample and each permuted gap also carries a normal term "
         "of variance p1 (1 - p1) / n + p2 (1 - p2) / n, p1 and p2 the two "
         "expected maxima). " if n_eval else
         f"variation only (the {split} set's size is not recorded: its own "
         "noise is left out, so both are narrower than a test over new "
         "examples would give). ")
      + "Each trial is one run (seed 0), so a curve's right end rests on "
      "its top trials and their seed noise: "
      + ("'best draw, over seeds' trains each model's best draw (chosen on "
         "the carved phrases) again with seeds 0 and --best_seeds, scored on "
         "dev (its verdict: Welch's test below). " if carved else
         "the best draws are trained over seeds only with --carve, where "
         "they are chosen on carved train phrases rather than on the dev "
         "sentences their seeds are scored on. ")
      + (stats.VERDICT_NOTE if carved else ""))
