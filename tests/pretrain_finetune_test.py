"""experiments/pretrain_finetune.py: the pretraining run's encoder is the
classifier's encoder (what the fine-tuning arm loads), on the same data."""
import argparse
import json
import pathlib
import shutil
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest

from hypermixer_jax import experiment
from hypermixer_jax.experiment import glue
from hypermixer_jax.experiment import nli
from hypermixer_jax.experiment import pretraining
from hypermixer_jax.experiment import selection
from hypermixer_jax.models import zoo
from hypermixer_jax.train import checkpoint
from hypermixer_jax.train import optim

import script_modules

pf = script_modules.load("experiments/pretrain_finetune.py")


def _shapes(model_config):
  x = zoo.dummy_inputs(model_config)
  params = jax.eval_shape(
      lambda: zoo.build_model(model_config).init(
          jax.random.key(0), jnp.zeros(x.shape, x.dtype))["params"])
  flat = checkpoint._flatten(nn.unbox(params))  # pylint: disable=protected-access
  return {k: tuple(v.shape) for k, v in flat.items()}


@pytest.fixture(name="configs", scope="module")
def _configs(shared_data, tmp_path_factory):
  tmp_path = tmp_path_factory.mktemp("pretrain_finetune")
  # Building configs reads no vocabulary: any SentencePiece path will do.
  vocab = {"path": str(shared_data / "t5_spm/sentencepiece.model"),
           "model_vocab_size": 8064}
  out = {}
  for mixer in pf.MODELS:
    pre = pf.pretrain_config(mixer, shared_data, vocab, seed=1, steps=30)
    fine = pf.finetune_config(mixer, shared_data, vocab, lr=1e-3, seed=1,
                              fraction=0.1, out=tmp_path, steps=20,
                              init="/ckpt")
    pair = pf.finetune_config(mixer, shared_data, vocab, lr=3e-4, seed=1,
                              fraction=1.0, out=tmp_path, steps=20,
                              init="/ckpt", task="snli")
    out[mixer] = pre, fine, pair
  return out, tmp_path


@pytest.mark.parametrize("mixer", pf.MODELS)
def test_pretrained_encoder_is_the_classifier_encoder(configs, mixer):
  pre, fine, pair = configs[0][mixer]
  a = _shapes(pre.model)
  enc_a = {k: v for k, v in a.items() if k.startswith("encoder/")}
  assert any(k.startswith("mlm_head/") for k in a)
  assert pre.model.head == "mlm"
  # Both downstream tasks load the same pretrained encoder: only the heads
  # differ (SST-2's two classes, SNLI's three), and fine-tuning
  # re-initialises exactly them.
  for c, classes, head in ((fine, 2, "classify"), (pair, 3, "pair_classify")):
    b = _shapes(c.model)
    enc_b = {k: v for k, v in b.items() if k.startswith("encoder/")}
    assert enc_a and enc_a == enc_b
    assert any(k.startswith("classifier/") for k in b)
    assert c.model.num_classes == classes
    assert c.init_reinit == "(?!encoder/)"
    assert c.init_checkpoint == "/ckpt"
    assert c.model.head == head


def _decay_masks(model_config):
  """(the current rule's mask, the rule of runs recorded without
  ``weight_decay_mask``: every leaf of rank > 1), flattened by path."""
  boxed = zoo.abstract_variables(model_config)["params"]
  new = checkpoint._flatten(optim.weight_decay_mask(boxed))  # pylint: disable=protected-access
  old = {k: len(v.shape) > 1 for k, v in checkpoint._flatten(  # pylint: disable=protected-access
      nn.unbox(boxed)).items()}
  return new, old


@pytest.mark.parametrize("mixer", pf.MODELS)
def test_which_models_the_earlier_decay_rule_trained_otherwise(configs, mixer):
  # Runs recorded before runs named their weight-decay rule decayed every
  # leaf of rank > 1. In this study's models that differs from the current
  # rule only at the Transformer's [heads, head_dim] query / key / value
  # biases (and, the check's control, wherever layers are scanned).
  models = [c.model for c in configs[0][mixer]]
  for model in models:
    new, old = _decay_masks(model)
    assert any(new.values()) and not all(new.values())
    differ = sorted(k for k in new if new[k] != old[k])
    assert differ == ([f"encoder/stack/layer_{i}/token_mixing/{w}/bias"
                       for i in range(2) for w in ("key", "query", "value")]
                      if mixer == "attention" else [])
  assert experiment.decay_rules_differ(models) == (mixer == "attention")
  scanned = models[1].copy_and_resolve_references()
  scanned.scan_layers = True
  assert experiment.decay_rules_differ([scanned])


