"""The claims table: generated from records, by the statistics of
``experiment.stats``, and the committed one up to date."""
import dataclasses
import json
import pathlib
import tempfile

from absl.testing import absltest
import numpy as np
from scipy import stats as sps

from hypermixer_jax.experiment import claims
from hypermixer_jax.experiment import glue
from hypermixer_jax.experiment import stats

ROOT = pathlib.Path(__file__).resolve().parent.parent
RESULTS = ROOT / "experiments" / "results"

OURS = [0.812, 0.809, 0.821, 0.804, 0.815]
OTHER = [0.791, 0.797, 0.786]


def _record(tmp: pathlib.Path, runs: dict, **extra) -> pathlib.Path:
  (tmp / "toy").mkdir(parents=True, exist_ok=True)
  (tmp / "toy" / "results.json").write_text(json.dumps(
      {"runs": runs, **extra}))
  return tmp


def _claim(**kw) -> claims.Claim:
  fields = dict(
      paper="P", experiment="toy", text="a above b", paper_number="1 vs 0",
      ours=claims.Arm("a", "a/seed=*"), others=(claims.Arm("b", "b/seed=*"),),
      direction="higher", baseline=("majority", ("baselines", "majority")),
      regime="tiny", at_scale="more data")
  fields.update(kw)
  return claims.Claim(**fields)


def _runs(name: str, values) -> dict:
  return {f"{name}/seed={i}": {"eval": {"accuracy": v}}
          for i, v in enumerate(values)}


