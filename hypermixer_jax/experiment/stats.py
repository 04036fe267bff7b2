"""Seeds turned into the numbers and verdicts of a table.

A verdict comes from a test, never from a rule of thumb: Welch's t-test at
``ALPHA`` (two-sided) on the seeds of two settings, with at least
``MIN_SEEDS`` seeds a side, reported as the difference of the means with its
95% confidence interval and p. A deterministic baseline (a number, e.g.
Naive Bayes) is compared with a one-sample test. Equality is claimed only
from an equivalence test (TOST, two one-sided tests) with its margin stated.

Accuracies carry the evaluation set's own noise as well as the seeds': with
``n_eval`` examples, each side's mean gains the binomial variance
``p (1 - p) / n_eval`` (a deterministic baseline too, since it was scored on
the same finite set), and the degrees of freedom follow Welch-Satterthwaite
with ``n_eval - 1`` for those terms. Both sides are scored on the same
examples, so treating their evaluation noise as independent is conservative;
a paired bootstrap over the examples would be tighter, but the records hold
no per-example predictions.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Mapping, Sequence

import numpy as np

ALPHA = 0.05      # two-sided level of every test
MIN_SEEDS = 3     # seeds a side before a test decides anything
CLAIMS = ("higher", "lower", "equal")
# How a table's verdicts were reached, for its notes.
VERDICT_NOTE = (
    "Verdicts: Welch's t-test on the seeds, two-sided at alpha = 0.05, with "
    "at least 3 seeds a side (a trivial baseline: a one-sample test, or "
    "Welch's where it was scored on each seed's data); a cell "
    "gives the difference of the means with its 95% confidence interval and "
    "p. For accuracies each side also carries the evaluation set's binomial "
    "noise, p (1 - p) / n (conservative: both sides are scored on the same "
    "examples). 'not decided' where p >= 0.05 (a claim of a difference "
    "whose TOST shows the sides equal within its stated margin disagrees); "
    "equality is claimed only from an equivalence test (TOST) with its "
    "margin stated.")


NO_VERDICT = "no verdict (untuned)"
UNTUNED_NOTE = (
    "Untuned: every model at the one setting stated here (no search of "
    "learning rate or warm-up), so an equal search might reorder close "
    "models; a test between models reads 'no verdict (untuned)': its "
    "difference and p are shown but decide nothing; where the study has a "
    "table_tuned.md, it holds the comparison with every model tuned alike. ")


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


def seed_summary(values: Sequence[float]) -> dict[str, float | int]:
  """A cell's seeds as ``mean``, ``std`` (ddof=1; 0 for one value), ``min``,
  ``max`` and ``seeds``, over the finite values (a diverged seed counts
  as one not run: ``seeds`` is the finite count; for none, 0 seeds, NaN
  mean, min and max, std 0)."""
  v = np.array(values, dtype=float).ravel()
  v = v[np.isfinite(v)]
  if not len(v):
    v = np.array([np.nan])
  return dict(mean=float(v.mean()),
              std=float(v.std(ddof=1)) if len(v) > 1 else 0.0,
              min=float(v.min()), max=float(v.max()),
              seeds=int(np.isfinite(v).sum()))


def fmt_seed_summary(stats: Mapping[str, float], planned: int) -> str:
  """``'1.23e-03 ± 4.0e-05'`` of a ``seed_summary``, with the count where
  fewer than the ``planned`` seeds ran; '—' for none."""
  if not stats["seeds"]:
    return "—"
  text = f"{stats['mean']:.2e}"
  if stats["seeds"] > 1:
    text += f" ± {stats['std']:.1e}"
  return text + ("" if stats["seeds"] == planned
                 else f" ({stats['seeds']} of {planned} seeds)")


def mean_ci(values: Sequence[float], level: float = 0.95,
            n_eval: int | None = None) -> tuple[float, float, float]:
  """``(mean, low, high)``: the mean of the seeds with its t interval (NaN
  bounds for fewer than two values). ``n_eval``: for accuracies, the
  evaluation set's binomial variance is added to the seeds' (as ``welch``
  does), degrees of freedom by Welch-Satterthwaite: the interval of the
  accuracy on the population the evaluation set was drawn from. A value
  that is not finite (a diverged seed) gives NaN bounds."""
  from scipy import stats  # pylint: disable=g-import-not-at-top
  if not np.all(np.isfinite(np.asarray(values, float))):
    return float(np.mean(values)), math.nan, math.nan
  mean, terms, k = _side(values, n_eval)
  if k < 2:
    return mean, math.nan, math.nan
  var = sum(v for v, _ in terms)
  if var == 0:
    return mean, mean, mean
  df = var ** 2 / sum(v ** 2 / d for v, d in terms if v > 0)
  half = stats.t.ppf(0.5 + level / 2, df) * math.sqrt(var)
  return mean, mean - half, mean + half


@dataclasses.dataclass(frozen=True)
class Difference:
  """``mean(ours) - mean(other)`` with its standard error, Welch-Satterthwaite
  degrees of freedom, 95% interval and two-sided p."""
  diff: float
  se: float
  df: float
  low: float
  high: float
  p: float
  seeds: tuple[int, int]    # seeds a side (0: a deterministic baseline)


def _scalar(values) -> bool:
  """A deterministic baseline (one number, Python's or NumPy's) rather than
  a sequence of seeds."""
  return np.ndim(values) == 0


def _side(values: Sequence[float] | float, n_eval: int | None
          ) -> tuple[float, list[tuple[float, float]], int]:
  """``(mean, [(variance of the mean, its df)], seeds)`` of one side."""
  if _scalar(values):
    mean, terms, k = float(values), [], 0
  else:
    values = [float(v) for v in values]
    mean, sd = mean_sd(values)
    k = len(values)
    terms = [(sd ** 2 / k, k - 1)] if k > 1 else []
  if n_eval:
    if not 0.0 <= mean <= 1.0:
      raise ValueError(f"n_eval={n_eval} is for accuracies in [0, 1]; got a "
                       f"mean of {mean:g} (pass fractions, not percent).")
    terms.append((mean * (1 - mean) / n_eval, n_eval - 1))
  return mean, terms, k


def welch(ours: Sequence[float], other: Sequence[float] | float, *,
          n_eval: int | None = None, shift: float = 0.0,
          level: float = 0.95) -> Difference:
  """Welch's test of ``mean(ours) - mean(other) = shift``.

  ``other`` a number: a deterministic baseline (a one-sample test).
  ``n_eval``: the evaluation set's size, for accuracies (see the module's
  docstring). With neither, this is ``scipy.stats.ttest_ind(ours, other,
  equal_var=False)``.
  """
  from scipy import stats  # pylint: disable=g-import-not-at-top
  for name, side in (("ours", ours), ("other", other)):
    if not _scalar(side) and len(side) < 2:
      raise ValueError(
          f"welch: {name} has {len(side)} value(s); a test needs at least "
          "two seeds a side (pass a deterministic baseline as a number).")
  m1, t1, k1 = _side(ours, n_eval)
  m2, t2, k2 = _side(other, n_eval)
  terms = t1 + t2
  var = sum(v for v, _ in terms)
  if var == 0:
    raise ValueError("welch: every value is equal on both sides; the "
                     "difference has no spread to test against.")
  df = var ** 2 / sum(v ** 2 / d for v, d in terms if v > 0)
  se = math.sqrt(var)
  diff = m1 - m2
  p = 2 * stats.t.sf(abs(diff - shift) / se, df)
  half = stats.t.ppf(0.5 + level / 2, df) * se
  return Difference(diff, se, df, diff - half, diff + half, float(p),
                    (k1, k2))


def tost(ours: Sequence[float], other: Sequence[float] | float,
         margin: float, *, n_eval: int | None = None) -> float:
  """p of the equivalence test "``|mean(ours) - mean(other)| < margin``":
  the larger p of the two one-sided Welch tests (equivalent at ``ALPHA``
  exactly when the 90% interval lies inside ``(-margin, margin)``)."""
  from scipy import stats  # pylint: disable=g-import-not-at-top
  if margin <= 0:
    raise ValueError(f"tost: margin={margin} must be positive (the largest "
                     "difference that still counts as equal).")
  d = welch(ours, other, n_eval=n_eval)
  p_low = stats.t.sf((d.diff + margin) / d.se, d.df)    # H0: diff <= -m
  p_high = stats.t.cdf((d.diff - margin) / d.se, d.df)  # H0: diff >= +m
  return float(max(p_low, p_high))


@dataclasses.dataclass(frozen=True)
class Verdict:
  """What the seeds say of a paper's claim about ``ours`` against
  ``other``: ``word`` is 'agrees', 'disagrees' or 'not decided'."""
  word: str
  claim: str
  test: Difference | None = None
  margin: float | None = None
  p_equal: float | None = None     # TOST's p, when a margin was given
  why: str = ""                    # why nothing was decided, if so
  # Every model at one shared setting, none searched: the test is shown,
  # but an unequal tuning decides nothing ('no verdict (untuned)').
  untuned: bool = False

  def text(self, scale: float = 1.0, digits: int = 1,
           words: Mapping[str, str] | None = None, spec: str = "") -> str:
    """The table's cell: ``'agrees: +1.2 [+0.3, +2.1], p = 0.012'`` (the
    difference and its 95% interval times ``scale``, ``digits`` decimals or
    the format ``spec``, e.g. ``'+.1e'``; ``words`` renames the verdict,
    e.g. ``{'agrees': 'yes'}``)."""
    word = (NO_VERDICT if self.untuned
            else (words or {}).get(self.word, self.word))
    if self.test is None:
      return f"{word} ({self.why})"
    return f"{word}: {self.detail(scale, digits, spec)}"

  def detail(self, scale: float = 1.0, digits: int = 1, spec: str = "") -> str:
    """``text`` without the verdict's word: the difference, its interval
    and p, and where a margin was tested, TOST's p (a claim of equality
    leads with it: its verdict is TOST's)."""
    if self.test is None:
      return self.why
    t, f = self.test, spec or f"+.{digits}f"
    diff = (f"{scale * t.diff:{f}} [{scale * t.low:{f}}, "
            f"{scale * t.high:{f}}], {p_text(t.p)}")
    if self.margin is None:
      return diff
    tost_ = (f"TOST within ±{scale * self.margin:{f.lstrip('+')}}: "
             f"{p_text(self.p_equal)}")
    if self.claim == "equal":
      return f"{tost_}; difference {diff}"
    return f"{diff}; {tost_}"

  def __str__(self) -> str:
    return self.text()