def test_records_of_the_earlier_decay_rule_run_again_where_it_differs(
    shared_data, tmp_path):
  vocab = {"path": str(shared_data / "t5_spm/sentencepiece.model"),
           "model_vocab_size": 8064}
  exp = experiment.Experiment(tmp_path / "exp")
  keys = {m: [f"pretrain/s3/model={m}/seed=0",
              f"p3_f2/task=snli/model={m}/fraction=1/arm=scratch/lr=0.001/"
              "seed=0", f"probe/s3/model={m}/fraction=1/seed=0"]
          for m in ("attention", "gmlp")}
  for m in keys:
    for k in keys[m]:
      exp.runs[k] = {"eval": {"accuracy": 0.5}}
  current = "p3_f2/model=attention/fraction=1/arm=scratch/lr=0.01/seed=0"
  exp.runs[current] = {"eval": {"accuracy": 0.6},
                       "weight_decay_mask": optim.DECAY_MASK_RULE}
  exp.save()
  assert pf.retire_other_decay(exp, "gmlp", shared_data, vocab,
                               ["snli"]) == []
  assert pf.retire_other_decay(exp, "attention", shared_data, vocab,
                               ["snli"]) == keys["attention"]
  assert sorted(exp.runs) == sorted([current, *keys["gmlp"]])
  retired = json.loads((tmp_path / "exp/results.json").read_text())[
      "superseded"]
  assert sorted(retired) == sorted(keys["attention"])
  assert all("earlier weight-decay rule" in r["superseded_because"]
             for r in retired.values())
  # Nothing left to retire: a second process retires nothing.
  assert pf.retire_other_decay(exp, "attention", shared_data, vocab,
                               ["snli"]) == []
  # What the rule changed: the cells run again beside their retired records.
  assert pretraining._rule_section(exp.data) == ""  # pylint: disable=protected-access
  exp.runs[keys["attention"][0]] = {"eval": {"perplexity": 420.0}}
  exp.runs[keys["attention"][1]] = {"eval": {"accuracy": 0.52}}
  exp.data["superseded"][keys["attention"][0]]["eval"] = {"perplexity": 400.0}
  assert experiment.decay_rule_pairs(exp.data, "accuracy") == [
      (keys["attention"][1], 0.5, 0.52)]
  assert pretraining._rule_section(exp.data) == (  # pylint: disable=protected-access
      "\n\n**Weight-decay rule.** Cells run again under the current rule "
      "beside their retired records of the earlier one (the same setting and "
      "seed): accuracy, 1 cell(s): current - earlier +2 points on average "
      "(sd 0, largest |difference| 2); MLM held-out perplexity, 1 "
      "cell(s): current - earlier +5 % on average (sd 0, largest "
      "|difference| 5).")