class ClaimsTest(absltest.TestCase):

  def setUp(self):
    super().setUp()
    self.tmp = pathlib.Path(tempfile.mkdtemp())

  def test_row_is_welchs_test_on_the_matching_runs(self):
    runs = {**_runs("a", OURS), **_runs("b", OTHER),
            # Another budget's run of the same model stays out.
            "a_long/seed=0": {"eval": {"accuracy": 0.0}}}
    data = json.loads(_record(self.tmp, runs, baselines={"majority": 0.5})
                      .joinpath("toy", "results.json").read_text())
    row = dict(zip(claims.HEADERS, claims.judge(_claim(), data)))
    ref = sps.ttest_ind(OURS, OTHER, equal_var=False)
    ci = ref.confidence_interval()
    self.assertEqual(
        row["verdict (difference [95% CI], p)"],
        f"agrees: {100 * (np.mean(OURS) - np.mean(OTHER)):+.1f} "
        f"[{100 * ci.low:+.1f}, {100 * ci.high:+.1f}], p = {ref.pvalue:.3f}")
    low, high = sps.t.interval(0.95, 4, np.mean(OURS), sps.sem(OURS))
    self.assertEqual(
        row["ours (mean ± sd, 95% CI)"],
        f"{100 * np.mean(OURS):.1f} ± {100 * np.std(OURS, ddof=1):.1f} "
        f"(n=5), 95% CI [{100 * low:.1f}, {100 * high:.1f}]")
    self.assertTrue(row["trivial baseline"].startswith(
        "majority 50.0: ours above: +31.2"))

  def test_evaluation_noise_and_several_opponents(self):
    runs = {**_runs("a", OURS), **_runs("b", OTHER), **_runs("c", OURS)}
    data = {"runs": runs, "baselines": {"majority": 0.5, "n": 872}}
    c = _claim(n_eval=("baselines", "n"),
               others=(claims.Arm("b", "b/seed=*"),
                       claims.Arm("c", "c/seed=*")))
    verdict = claims.judge(c, data)[6]
    # With 872 examples the gap to b is no longer decided, and c ties.
    want = [stats.verdict(OURS, o, "higher", n_eval=872).text(100)
            for o in (OTHER, OURS)]
    self.assertEqual(verdict, f"not decided: vs b: {want[0]}; vs c: {want[1]}")

  def test_several_opponents_disagree_only_at_alpha_over_k(self):
    # Every pair must agree (each at alpha); one pair disagreeing by chance
    # is likelier among k, so it decides only at alpha / k (Bonferroni).
    def word(pairs):
      v = [stats.Verdict(w, "higher", stats.Difference(
          diff=-1.0 if w == "disagrees" else 1.0, se=1.0, df=4.0, low=0.0,
          high=0.0, p=p, seeds=(3, 3))) for w, p in pairs]
      return claims._joint_word(v)
    self.assertEqual(word([("agrees", 0.01), ("agrees", 0.04)]), "agrees")
    self.assertEqual(word([("agrees", 0.01), ("not decided", 0.3)]),
                     "not decided")
    self.assertEqual(word([("disagrees", 0.04)]), "disagrees")
    self.assertEqual(word([("disagrees", 0.04), ("agrees", 0.01)]),
                     "not decided")
    self.assertEqual(word([("disagrees", 0.02), ("not decided", 0.5)]),
                     "disagrees")
    self.assertEqual(word([("disagrees", 0.02), ("agrees", 0.01),
                           ("not decided", 0.5)]), "not decided")

  def test_a_relative_margin_is_a_share_of_the_others_mean(self):
    near = [0.802, 0.81, 0.806]                  # mean 0.806
    data = {"runs": {**_runs("a", OURS), **_runs("b", near)},
            "baselines": {"majority": 0.5}}
    c = _claim(direction="equal", margin=0.1, relative_margin=True)
    want = stats.verdict(OURS, near, "equal", margin=0.1 * np.mean(near))
    self.assertEqual(claims.judge(c, data)[6], want.text(100))
    self.assertTrue(want.text(100).startswith("agrees"))
    # An absolute margin of 0.1 would be 10 points wide, not 8.1.
    self.assertNotEqual(
        claims.judge(dataclasses.replace(c, relative_margin=False), data)[6],
        want.text(100))

  def test_an_untuned_comparison_shows_its_test_but_decides_nothing(self):
    # Every model at one shared setting: a significant difference is shown
    # with its interval and p, never as the claim's verdict.
    data = {"runs": {**_runs("a", OURS), **_runs("b", OTHER)},
            "baselines": {"majority": 0.5}}
    tuned = claims.judge(_claim(), data)[6]
    untuned = claims.judge(_claim(untuned=True), data)[6]
    self.assertTrue(tuned.startswith("agrees: "), tuned)
    self.assertEqual(untuned, "no verdict (untuned): "
                     + tuned.removeprefix("agrees: "))
    two = _claim(untuned=True, others=(claims.Arm("b", "b/seed=*"),
                                       claims.Arm("c", "b/seed=*")))
    self.assertEqual(claims.judge(two, data)[6].count("no verdict"), 1)
    v = stats.verdict(OURS, OTHER, "higher", untuned=True)
    self.assertEqual((v.word, v.text(100, words={"agrees": "yes"})),
                     ("agrees", untuned))
    # Against a baseline: one with no setting of its own keeps its test;
    # one whose setting was searched (a ridge penalty) decides nothing
    # against untuned models, and still decides against tuned ones.
    base = claims.judge(_claim(untuned=True), data)[5]
    self.assertTrue(base.startswith("majority 50.0: ours above: "), base)
    searched = claims.judge(_claim(untuned=True, baseline_tuned=True),
                            data)[5]
    self.assertEqual(searched, base.replace("ours above: ",
                                            "ours no verdict (untuned): "))
    self.assertEqual(claims.judge(_claim(baseline_tuned=True), data)[5], base)
    self.assertEqual(
        stats.against_baseline(OURS, 0.5, untuned=True).word, "above")

  def test_a_baseline_scored_per_seed_is_tested_as_seeds(self):
    # A baseline with a value per seed (a pattern of keys) has a spread of
    # its own: Welch's test against those values, as scipy computes it,
    # not a one-sample test against their mean (which would be narrower).
    base = [0.80, 0.78, 0.79]
    data = {"runs": {**_runs("a", OURS), **_runs("b", OTHER)},
            "baselines": {**{f"m/seed={i}": {"x": v}
                             for i, v in enumerate(base)},
                          "other": {"x": 0.0}}}
    c = _claim(baseline=("avg", ("baselines", "m/seed=*", "x")))
    cell = claims.judge(c, data)[5]
    ref = sps.ttest_ind(OURS, base, equal_var=False)
    ci = ref.confidence_interval()
    self.assertEqual(
        cell, f"avg 79.0 ± 1.0 (n=3): ours above: "
        f"{100 * (np.mean(OURS) - np.mean(base)):+.1f} [{100 * ci.low:+.1f}, "
        f"{100 * ci.high:+.1f}], {stats.p_text(ref.pvalue)}")
    one_sample = sps.ttest_1samp(OURS, np.mean(base)).confidence_interval()
    self.assertGreater(ci.high - ci.low, one_sample.high - one_sample.low)
    with self.assertRaisesRegex(KeyError, "nothing at 'n/seed=\\*'"):
      claims.judge(_claim(baseline=("avg", ("baselines", "n/seed=*", "x"))),
                   data)

  def test_a_measured_claim_compares_without_a_test(self):
    data = {"exponents": {"a": {"time": 1.1}, "b": {"time": 1.8}}}
    m = claims.Measured("P", "toy", "a's exponent below b's", "a figure",
                        ("a", ("exponents", "a", "time")),
                        (("b", ("exponents", "b", "time")),), "lower")
    row = m.row(data)
    self.assertEqual(row[3:7], ["a 1.10 (one run)", "b 1.80", "",
                                "agrees as measured (one run a side, no "
                                "test)"])
    self.assertTrue(
        dataclasses.replace(m, direction="higher").row(data)[6].startswith(
            "disagrees"))

  def test_missing_runs_and_records(self):
    data = {"runs": _runs("a", OURS), "baselines": {"majority": 0.5}}
    self.assertEqual(claims.judge(_claim(), data)[6], "not run")
    with self.assertRaisesRegex(FileNotFoundError, "no record .* --results"):
      claims.table(self.tmp, [_claim(experiment="absent")])

  def test_image_regime_is_read_from_the_runs(self):
    def run(lr, batch=64):
      return {"step": 40, "params": 123_456, "args": {"batch_size": batch},
              "setting": {"lr": lr}}
    data = {"args": {"batch_size": 999},
            "baselines": {"carved": {"train_images": 1_600}},
            "runs": {"small/s300/tune/model=a/setting=0": run(1e-3),
                     "small/s300/tune/model=a/setting=1": run(1e-2),
                     "small/s300/tune/model=b/setting=0": run(1e-3),
                     "small/s300/tune/model=b/setting=1": run(1e-2),
                     "small/s300/tuned/model=a/seed=0": run(1e-2),
                     "small/s300/tuned/model=b/seed=0": run(1e-3)}}
    text = claims._image_regime(("a", "b"), "carved", tuned=True)(data)
    search = ("; each model's lr and warm-up chosen from 2 "
              "settings on the validation images carved from train (a at the "
              "grid's largest lr, 0.01; b at the grid's smallest lr, 0.001)")
    self.assertEqual(
        text, "CIFAR-10 32x32, 1,600 training images, 40 steps x 64 (1.60 "
        "epochs; the length set by compute), 0.12M params (the length not "
        "confirmed on the carved split)" + search)
    # The length rule's check on the carved images, under the runs' prefix
    # (the batch named where it is not the small scale's): confirmed where
    # it picks the length used after a shorter one was tried and both
    # models were judged; another pick is named.
    check = {"steps": 40, "picked": 40, "lengths": [20, 40],
             "chosen": {"a": {}, "b": {}}}
    data["length_checks"] = {"small/s40b64/": check}
    self.assertEqual(
        claims._image_regime(("a", "b"), "carved", tuned=True)(data),
        "CIFAR-10 32x32, 1,600 training images, 40 steps x 64 (1.60 "
        "epochs; the length set by compute; the same rule picks it among 20 "
        "and 40 steps on the carved split), 0.12M params" + search)
    data["length_checks"] = {"small/s40b64/": dict(check, picked=20)}
    self.assertIn(
        "0.12M params (on the carved split the same rule picks 20 steps: the "
        "length not confirmed); each",
        claims._image_regime(("a", "b"), "carved", tuned=True)(data))
    data["length_checks"] = {"small/s40/": check}   # another batch's check
    self.assertIn("(the length not confirmed on the carved split)",
                  claims._image_regime(("a", "b"), "carved", tuned=True)(data))
    del data["length_checks"]
    # A run without its own arguments ran at the default batch (a key with
    # no 'b<batch>'), not at the last invocation's (the record's args).
    data["runs"] = {"small/s300/a/seed=0": {"step": 40, "params": 2e6}}
    self.assertIn("40 steps x 128",
                  claims._image_regime(("a",), "carved", False)(data))
    self.assertEqual(claims._image_regime(("c",), "carved", False)(data),
                     "not run")

  def test_regimes_count_what_the_records_hold(self):
    # Pair tasks: the train part's pairs, their share of the full train set
    # and each model's size, from the record; MoE: the planned sizes of the
    # compared models; where runs ran: CPU for records before ran_on.
    run = lambda params: {"params": params, "eval": {"accuracy": 0.5}}  # noqa: E731
    data = {"splits": {"snli": {"rows": {"train": 5_501}}},
            "snli_split": {"train": {"documents": 2_750}},
            "runs": {claims.NLI.format("snli", "hypermixer") + "0": run(8e5),
                     claims.NLI.format("snli", "mlp_mixer") + "0": run(9.4e5)}}
    text = claims._nli_regime("snli", ("hypermixer", "mlp_mixer"))(data)
    self.assertTrue(text.startswith(
        "SNLI: 80% of the dev file (5,501 pairs, 1.0% of the full train "
        "set), 1,000 steps x 64 (<= 8.2M tokens), 0.80-0.94M params; no "
        "search"), text)
    self.assertIn("(100x these pairs)", claims._nli_scale("snli", False)(data))
    # A record without the task (another --tasks) reports it not run.
    self.assertEqual(claims._nli_regime("qnli", ("hypermixer",))(data),
                     "not run")
    self.assertEqual(claims._nli_scale("qnli", True)(data),
                     "the paper trains on the full train set")
    big = {"runs": {"x/0": {"params": 1.02e7}, "x/1": {"params": 9.5e6}}}
    self.assertEqual(claims._nli_params(big, "x/*", ("",)),
                     "9.50-10.20M params")
    self.assertEqual(claims._nli_params(big, "y/*", ("",)), "")
    self.assertIn("(200x these pairs)", claims._nli_scale("snli", True)(data))
    plan = {"plan": {"a": {"params": 2_211_072}, "b": {"params": 3_477_632},
                     "c": {"params": 2_211_072}}}
    self.assertEqual(claims._moe_params(plan, ("a", "b")), "2.21-3.48M params")
    self.assertEqual(claims._moe_params(plan, ("a", "c")), "2.21M params")
    arm = claims.Arm("a", "a/seed=*")
    ran = {"runs": {"a/seed=0": {}, "a/seed=1": {"ran_on": "gpu: X"}}}
    self.assertEqual(claims._ran_on(ran, "r", arm), "r; ran on CPU and gpu: X")

  def test_insert_between_the_markers(self):
    doc = self.tmp / "doc.md"
    doc.write_text("# T\n<!-- claims -->\nold\n<!-- /claims -->\nend\n")
    claims.insert("new table", doc)
    self.assertEqual(doc.read_text(),
                     "# T\n<!-- claims -->\nnew table\n<!-- /claims -->\nend\n")
    doc.write_text("no markers")
    with self.assertRaisesRegex(ValueError, "no '<!-- claims -->'"):
      claims.insert("x", doc)

  def test_the_committed_table_is_generated_from_the_committed_records(self):
    committed = RESULTS / "claims.md"
    out = self.tmp / "claims.md"
    claims.main([f"--results={RESULTS}", f"--out={out}"])
    self.assertEqual(
        committed.read_text(encoding="utf-8"), out.read_text(encoding="utf-8"),
        "experiments/results/claims.md is stale; run "
        "python -m hypermixer_jax.experiment.claims")


