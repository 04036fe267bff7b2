"""The token-mixing-cost and synthetic-data-efficiency experiments at toy size.

Each experiment's core function runs end to end (2 lengths; 2 training-set
sizes x 2 seeds of a few steps) and must write its results, table and
figures; the numbers are checked against references computed another way:
attention's XLA FLOP count against its closed form, the growth exponents
against each other, the pseudo-attention map of the no-mixing model against
the receptive field of its convolution stem.
"""
import hashlib
import json
import pathlib
import tempfile

from absl.testing import absltest
import jax
import jax.numpy as jnp
from jax.experimental.compilation_cache import compilation_cache
import matplotlib.image
import numpy as np
import pytest

from hypermixer_jax import experiment
from hypermixer_jax import models
from hypermixer_jax.data import synthetic as data_syn
from hypermixer_jax.experiment import runs

import script_modules

sde = script_modules.load("experiments/synthetic_data_efficiency.py")
tmc = script_modules.load("experiments/token_mixing_cost.py")


def _png(path: pathlib.Path) -> np.ndarray:
  assert path.exists(), f"{path} not written"
  return matplotlib.image.imread(str(path))


class TokenMixingCostTest(absltest.TestCase):

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.out = pathlib.Path(tempfile.mkdtemp())
    cls.lengths = (128, 512)
    cls.exponents = tmc.run(experiment.Experiment(cls.out),
                            lengths=cls.lengths,
                            mixers=("hypermixer", "attention", "fnet",
                                    "linear_attention"),
                            rounds=2, min_seconds=0.0)
    cls.saved = json.loads((cls.out / "results.json").read_text())

  def test_outputs(self):
    for key in ("runs", "exponents", "lengths", "mixers", "backend"):
      self.assertIn(key, self.saved)
    self.assertEqual(self.saved["lengths"], list(self.lengths))
    for mixer in ("hypermixer", "attention", "fnet", "linear_attention"):
      for n in self.lengths:
        r = self.saved["runs"][f"{mixer}/n{n}"]
        self.assertGreater(r["time_s"], 0)
        self.assertGreater(r["flops"], 0)
        self.assertGreaterEqual(r["repeats"], 1)
        # Timed in the same rounds as the other mixers and the ceiling.
        self.assertEqual(r["timed"], tmc.TIMED)
        self.assertGreater(r["of_ceiling"], 0)
        self.assertGreater(r["ceiling_flops_s"], 0)
    table = (self.out / "table.md").read_text()
    for label in ("HyperMixer", "Attention", "FNet", "N=128", "N=512",
                  "exponent", "matmul ceiling (GFLOP/s)"):
      self.assertIn(label, table)
    self.assertEqual(_png(self.out / "token_mixing_cost.png").ndim, 3)

  def test_linear_attention_flops_are_linear_in_n(self):
    # Counted on the module itself (one unpacked row: a single einsum).
    runs = self.saved["runs"]
    ratio = (runs["linear_attention/n512"]["flops"]
             / runs["linear_attention/n128"]["flops"])
    self.assertAlmostEqual(ratio, 4.0, delta=0.05)

  def test_attention_flops_match_closed_form(self):
    # q, k, v, out projections 4 * 2 N d^2; scores and weighted sum 2 * 2 N^2 d
    # (all heads together); softmax and biases are lower order.
    for n in self.lengths:
      d = self.saved["runs"][f"attention/n{n}"]["d"]
      closed = 8 * n * d * d + 4 * n * n * d
      self.assertBetween(self.saved["runs"][f"attention/n{n}"]["flops"],
                         closed, 1.05 * closed)

  def test_attention_grows_faster_than_hypermixer(self):
    # From XLA's FLOP counts (times are too noisy on a shared CPU): over
    # 128 -> 512 at d=256 attention's quadratic term already shows
    # (closed form: exponent 1.34), HyperMixer stays linear.
    self.assertAlmostEqual(self.exponents["hypermixer"]["flops"], 1.0,
                           delta=0.05)
    self.assertGreater(self.exponents["attention"]["flops"],
                       self.exponents["hypermixer"]["flops"] + 0.2)

  def test_growth_exponent(self):
    ns = [32, 64, 128, 256]
    self.assertAlmostEqual(tmc.growth_exponent(ns, [n ** 2 for n in ns]), 2.0)
    # Only the upper half counts: a constant floor at small N is ignored.
    self.assertAlmostEqual(
        tmc.growth_exponent(ns, [1e4, 1e4, 128.0, 256.0]), 1.0)
    # Skipped points (None) are left out.
    self.assertAlmostEqual(tmc.growth_exponent(ns + [512], [
        32.0, 64.0, 128.0, 256.0, None]), 1.0)

  def test_memory_limit_skips(self):
    r = tmc.measure_length(["attention"], 256, rounds=1, min_seconds=0.0,
                           max_gib=1e-6)["attention"]
    self.assertIn("--max_gib", r["skipped"])
    self.assertNotIn("time_s", r)
    self.assertGreater(r["flops"], 0)