def test_same_vocabulary_length_and_seed(configs, shared_data, tmp_path):
  configs, out = configs
  for pre, fine, pair in configs.values():
    assert pre.data.vocab_path == fine.data.vocab_path == pair.data.vocab_path
    assert pre.data.seq_len == fine.data.seq_len == fine.model.max_len
    assert pair.data.seq_len == pair.model.max_len == pre.data.seq_len
    assert pre.seed == fine.seed == pair.seed == 1
    assert pair.learning_rate == 3e-4 and pair.num_train_steps == 20
    assert pre.num_train_steps == 30 and pre.checkpoint_every == 6
    assert pre.keep_checkpoints >= 1
    train = pre.data.local_files.train.split(",")
    assert [pathlib.Path(p).name for p in train] == [
        pathlib.Path(p).name for p in pretraining.C4_TRAIN_ALL.split(",")]
    assert "wiki.valid" in pre.data.local_files.validation
  # 10% of the labels: a fixed subset file, the same for every model and arm.
  subset = pathlib.Path(configs["attention"][1].data.local_files.train)
  # The pair task: nli_splits' fixed cut of the SNLI dev file, trained on
  # the 80% part and evaluated on the other 20%, nothing shared.
  pair = configs["attention"][2]
  train = pathlib.Path(pair.data.local_files.train)
  test = pathlib.Path(pair.data.local_files.validation)
  assert pair.eval_split == "validation" and train.parent == out / "splits"
  tr, te = (p.read_text(encoding="utf-8").splitlines() for p in (train, test))
  source = (shared_data / nli.FILES["snli"][0]).read_text(
      encoding="utf-8").splitlines()
  assert sorted(tr + te) == sorted(source)
  # A partition of the rows by premise: no premise on both sides.
  premise = lambda line: json.loads(line)["premise"]  # noqa: E731
  assert not {premise(x) for x in tr} & {premise(x) for x in te}
  assert round(0.2 * len(source)) <= len(te) < round(0.2 * len(source)) + 10
  rows = subset.read_text(encoding="utf-8").splitlines()
  full = (shared_data / "glue/SST-2/train.tsv").read_text(
      encoding="utf-8").splitlines()
  assert rows[0] == full[0] and len(rows) - 1 == round(0.1 * (len(full) - 1))
  assert set(rows[1:]) <= set(full[1:])
  scratch = pf.finetune_config("attention", shared_data, {
      "path": "x.model", "model_vocab_size": 8064}, lr=1e-3, seed=0,
                               fraction=1.0, out=tmp_path, steps=20)
  assert not scratch.init_checkpoint
  assert scratch.data.local_files.train.endswith("SST-2/train.tsv")
  with pytest.raises(ValueError, match="applies to sst2 only"):
    pf.finetune_config("attention", shared_data, {"path": "x.model"},
                       lr=1e-3, seed=0, fraction=0.1, out=tmp_path, steps=20,
                       task="snli")
  with pytest.raises(ValueError, match="unknown task 'cola'"):
    pf.finetune_config("attention", shared_data, {"path": "x.model"},
                       lr=1e-3, seed=0, fraction=1.0, out=tmp_path, steps=20,
                       task="cola")


def test_settings_and_baseline_keys():
  # SST-2 at each fraction, the pair task once at all of its labels; the
  # SST-2 baselines keep the keys of the first recorded runs.
  assert pf.settings_of(["sst2", "snli"], [0.1, 1.0]) == [
      ("sst2", 0.1), ("sst2", 1.0), ("snli", 1.0)]
  assert pf.nb_key("sst2", 0.1) == "nb/0.1"
  assert pf.nb_key("snli", 1.0) == "nb/snli_by_premise"
  assert pretraining.setting_label("snli", 1.0) == "SNLI, 80% split"


def test_report_rows_of_run_and_unrun_settings(tmp_path):
  # gMLP at 100% of SST-2 and on SNLI (seeds 0, 1), nothing at 10%.
  exp = experiment.Experiment(tmp_path)
  settings = [("sst2", 1.0), ("snli", 1.0), ("sst2", 0.1)]
  acc = {("sst2", "scratch"): (0.77, 0.79), ("sst2", "pretrained"): (0.8, 0.8),
         ("snli", "scratch"): (0.55, 0.57), ("snli", "pretrained"): (0.6, 0.6)}
  keys, chosen = {}, {}
  for (task, fraction) in settings:
    for arm in ("scratch", "pretrained"):
      ks = [f"{task}/{fraction:g}/{arm}/seed={s}" for s in (0, 1)]
      for k, a in zip(ks, acc.get((task, arm), ()) if fraction == 1 else ()):
        exp.runs[k] = {"eval": {"accuracy": a},
                       "eval_curve": {"1000": {"accuracy": a}}}
      keys["gmlp", (task, fraction), arm] = ks if fraction == 1 else []
      chosen["gmlp", (task, fraction), arm] = (
          (1e-3, 0.1, "validation") if fraction == 1
          else (None, 0.1, "searching"))
  for s, (fresh, pre) in enumerate(((0.60, 0.62), (0.62, 0.64))):
    exp.runs[f"probe/s30/model=gmlp/fraction=1/seed={s}"] = {
        "random": fresh, "pretrained": pre, "dev_rows": 872}
  args = argparse.Namespace(pretrain_steps=30, finetune_steps=10,
                            lrs="1e-3", warmup_shares="0.1", pair_grid="")
  pretraining.report(exp, args, ["gmlp"], settings, [0, 1], chosen, keys)
  rows = [[c.strip() for c in line.split("|")[1:-1]]
          for line in (tmp_path / "table.md").read_text().splitlines()
          if line.startswith("| gMLP")]
  cols = {r[1]: r for r in rows}
  full, snli, tenth = (cols["SST-2, 100% of the labels"],
                       cols["SNLI, 80% split"], cols["SST-2, 10% of the labels"])
  # (Beyond the spread, but two seeds are too few for a verdict.)
  assert full[2:7] == ["78.0 ± 1.4 (n=2)", "80.0 ± 0.0 (n=2)", "+2.0",
                       "not decided (2 < 3 seeds)", "0.001 / 0.001"]
  # The probe: random / pretrained, and Welch's test of the two.
  assert full[9] == ("61.0 ± 1.4 (n=2) / 63.0 ± 1.4 (n=2): not decided "
                     "(2 < 3 seeds)")
  # The probes read SST-2: a pair task's row shows none.
  assert snli[2:5] == ["56.0 ± 1.4 (n=2)", "60.0 ± 0.0 (n=2)", "+4.0"]
  assert snli[6] == "0.001 / 0.001"
  assert snli[9] == ""
  # A setting whose searches are not whole has no gain, verdict or rate.
  assert tenth[2:7] == ["not run", "not run", "", "", "searching / searching"]


