"""``mlm_perplexity.py --tune``: every model searched alike on a validation
split carved from the training sample, the seeds then run at the chosen
setting; nothing chosen on the reported held-out set."""
import json
import sys

import pytest

from hypermixer_jax import experiment
from hypermixer_jax.experiment import mlm
from hypermixer_jax.experiment import selection as selection_lib

import script_modules

mlm_perplexity = script_modules.load("experiments/mlm_perplexity.py")

# Each model config is traced once for the module (mlm.params counts them).
pytestmark = pytest.mark.usefixtures("models_traced_once")


def _shared(tmp_path, shared_data, docs=120, lines=60):
  """A shared folder with the real vocabulary, the first ``docs`` documents
  of the C4 sample and the first ``lines`` lines of WikiText-2 validation."""
  root = tmp_path / "shared"
  for path, n in ((mlm.C4_TRAIN, docs), (mlm.WIKITEXT_VALID, lines)):
    text = (shared_data / path).read_text(encoding="utf-8").split("\n")
    (root / path).parent.mkdir(parents=True, exist_ok=True)
    (root / path).write_text("\n".join(text[:n]) + "\n", encoding="utf-8")
  (root / "t5_spm").symlink_to(shared_data / "t5_spm")
  return root


def _tiny(monkeypatch):
  """A 50-step small scale searching two rates at 10% warm-up."""
  monkeypatch.setattr(mlm, "SMALL", dict(
      mlm.SMALL, d_model=32, bert_d_ffn=64, mlp_layers=2, bert_layers=1,
      bert_heads=1, seq_len=32, batch_size=8, steps=50, evals=1,
      eval_batch_size=8, eval_batches=2))
  monkeypatch.setattr(mlm, "TUNE_LRS", (1e-3, 3e-3))
  monkeypatch.setattr(mlm, "TUNE_WARMUP_SHARES", (0.1,))


def test_carved_split_is_deterministic_disjoint_and_complete(tmp_path):
  source = tmp_path / "docs.jsonl"
  lines = [json.dumps({"text": f"document {i}"}) + "\n" for i in range(23)]
  source.write_text("".join(lines), encoding="utf-8")
  split = mlm.carve_validation(source, tmp_path / "a")
  again = mlm.carve_validation(source, tmp_path / "b")
  valid = (tmp_path / "a" / "validation.jsonl").read_text().splitlines(True)
  train = (tmp_path / "a" / "train.jsonl").read_text().splitlines(True)
  assert valid == [lines[0], lines[10], lines[20]]
  assert train == [x for i, x in enumerate(lines) if i % 10]
  assert (split["validation"]["documents"], split["train"]["documents"]) == (
      3, 20)
  for part in ("train", "validation"):
    assert split[part]["sha256"] == experiment.file_digest(
        split[part]["path"]) == again[part]["sha256"]
  assert "path" not in json.dumps(mlm.split_record(split))


def test_search_is_the_same_for_every_model_and_chooses_the_lowest():
  settings = mlm.tune_settings(2000)
  assert len(settings) >= 6
  assert {s["warmup"] for s in settings} == {40, 200}
  run = lambda s, ppl: {"setting": s, "eval": {"perplexity": ppl}}
  selection = {"attention": [run(s, 10.0 + i % 3) for i, s in
                             enumerate(settings)],
               "gmlp": [run(s, 9.0 - i) for i, s in enumerate(settings)]}
  chosen = mlm.choose(selection)
  assert chosen == {"attention": settings[0], "gmlp": settings[-1]}
  text = selection_lib.search_section(
      selection, chosen, mlm.LABELS, mlm.TUNE_LRS,
      shares=mlm.TUNE_WARMUP_SHARES, what="perplexity",
      cell=lambda r: f"{mlm.final_perplexity(r):.2f}")
  rows = {r[0]: r[1:] for r in (
      [c.strip() for c in line.strip("|").split("|")]
      for line in text.splitlines() if line.startswith("| "))}
  assert rows["gMLP"][-1] == f"{9.0 - (len(settings) - 1):.2f} *"
  assert rows["BERT (Transformer)"][0] == "10.00 *"
  assert sum("*" in c for c in rows["gMLP"]) == 1
  # Both choices sit at an end of the searched rates, and the table says so.
  assert text.endswith(
      f"(a wider search may find a better one): BERT (Transformer) (lr "
      f"{min(mlm.TUNE_LRS):g}), gMLP (lr {max(mlm.TUNE_LRS):g}).")