class SyntheticDataEfficiencyTest(absltest.TestCase):

  @pytest.mark.slow
  def test_run(self):
    out = pathlib.Path(tempfile.mkdtemp())
    # As the script's command line does (experiment.parse): the four runs of
    # one model share their compiled steps through the persistent cache.
    keys = ("jax_compilation_cache_dir",
            "jax_persistent_cache_min_compile_time_secs")
    saved = {k: getattr(jax.config, k) for k in keys}
    jax.config.update(keys[0], str(out / "jax_cache"))
    jax.config.update(keys[1], 0)
    self.addCleanup(compilation_cache.reset_cache)
    for k, v in saved.items():
      self.addCleanup(jax.config.update, k, v)
    # The fewest runs the summary needs: two sizes x two seeds (a spread),
    # two steps each (two evaluations), 16 test sequences.
    opts = dict(steps=2, mixers=("hypermixer",), batch_size=16,
                eval_examples=16)
    summary = sde.run(experiment.Experiment(out), sizes=(64, 32),
                      seeds=(0, 1), **opts)
    saved = json.loads((out / "results.json").read_text())
    self.assertEqual(saved["sizes"], [32, 64])
    self.assertEqual(sorted(saved["runs"]), [
        f"hypermixer/n{n}/seed{s}" for n in (32, 64) for s in (0, 1)])
    for n in (32, 64):
      stats = summary["hypermixer"][str(n)]
      mses = [saved["runs"][f"hypermixer/n{n}/seed{s}"]["mse"] for s in (0, 1)]
      self.assertAlmostEqual(stats["mean"], np.mean(mses), places=6)
      self.assertAlmostEqual(stats["std"], np.std(mses, ddof=1), places=6)
      self.assertEqual(stats["seeds"], 2)
      for s in (0, 1):
        self.assertEqual(saved["runs"][f"hypermixer/n{n}/seed{s}"]["step"], 2)
    # The map: largest size, first seed only; HyperMixer reads far tokens.
    stats_32 = summary["hypermixer"]["32"]
    self.assertNotIn("pseudo_attention",
                     saved["runs"]["hypermixer/n32/seed0"])
    pam = np.array(saved["runs"]["hypermixer/n64/seed0"]["pseudo_attention"])
    self.assertEqual(pam.shape, (64, 64))
    far = np.abs(np.subtract.outer(np.arange(64), np.arange(64))) > 8
    self.assertGreater(pam[far].max(), 1e-3 * pam.max())
    table = (out / "table.md").read_text()
    self.assertIn("| HyperMixer |", table)
    self.assertIn("n=32", table)
    # The trivial predictors, on the same 16 test sequences.
    from hypermixer_jax.data import synthetic  # pylint: disable=g-import-not-at-top
    test = synthetic.generate(sde.run_config("hypermixer", 64, 0, 2,
                                             eval_examples=16).data
                              .synthetic, "test", np.arange(16))
    self.assertAlmostEqual(saved["baselines"]["copy_input"], float(np.mean(
        (test["inputs"] - test["targets"]) ** 2)), places=6)
    self.assertGreater(saved["baselines"]["train_mean"], 0)
    self.assertIn(f"| copy the input | {saved['baselines']['copy_input']:.2e}",
                  table)
    self.assertIn("±", table)
    self.assertEqual(_png(out / "data_efficiency.png").ndim, 3)
    self.assertEqual(_png(out / "pseudo_attention.png").ndim, 3)
    # Drawn again from results.json with a seed that never ran: nothing is
    # trained, the cells say how many seeds they hold.
    again = sde.run(experiment.Experiment(out), sizes=(32, 64),
                    seeds=(0, 1, 2), report_only=True, **opts)
    self.assertEqual(again["hypermixer"]["32"]["seeds"], 2)
    self.assertAlmostEqual(again["hypermixer"]["32"]["mean"],
                           stats_32["mean"], places=6)
    self.assertIn("(2 of 3 seeds)", (out / "table.md").read_text())
    self.assertFalse((out / "runs" / "hypermixer/n32/seed2").exists())

  def test_config(self):
    c = sde.run_config("attention", 5000, 3, 200)
    self.assertEqual(c.model.mixer, "attention")
    self.assertEqual(c.data.synthetic.num_examples, 5000)
    self.assertEqual((c.seed, c.data.synthetic.data_seed), (3, 3))
    self.assertEqual(c.eval_split, "test")
    self.assertEqual(c.num_train_steps, 200)

  def test_no_mixing_map_stays_in_the_stem_field(self):
    # None: each output reads only the two kernel-5 convolutions' receptive
    # field (|i - j| <= 4); a reference computed without training.
    c = sde.run_config("none", 32, 0, 1)
    x = sde.map_example(c)["inputs"]
    # One program (op by op, every operation would compile on its own).
    params = jax.jit(models.build_model(c.model).init)(
        jax.random.key(0), jnp.asarray(x)[None])["params"]
    pam = sde.pseudo_attention_map(c, params, x)
    dist = np.abs(np.subtract.outer(np.arange(len(x)), np.arange(len(x))))
    self.assertEqual(float(pam[dist > 4].max()), 0.0)
    self.assertGreater(float(pam[dist <= 4].min()), 0.0)