# Final accuracy of the fake runs: 3e-4 is the better rate on validation.
ACC = {3e-4: 0.8, 1e-3: 0.7}


def _fake_grid(shared_data, out, monkeypatch):
  """The grid's control flow, with training replaced by a record of what
  each run was asked to do: ``(calls, main(*flags))``."""
  calls = []

  def train(config, workdir):
    if config.get("init_checkpoint"):   # its last step (--pretrain_steps)
      assert pathlib.Path(config.init_checkpoint, "checkpoints", "3").is_dir()
    (pathlib.Path(workdir) / "checkpoints" / str(config.num_train_steps)
     ).mkdir(parents=True, exist_ok=True)
    calls.append((pathlib.Path(workdir).relative_to(out).as_posix(),
                  config.learning_rate))
    acc = ACC.get(config.learning_rate, 0.7)
    return {"eval": {"perplexity": 40.0, "accuracy": acc},
            "eval_curve": {"2": {"accuracy": acc}},
            "data": config.data.local_files.to_dict(),
            "eval_every": config.eval_every,
            "warmup_steps": config.warmup_steps}
  monkeypatch.setattr(pf.experiment, "train", train)
  monkeypatch.setattr(pf.mlm, "c4_vocab", lambda exp, shared: {
      "path": str(shared_data / "t5_spm/sentencepiece.model"),
      "model_vocab_size": 32128})
  monkeypatch.setattr(pf.mlm, "lm_baselines", lambda c: {
      "unigram": 80.0, "bigram": 60.0, "held_out": {"rows": 4}})
  monkeypatch.setattr(pf.glue, "bag_of_words_baselines",
                      lambda c: {"naive_bayes": 0.75})
  monkeypatch.setattr(pf, "probe_encoders", lambda c, workdir, seed: {
      "random": 0.6, "pretrained": 0.62, "dev_rows": 872})

  def main(*flags):
    monkeypatch.setattr(sys, "argv", [
        "pretrain_finetune.py", f"--out={out}", f"--shared={shared_data}",
        "--models=gmlp", "--fractions=1.0", "--tasks=sst2",
        "--pretrain_steps=3", "--finetune_steps=2", "--lrs=3e-4,1e-3",
        "--warmup_shares=0.1", *flags])   # a small grid unless flags say
    pf.main()
  return calls, main


PRE = "runs/pretrain/s3/model=gmlp/seed={}"
FINE = "runs/p3_f2/model=gmlp/fraction=1/arm={}/lr={}/seed={}"
SEL = "runs/select/p3_f2/task=sst2/model=gmlp/fraction=1/arm={}/lr={}/seed=100"


