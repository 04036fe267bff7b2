"""experiments/causal_lm.py: causality of every model as the experiment
builds it, its FLOP counts against closed forms, one scored token set for
the models and the baselines at every length, and a toy run that resumes."""
import argparse
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hypermixer_jax import baselines
from hypermixer_jax import experiment
from hypermixer_jax import heads
from hypermixer_jax import models
from hypermixer_jax.experiment import causal
from hypermixer_jax.experiment import mlm
from hypermixer_jax.experiment import stats
from hypermixer_jax.train import artifacts
from hypermixer_jax.train import evaluation

import script_modules

cl = script_modules.load("experiments/causal_lm.py")


TINY = dict(d_model=32, num_layers=2, d_ffn=64, heads=2, gmlp_depth=1,
            hyper_dim=8, chunk=4, seq_len=16, max_len=64, batch_size=8,
            steps=2, lr=1e-3, warmup=1, evals=1, eval_batch_size=8,
            eval_batches=1, eval_rows=3, eval_lengths=(16, 64))
VOCAB = 128


@pytest.fixture(scope="module", autouse=True)
def computed_once():
  """Each FLOP count and each read of a data split computed once in this
  module: its tests, and the toy run's restart, ask for the same ones again,
  and each costs a compile or a seqio pipeline (the values are the
  library's, only not computed twice)."""
  flops, arrays = {}, {}
  count, read = causal.forward_flops, experiment.pipeline_arrays

  def cached_flops(m, n):
    key = (m.to_json_best_effort(), n)
    if key not in flops:
      flops[key] = count(m, n)
    return flops[key]

  def cached_arrays(data_config, split, batch_size=1024, **kwargs):
    key = (data_config.to_json_best_effort(), split, batch_size,
           tuple(sorted(kwargs.items())))
    if key not in arrays:
      arrays[key] = read(data_config, split, batch_size, **kwargs)
    return dict(arrays[key])
  with pytest.MonkeyPatch.context() as mp:
    mp.setattr(causal, "forward_flops", cached_flops)
    mp.setattr(cl, "forward_flops", cached_flops)
    mp.setattr(experiment, "pipeline_arrays", cached_arrays)
    yield


@pytest.fixture(scope="module")
def tiny_models():
  return cl.model_configs(TINY, VOCAB)


@pytest.mark.parametrize("name", cl.MODELS)
def test_no_position_reads_a_later_token(tiny_models, name):
  """Changing the tokens after position t leaves the logits up to t
  unchanged and changes those after it (HyperMixer: t inside a chunk)."""
  m = tiny_models[name]
  model = models.build_model(m)
  n, t = 16, 6
  rng = np.random.default_rng(0)
  a = rng.integers(2, VOCAB, (2, n))
  b = a.copy()
  b[:, t + 1:] = rng.integers(2, VOCAB, (2, n - t - 1))
  params = jax.jit(model.init)(jax.random.key(0), jnp.asarray(a))["params"]

  @jax.jit
  def apply(x):
    return model.apply({"params": params}, x, segment_ids=jnp.ones_like(x))

  def logits(x):
    return np.asarray(apply(jnp.asarray(x)))
  la, lb = logits(a), logits(b)
  np.testing.assert_allclose(la[:, :t + 1], lb[:, :t + 1], atol=1e-5)
  assert np.abs(la[:, t + 1:] - lb[:, t + 1:]).max() > 1e-3


def test_attention_flops_grow_by_the_score_products():
  """Per token, doubling N adds attention's QK^T and AV products:
  layers x 4 n d FLOPs (XLA's count against the closed form)."""
  m = cl.model_config("attention", TINY, VOCAB)
  n = 32
  extra = cl.forward_flops(m, 2 * n) - cl.forward_flops(m, n)
  want = TINY["num_layers"] * 4 * n * TINY["d_model"]
  assert abs(extra / want - 1) < 0.15, (extra, want)


def test_hypermixer_flops_are_per_chunk():
  """Causal HyperMixing: the in-chunk prefix sum costs 2 C d d' per token
  and layer, whatever N (the scan is counted on one chunk)."""
  def flops(chunk, n):
    return cl.forward_flops(cl.model_config(
        "hypermixer", TINY, VOCAB, chunk=chunk), n)
  extra = flops(8, 32) - flops(4, 32)
  want = TINY["num_layers"] * 2 * (8 - 4) * TINY["d_model"] * TINY["hyper_dim"]
  assert abs(extra / want - 1) < 0.1, (extra, want)
  assert flops(4, 64) == flops(4, 16)
  with pytest.raises(ValueError, match="not a multiple of the HyperMixer"):
    flops(4, 18)


