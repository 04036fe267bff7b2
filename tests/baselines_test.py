"""The trivial baselines against hand-computed examples, and the harness's
grid, seed statistics and vocabulary/token plumbing (verdicts:
experiment_stats_test.py)."""
import math
import os
import pathlib
import tempfile

from absl.testing import absltest
import numpy as np

from hypermixer_jax import baselines
from hypermixer_jax import experiment
from hypermixer_jax.data import testing
from hypermixer_jax.experiment import records


class NaiveBayesTest(absltest.TestCase):
  # Vocabulary {0: pad, 1, 2, 3}; class 0 has tokens 1, 1, 1, 3 (4), class 1
  # has 2, 3 (2). Add-1: P(.|0) = (1, 4, 1, 2) / 8, P(.|1) = (1, 1, 2, 2) / 6;
  # priors 2/3, 1/3.
  TRAIN = np.array([[1, 1, 0], [2, 3, 0], [1, 3, 0]])
  LABELS = np.array([0, 1, 0])

  def test_hand_computed_predictions(self):
    test = np.array([
        [3, 0],   # 2/8 * 2/3 = 1/6  vs 2/6 * 1/3 = 1/9   -> 0
        [2, 3],   # 1/8 * 2/8 * 2/3 = 1/48 vs 2/6 * 2/6 * 1/3 = 1/27 -> 1
        [2, 0],   # 1/8 * 2/3 = 1/12 vs 2/6 * 1/3 = 1/9   -> 1
        [0, 0],   # the prior alone                        -> 0
    ])
    pred = baselines.naive_bayes(self.TRAIN, self.LABELS, test, vocab_size=4)
    np.testing.assert_array_equal(pred, [0, 1, 1, 0])

  def test_padding_is_not_a_word(self):
    # Padding the test rows further changes nothing.
    test = np.array([[2, 3], [3, 1]])
    padded = np.pad(test, ((0, 0), (0, 5)))
    np.testing.assert_array_equal(
        baselines.naive_bayes(self.TRAIN, self.LABELS, test, vocab_size=4),
        baselines.naive_bayes(self.TRAIN, self.LABELS, padded, vocab_size=4))

  def test_majority(self):
    np.testing.assert_array_equal(baselines.majority([1, 0, 1, 2], 3),
                                  [1, 1, 1])