if __name__ == "__main__":
  absltest.main()


def test_untuned_regimes_state_the_rates_the_studies_ran_with():
  # The synthetic study trains configs/default.py's rate and warm-up
  # (capped at a tenth of its 1,500 steps); the regime must say the same.
  from hypermixer_jax import experiment  # pylint: disable=g-import-not-at-top
  c = experiment.load_config("default.py", "hypermixer")
  regime = claims.SYN_REGIME.format(500)
  assert (f"every model at lr {c.learning_rate:g}, warm-up "
          f"{min(c.warmup_steps, 1500 // 10)} steps") in regime, regime
  assert "lr 0.001, warm-up 10% of the steps" in claims.SST2_REGIME


def test_a_tuned_row_appears_once_its_runs_are_recorded(tmp_path):
  # The tuned SST-2 claim against gMLP: absent from the table while the
  # record holds no tuned run, then judged on them, its regime naming the
  # carved phrases and each model's search.
  claim = claims._sst2("gmlp", "gMLP", "81.4 vs 79.5 (test)", tuned=True)
  untuned = claims._sst2("gmlp", "gMLP", "81.4 vs 79.5 (test)")
  base = {"naive_bayes": 0.81, "dev_rows": 872}
  record = {"runs": {}, "baselines": {"w128_s1000_n64": base,
                                      "w128_s1000_n64/carved": base},
            "sst2_split": {"train": {"documents": 60614}}}
  for i, v in enumerate(OURS[:3]):
    record["runs"][f"w128_s1000_n64/task=sst2/model=hypermixer/lr=0.001/"
                   f"seed={i}"] = {"eval": {"accuracy": v}}
    record["runs"][f"w128_s1000_n64/task=sst2/model=gmlp/lr=0.001/"
                   f"seed={i}"] = {"eval": {"accuracy": OTHER[i]}}
  (tmp_path / "glue_from_scratch").mkdir()
  path = tmp_path / "glue_from_scratch" / "results.json"
  path.write_text(json.dumps(record))
  table = claims.table(tmp_path, (untuned, claim))
  assert "all tuned alike" not in table and "above gMLP" in table
  for model, best, values in (("hypermixer", 1e-3, OURS[:3]),
                              ("gmlp", 3e-3, OTHER)):
    for j, lr in enumerate((1e-3, 3e-3)):
      record["runs"][f"w128_s1000_n64/tune/model={model}/setting={j}"] = {
          "setting": {"lr": lr}, "eval": {"accuracy": 0.8}}
    for i, v in enumerate(values):
      record["runs"][f"w128_s1000_n64/tuned/model={model}/seed={i}"] = {
          "setting": {"lr": best}, "eval": {"accuracy": v}}
    path.write_text(json.dumps(record))
    if model == "hypermixer":   # one arm recorded: still no row
      assert "all tuned alike" not in claims.table(tmp_path, (untuned, claim))
  row = dict(zip(claims.HEADERS, claims.judge(claim, record)))
  assert row["claim"] == "SST-2: HyperMixer above gMLP, all tuned alike"
  assert row["verdict (difference [95% CI], p)"] == stats.verdict(
      OURS[:3], OTHER, "higher", n_eval=872).text(100)
  assert row["regime"] == (
      "SST-2, 60,614 train phrases (a tenth of the sentences carved out), "
      "1,000 steps x 64 (budget set on dev), ~1.3M params (the length not "
      "confirmed on the carved split); each model's lr "
      "and warm-up chosen from 2 settings on the validation sentences carved from train (gmlp "
      "at the grid's largest lr, 0.003; hypermixer at the grid's smallest "
      "lr, 0.001)")
  assert "gMLP, all tuned alike" in claims.table(tmp_path, (untuned, claim))
  # The length rule's check, recorded for all six models with a shorter
  # length tried, is named; one over fewer models, or without a shorter
  # length, is not.
  check = {"steps": 1000, "picked": 1000, "lengths": [500, 1000],
           "chosen": {m: {} for m in glue.MIXERS}}
  confirmed = ("(budget set on dev; the same rule picks it among 500 and "
               "1,000 steps on the carved split)")
  record["length_checks"] = {"w128_s1000_n64/": check}
  regime = dict(zip(claims.HEADERS, claims.judge(claim, record)))["regime"]
  assert confirmed in regime and "not confirmed" not in regime
  for wrong in ({"lengths": [1000]}, {"chosen": {"gmlp": {}}},
                {"picked": 500, "chosen": {"gmlp": {}}}):
    record["length_checks"] = {"w128_s1000_n64/": {**check, **wrong}}
    regime = dict(zip(claims.HEADERS, claims.judge(claim, record)))["regime"]
    assert ("budget set on dev), ~1.3M params (the length not confirmed on the "
            "carved split)") in regime
  # A check over every model that picks another length names it.
  record["length_checks"] = {"w128_s1000_n64/": {**check, "picked": 500}}
  regime = dict(zip(claims.HEADERS, claims.judge(claim, record)))["regime"]
  assert ("budget set on dev), ~1.3M params (on the carved split the same "
          "rule picks 500 steps: the length not confirmed)") in regime
  # A length the study holds fixed by design (its head says why) is not
  # called unconfirmed.
  fixed = claims._tuned_regime("sst2_split", "sentences", ("hypermixer",),
                               claims.SST2_TUNED, "{train} phrases, held "
                               "fixed", fixed=True)(record)
  assert fixed.startswith("60,614 phrases, held fixed; each model's lr")
  assert "not confirmed" not in fixed