def test_learning_rate_is_chosen_on_a_split_carved_from_train(
    shared_data, tmp_path, monkeypatch):
  out = tmp_path / "out"
  calls, main = _fake_grid(shared_data, out, monkeypatch)
  main("--seeds=0,1", "--lrs=0.001,0.0003", "--arms=scratch")
  # The search (seed 100), then every seed at the better rate only.
  assert calls == [(SEL.format("scratch", "0.001"), 1e-3),
                   (SEL.format("scratch", "0.0003"), 3e-4),
                   (FINE.format("scratch", "0.0003", 0), 3e-4),
                   (FINE.format("scratch", "0.0003", 1), 3e-4)]
  runs = json.loads((out / "results.json").read_text())["runs"]
  sel = runs[SEL.format("scratch", "0.001")[len("runs/"):]]
  # Trained on the carved train part, scored once on the carved validation
  # part: every 10th SST-2 sentence with its phrases, never the dev file.
  train, held = (pathlib.Path(sel["data"][p]) for p in ("train", "validation"))
  assert held.name == "train_carved_validation.tsv"
  assert "dev" not in sel["data"]["validation"] and sel["eval_every"] == 2
  source = shared_data / "glue/SST-2/train.tsv"
  rows = source.read_text().splitlines(True)
  keys = glue.sentence_groups(str(source))(rows[1:])
  every = set(list(dict.fromkeys(keys))[::10])
  assert held.read_text() == "".join(
      [rows[0]] + [r for r, k in zip(rows[1:], keys) if k in every])
  assert len(train.read_text().splitlines()) + len(
      held.read_text().splitlines()) == len(rows) + 1   # a header each
  assert sel["split"]["validation"]["sha256"] == experiment.file_digest(held)
  assert "path" not in json.dumps(sel["split"])
  # The seeds train on the whole train file and are scored on dev.
  seed = runs[FINE.format("scratch", "0.0003", 0)[len("runs/"):]]
  assert seed["data"]["train"].endswith("SST-2/train.tsv")
  assert seed["data"]["validation"].endswith("SST-2/dev.tsv")
  table = (out / "table.md").read_text()
  assert "| 0.0003 / searching |" in table
  # The search itself, under the table: every setting's carved score, the
  # choice marked, an arm not searched yet, and a choice at the grid's edge.
  assert ("| model | lr 0.001, warm-up 10% | lr 0.0003, warm-up 10% |\n"
          "| --- | --- | --- |\n| gMLP, scratch | 70.00 | 80.00 * |\n"
          "| gMLP, pretrained | not run | not run |" in table)
  assert ("the searched learning rates (a wider search may find a better "
          "one): gMLP, scratch (lr 0.0003)." in table)


def test_a_diverged_or_nan_search_run_is_never_chosen(
    shared_data, tmp_path, monkeypatch):
  # 3e-4 scores best (the fake's ACC) but its selection run stops on NaN:
  # recorded as diverged, and the seeds train at 1e-3. An arm whose every
  # setting diverged (or scored NaN) reports 'diverged' and trains nothing.
  def grid(out, bad):
    calls, main = _fake_grid(shared_data, out, monkeypatch)
    fake = pf.experiment.train

    def train(config, workdir):
      if "select/" in str(workdir) and config.learning_rate in bad:
        if bad[config.learning_rate] == "nan":
          return dict(fake(config, workdir), eval={"accuracy": float("nan")})
        raise FloatingPointError(bad[config.learning_rate] + "; in /x")
      return fake(config, workdir)
    monkeypatch.setattr(pf.experiment, "train", train)
    main("--seeds=0", "--lrs=0.001,0.0003", "--arms=scratch")
    return calls
  out = tmp_path / "out"
  grid(out, {3e-4: "nan loss at step 1"})
  runs = json.loads((out / "results.json").read_text())["runs"]
  assert runs[SEL.format("scratch", "0.0003")[5:]]["diverged"] == (
      "nan loss at step 1")
  assert FINE.format("scratch", "0.001", 0)[5:] in runs
  assert FINE.format("scratch", "0.0003", 0)[5:] not in runs
  out2 = tmp_path / "out2"
  calls = grid(out2, {1e-3: "nan", 3e-4: "nan loss at step 1"})
  assert len(calls) == 1 and "select/" in calls[0][0]   # no seed trained
  assert "| diverged / searching |" in (out2 / "table.md").read_text()