class RidgeClassifierTest(absltest.TestCase):

  @staticmethod
  def _reference(x, y, q, l2, classes):
    """Independent: the ridge problem as one augmented least-squares system
    (penalty rows sqrt(l2) I, none on the intercept column), solved by
    ``lstsq`` on the standardised features."""
    mean, sd = x.mean(0), x.std(0)
    sd = np.where(sd > 0, sd, 1.0)
    z = np.hstack([(x - mean) / sd, np.ones((len(x), 1))])
    pen = np.hstack([np.sqrt(l2) * np.eye(x.shape[1]),
                     np.zeros((x.shape[1], 1))])
    a = np.vstack([z, pen])
    b = np.vstack([np.eye(classes)[y], np.zeros((x.shape[1], classes))])
    w = np.linalg.lstsq(a, b, rcond=None)[0]
    zq = np.hstack([(q - mean) / sd, np.ones((len(q), 1))])
    return np.argmax(zq @ w, -1), zq @ w

  def test_matches_augmented_least_squares(self):
    rng = np.random.default_rng(0)
    # Images-like input (rows of [4, 4, 3]) with one constant feature.
    x = rng.normal(size=(60, 4, 4, 3)) + rng.normal(size=(3, 1, 1, 3))[
        np.arange(60) % 3]
    x[:, 0, 0, 0] = 5.0
    y = np.arange(60) % 3
    q = rng.normal(size=(25, 4, 4, 3))
    for l2 in (0.5, 30.0):
      pred, info = baselines.ridge_classifier(x, y, q, l2s=(l2,))
      want, scores = self._reference(x.reshape(60, -1), y, q.reshape(25, -1),
                                     l2, 3)
      top2 = np.sort(scores, -1)[:, -2:]
      clear = top2[:, 1] - top2[:, 0] > 1e-9
      np.testing.assert_array_equal(pred[clear], want[clear])
      self.assertEqual(info["l2"], l2)

  def test_fewer_rows_than_features_matches_too(self):
    # 30 rows of 200 features: the fit goes through the 30 x 30 Gram matrix.
    rng = np.random.default_rng(2)
    x = rng.normal(size=(30, 200)) + 2.0 * np.eye(3)[np.arange(30) % 3] @ (
        rng.normal(size=(3, 200)))
    y = np.arange(30) % 3
    q = rng.normal(size=(40, 200)) + np.eye(3)[np.arange(40) % 3] @ (
        rng.normal(size=(3, 200)))
    for l2 in (1e-3, 1.0, 1e4):
      pred, _ = baselines.ridge_classifier(x, y, q, l2s=(l2,))
      want, scores = self._reference(x, y, q, l2, 3)
      top2 = np.sort(scores, -1)[:, -2:]
      clear = top2[:, 1] - top2[:, 0] > 1e-9
      self.assertGreater(clear.sum(), 30)
      np.testing.assert_array_equal(pred[clear], want[clear])

  def test_penalty_picked_on_the_held_out_rows(self):
    rng = np.random.default_rng(1)
    # Few rows, many noise features: a tiny penalty overfits.
    x = rng.normal(size=(100, 80))
    y = (x[:, 0] > 0).astype(int)
    q = rng.normal(size=(400, 80))
    l2s = (1e-6, 10.0, 1e3)
    _, info = baselines.ridge_classifier(x, y, q, l2s=l2s, held_out=0.2)
    for l2 in l2s:
      want, _ = self._reference(x[:80], y[:80], x[80:], l2, 2)
      self.assertAlmostEqual(info["held_out_accuracy"][f"{l2:g}"],
                             np.mean(want == y[80:]))
    best = max(info["held_out_accuracy"].values())
    self.assertEqual(info["held_out_accuracy"][f"{info['l2']:g}"], best)
    self.assertEqual(info["l2"], 10.0)
    # The picked penalty generalises better than the overfitting one.
    truth = q[:, 0] > 0
    pred, _ = baselines.ridge_classifier(x, y, q, l2s=l2s, held_out=0.2)
    tiny, _ = baselines.ridge_classifier(x, y, q, l2s=(1e-6,), held_out=0.2)
    self.assertGreater(np.mean(pred == truth), np.mean(tiny == truth) + 0.05)

  def test_bad_held_out_fraction(self):
    x, y = np.zeros((5, 2)), np.array([0, 1, 0, 1, 0])
    for bad in (0.0, 1.0, 0.1):   # 0.1 of 5 rows holds out none
      with self.assertRaisesRegex(ValueError, "held_out="):
        baselines.ridge_classifier(x, y, x, held_out=bad)