def test_models_are_matched(tiny_models):
  target = cl.forward_flops(tiny_models["attention"], TINY["seq_len"])
  for name in cl.MODELS:
    got = cl.forward_flops(tiny_models[name], TINY["seq_len"])
    assert abs(got / target - 1) < 0.1, (name, got, target)
  # Ablations along d' (at the default C) and C (at the default d'); a
  # mixing too wide for the budget keeps the Transformer's FFN.
  ablations = cl.model_configs(TINY, VOCAB, ("attention",), (4, 32), (8,))
  assert sorted(ablations) == ["attention", "hypermixer_h32_c4",
                               "hypermixer_h4_c4", "hypermixer_h8_c8"]
  for name, m in ablations.items():
    if name != "attention":
      got = cl.forward_flops(m, TINY["seq_len"])
      assert (abs(got / target - 1) < 0.1) != (m.d_ffn == TINY["d_ffn"])
  assert tiny_models["gmlp"].block == "gmlp"
  assert tiny_models["hypermixer"].position_embeddings == "none"


@pytest.fixture(scope="module")
def shared(tmp_path_factory, shared_data):
  """A small copy of the shared samples: 40 C4 documents, 6 WikiText-2
  validation articles (skips where ``../shared/data`` is absent)."""
  SHARED_DATA = shared_data  # pylint: disable=invalid-name
  root = tmp_path_factory.mktemp("shared")
  (root / "c4").mkdir()
  (root / "wikitext-2-raw").mkdir()
  with open(SHARED_DATA / mlm.C4_TRAIN, encoding="utf-8") as f:
    lines = [next(f) for _ in range(40)]
  (root / mlm.C4_TRAIN).write_text("".join(lines), encoding="utf-8")
  text, articles = [], 0
  with open(SHARED_DATA / mlm.WIKITEXT_VALID, encoding="utf-8") as f:
    for line in f:
      if line.startswith(" = ") and not line.startswith(" = = "):
        articles += 1
        if articles > 6:
          break
      text.append(line)
  (root / mlm.WIKITEXT_VALID).write_text("".join(text), encoding="utf-8")
  return root


@pytest.fixture(scope="module")
def vocab(shared):
  """A 300-piece vocabulary of the 40 sample documents: a small output
  layer keeps the models, the toy run's steps and the baselines cheap."""
  from hypermixer_jax.data import train_vocab  # pylint: disable=g-import-not-at-top
  path = train_vocab.train(str(shared / mlm.C4_TRAIN),
                           str(shared / "toy_spm"), 300)
  return {"path": path, "pieces": 300, "sha256": experiment.file_digest(path),
          "model_vocab_size": 512}


def test_held_out_tokens_are_the_same_at_every_length(shared, vocab,
                                                      tiny_models):
  cfg = cl.train_config(tiny_models["attention"], "small", shared, vocab)
  held = cl.held_out_sets(cfg, TINY["eval_lengths"], 64, TINY["eval_rows"])
  assert len({cl.digest(a) for a in held.values()}) == 1
  assert held[64]["inputs"].shape == (TINY["eval_rows"], 64)
  # Shorter rows: more of them, more row starts, the same scored tokens.
  assert len(held[16]["inputs"]) >= 4 * TINY["eval_rows"] - 3
  for n, arrays in held.items():
    np.testing.assert_array_equal(arrays["weights"] > 0,
                                  arrays["segment_ids"] > 0)
    base = baselines.lm_baselines(held[64]["targets"], arrays,
                                  vocab_size=vocab["model_vocab_size"],
                                  causal=True)
    assert base["scored_tokens"] == int(arrays["weights"].sum())
    assert base["row_starts"] == int((arrays["inputs"][:, 0] == 0).sum())
  with pytest.raises(ValueError, match="must divide the longest"):
    cl.held_out_rows(cfg, 24, 64, 2)


