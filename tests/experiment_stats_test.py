"""The experiments' statistics against scipy on constructed cases."""
from absl.testing import absltest
from absl.testing import parameterized
import numpy as np
from scipy import stats as sps

from hypermixer_jax.experiment import stats

A = [0.812, 0.809, 0.821, 0.804, 0.815]
B = [0.791, 0.797, 0.786]


class WelchTest(parameterized.TestCase):

  @parameterized.named_parameters(("five_three", A, B),
                                  ("three_five", B, A),
                                  ("unequal_spread", [1.0, 1.1, 1.2],
                                   [0.0, 2.0, 4.0, 1.0]))
  def test_matches_scipys_welch(self, a, b):
    d = stats.welch(a, b)
    ref = sps.ttest_ind(a, b, equal_var=False)
    ci = ref.confidence_interval(0.95)
    np.testing.assert_allclose(
        [d.p, d.df, d.low, d.high, d.diff],
        [ref.pvalue, ref.df, ci.low, ci.high, np.mean(a) - np.mean(b)],
        rtol=1e-10)

  def test_a_deterministic_baseline_is_a_one_sample_test(self):
    d = stats.welch(A, 0.80)
    ref = sps.ttest_1samp(A, 0.80)
    ci = ref.confidence_interval(0.95)
    np.testing.assert_allclose([d.p, d.df, d.low + 0.80, d.high + 0.80],
                               [ref.pvalue, ref.df, ci.low, ci.high],
                               rtol=1e-10)

  def test_evaluation_noise_without_seed_spread_is_welch_on_the_examples(
      self):
    # Seeds that agree exactly leave only the evaluation set's noise: the
    # same as Welch's test on n Bernoulli outcomes of variance p (1 - p).
    n, p1, p2 = 872, 0.8138, 0.7752
    d = stats.welch([p1] * 3, [p2] * 4, n_eval=n)
    ref = sps.ttest_ind_from_stats(p1, np.sqrt(p1 * (1 - p1)), n,
                                   p2, np.sqrt(p2 * (1 - p2)), n,
                                   equal_var=False)
    np.testing.assert_allclose(d.p, ref.pvalue, rtol=1e-10)

  def test_evaluation_noise_widens_the_interval(self):
    seeds_only = stats.welch(A, B)
    with_eval = stats.welch(A, B, n_eval=872)
    self.assertGreater(with_eval.p, seeds_only.p)
    self.assertGreater(with_eval.high - with_eval.low,
                       seeds_only.high - seeds_only.low)
    # A large evaluation set tends to the seeds' test.
    huge = stats.welch(A, B, n_eval=10**12)
    np.testing.assert_allclose(huge.p, seeds_only.p, rtol=1e-6)

  def test_evaluation_noise_by_hand(self):
    """The four variance terms (each side's seeds and binomial noise) and
    Welch-Satterthwaite's degrees of freedom over them, written out; a
    one-sample test against a number keeps the number's binomial term."""
    n = 872
    def terms(v):
      v = np.asarray(v, float)
      m = v.mean()
      return m, [(v.var(ddof=1) / len(v), len(v) - 1),
                 (m * (1 - m) / n, n - 1)]
    for other in (B, 0.78):
      m1, t1 = terms(A)
      if isinstance(other, float):
        m2, t2 = other, [(other * (1 - other) / n, n - 1)]
      else:
        m2, t2 = terms(other)
      var = sum(v for v, _ in t1 + t2)
      df = var ** 2 / sum(v ** 2 / d for v, d in t1 + t2)
      se = np.sqrt(var)
      p = 2 * sps.t.sf(abs(m1 - m2) / se, df)
      half = sps.t.ppf(0.975, df) * se
      got = stats.welch(A, other, n_eval=n)
      np.testing.assert_allclose([got.diff, got.se, got.df, got.p, got.low,
                                  got.high],
                                 [m1 - m2, se, df, p, m1 - m2 - half,
                                  m1 - m2 + half], rtol=1e-10)
      # TOST at a margin: the larger of the two one-sided p's.
      margin = 0.02
      want = max(sps.t.sf((m1 - m2 + margin) / se, df),
                 sps.t.cdf((m1 - m2 - margin) / se, df))
      np.testing.assert_allclose(stats.tost(A, other, margin, n_eval=n),
                                 want, rtol=1e-10)
    # The same test against a trivial baseline, in its own words.
    self.assertEqual(stats.against_baseline(A, 0.9, n_eval=n).word, "below")
    self.assertEqual(stats.against_baseline(A, 0.7, n_eval=n).word, "above")
    self.assertEqual(stats.against_baseline(A, 0.81, n_eval=n).word,
                     "not decided")

  def test_bad_input(self):
    with self.assertRaisesRegex(ValueError, "fractions, not percent"):
      stats.welch([81.0, 82.0, 80.0], [70.0, 71.0, 72.0], n_eval=872)
    # One seed a side is not a sample (scipy gives NaN), with or without
    # the evaluation set's noise; a baseline is passed as a number.
    with self.assertRaisesRegex(ValueError, "ours has 1 value.*two seeds"):
      stats.welch([0.5], [0.4])
    with self.assertRaisesRegex(ValueError, "other has 1 value"):
      stats.welch([0.79, 0.80, 0.81], [0.5], n_eval=100)
    self.assertTrue(np.isnan(sps.ttest_ind([0.5], [0.79, 0.8, 0.81],
                                           equal_var=False).pvalue))
    with self.assertRaisesRegex(ValueError, "no spread to test"):
      stats.welch([0.5, 0.5], [0.4, 0.4])