def p_text(p: float) -> str:
  """``p`` to three decimals, or more where three would put it on the other
  side of ``ALPHA`` (0.04996: 'p = 0.04996', never 'p = 0.050')."""
  if p < 0.001:
    return "p < 0.001"
  for digits in range(3, 9):
    if (float(f"{p:.{digits}f}") < ALPHA) == (p < ALPHA):
      return f"p = {p:.{digits}f}"
  return f"p = {p!r}"


def _no_spread(values: Sequence[float], n_eval: int | None) -> bool:
  """Seeds that all score alike, with no evaluation-set noise either (none
  given, or accuracies all at 0 or 1, whose binomial variance is 0)."""
  same = max(values) == min(values)
  return same and (not n_eval or float(values[0]) in (0.0, 1.0))


def verdict(ours: Sequence[float], other: Sequence[float] | float,
            claim: str, *, n_eval: int | None = None,
            margin: float | None = None, untuned: bool = False) -> Verdict:
  """Whether the seeds back a paper's claim that ``ours`` is ``claim``
  ('higher', 'lower' or 'equal') than ``other`` (seeds, or a number: a
  deterministic baseline).

  'higher' / 'lower': 'agrees' / 'disagrees' where Welch's test rejects
  equal means at ``ALPHA`` (a difference in the claimed / the other
  direction); with ``margin`` and no significant difference, equality
  within the margin shown by TOST disagrees. 'equal' (``margin``
  required): TOST decides, 'agrees' where it shows the difference within
  the margin (a significant difference inside the margin included), and
  'disagrees' where the 95% interval lies wholly beyond the margin. Anything
  else, fewer than ``MIN_SEEDS`` seeds a side, or a value that is not
  finite, is 'not decided'. Pass values where higher is better or not, as
  the claim reads (perplexities as they are, with 'lower'). ``untuned``:
  the models ran at one shared setting, none searched; the word is kept
  but the text reads ``NO_VERDICT`` (an unequal tuning decides nothing).
  """
  v = _verdict(ours, other, claim, n_eval=n_eval, margin=margin)
  return dataclasses.replace(v, untuned=untuned)