def test_tune_selects_on_the_carved_split_and_reports_at_the_choice(
    shared_data, tmp_path, monkeypatch):
  """The orchestration with training replaced by a function of what each run
  was given: which data it trained and was scored on, at which setting."""
  _tiny(monkeypatch)
  seen = []

  def fake_train(c, workdir):
    seen.append((workdir, c.data.local_files.train,
                 c.data.local_files.validation, c.eval_steps,
                 c.learning_rate, c.warmup_steps, c.seed))
    # gMLP is best at the larger rate, BERT at the smaller one.
    best = 3e-3 if c.model.block == "gmlp" else 1e-3
    ppl = 5.0 + abs(c.learning_rate - best) * 1e3
    return {"eval": {"perplexity": ppl}, "eval_curve": {}, "step": 50}
  monkeypatch.setattr(experiment, "train", fake_train)
  out = tmp_path / "out"
  argv = ["mlm_perplexity.py", "--scale=small", f"--out={out}", "--vocab=t5",
          "--seeds=1", "--models=attention,gmlp", "--tune",
          f"--shared={_shared(tmp_path, shared_data)}"]
  monkeypatch.setattr(sys, "argv", argv)
  mlm_perplexity.main()
  saved = json.loads((out / "results.json").read_text())
  runs = saved["runs"]
  tune = {k: v for k, v in runs.items() if "/tune/" in k}
  tuned = {k: v for k, v in runs.items() if "/tuned/" in k}
  assert len(tune) == 2 * 2 and len(tuned) == 2
  split = saved["c4_split"]
  assert split["validation"]["documents"] == 12
  # Every search and seed run records the carve it was made on.
  assert {r["carved_validation_sha256"] for r in {**tune, **tuned}.values()
          } == {split["validation"]["sha256"]}
  for workdir, train, valid, eval_steps, lr, warmup, seed in seen:
    assert train.endswith("c4_split/train.jsonl")      # never the whole sample
    if "/tune/" in workdir:
      # Scored on the carved documents, all of them, at the search's seed.
      assert valid.endswith("c4_split/validation.jsonl") and eval_steps == -1
      assert seed == mlm.TUNE_SEED and warmup == 5
    else:
      # The reported runs: the held-out WikiText rows at the chosen rate.
      assert valid.endswith(mlm.WIKITEXT_VALID) and eval_steps == 2
      assert seed == 1
      assert lr == (3e-3 if "model=gmlp" in workdir else 1e-3)
  assert {v["setting"]["lr"] for k, v in tuned.items()
          if "model=attention" in k} == {1e-3}
  table = (out / "table_tuned.md").read_text()
  assert "lr 0.001, warm-up 10%" in table and "5.00 *" in table
  assert "trained with seeds 1 on the other 108 documents" in table
  assert not (out / "table.md").exists()

  # A search widened by --lrs (a rate appended after the recorded ones)
  # runs only the new settings, and one that changes its mind retires the
  # reported runs of the old choice instead of mixing them in.
  monkeypatch.setattr(sys, "argv", argv + ["--lrs=1e-3,3e-3,1e-2"])
  seen.clear()
  best_lr = {"value": 1e-2}

  def fake_train_2(c, workdir):
    seen.append(workdir)
    ppl = 4.0 if c.learning_rate == best_lr["value"] else 6.0
    return {"eval": {"perplexity": ppl}, "eval_curve": {}, "step": 50}
  monkeypatch.setattr(experiment, "train", fake_train_2)
  mlm_perplexity.main()
  saved = json.loads((out / "results.json").read_text())
  assert sum("/tune/" in w for w in seen) == 2       # the new setting only
  assert {v["setting"]["lr"] for k, v in saved["runs"].items()
          if "/tuned/" in k} == {1e-2}
  assert len(saved.get("superseded", {})) == 2
  table = (out / "table_tuned.md").read_text()
  assert "lr 0.01, warm-up 10%" in table and "4.00 *" in table
  assert "at each of the 3 settings" in table