def test_token_nll_is_the_training_loops_loss(shared, vocab, tiny_models):
  """The per-position loss the tables use sums to the loss the library's
  evaluation reports on the same rows (same positions, same weights)."""
  m = tiny_models["hypermixer"].copy_and_resolve_references()
  m.vocab_size = vocab["model_vocab_size"]
  cfg = cl.train_config(m, "small", shared, vocab)
  arrays = cl.held_out_rows(cfg, 16, 64, 2)
  model = models.build_model(m)
  params = jax.jit(model.init)(jax.random.key(1),
                               jnp.asarray(arrays["inputs"][:2]))["params"]
  nll = cl.token_nll(m, params, arrays, batch_size=5)
  assert nll.shape == arrays["inputs"].shape
  assert (nll[arrays["weights"] == 0] == 0).all()
  step = evaluation.make_eval_step(model, "causal_lm")
  keys = ("inputs", "targets", "weights", "segment_ids", "positions")
  batch = {k: jnp.asarray(v) for k, v in arrays.items() if k in keys}
  sums = jax.device_get(jax.jit(step)(artifacts.ParamsOnly(params=params),
                                      batch))
  want = heads.finalize("causal_lm", sums)["perplexity"]
  np.testing.assert_allclose(cl.perplexity(nll, arrays["weights"]), want,
                             rtol=1e-4)