def test_warm_up_shares_widen_the_search_and_keep_the_recorded_keys(
    shared_data, tmp_path, monkeypatch):
  # --warmup_shares: each rate with each share (the configs' own 10% keeps
  # its keys, so searches recorded before stay valid); the seeds train at
  # the chosen pair, the share in their keys and configs.
  out = tmp_path / "out"
  calls, main = _fake_grid(shared_data, out, monkeypatch)
  main("--seeds=0", "--lrs=0.001", "--arms=scratch")
  assert calls[0] == (SEL.format("scratch", "0.001"), 1e-3)
  calls.clear()
  main("--seeds=0", "--lrs=0.001,0.0003", "--warmup_shares=0.5,0.1",
       "--arms=scratch", "--finetune_steps=2")
  share = SEL.replace("/seed=100", "/warmup=0.5/seed=100")
  # 0.001 at 10% was recorded; the rest runs. 3e-4 wins (the fake's
  # scores), at 50% (the earlier of a tie).
  assert calls == [(share.format("scratch", "0.001"), 1e-3),
                   (share.format("scratch", "0.0003"), 3e-4),
                   (SEL.format("scratch", "0.0003"), 3e-4),
                   (FINE.format("scratch", "0.0003", 0).replace(
                       "/seed=0", "/warmup=0.5/seed=0"), 3e-4)]
  runs = json.loads((out / "results.json").read_text())["runs"]
  assert runs[share.format("scratch", "0.001")[5:]]["warmup_steps"] == 1
  assert runs[SEL.format("scratch", "0.001")[5:]]["warmup_steps"] == 1
  assert "| 0.0003, warm-up 50% / searching |" in (out / "table.md").read_text()


def test_pair_grid_gives_the_pair_task_its_own_search(
    shared_data, tmp_path, monkeypatch):
  # SST-2 searches --lrs x --warmup_shares; the pair task --pair_grid
  # (its recorded, smaller search), and the table's note names both.
  args = argparse.Namespace(lrs="1e-3,3e-4", warmup_shares="0.02,0.1",
                            pair_grid="1e-3/0.1")
  assert pretraining.search_grid(args, "sst2") == [
      (1e-3, 0.02), (1e-3, 0.1), (3e-4, 0.02), (3e-4, 0.1)]
  assert pretraining.search_grid(args, "snli") == [(1e-3, 0.1)]
  args.pair_grid = ""
  assert pretraining.search_grid(args, "snli") == pretraining.search_grid(
      args, "sst2")
  args.pair_grid = "1e-3"
  with pytest.raises(SystemExit, match=r"--pair_grid='1e-3': give "
                     r"LRS/SHARES, e\.g\. --pair_grid=3e-4,1e-3/0\.1\."):
    pretraining.search_grid(args, "snli")
  out = tmp_path / "out"
  calls, main = _fake_grid(shared_data, out, monkeypatch)
  main("--seeds=0", "--tasks=sst2,snli", "--lrs=0.001,0.0003",
       "--pair_grid=0.001/0.1", "--arms=scratch")
  pair = SEL.replace("task=sst2", "task=snli")
  assert [c for c, _ in calls if "select/" in c] == [
      SEL.format("scratch", "0.001"), SEL.format("scratch", "0.0003"),
      pair.format("scratch", "0.001")]
  assert ("best of lr 0.001,0.0003 x warm-up share 0.1 (a pair task: lr "
          "0.001 x warm-up share 0.1) on a validation split"
          in (out / "table.md").read_text())


def test_a_recorded_encoder_without_checkpoint_is_pretrained_again(
    shared_data, tmp_path, monkeypatch):
  # runs/ is not committed, so a pretraining run can be recorded while its
  # checkpoint is gone; a fine-tuning cell from it must pretrain it again
  # (same config and seed), not fail on the path. The pretrained arm's
  # search fine-tunes from its own pretraining (seed 100).
  out = tmp_path / "out"
  calls, main = _fake_grid(shared_data, out, monkeypatch)
  main("--seeds=0", "--lrs=0.001", "--arms=pretrained")
  assert calls == [(PRE.format(100), pf.SMALL["pretrain_lr"]),
                   (SEL.format("pretrained", "0.001"), 1e-3),
                   (PRE.format(0), pf.SMALL["pretrain_lr"]),
                   (FINE.format("pretrained", "0.001", 0), 1e-3)]
  # The pretraining checkpoint is gone; the better rate asks for it.
  shutil.rmtree(out / PRE.format(0))
  calls.clear()
  main("--seeds=0", "--lrs=0.001,0.0003", "--arms=pretrained")
  assert calls == [(SEL.format("pretrained", "0.0003"), 3e-4),
                   (PRE.format(0), pf.SMALL["pretrain_lr"]),
                   (FINE.format("pretrained", "0.0003", 0), 3e-4)]
  run = json.loads((out / "results.json").read_text())["runs"][
      "p3_f2/model=gmlp/fraction=1/arm=pretrained/lr=0.0003/seed=0"]
  assert run["pretrain_again_perplexity"] == 40.0
  assert run["pretrain_recorded_perplexity"] == 40.0
  # A pretraining whose process was stopped (a preemption save at step 1
  # of 3) is no encoder: it is trained on (resumed in its workdir) before
  # any fine-tuning reads it.
  shutil.rmtree(out / PRE.format(100))
  (out / PRE.format(100) / "checkpoints" / "1").mkdir(parents=True)
  calls.clear()
  main("--seeds=0", "--lrs=0.001,0.0003,0.003", "--arms=pretrained")
  assert calls[:2] == [(PRE.format(100), pf.SMALL["pretrain_lr"]),
                       (SEL.format("pretrained", "0.003"), 3e-3)]