def _verdict(ours: Sequence[float], other: Sequence[float] | float,
             claim: str, *, n_eval: int | None,
             margin: float | None) -> Verdict:
  if claim not in CLAIMS:
    raise ValueError(f"verdict: claim={claim!r}; use one of {CLAIMS}.")
  if claim == "equal" and margin is None:
    raise ValueError("verdict: a claim of equality needs margin= (the "
                     "largest difference that still counts as equal).")
  sides = [ours] + ([] if _scalar(other) else [other])
  seeds = [len(v) for v in sides]
  if min(seeds) < MIN_SEEDS:
    return Verdict("not decided", claim,
                   why=f"{min(seeds)} < {MIN_SEEDS} seeds")
  if not np.all(np.isfinite(np.concatenate(
      [np.asarray(v, float).ravel() for v in [ours, other]]))):
    return Verdict("not decided", claim, why="a value is not finite")
  spread = [ours, [other] if _scalar(other) else other]
  if all(_no_spread(v, n_eval) for v in spread):
    return Verdict("not decided", claim, why="no spread between the seeds")
  test = welch(ours, other, n_eval=n_eval)
  p_equal = None if margin is None else tost(ours, other, margin,
                                             n_eval=n_eval)
  if claim == "equal":
    if p_equal < ALPHA:
      word = "agrees"
    elif test.low > margin or test.high < -margin:
      word = "disagrees"
    else:
      word = "not decided"
  elif test.p < ALPHA:
    word = "agrees" if (test.diff > 0) == (claim == "higher") else "disagrees"
  elif p_equal is not None and p_equal < ALPHA:
    word = "disagrees"
  else:
    word = "not decided"
  return Verdict(word, claim, test, margin, p_equal)


def against_baseline(ours: Sequence[float],
                     baseline: float | Sequence[float], *,
                     n_eval: int | None = None,
                     untuned: bool = False) -> Verdict:
  """``ours`` against a trivial baseline by the same test as ``verdict``: a
  number (one-sample), or its seeds where it was scored on each seed's
  data (Welch, as between two models); 'above' / 'below' where it decides,
  else 'not decided' (never 'level': no margin was tested). ``untuned``:
  ``ours`` ran at a shared setting, no search, against a baseline whose
  own setting was searched (e.g. a ridge penalty): ``NO_VERDICT``."""
  v = verdict(ours, baseline, "higher", n_eval=n_eval, untuned=untuned)
  words = {"agrees": "above", "disagrees": "below"}
  return dataclasses.replace(v, word=words.get(v.word, v.word))