def test_budget_check_trains_each_choice_shorter_on_the_carved_split(
    shared_data, tmp_path, monkeypatch):
  """--budget_check: each model at its chosen lr and warm-up share trained
  for the shorter length on the carved train part, scored on the carved
  documents at the search's seed; the rule (every model below 0.6 x
  unigram and the bigram of those positions) picks the shortest length."""
  _tiny(monkeypatch)
  seen = []

  def fake_train(c, workdir):
    seen.append((workdir, c.num_train_steps, c.data.local_files.train,
                 c.data.local_files.validation, c.eval_steps,
                 c.learning_rate, c.warmup_steps, c.seed))
    best = 3e-3 if c.model.block == "gmlp" else 1e-3
    # At 25 steps BERT is far above any bar; every model is below at 50.
    short_bert = c.num_train_steps == 25 and c.model.block != "gmlp"
    ppl = 1e6 if short_bert else 5.0 + abs(c.learning_rate - best) * 1e3
    return {"eval": {"perplexity": ppl}, "eval_curve": {},
            "step": c.num_train_steps}
  monkeypatch.setattr(experiment, "train", fake_train)
  out = tmp_path / "out"
  monkeypatch.setattr(sys, "argv", [
      "mlm_perplexity.py", "--scale=small", f"--out={out}", "--vocab=t5",
      "--seeds=1", "--models=attention,gmlp", "--tune", "--budget_check=25",
      f"--shared={_shared(tmp_path, shared_data)}"])
  mlm_perplexity.main()
  short = [s for s in seen if "/budget/steps=25/" in s[0]]
  assert sorted((s[5], s[6]) for s in short) == [(1e-3, 2), (3e-3, 2)]
  for _, steps, train, valid, eval_steps, _, _, seed in short:
    assert (steps, seed, eval_steps) == (25, mlm.TUNE_SEED, -1)
    assert train.endswith("c4_split/train.jsonl")
    assert valid.endswith("c4_split/validation.jsonl")
  saved = json.loads((out / "results.json").read_text())
  base = saved["baselines"][f"small/s50/vocab=t5/carved_validation/seed="
                            f"{mlm.TUNE_SEED}"]
  assert base["held_out"]["rows"] > 0 and base["unigram"] > 10
  table = (out / "table_tuned.md").read_text()
  assert ("the rule picks 50 steps, the length used: confirmed on "
          "validation") in table
  assert "| BERT (Transformer) | 1000000.0 | 5.0 |" in table
  assert "checked on the carved validation split in the last section" in table
  # Were BERT above the bar at 50 steps too, no length would clear.
  assert mlm.budget_rule({25: {"a": 1e6}, 50: {"a": 1e6}}, base, ["a"]) is None
  assert mlm.budget_rule({25: {"a": 1.0}, 50: {"a": 1.0}}, base, ["a"]) == 25


@pytest.mark.parametrize("argv,message", [
    (["--scale=paper", "--tune"], "--tune: the small scale carves"),
    (["--budget_check=1000"], "--budget_check: .* add --tune"),
])
def test_tune_is_refused_where_there_is_no_sample_to_carve(
    argv, message, tmp_path, monkeypatch, capsys):
  monkeypatch.setattr(sys, "argv", ["mlm_perplexity.py", f"--out={tmp_path}",
                                    *argv])
  with pytest.raises(SystemExit, match=message):
    mlm_perplexity.main()