if __name__ == "__main__":
  absltest.main()


def test_synthetic_tune_holds_out_training_sequences_and_tests_on_test(
    tmp_path, monkeypatch):
  # --tune's wiring, the trainer replaced: a search run evaluates on every
  # 10th sequence of its own training draw (seed 100), the seeds on the
  # test draw after training on their whole sets; each model's seeds at the
  # setting of lowest validation MSE.
  from hypermixer_jax.experiment import selection  # pylint: disable=g-import-not-at-top
  from hypermixer_jax.experiment import synthetic as syn  # pylint: disable=g-import-not-at-top
  seen = []

  def fake_train(c, workdir):
    seen.append((None, c.seed, c.data.synthetic.data_seed,
                 c.data.synthetic.validation_every, c.eval_split,
                 c.learning_rate, c.data.synthetic.num_examples))
    return {"eval": {"mse": abs(c.learning_rate - 1e-3) + c.seed / 1e4}}
  monkeypatch.setattr(syn.experiment, "train", fake_train)
  exp = experiment.Experiment(tmp_path, None)
  setting = dict(sizes=(500,), seeds=(0, 1, 2), steps=100)
  tuned = syn.tune(exp, lambda m, n, s: sde.run_config(m, n, s, 100),
                   ["hypermixer", "attention"], setting, (1e-3, 3e-3))
  searched, chosen, runs = tuned[500]
  select = [s for s in seen if s[1] == selection.SEED]
  assert len(select) == 8 and all(
      s[2:5] == (selection.SEED, 10, "validation") and s[6] == 500
      for s in select)
  final = [s for s in seen if s[1] != selection.SEED]
  assert [(s[1], s[2], s[3], s[4]) for s in final] == [
      (seed, seed, 0, "test") for seed in (0, 1, 2)] * 2
  assert {m: c["lr"] for m, c in chosen.items()} == {
      "hypermixer": 1e-3, "attention": 1e-3}
  assert [r["mse"] for r in runs["attention"]] == pytest.approx(
      [0.0, 1e-4, 2e-4])
  syn.report_tuned(exp, tuned, ["hypermixer", "attention"], sde.LABELS,
                   setting, (1e-3, 3e-3), equal=(100_000, 0.1), claim="")
  table = (tmp_path / "table_tuned.md").read_text()
  assert "| HyperMixer | 1.00e-04 ± 1.0e-04 (lr 0.001, 2%) |" in table
  assert "| HyperMixer | 1.00e-02 * | 1.00e-02 | 1.20e-02 | 1.20e-02 |" \
      in table
  # The carved split's digests, recomputed from the whole draw by slicing
  # every 10th sequence out: they name what the search ran on.
  opts = sde.run_config("hypermixer", 500, selection.SEED, 100).data.synthetic
  whole = data_syn.generate(opts, "train", np.arange(500))
  held = np.arange(500) % 10 == 0
  split = exp.data["synthetic_splits"]["n500"]
  for part, rows in (("validation", held), ("train", ~held)):
    digest = hashlib.sha256(whole["inputs"][rows, :, 0].tobytes()
                            + whole["targets"][rows, :, 0].tobytes())
    assert split[part] == {"sequences": int(rows.sum()),
                           "sha256": digest.hexdigest()}
  assert (f"Held-out sequences: n=500: 50 (sha256 "
          f"{split['validation']['sha256'][:12]}...)") in table
  # Every search and seed run records that carve.
  assert {r["carved_validation_sha256"] for r in exp.runs.values()} == {
      split["validation"]["sha256"]}