class LanguageModelBaselinesTest(absltest.TestCase):

  def test_unigram_add_one(self):
    # Counts (pad left out): 1 -> 2, 2 -> 1, 3 -> 0 of 3; add-1 over 4 ids:
    # P(1) = 3/7, P(3) = 1/7; perplexity of [1, 3] = sqrt(49 / 3).
    ppl = baselines.unigram_perplexity(np.array([[1, 1, 2, 0]]),
                                       np.array([1, 3]), vocab_size=4, k=1.0)
    self.assertAlmostEqual(ppl, math.sqrt(49 / 3))

  def test_unigram_without_data_is_uniform(self):
    ppl = baselines.unigram_perplexity(np.zeros((2, 3), int),
                                       np.array([1, 2, 3]), vocab_size=7)
    self.assertAlmostEqual(ppl, 7.0)

  def test_bigram_add_one(self):
    # Pairs (1,2), (2,1), (1,2); (2, pad) is dropped. P(2|1) = 3/6,
    # P(3|1) = 1/6, P(1|2) = 2/5, P(1|3) = 1/4 (3 never precedes).
    ppl = baselines.bigram_perplexity(
        np.array([[1, 2, 1, 2, 0]]), np.array([1, 1, 2, 3]),
        np.array([2, 3, 1, 1]), vocab_size=4, k=1.0)
    self.assertAlmostEqual(ppl, 120 ** 0.25)

  def test_bigram_matches_dense_counts(self):
    rng = np.random.default_rng(0)
    rows = rng.integers(0, 9, (20, 12))
    prev, tgt = rng.integers(1, 9, 50), rng.integers(1, 9, 50)
    dense = np.zeros((9, 9))
    for r in rows:
      for a, b in zip(r[:-1], r[1:]):
        if a and b:
          dense[a, b] += 1
    p = (dense + 0.5) / (dense.sum(1, keepdims=True) + 0.5 * 9)
    want = np.exp(-np.mean(np.log(p[prev, tgt])))
    self.assertAlmostEqual(baselines.bigram_perplexity(
        rows, prev, tgt, vocab_size=9, k=0.5), want)

  def test_lm_baselines_on_scored_positions(self):
    # Rows of a causal pipeline: inputs are the targets shifted right after
    # BOS (0); the last position of the second row is padding.
    train = np.array([[1, 2, 1, 2, 0]])
    targets = np.array([[1, 2, 3], [2, 1, 0]])
    arrays = {"targets": targets,
              "inputs": np.array([[0, 1, 2], [0, 2, 0]]),
              "weights": (targets > 0).astype(np.float32)}
    uni = baselines.unigram_perplexity(train, [1, 2, 3, 2, 1], vocab_size=4)
    causal = baselines.lm_baselines(train, arrays, vocab_size=4, causal=True,
                                    ks=(1.0,))
    # Row starts (targets 1 and 2 after BOS) by the unigram, the rest
    # (2 after 1, 3 after 2, 1 after 2) by the bigram.
    first = baselines.unigram_perplexity(train, [1, 2], vocab_size=4)
    rest = baselines.bigram_perplexity(train, [1, 2, 2], [2, 3, 1],
                                       vocab_size=4, k=1.0)
    self.assertAlmostEqual(causal["bigram"], (first ** 2 * rest ** 3) ** 0.2)
    self.assertAlmostEqual(causal["unigram"], uni)
    self.assertEqual((causal["scored_tokens"], causal["row_starts"]), (5, 2))
    # Masked: every scored target reads the row's previous token (0 at a
    # row's start); one train row holds nothing out, so k is the first.
    masked = baselines.lm_baselines(train, arrays, vocab_size=4,
                                    causal=False, ks=(0.1, 1.0))
    want = baselines.bigram_perplexity(train, [0, 1, 2, 0, 2],
                                       [1, 2, 3, 2, 1], vocab_size=4, k=0.1)
    self.assertEqual((masked["bigram_k"], masked["bigram"]), (0.1, want))
    self.assertNotIn("row_starts", masked)

  def test_bigram_k_is_chosen_on_held_out_train_rows(self):
    # Train alternates 1 and 2, so its held-out rows favour little
    # smoothing; the reported targets are pairs train never holds, which
    # favour much. The baseline takes the train rows' k, not its own best.
    train = np.tile([1, 2], (30, 4))
    arrays = {"targets": np.array([[1, 3, 3, 3]]),
              "weights": np.array([[0, 1, 1, 1]], np.float32)}
    ks = (1e-3, 1.0)
    on_reported = {k: baselines.bigram_perplexity(
        train, [1, 3, 3], [3, 3, 3], vocab_size=5, k=k) for k in ks}
    self.assertLess(on_reported[1.0], on_reported[1e-3])
    self.assertEqual(baselines.choose_bigram_k(train, vocab_size=5, ks=ks),
                     1e-3)
    got = baselines.lm_baselines(train, arrays, vocab_size=5, causal=False,
                                 ks=ks)
    self.assertEqual((got["bigram_k"], got["bigram"]),
                     (1e-3, on_reported[1e-3]))