class TostTest(parameterized.TestCase):

  @parameterized.parameters(0.01, 0.02, 0.05)
  def test_is_the_larger_of_two_one_sided_scipy_tests(self, margin):
    lower = sps.ttest_ind(np.add(A, margin), B, equal_var=False,
                          alternative="greater").pvalue
    upper = sps.ttest_ind(np.subtract(A, margin), B, equal_var=False,
                          alternative="less").pvalue
    np.testing.assert_allclose(stats.tost(A, B, margin), max(lower, upper),
                               rtol=1e-10)

  def test_equivalent_exactly_when_the_90_percent_interval_is_inside(self):
    ci = sps.ttest_ind(A, B, equal_var=False).confidence_interval(0.90)
    edge = max(abs(ci.low), abs(ci.high))
    self.assertLess(stats.tost(A, B, edge * 1.001), stats.ALPHA)
    self.assertGreater(stats.tost(A, B, edge * 0.999), stats.ALPHA)

  def test_margin_must_be_positive(self):
    with self.assertRaisesRegex(ValueError, "margin=0"):
      stats.tost(A, B, 0)


class VerdictTest(absltest.TestCase):

  def test_directions(self):
    self.assertEqual(stats.verdict(A, B, "higher").word, "agrees")
    self.assertEqual(stats.verdict(A, B, "lower").word, "disagrees")
    # The 95% interval lies wholly beyond a margin of 0.001: not equal.
    ci = sps.ttest_ind(A, B, equal_var=False).confidence_interval()
    self.assertGreater(ci.low, 0.001)
    self.assertEqual(stats.verdict(A, B, "equal", margin=0.001).word,
                     "disagrees")
    # A margin inside the interval decides nothing either way.
    self.assertEqual(stats.verdict(A, B, "equal",
                                   margin=(ci.low + ci.high) / 2).word,
                     "not decided")

  def test_a_significant_difference_inside_the_margin_is_equal(self):
    # Welch rejects equal means, but the whole difference is far inside the
    # margin: equality within the margin holds (TOST decides "equal").
    ours, other = [0.500, 0.501, 0.502, 0.5005], [0.510, 0.511, 0.512, 0.5105]
    self.assertLess(sps.ttest_ind(ours, other, equal_var=False).pvalue,
                    0.001)
    v = stats.verdict(ours, other, "equal", margin=0.05)
    self.assertEqual(v.word, "agrees")
    self.assertIn("TOST within ±5.0: p < 0.001", v.text(100))
    # The directional claim still reads the significant difference.
    self.assertEqual(stats.verdict(ours, other, "lower", margin=0.05).word,
                     "agrees")

  def test_a_value_that_is_not_finite_decides_nothing(self):
    for ours, other in (([0.8, np.nan, 0.81], B), (A, [0.7, 0.71, np.inf]),
                        (A, float("nan"))):
      v = stats.verdict(ours, other, "higher", n_eval=872)
      self.assertEqual(v.text(), "not decided (a value is not finite)")

  def test_a_numpy_scalar_is_a_deterministic_baseline(self):
    for baseline in (np.float32(0.7), np.float64(0.7), np.array(0.7)):
      np.testing.assert_allclose(
          stats.welch(A, baseline).p,
          sps.ttest_1samp(A, 0.7).pvalue, rtol=1e-6)
      self.assertEqual(stats.against_baseline(A, baseline).word, "above")

  def test_p_is_never_rounded_across_alpha(self):
    self.assertEqual(stats.p_text(0.04996), "p = 0.04996")
    self.assertEqual(stats.p_text(0.0504), "p = 0.050")
    self.assertEqual(stats.p_text(0.0496), "p = 0.0496")
    self.assertEqual(stats.p_text(0.123), "p = 0.123")
    self.assertEqual(stats.p_text(0.0004), "p < 0.001")

  def test_a_gap_beyond_the_summed_sds_need_not_be_significant(self):
    # The old rule ("the gap exceeds the two sample sds") called this a
    # difference: t = 2.5 on about 4 degrees of freedom, p = 0.066.
    ours, other = [2.05, 3.05, 4.05], [0.0, 1.0, 2.0]
    self.assertGreater(abs(np.mean(ours) - np.mean(other)),
                       np.std(ours, ddof=1) + np.std(other, ddof=1))
    v = stats.verdict(ours, other, "higher")
    self.assertEqual(v.word, "not decided")
    self.assertAlmostEqual(
        v.test.p, sps.ttest_ind(ours, other, equal_var=False).pvalue)

  def test_equality_only_from_the_equivalence_test(self):
    ours, other = [0.500, 0.502, 0.498, 0.501], [0.499, 0.501, 0.500]
    self.assertEqual(stats.verdict(ours, other, "equal", margin=0.01).word,
                     "agrees")
    # Without a margin a directional claim stays undecided ...
    self.assertEqual(stats.verdict(ours, other, "higher").word,
                     "not decided")
    # ... and with one, equality refutes it.
    v = stats.verdict(ours, other, "higher", margin=0.01)
    self.assertEqual(v.word, "disagrees")
    self.assertIn("; TOST within ±1.0: p", v.text(100))
    self.assertTrue(v.text(100).startswith("disagrees: +0.0 ["))
    # A claim of equality leads with its test, TOST, then the difference.
    v = stats.verdict(ours, other, "equal", margin=0.01)
    self.assertEqual(v.text(100), (
        "agrees: TOST within ±1.0: p < 0.001; difference +0.0 "
        f"[-0.2, +0.3], {stats.p_text(v.test.p)}"))
    self.assertEqual(v.text(100), "agrees: " + v.detail(100))
    # Too narrow a margin decides nothing.
    self.assertEqual(stats.verdict(ours, other, "equal", margin=1e-4).word,
                     "not decided")

  def test_fewer_than_three_seeds_decide_nothing(self):
    v = stats.verdict([0.9, 0.91], [0.1, 0.11, 0.12], "higher")
    self.assertEqual(v.word, "not decided")
    self.assertEqual(v.text(), "not decided (2 < 3 seeds)")

  def test_seeds_without_spread_decide_nothing(self):
    # Identical seeds (e.g. a deterministic run repeated) have no variance
    # to test with; with an evaluation set's size they still do.
    v = stats.verdict([2.0] * 3, [1.0] * 3, "higher")
    self.assertEqual(v.text(), "not decided (no spread between the seeds)")
    self.assertEqual(
        stats.verdict([0.9] * 3, [0.5] * 3, "higher", n_eval=100).word,
        "agrees")
    # Accuracies all at 1 (or 0) have no binomial noise either.
    for other in ([1.0] * 3, 1.0):
      v = stats.verdict([1.0] * 3, other, "higher", n_eval=100)
      self.assertEqual(v.text(), "not decided (no spread between the seeds)")
    self.assertEqual(stats.against_baseline([0.0] * 3, 0.0, n_eval=50).word,
                     "not decided")
    # A deterministic accuracy against identical seeds: the baseline's own
    # binomial noise is tested, as welch does (a one-sample test would not).
    v = stats.verdict([1.0] * 3, 0.5, "higher", n_eval=500)
    self.assertEqual(v.word, "agrees")
    self.assertAlmostEqual(
        v.test.p, stats.welch([1.0] * 3, 0.5, n_eval=500).p)

  def test_text_reports_the_difference_interval_and_p(self):
    v = stats.verdict(A, B, "higher")
    ref = sps.ttest_ind(A, B, equal_var=False)
    ci = ref.confidence_interval()
    self.assertEqual(
        v.text(100, 2),
        f"agrees: {100 * (np.mean(A) - np.mean(B)):+.2f} "
        f"[{100 * ci.low:+.2f}, {100 * ci.high:+.2f}], "
        f"p = {ref.pvalue:.3f}")

  def test_bad_claims(self):
    with self.assertRaisesRegex(ValueError, "claim='more'"):
      stats.verdict(A, B, "more")
    with self.assertRaisesRegex(ValueError, "needs margin="):
      stats.verdict(A, B, "equal")

  def test_sst2_models_against_naive_bayes(self):
    # 81.38 ± 0.43 over three seeds against Naive Bayes' 80.96 on the 872
    # sentences of SST-2 dev: not told apart once the evaluation set's noise
    # counts (and never called "level": no margin was tested).
    ours = [0.8138 - 0.0043, 0.8138, 0.8138 + 0.0043]
    self.assertEqual(stats.against_baseline(ours, 0.8096).word,
                     "not decided")
    v = stats.against_baseline(ours, 0.8096, n_eval=872)
    self.assertEqual(v.word, "not decided")
    self.assertIsNotNone(v.test)
    self.assertEqual(stats.against_baseline(ours, 0.70, n_eval=872).word,
                     "above")
    self.assertEqual(stats.against_baseline(ours[:2], 0.70).word,
                     "not decided")

  def test_mean_ci_is_scipys_t_interval(self):
    mean, low, high = stats.mean_ci(A)
    ref = sps.t.interval(0.95, len(A) - 1, loc=np.mean(A),
                         scale=sps.sem(A))
    np.testing.assert_allclose([mean, low, high], [np.mean(A), *ref])

  def test_mean_ci_of_accuracies_carries_the_evaluation_sets_noise(self):
    acc = [0.80, 0.81, 0.82]
    # Seeds' variance of the mean plus the binomial one, Welch-Satterthwaite
    # degrees of freedom, computed here by hand.
    v_seeds, v_eval = np.var(acc, ddof=1) / 3, 0.81 * 0.19 / 872
    df = (v_seeds + v_eval) ** 2 / (v_seeds ** 2 / 2 + v_eval ** 2 / 871)
    half = sps.t.ppf(0.975, df) * np.sqrt(v_seeds + v_eval)
    mean, low, high = stats.mean_ci(acc, n_eval=872)
    np.testing.assert_allclose([mean, low, high],
                               [0.81, 0.81 - half, 0.81 + half])
    # Wider than the seeds' interval alone, which ignores the 872 examples.
    self.assertLess(low, stats.mean_ci(acc)[1])

  def test_mean_ci_of_a_diverged_seed_has_no_interval(self):
    for bad in (np.nan, np.inf):
      for n_eval in (None, 872):
        mean, low, high = stats.mean_ci([0.8, bad, 0.82], n_eval=n_eval)
        self.assertFalse(np.isfinite(mean))
        self.assertTrue(np.isnan(low) and np.isnan(high))


if __name__ == "__main__":
  absltest.main()