@pytest.mark.slow
def test_a_cut_short_cell_resumes_only_its_own_config(tmp_path, capsys):
  """A cell whose run was cut short resumes its checkpoints only where they
  were trained with the same config (bookkeeping aside): a cell whose
  setting moved meanwhile trains from scratch, the old run moved aside."""
  cfg = sde.run_config("none", 64, 0, 2, batch_size=8, eval_examples=8)
  workdir = str(tmp_path / "cell")
  assert experiment.train(cfg, workdir)["source"] == "scratch"
  cfg.log_every, cfg.keep_checkpoints = 2, 3          # bookkeeping only
  assert experiment.train(cfg, workdir)["source"] == "workdir"
  # A field naming files of equal content by another path is the same run.
  (tmp_path / "a.txt").write_text("x")
  (tmp_path / "b.txt").write_text("x")
  assert runs.set_aside_other_run(cfg, workdir) is None
  saved = sorted((tmp_path / "cell" / "configs").glob("*.json"))
  for copy in saved:
    text = json.loads(copy.read_text())
    text["init_checkpoint"] = str(tmp_path / "a.txt")
    copy.write_text(json.dumps(text))
  cfg.init_checkpoint = str(tmp_path / "b.txt")
  assert runs.set_aside_other_run(cfg, workdir) is None
  cfg.init_checkpoint = ""
  for copy in saved:
    text = json.loads(copy.read_text())
    text["init_checkpoint"] = ""
    copy.write_text(json.dumps(text))
  assert not list(tmp_path.glob("cell.other-config-*"))
  cfg.learning_rate *= 3                               # the setting moved
  result = experiment.train(cfg, workdir)
  assert result["source"] == "scratch"
  (moved,) = tmp_path.glob("cell.other-config-*")
  assert (moved / "checkpoints" / "2").is_dir()
  assert "learning_rate: " in capsys.readouterr().out