def test_the_carved_tuning_cost_row_waits_for_its_record(tmp_path):
  # Its arms read a record key that only --carve writes.
  rows = {"best_draws": {"hypermixer": {"accuracy": OURS[:3]},
                         "attention": {"accuracy": OTHER}}}
  base = {"naive_bayes": 0.81, "dev_rows": 872}
  (tmp_path / "tuning_cost").mkdir()
  path = tmp_path / "tuning_cost" / "results.json"
  path.write_text(json.dumps({"runs": {}, **rows, "baselines": {
      "w128_s1000_n64": base, "w128_s1000_n64_carved": base}}))
  # The draws chosen on dev (scored on it too) make no claims row.
  row = (claims._tuning_cost(),)
  assert "random-search draw" not in claims.table(tmp_path, row)
  rows["best_draws_carved"] = rows["best_draws"]
  path.write_text(json.dumps({"runs": {}, **rows, "baselines": {
      "w128_s1000_n64": base, "w128_s1000_n64_carved": base}}))
  assert "chosen on carved phrases" in claims.table(tmp_path, row)


def test_the_regime_says_when_the_sides_ran_on_different_devices():
  gpu = "gpu: NVIDIA H200 (matmul precision highest)"
  data = {"runs": {
      "a/seed=0": {"ran_on": "cpu: cpu"}, "a/seed=1": {"ran_on": "cpu: cpu"},
      "b/seed=0": {"ran_on": gpu},
      "a/setting=0": {"ran_on": gpu}, "b/setting=0": {"ran_on": gpu}}}
  arms = (claims.Arm("A", "a/seed=*"), claims.Arm("B", "b/seed=*"))
  got = claims._ran_on(data, "R", *arms, search=("*/setting=*",))
  assert got == (f"R; the sides ran on different devices: A's runs on CPU; "
                 f"B's runs on {gpu}; the search on {gpu}")
  data["runs"]["b/seed=0"]["ran_on"] = "cpu: cpu"
  assert claims._ran_on(data, "R", *arms) == "R; ran on CPU"