def test_arms_split_between_processes(shared_data, tmp_path, monkeypatch):
  # Each arm chooses its own rate, so one process per arm trains every
  # cell once; the second reports both arms.
  out = tmp_path / "out"
  calls, main = _fake_grid(shared_data, out, monkeypatch)
  main("--seeds=0,1", "--lrs=0.001", "--arms=scratch")
  assert calls == [(SEL.format("scratch", "0.001"), 1e-3)] + [
      (FINE.format("scratch", "0.001", s), 1e-3) for s in (0, 1)]
  assert "| gMLP | SST-2, 100% of the labels | 70.0 ± 0.0 (n=2) | not run |" \
      in (out / "table.md").read_text()
  calls.clear()
  main("--seeds=0,1", "--lrs=0.001", "--arms=pretrained")
  assert calls == [(PRE.format(100), pf.SMALL["pretrain_lr"]),
                   (SEL.format("pretrained", "0.001"), 1e-3),
                   (PRE.format(0), pf.SMALL["pretrain_lr"]),
                   (FINE.format("pretrained", "0.001", 0), 1e-3),
                   (PRE.format(1), pf.SMALL["pretrain_lr"]),
                   (FINE.format("pretrained", "0.001", 1), 1e-3)]
  runs = json.loads((out / "results.json").read_text())["runs"]
  assert {k for k in runs if k.startswith("probe/")} == {
      "probe/s3/model=gmlp/fraction=1/seed=0",
      "probe/s3/model=gmlp/fraction=1/seed=1"}
  assert ("| 70.0 ± 0.0 (n=2) | 70.0 ± 0.0 (n=2) | +0.0 |"
          in (out / "table.md").read_text())
  calls.clear()
  main("--seeds=0,1", "--lrs=0.001")      # both recorded: nothing to train
  assert not calls
  with pytest.raises(SystemExit, match="--arms='pretrain': give scratch "
                     "and/or pretrained"):
    main("--arms=pretrain")


def test_an_arm_without_its_whole_search_reports_nothing(
    shared_data, tmp_path, monkeypatch):
  # A record from before the carved search: seed 0 at both rates on dev,
  # and a search of the pretrained arm scored on another carved split
  # (favouring the other rate). A process training only the scratch arm
  # reports nothing of the pretrained arm (never a rate picked on the dev
  # score its seeds are reported on), trains nothing of it, and leaves the
  # stale search to the process that trains that arm.
  out = tmp_path / "out"
  exp = experiment.Experiment(out)
  for lr, acc in ((0.001, 0.75), (0.0003, 0.72)):
    exp.runs[FINE.format("pretrained", lr, 0)[len("runs/"):]] = {
        "eval": {"accuracy": acc}, "eval_curve": {"2": {"accuracy": acc}}}
    exp.runs[SEL.format("pretrained", lr)[len("runs/"):]] = {
        "eval": {"accuracy": 1 - acc},
        "split": {"validation": {"sha256": "0" * 64}}}
  exp.save()
  calls, main = _fake_grid(shared_data, out, monkeypatch)
  main("--seeds=0", "--lrs=0.001,0.0003", "--arms=scratch")
  assert all("pretrained" not in c for c, _ in calls)
  row = next([c.strip() for c in line.split("|")[1:-1]] for line in (
      out / "table.md").read_text().splitlines() if line.startswith("| gMLP"))
  assert row[3] == "not run" and row[6] == "0.0003 / searching"
  runs = json.loads((out / "results.json").read_text())["runs"]
  assert SEL.format("pretrained", "0.0003")[len("runs/"):] in runs


