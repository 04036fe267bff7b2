"""experiment.sparse_lm's steps on the committed record: depths, runs and
report of experiments/results/smlp_vs_moe give back its table.md."""
import argparse
import pathlib
import shutil

from hypermixer_jax import experiment
from hypermixer_jax.experiment import sparse_lm

RECORD = (pathlib.Path(__file__).resolve().parent.parent
          / "experiments/results/smlp_vs_moe")


def _not_run(*_):
  raise AssertionError("a recorded measurement or run was computed again")


def test_report_of_the_record_is_its_committed_table(tmp_path):
  # The report command of the record (--report_only --ablations, the 8k
  # vocabulary's regime), step by step: recorded FLOP fits, depths chosen
  # again, recorded runs and baselines; nothing is measured or trained.
  shared = tmp_path / "shared"
  for f in ("c4/c4_en_tfds_minimal_train_1000.jsonl",
            "c4/c4_en_train_00000_first1000.jsonl",
            "wikitext-2-raw/wiki.valid.raw"):
    (shared / f).parent.mkdir(parents=True, exist_ok=True)
    (shared / f).write_text("x")
  out = tmp_path / "out"
  out.mkdir()
  shutil.copy(RECORD / "results.json", out)
  exp = experiment.Experiment(out, argparse.Namespace(report_only=True))
  regime, s = sparse_lm.settings("small", "small")
  vocab = dict(exp.data["vocab"], path=str(out / "unused.model"))
  steps, seeds = s["steps"], [0, 1, 2]

  def config(name, depth, seed=0):
    return sparse_lm.run_config(name, "small", depth, shared, vocab=vocab,
                                seed=seed, steps=steps)

  def fit_of(name):
    return exp.run(f"{regime}/flops/{name}", _not_run)

  plan = sparse_lm.record_plan(
      exp, s, list(sparse_lm.MODELS) + list(sparse_lm.ABLATIONS), config,
      fit_of)
  assert plan["smlp_partial"]["depth"] == (3, 2)
  assert plan["gmlp"]["depth"] == (10, 0)
  for name in sparse_lm.ABLATIONS:
    assert plan[name]["depth"] == s["smlp_depth"]
  runs = sparse_lm.train_runs(exp, plan, seeds, f"{regime}/s{steps}",
                              config, s["batch_size"] * s["seq_len"])
  assert {n: len(r) for n, r in runs.items()} == {
      **{n: 3 for n in sparse_lm.MODELS},
      **{n: 1 for n in sparse_lm.ABLATIONS}}
  sparse_lm.write_report(exp, "small", s, plan, runs,
                         exp.data["baselines"][regime], vocab, steps, seeds)
  assert ((out / "table.md").read_text(encoding="utf-8")
          == (RECORD / "table.md").read_text(encoding="utf-8"))
  assert (out / "smlp_vs_moe.png").stat().st_size > 0
  # A report rewrites no record.
  assert ((out / "results.json").read_bytes()
          == (RECORD / "results.json").read_bytes())