class HarnessTest(absltest.TestCase):

  def test_grid_first_axis_slowest(self):
    cells = experiment.grid(model=("a", "b"), seed=(0, 1))
    self.assertEqual([(c["model"], c["seed"]) for c in cells],
                     [("a", 0), ("a", 1), ("b", 0), ("b", 1)])
    self.assertEqual(experiment.cell_key("w64", {"model": "a", "lr": 1e-3}),
                     "w64/model=a/lr=0.001")

  def test_grid_rejects_an_empty_or_string_axis(self):
    with self.assertRaisesRegex(ValueError, r"grid axis seed=\(\) must be"):
      experiment.grid(model=("a",), seed=())
    with self.assertRaisesRegex(ValueError, "grid axis model='ab' must be"):
      experiment.grid(model="ab")

  def test_mean_sd(self):
    values = [0.8, 0.82, 0.83]
    mean, sd = experiment.mean_sd(values)
    self.assertAlmostEqual(mean, np.mean(values))
    self.assertAlmostEqual(sd, np.std(values, ddof=1))
    self.assertEqual(experiment.mean_sd([0.5]), (0.5, 0.0))
    self.assertEqual(experiment.fmt_mean_sd([0.8, 0.82], 100),
                     "81.0 ± 1.4 (n=2)")
    # One value has no spread to show.
    self.assertEqual(experiment.fmt_mean_sd([0.8], 100), "80.0 (n=1)")

  def test_recorded_paths_are_relative_to_the_repository(self):
    portable = records._portable  # pylint: disable=protected-access
    repo = pathlib.Path(experiment.__file__).resolve().parents[2]
    self.assertEqual(portable(str(repo / "experiments/results/x")),
                     "experiments/results/x")
    self.assertEqual(portable(str(repo.parent / "shared/data")),
                     os.path.join("..", "shared", "data"))
    self.assertEqual(portable("/elsewhere/x"), "/elsewhere/x")
    self.assertEqual(portable(3), 3)

  def test_workdirs_are_absolute(self):
    # Orbax refuses relative checkpoint paths; --out is often relative.
    cwd = os.getcwd()
    os.chdir(tempfile.mkdtemp())
    try:
      exp = experiment.Experiment("rel/out")
      path = exp.workdir("a/b")
      self.assertTrue(os.path.isabs(path))
      self.assertEqual(path, os.path.join(os.getcwd(), "rel/out/runs/a/b"))
    finally:
      os.chdir(cwd)

  def test_small_vocab_is_built_once_with_its_digest(self):
    out = tempfile.mkdtemp()
    text = os.path.join(out, "train.txt")
    pathlib.Path(text).write_text("\n".join(testing.sentences(300)) + "\n")
    vocab = experiment.small_vocab(out, text, ("text",), size=60)
    self.assertEqual(vocab["path"], os.path.join(out, "vocab", "spm60.model"))
    self.assertEqual(vocab["sha256"], experiment.file_digest(vocab["path"]))
    self.assertEqual(vocab["model_vocab_size"], 256)  # 60 + 100 -> 128k
    mtime = os.path.getmtime(vocab["path"])
    self.assertEqual(experiment.small_vocab(out, text, ("text",), 60), vocab)
    self.assertEqual(os.path.getmtime(vocab["path"]), mtime)

  def test_a_stale_working_vocabulary_gives_way_to_the_recorded_one(self):
    out = tempfile.mkdtemp()
    text = os.path.join(out, "train.txt")
    pathlib.Path(text).write_text("\n".join(testing.sentences(300)) + "\n")
    store = os.path.join(out, "store")
    vocab = experiment.small_vocab(out, text, ("text",), size=60,
                                   store_dir=store)
    good = pathlib.Path(vocab["path"]).read_bytes()
    pathlib.Path(vocab["path"]).write_bytes(b"another vocabulary")
    again = experiment.small_vocab(out, text, ("text",), size=60,
                                   store_dir=store, digest=vocab["sha256"])
    self.assertEqual(again["sha256"], vocab["sha256"])
    self.assertEqual(pathlib.Path(vocab["path"]).read_bytes(), good)

  def test_pipeline_arrays_hold_every_row_once(self):
    from hypermixer_jax import data  # pylint: disable=g-import-not-at-top
    tmp = tempfile.mkdtemp()
    labels = testing.write_pairs_tsv(os.path.join(tmp, "pairs.tsv"), 37)
    cfg = data.default_data_config()
    cfg.update(task="glue_mnli", seq_len=24,
               vocab_path=testing.tiny_vocab(tmp))
    cfg.local_files.train = os.path.join(tmp, "pairs.tsv")
    arrays = experiment.pipeline_arrays(cfg, "train", batch_size=8)
    self.assertEqual(arrays["inputs"].shape, (37, 24))
    np.testing.assert_array_equal(arrays["label"], labels)
    first = experiment.pipeline_arrays(cfg, "train", batch_size=8, batches=2)
    np.testing.assert_array_equal(first["inputs"], arrays["inputs"][:16])


if __name__ == "__main__":
  absltest.main()