def test_pair_task_is_carved_by_premise(shared_data, tmp_path):
  vocab = {"path": str(shared_data / "t5_spm/sentencepiece.model"),
           "model_vocab_size": 8064}
  c = pf.finetune_config("gmlp", shared_data, vocab, lr=1e-3, seed=0,
                         fraction=1.0, out=tmp_path, steps=2, task="snli")
  split = pretraining.carve_setting(c, tmp_path, "snli")
  read = lambda p: [json.loads(x)["premise"] for x in
                    pathlib.Path(split[p]["path"]).read_text().splitlines()]
  train, held = read("train"), read("validation")
  assert not set(train) & set(held)
  assert len(train) + len(held) == len(pathlib.Path(
      c.data.local_files.train).read_text().splitlines())
  assert 0.07 < len(held) / (len(train) + len(held)) < 0.13
  sel = pretraining.selection_config(c, split)
  assert sel.data.local_files.validation == split["validation"]["path"]
  assert sel.eval_every == sel.num_train_steps == 2
  assert c.data.local_files.validation.endswith("snli_test_by_premise.jsonl")


def test_sst2_is_carved_by_sentence_and_other_carves_retired(shared_data,
                                                             tmp_path):
  """SST-2 at 10%: whole sentences (of the whole train file) are carved;
  asked without them, the carve refuses; a selection run recorded on
  another validation split is retired and its key runs again."""
  vocab = {"path": str(shared_data / "t5_spm/sentencepiece.model"),
           "model_vocab_size": 8064}
  c = pf.finetune_config("gmlp", shared_data, vocab, lr=1e-3, seed=0,
                         fraction=0.1, out=tmp_path, steps=2, task="sst2")
  with pytest.raises(ValueError, match="sentences=glue.sentence_groups"):
    pretraining.carve_setting(c, tmp_path, "sst2")
  group = glue.sentence_groups(glue.sst2_train(shared_data))
  split = pretraining.carve_setting(c, tmp_path, "sst2", group)
  held, kept = (set(group(pathlib.Path(split[p]["path"]).read_text(
      encoding="utf-8").splitlines(True)[1:])) for p in ("validation", "train"))
  assert held and kept and not held & kept
  exp = experiment.Experiment(tmp_path / "exp", argparse.Namespace(
      report_only=False))
  same = {"split": selection.split_record(split)}
  other = {"split": {"validation": {"sha256": "0" * 64}}}
  exp.runs.update({"a": dict(same), "b": dict(other)})
  for key in ("a", "b"):
    pretraining.retire_other_carve(exp, key, split)
  assert "a" in exp.runs and "b" not in exp.runs
  assert exp.data["superseded"]["b"]["superseded_because"] == (
      "carved from another validation split")


def test_probe_reads_the_pretrained_encoder(shared_data, tmp_path,
                                           monkeypatch):
  from hypermixer_jax.train import artifacts  # pylint: disable=g-import-not-at-top
  # Every probe below reads the same rows: each split's pipeline runs once.
  reads, read = {}, experiment.pipeline_arrays

  def read_once(data_config, split, *args, **kwargs):
    key = (data_config.to_json_best_effort(), split, args,
           tuple(sorted(kwargs.items())))
    if key not in reads:
      reads[key] = read(data_config, split, *args, **kwargs)
    return dict(reads[key])
  monkeypatch.setattr(experiment, "pipeline_arrays", read_once)
  vocab = {"path": str(shared_data / "t5_spm/sentencepiece.model"),
           "model_vocab_size": 32128}
  c = pf.finetune_config("hypermixer", shared_data, vocab, lr=1e-3, seed=3,
                         fraction=0.01, out=tmp_path, steps=1)
  c.model.update(d_model=16, d_ffn=32, num_layers=1)
  c.model.mixer_kwargs.hyper_dim = 16
  c.init_reinit = "(?!encoder/)"

  def write(seed, name):
    model = zoo.build_model(c.model)
    x = zoo.dummy_inputs(c.model)
    params = nn.unbox(jax.jit(model.init)(
        jax.random.key(seed), jnp.zeros(x.shape, x.dtype))["params"])
    artifacts.write_params(tmp_path / name, params, step=1)
    return str(tmp_path / name)
  # A "pretrained" encoder equal to the fresh one: the same probe result.
  same = pf.probe_encoders(c, write(3, "same"), seed=3)
  assert same["random"] == same["pretrained"]
  assert same["train_rows"] == 673 and same["dev_rows"] == 872
  # Another encoder is read (the fresh one is the same as above).
  other = pf.probe_encoders(c, write(5, "other"), seed=3)
  assert other["random"] == same["random"]
  assert other["pretrained"] != same["pretrained"]
  assert 0.5 < same["random"] < 1.0
