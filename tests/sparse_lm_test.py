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


def test_a_run_whose_final_checkpoint_is_gone_trains_again(tmp_path,
                                                           monkeypatch):
  """The last-80% perplexity reads a run's final checkpoint: on a new
  machine (ignored work directories gone) a run recorded without it is
  retired and trained again, not stuck on FileNotFoundError."""
  import ml_collections  # pylint: disable=g-import-not-at-top
  trained, tails = [], []

  def fake_train(c, workdir):
    trained.append(workdir)
    final = pathlib.Path(workdir) / "checkpoints" / str(c.num_train_steps)
    final.mkdir(parents=True)
    return {"eval": {}}

  def fake_last80(c, workdir):
    tails.append(workdir)
    if not (pathlib.Path(workdir) / "checkpoints" / "5").exists():
      raise FileNotFoundError(workdir)
    return {"perplexity": 1.0}
  monkeypatch.setattr(sparse_lm.experiment, "train", fake_train)
  monkeypatch.setattr(sparse_lm, "heldout_last80", fake_last80)
  monkeypatch.setattr(sparse_lm, "run_summary", lambda r, t: {})
  exp = experiment.Experiment(tmp_path, argparse.Namespace(report_only=False))
  exp.runs["b/runs/gmlp/seed=0"] = {"eval": {}, "old": True,
                                    "dispatch": sparse_lm.DISPATCH}
  exp.save()
  config = lambda name, depth, seed: ml_collections.ConfigDict(  # noqa: E731
      {"num_train_steps": 5})
  runs = sparse_lm.train_runs(exp, {"gmlp": {"depth": [2, 0]}}, [0], "b",
                              config, 1)
  assert len(trained) == len(tails) == 1
  assert runs["gmlp"][0]["last80"]["perplexity"] == 1.0
  assert "old" not in runs["gmlp"][0]
  assert exp.data["superseded"]["b/runs/gmlp/seed=0"]["old"]
  # Recorded whole now: nothing is trained again.
  sparse_lm.train_runs(exp, {"gmlp": {"depth": [2, 0]}}, [0], "b", config, 1)
  assert len(trained) == 1