@pytest.mark.slow
def test_toy_run_records_and_resumes(shared, vocab, tmp_path, monkeypatch):
  # One layer: the run records and resumes the same at any depth. The
  # HyperMixer width is chosen among two on the carved C4 validation split;
  # only the chosen width's seed is trained (no --models: the Transformer's
  # run is the same code, and the verdict's text is tested below).
  monkeypatch.setattr(cl, "SMALL", dict(TINY, num_layers=1))
  monkeypatch.setattr(mlm, "c4_vocab", lambda out, shared: vocab)
  trained = []
  real_train = experiment.train
  # The selection runs' scores are set here (d' = 4 the better), so that
  # the choice, not a toy run's noise, is what the test reads; the runs
  # themselves are the library's training, tested elsewhere.
  scores = {4: 50.0, 8: 60.0}

  def spy(config, workdir, **kwargs):
    trained.append((workdir, config.data.local_files.to_dict()))
    if "/select_hyper_dim/" in workdir:
      return {"eval": {"perplexity": scores[
          config.model.mixer_kwargs.hyper_dim]}, "step": 2,
              "source": "scratch", "eval_curve": {}, "train_curve": {}}
    return real_train(config, workdir, **kwargs)
  monkeypatch.setattr(experiment, "train", spy)
  args = argparse.Namespace(
      scale="small", out=str(tmp_path / "out"), shared=str(shared),
      models="", seeds="0", steps=0,
      ablate_hyper_dims="", ablate_chunks="", ablation_seeds=1,
      select_hyper_dims="4,8", report_only=False, tune=False, lrs="",
      order="forward")
  cl.lm_part(args, experiment.Experiment(args.out, args))
  saved = json.loads((tmp_path / "out" / "results.json").read_text())
  selected = {k: v for k, v in saved["runs"].items() if "/select_" in k}
  assert sorted(selected) == [
      "small/s2/select_hyper_dim/model=hypermixer",
      "small/s2/select_hyper_dim/model=hypermixer_h4_c4"]
  # Selection runs train on the carved train part and score the carved
  # validation part; the reported seeds train on the whole sample.
  split = saved["c4_split"]
  documents = len((shared / mlm.C4_TRAIN).read_text().splitlines())
  assert split["validation"]["documents"] == -(-documents // 10)
  assert split["train"]["documents"] == documents - -(-documents // 10)
  carved = {w: f for w, f in trained if "/select_hyper_dim/" in w}
  assert len(carved) == 2
  for files in carved.values():
    assert files["train"].endswith("c4_split/train.jsonl")
    assert files["validation"].endswith("c4_split/validation.jsonl")
  for w, files in trained:
    if w not in carved:
      assert files["train"] == str(shared / mlm.C4_TRAIN)
  keys = sorted(k for k in saved["runs"] if "/select_" not in k)
  assert keys == ["small/s2/model=hypermixer_h4_c4/seed=0"]
  base = saved["baselines"]["small/s2"]
  for key in keys:
    run = saved["runs"][key]
    assert run["step"] == 2
    for n in TINY["eval_lengths"]:
      assert run["lengths"][str(n)]["digest"] == base[str(n)]["digest"]
      assert 1 < run["lengths"][str(n)]["perplexity"] < 1e6
  assert len({base[str(n)]["digest"] for n in TINY["eval_lengths"]}) == 1
  table = (tmp_path / "out" / "table.md").read_text()
  for text in ("HyperMixer (causal), d' chosen on validation", "unigram",
               "bigram", "N = 64",
               "d' chosen on a validation split", "| 4 | 112 | 0.05M | 50.0 * |",
               "| 8 | 96 | 0.05M | 60.0 |", "The chosen d' = 4 then trains",
               "as every model of the table does: not run yet"):
    assert text in table
  assert (tmp_path / "out" / "causal_lm.png").exists()

  # A restart with the same --out trains nothing again.
  def fail(*a, **k):
    raise AssertionError("a recorded cell was trained again")
  monkeypatch.setattr(cl, "run_cell", fail)
  monkeypatch.setattr(experiment, "train", fail)
  # (The recorded sizes are kept: each model's config is the one recorded,
  # once read back from JSON.)
  def recount(*a, **k):
    raise AssertionError("a recorded model's FLOPs were counted again")
  monkeypatch.setattr(causal, "sizes_of", recount)
  cl.lm_part(args, experiment.Experiment(args.out, args))
  again = json.loads((tmp_path / "out" / "results.json").read_text())
  assert again["runs"] == saved["runs"]

  # A report reads the recorded models: it compiles none to match FLOPs,
  # and writes the same table.
  monkeypatch.setattr(causal, "forward_flops", recount)
  monkeypatch.setattr(cl, "forward_flops", recount)
  (tmp_path / "out" / "table.md").unlink()
  report = argparse.Namespace(**dict(vars(args), report_only=True))
  cl.lm_part(report, experiment.Experiment(report.out, report))
  assert (tmp_path / "out" / "table.md").read_text() == table


def _one_layer_one_share(monkeypatch, vocab) -> None:
  """--tune at one layer, on the test vocabulary, with one warm-up share."""
  from hypermixer_jax.experiment import selection  # pylint: disable=g-import-not-at-top
  monkeypatch.setattr(cl, "SMALL", dict(TINY, num_layers=1))
  monkeypatch.setattr(mlm, "c4_vocab", lambda out, shared: vocab)
  monkeypatch.setattr(selection, "WARMUP_SHARES", (0.5,))


def _train_with(monkeypatch, spy) -> None:
  """Training replaced by ``spy(config, workdir)``; a scored cell adds its
  sizes and a perplexity of 40 + N at every held-out length."""
  def scored(config, workdir, held, sizes):
    return dict(spy(config, workdir), **sizes, train_tokens_per_sec=1.0,
                lengths={str(n): {"perplexity": 40.0 + n,
                                  "digest": causal.digest(a)}
                         for n, a in held.items()})
  monkeypatch.setattr(experiment, "train", spy)
  monkeypatch.setattr(causal, "run_cell", scored)
  monkeypatch.setattr(cl, "run_cell", scored)


def test_tune_chooses_each_models_setting_on_carved_documents(
    shared, vocab, tmp_path, monkeypatch):
  # --tune: both models search the same settings on the carved C4 split
  # (scores set here: the Transformer best at the larger rate, HyperMixer
  # at the smaller); their seeds train on the carved train part at their
  # own choice and are scored on the held-out rows at every length (the
  # trainer and the scoring replaced: both are the toy run's, tested above).
  _one_layer_one_share(monkeypatch, vocab)
  trained = []

  def spy(config, workdir, **kwargs):
    trained.append((workdir, config.data.local_files.to_dict(),
                    config.learning_rate))
    best = 3e-3 if config.model.mixer == "attention" else 1e-3
    return {"eval": {"perplexity": 50 + 1e4 * abs(
        config.learning_rate - best)}, "step": 2, "source": "scratch",
            "eval_curve": {}, "train_curve": {}}

  _train_with(monkeypatch, spy)
  args = argparse.Namespace(
      scale="small", out=str(tmp_path / "out"), shared=str(shared),
      models="attention,hypermixer", seeds="0,1", steps=0,
      ablate_hyper_dims="", ablate_chunks="", ablation_seeds=1,
      select_hyper_dims="", report_only=False, tune=True,
      lrs="0.001,0.003", order="forward")
  cl.lm_part(args, experiment.Experiment(args.out, args))
  saved = json.loads((tmp_path / "out" / "results.json").read_text())
  assert sorted(k for k in saved["runs"] if "/tune/" in k) == sorted(
      f"small/s2/tune/model={m}/setting={i}"
      for m in ("attention", "hypermixer") for i in (0, 1))
  # Every search and seed run records the carve it was made on.
  assert {r["carved_validation_sha256"] for r in saved["runs"].values()} == {
      saved["c4_split"]["validation"]["sha256"]}
  # Nothing of the untuned grid ran.
  assert all("/tune/" in w or "/tuned/" in w for w, _, _ in trained)
  for w, files, lr in trained:
    assert files["train"].endswith("c4_split/train.jsonl")
    assert files["validation"].endswith(
        "c4_split/validation.jsonl" if "/tune/" in w else "wiki.valid.raw")
  finals = {w.split("/tuned/")[1]: lr for w, _, lr in trained
            if "/tuned/" in w}
  assert finals == {"model=attention/seed=0": 3e-3,
                    "model=attention/seed=1": 3e-3,
                    "model=hypermixer/seed=0": 1e-3,
                    "model=hypermixer/seed=1": 1e-3}
  # Baselines counted on the carved train part, the same scored tokens.
  base = saved["baselines"]["small/s2/carved"]
  assert base["train_tokens"] < saved["baselines"]["small/s2"][
      "train_tokens"]
  table = (tmp_path / "out" / "table_tuned.md").read_text()
  assert "every model tuned alike" in table
  assert "| Transformer | 70.0 | 50.0 * |" in table
  assert "| HyperMixer (causal) | 50.0 * | 70.0 |" in table
  assert "each model's chosen warm-up and peak lr" in table
  assert "less the carved documents" in table
  assert not (tmp_path / "out" / "table.md").exists()


def test_a_width_that_leaves_no_ffn_is_not_a_candidate():
  with pytest.raises(ValueError, match=r"--select_hyper_dims: d'=256 "
                     r"leaves an FFN of \d+ \(< 64\)"):
    causal.selection_configs(TINY, VOCAB, (256,))


def test_the_chosen_width_is_judged_against_the_transformer():
  def run(ppl):   # at N = 64: 10 less
    return {"lengths": {"16": {"perplexity": ppl},
                        "64": {"perplexity": ppl - 10}}}
  sizes = {n: {"model": {"mixer_kwargs": {"hyper_dim": h}, "d_ffn": f},
               "flops_per_token": 5e4}
           for n, h, f in (("hypermixer_h4_c4", 4, 112), ("hypermixer", 8, 96))}
  selection = {"hypermixer_h4_c4": [{"eval": {"perplexity": 50.0}}],
               "hypermixer": [{"eval": {"perplexity": 60.0}}]}
  hm, tf = [101.0, 103.0, 102.0], [100.0, 99.0, 101.0]
  runs = {"attention": [run(x) for x in tf],
          "hypermixer_h4_c4": [run(x) for x in hm]}
  split = {"train": {"documents": 900, "sha256": "a" * 64},
           "validation": {"documents": 100, "sha256": "b" * 64}}
  chosen = causal.choose_hyper_dim(selection)
  assert chosen == "hypermixer_h4_c4"
  text = causal.selection_section(selection, chosen, runs, sizes, split,
                                  dict(TINY))
  assert "| 4 | 112 | 0.05M | 50.0 * |" in text
  assert "The chosen d' = 4" in text
  # Every model at the study's one setting (a width search for HyperMixer
  # alone): the tests are shown, no verdict is given.
  equal = experiment.verdict(hm, tf, "equal", margin=5.0)
  assert (f"{100 * (np.mean(hm) / np.mean(tf) - 1):+.1f}% (target: within "
          f"5%: no verdict (untuned); TOST within ±5.0: "
          f"{stats.p_text(equal.p_equal)}; difference +2.0 [-0.3, +4.3], "
          "p = 0.070)") in text
  assert str(experiment.verdict(hm, tf, "lower", untuned=True)) in text
  lower = experiment.verdict([x - 10 for x in hm], [x - 10 for x in tf],
                             "lower", untuned=True)
  assert f"At N = 64 (trained at 16): 92.0 ± 1.0 (n=3) against " in text
  assert f"lower: {lower}." in text
  # A candidate not run yet: nothing is chosen.
  assert causal.choose_hyper_dim({**selection, "hypermixer": []}) is None
  # One that diverged, or scored NaN, is never chosen, listed first or not.
  diverged = {"hypermixer_h4_c4": [{"diverged": "step 7"}],
              "hypermixer": [{"eval": {"perplexity": 60.0}}]}
  for bad in (diverged, {**diverged, "hypermixer_h4_c4": [
      {"eval": {"perplexity": float("nan")}}]}):
    assert causal.choose_hyper_dim(bad) == "hypermixer"
    assert "| 4 | 112 | 0.05M | diverged |" in causal.selection_section(
        bad, "hypermixer", runs, sizes, split, dict(TINY))
  with pytest.raises(SystemExit, match="every width diverged"):
    causal.choose_hyper_dim({m: diverged["hypermixer_h4_c4"]
                             for m in diverged})


def test_tune_searches_hypermixer_at_the_width_chosen_on_validation(
    shared, vocab, tmp_path, monkeypatch):
  # --tune --select_hyper_dims: HyperMixer is searched at the d' the
  # selection chose on the carved documents (here d' = 4, set better by the
  # spy), not at the default one; before the selection has run every width
  # the run stops and says so.
  _one_layer_one_share(monkeypatch, vocab)
  trained = []

  def spy(config, workdir, **kwargs):
    trained.append(workdir)
    hyper = config.model.mixer_kwargs.get("hyper_dim", 0)
    return {"eval": {"perplexity": 50.0 + hyper}, "step": 2,
            "source": "scratch", "eval_curve": {}, "train_curve": {}}

  _train_with(monkeypatch, spy)
  args = argparse.Namespace(
      scale="small", out=str(tmp_path / "out"), shared=str(shared),
      models="attention,hypermixer", seeds="0", steps=0,
      ablate_hyper_dims="", ablate_chunks="", ablation_seeds=1,
      select_hyper_dims="4,8", report_only=True, tune=True,
      lrs="0.001", order="forward")
  with pytest.raises(SystemExit, match=r"--tune --select_hyper_dims: the d' "
                     r"selection has not run every width yet"):
    cl.lm_part(args, experiment.Experiment(args.out, args))
  args.report_only = args.tune = False
  cl.lm_part(args, experiment.Experiment(args.out, args))
  args.tune = True
  trained.clear()
  cl.lm_part(args, experiment.Experiment(args.out, args))
  assert sorted(w.split("/s2/")[1] for w in trained) == [
      "tune/model=attention/setting=0",
      "tune/model=hypermixer_h4_c4/setting=0",
      "tuned/model=attention/seed=0", "tuned/model=hypermixer_h4_c4/seed=0"]
  table = (tmp_path / "out" / "table_tuned.md").read_text()
  assert "| HyperMixer (causal), d' chosen on validation | 54.0 * |" in table
  assert "HyperMixer enters at d' = 4, the width chosen" in table
  # The gap verdict reads the chosen width's seeds.
  assert "Causal HyperMixer / Transformer perplexity - 1 = +0.0%" in table


def test_recorded_sizes_are_counted_once(tmp_path, monkeypatch):
  # A model recorded once (in this process, or read back from JSON by
  # another) is not compiled again to count its FLOPs.
  counted = []
  monkeypatch.setattr(causal, "sizes_of", lambda m, n: counted.append(
      m.mixer) or {"params": 1, "non_embedding": 1, "flops_per_token": 1.0})
  configs = {"attention": cl.model_config("attention", TINY, VOCAB)}
  exp = experiment.Experiment(tmp_path, None)
  causal.record_sizes(exp, configs, ["attention"], TINY["seq_len"])
  causal.record_sizes(exp, configs, ["attention"], TINY["seq_len"])
  causal.record_sizes(experiment.Experiment(tmp_path, None), configs,
                      ["attention"], TINY["seq_len"])
  assert counted == ["attention"]
  wider = {"attention": cl.model_config("attention", dict(TINY, d_ffn=128),
                                        VOCAB)}
  causal.record_sizes(exp, wider, ["attention"], TINY["seq_len"])
  assert counted == ["attention", "attention"]
