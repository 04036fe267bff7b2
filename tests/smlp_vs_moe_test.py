"""experiments/smlp_vs_moe.py's study (experiment.sparse_lm): configs, FLOP
matching, summaries, table rows."""
import argparse
import itertools
import json
import math
import pathlib

import pytest


from hypermixer_jax import experiment
from hypermixer_jax import models
from hypermixer_jax.experiment import sparse_lm
from hypermixer_jax.train import loop

SHARED = pathlib.Path("/nonexistent")


@pytest.fixture
def shared(tmp_path):
  """A fake --shared folder with the files the small scale names."""
  for f in ("t5_spm/sentencepiece.model",
            "c4/c4_en_tfds_minimal_train_1000.jsonl",
            "c4/c4_en_train_00000_first1000.jsonl",
            "wikitext-2-raw/wiki.valid.raw"):
    (tmp_path / f).parent.mkdir(parents=True, exist_ok=True)
    (tmp_path / f).write_text("x")
  return tmp_path


def test_model_configs_build_the_named_models(shared):
  want = {"smlp_deterministic": ("gmlp", "base", "deterministic"),
          "smlp_partial": ("gmlp", "base", "partial"),
          "switch": ("attention", "switch", None),
          "gshard": ("attention", "gshard", None),
          "base_layers": ("attention", "base", None),
          "hash": ("attention", "hash", None),
          "gmlp": ("gmlp", None, None),
          "transformer": ("attention", None, None)}
  assert set(want) == set(sparse_lm.MODELS)
  configs = {}
  for name, (mixer, router, routing) in want.items():
    depth = (2, 0) if name in sparse_lm.DENSE else (1, 2)
    c = sparse_lm.train_config(sparse_lm.model_config(name, "small", depth),
                               "small", shared)
    m = c.model
    assert (m.token_mixer, m.num_dense_layers, m.num_sparse_layers) == (
        mixer, *depth)
    if router:
      assert m.moe.tmoe_router == router
    if routing:
      assert m.moe.smoe_routing == routing
    assert (m.d_model, m.d_ffn, m.max_len, m.moe.num_experts) == (
        64, 256, 128, 4)
    # Every config is one the training loop accepts (partial: no packing).
    loop.check_model_fits_data(c)
    models.build_model(m)
    configs[name] = c
  # Same data, optimiser and schedule for every model: only .model differs.
  strip = lambda c: {k: v for k, v in c.to_dict().items() if k != "model"}
  first = strip(configs["transformer"])
  for c in configs.values():
    assert strip(c) == first
  assert first["data"]["packing"] is False
  assert first["data"]["local_files"]["validation"].endswith("wiki.valid.raw")
  assert len(first["data"]["local_files"]["train"].split(",")) == 2
  with pytest.raises(ValueError, match="gmlp is dense"):
    sparse_lm.model_config("gmlp", "small", (1, 1))
  with pytest.raises(ValueError, match="unknown model 'moe'"):
    sparse_lm.model_config("moe", "small", (1, 1))
  with pytest.raises(FileNotFoundError,
                     match="SentencePiece vocabulary not found"):
    sparse_lm.train_config(sparse_lm.model_config("gmlp", "small", (1, 0)),
                           "small", SHARED)


def test_ablations_change_only_their_moe_fields(shared):
  ref = sparse_lm.run_config(sparse_lm.REFERENCE, "small", (2, 2), shared)
  want = {"smlp_e2": {"num_experts": 2}, "smlp_e8": {"num_experts": 8},
          "smlp_switch_tmoe": {"tmoe_router": "switch"}}
  assert set(want) == set(sparse_lm.ABLATIONS)
  for name, moe in want.items():
    c = sparse_lm.run_config(name, "small", (2, 2), shared)
    models.build_model(c.model)
    assert c.model.moe.to_dict() == {**ref.model.moe.to_dict(), **moe}
    c.model.moe = ref.model.moe
    assert c.to_dict() == ref.to_dict()


RECORD = (pathlib.Path(__file__).resolve().parent.parent
          / "experiments/results/smlp_vs_moe/results.json")


def test_recorded_flop_fits_are_what_the_study_runs_today(shared):
  # Every model runs the einsum dispatch, whose FLOPs the recorded fits
  # count: a fit measured again now on the study's config gives the
  # recorded one (the index dispatch's fit does not, and its matched depths
  # differ). GShard: top-2, the largest dispatch of the tMoEs; its sparse
  # block and the base suffice (the dense block is a Transformer block's).
  record = json.loads(RECORD.read_text(encoding="utf-8"))
  vocab = dict(record["vocab"], path=str(shared / "unused.model"))
  for name in sparse_lm.MODELS:
    c = sparse_lm.run_config(name, "small", (1, 1) if name not in
                             sparse_lm.DENSE else (1, 0), shared, vocab=vocab)
    assert c.model.moe.dispatch == sparse_lm.DISPATCH == "einsum"
  fit = record["runs"]["small8k/flops/gshard"]
  assert sparse_lm.recorded_dispatch(fit) == "einsum"

  def measure(depth, dispatch):
    c = sparse_lm.run_config("gshard", "small", depth, shared, vocab=vocab)
    c.model.moe.dispatch = dispatch
    return sparse_lm.train_step_flops(c)
  base = measure((0, 0), "einsum")
  sparse = measure((0, 1), "einsum") - base
  assert base == pytest.approx(fit["base"], rel=1e-3)
  assert sparse == pytest.approx(fit["sparse"], rel=1e-2)
  assert measure((0, 1), "index") - base < 0.95 * fit["sparse"]


def test_records_of_another_dispatch_or_fit_are_refused(tmp_path):
  exp = experiment.Experiment(tmp_path, argparse.Namespace(a=1))
  # A fit recorded before the layers had the choice ran the einsums.
  exp.runs["f/old"] = {"base": 1.0, "dense": 2.0, "sparse": 3.0}
  exp.runs["f/index"] = {"base": 1.0, "dense": 2.0, "sparse": 2.0,
                         "dispatch": "index"}
  exp.save()
  measured = []

  def measure():
    measured.append(1)
    return {"base": 1.0, "dense": 2.0, "sparse": 4.0}
  assert sparse_lm.recorded_fit(exp, "f/old", measure)["sparse"] == 3.0
  assert not measured
  got = sparse_lm.recorded_fit(exp, "f/index", measure)
  assert got["sparse"] == 4.0 and got["dispatch"] == "einsum"
  assert "ran dispatch='index'" in (
      exp.data["superseded"]["f/index"]["superseded_because"])
  # A run whose own FLOPs/token are not its plan's is not tabulated.
  plan = {"depth": (1, 2), "flops": 1.0e7}
  sparse_lm.check_flops("switch", plan, {"flops_per_token": 1.005e7})
  with pytest.raises(ValueError, match=r"switch: a recorded run measured "
                     r"10,500,000 FLOPs/token, its FLOP fit predicts "
                     r"10,000,000 at depth \(1, 2\)"):
    sparse_lm.check_flops("switch", plan, {"flops_per_token": 1.05e7})


def test_paper_scale_is_the_papers_setting(shared):
  c = sparse_lm.train_config(sparse_lm.model_config(
      sparse_lm.REFERENCE, "paper", sparse_lm.SCALES["paper"]["smlp_depth"]),
                             "paper", shared, data_dir="/tfds")
  assert (c.model.d_model, c.model.d_ffn, c.model.num_heads) == (1024, 4096, 16)
  assert c.num_train_steps == 25_000 and c.data.data_dir == "/tfds"


def test_fit_is_exact_for_additive_costs():
  cost = lambda d: 1000.0 + 7.0 * d[0] + 13.0 * d[1]
  fit = sparse_lm.fit_block_flops(cost)
  assert fit == {"base": 1000.0, "dense": 7.0, "sparse": 13.0}
  for d in itertools.product(range(4), range(4)):
    assert sparse_lm.layer_flops(fit, d) + fit["base"] == cost(d)


def test_choose_depth_picks_the_closest_in_log_ratio():
  fit = {"base": 0.0, "dense": 4.0, "sparse": 10.0}
  cands = sparse_lm.depth_candidates(False, 6)
  assert (0, 1) in cands and (2, 1) in cands and (1, 3) not in cands
  assert all(abs(a - b) <= 1 and b >= 1 and a + b <= 6 for a, b in cands)
  assert sparse_lm.depth_candidates(True, 3) == [(1, 0), (2, 0), (3, 0)]
  for target in (9.0, 17.0, 30.0, 41.0):
    depth, ratio = sparse_lm.choose_depth(fit, target, cands)
    brute = min(cands, key=lambda d: abs(math.log(
        sparse_lm.layer_flops(fit, d) / target)))
    assert depth == brute
    assert ratio == sparse_lm.layer_flops(fit, depth) / target
  # 18 and 22 are 10% either side of 20: log distance prefers 22 (1.1x)
  # over 18 (0.9x = 1.11x under).
  depth, _ = sparse_lm.choose_depth(
      {"base": 0, "dense": 18.0, "sparse": 22.0}, 20.0, [(1, 0), (0, 1)])
  assert depth == (0, 1)
  with pytest.raises(ValueError, match="target 0 FLOPs"):
    sparse_lm.choose_depth(fit, 0, cands)


@pytest.mark.slow
def test_train_step_flops_are_additive_over_blocks(shared):
  # Real XLA counts on a toy model: the linear fit predicts a deeper model.
  def config(depth):
    c = sparse_lm.train_config(
        sparse_lm.model_config("switch", "small", depth), "small", shared)
    c.model.update(dict(vocab_size=128, d_model=16, d_ffn=32, max_len=16))
    c.model.moe.expert_d_ffn = 32
    c.data.seq_len, c.batch_size = 16, 4
    return c
  fit = sparse_lm.fit_block_flops(
      lambda d: sparse_lm.train_step_flops(config(d)))
  assert fit["sparse"] > fit["dense"] > 0
  got = sparse_lm.train_step_flops(config((2, 1)))
  assert got == pytest.approx(
      fit["base"] + sparse_lm.layer_flops(fit, (2, 1)), rel=0.01)


def _run(ppl, tps_values, steps_per_sec=2.0):
  train = {str(10 * (i + 1)): {"tokens_per_sec": t,
                               "steps_per_sec": steps_per_sec,
                               "tflops_per_device": 3e-3 * steps_per_sec}
           for i, t in enumerate(tps_values)}
  return {"step": 10 * len(tps_values), "train_curve": train,
          "eval_curve": {"20": {"perplexity": 2 * ppl},
                         str(10 * len(tps_values)): {"perplexity": ppl}}}


def test_run_summary_and_table_rows():
  tokens = 1000
  r = sparse_lm.run_summary(
      _run(300.0, [900.0, 100.0, 1000.0, 1100.0, 950.0]), tokens)
  assert r["perplexity"] == 300.0
  assert r["tokens_per_sec"] == 950.0          # median: eval intervals skipped
  assert r["flops_per_token"] == pytest.approx(3e9 / tokens)
  assert r["train_seconds"] == pytest.approx(50 * tokens / 950.0)
  r2 = sparse_lm.run_summary(_run(310.0, [950.0] * 3), tokens)
  r3 = sparse_lm.run_summary(_run(305.0, [950.0] * 3), tokens)
  switch = [{**sparse_lm.run_summary(_run(ppl, [tps] * 3), tokens),
             "last80": {"perplexity": ppl - 50}}
            for ppl, tps in ((400.0, 1900.0), (420.0, 2100.0),
                             (410.0, 2000.0))]
  runs = {"smlp_deterministic": [r, r2, r3], "switch": switch,
          "hash": [{**r, "perplexity": 305.0}, {**r2, "perplexity": 306.0},
                   {**r3, "perplexity": 307.0}]}
  plan = {"smlp_deterministic": dict(depth=(2, 2), layer_flops=2e6,
                                     flops=3e6, params=2.5e6),
          "switch": dict(depth=(1, 2), layer_flops=1.8e6, flops=3e6,
                         params=2.4e6),
          "hash": dict(depth=(1, 2), layer_flops=1.8e6, flops=3e6,
                       params=2.4e6),
          "gmlp": dict(depth=(6, 0), layer_flops=2.1e6, flops=3.1e6,
                       params=2.3e6)}
  rows = sparse_lm.table_rows(
      ["smlp_deterministic", "switch", "hash", "gmlp"],
      {n: sparse_lm.MODELS[n][0] for n in sparse_lm.MODELS}, runs, plan,
      "smlp_deterministic", sparse_lm.PAPER, unigram=1000.0)
  assert all(len(row) == len(sparse_lm.HEADERS) for row in rows)
  col = {h: i for i, h in enumerate(sparse_lm.HEADERS)}
  sw = rows[1]
  assert sw[:6] == ["Switch Transformer", "1+2", "2.40M", "3.00", "1.80",
                    "0.90"]
  # Mean ± sd over the seeds, the ratio of the mean to the unigram, the
  # verdict by Welch's test (305 ± 5 vs 410 ± 10: sMLP lower).
  assert sw[col["WikiText-2 valid ppl"]] == "410.0 ± 10.0 (n=3)"
  assert sw[col["ppl / unigram"]] == "0.41"
  assert sw[col["ppl, last 80% of each row"]] == "360.0 ± 10.0 (n=3)"
  assert sw[col["sMLP (det.) lower?"]].startswith("yes: -105.0 [")
  assert sw[col["tokens/s"]] == "2,000"
  # sMLP's mean tokens/s is (950 + 950 + 950) / 3.
  assert sw[col["tokens/s vs sMLP"]] == f"{2000 / 950:.2f}"
  assert rows[2][col["sMLP (det.) lower?"]].startswith("not decided")
  assert rows[0][col["sMLP (det.) lower?"]] == ""
  assert rows[0][5] == "1.00" and rows[0][col["tokens/s vs sMLP"]] == "1.00"
  assert rows[3][3] == "not run" and rows[3][6] == "not run"
  assert rows[1][-1] == sparse_lm.PAPER["switch"]
  assert rows[3][5] == "1.05"
  base = {"all": {"unigram": 1000.0, "bigram": 600.0, "bigram_k": 0.01},
          "last80": {"unigram": 990.0, "bigram": 590.0, "bigram_k": 0.01}}
  uni, bi = sparse_lm.baseline_rows(base)
  assert uni[col["WikiText-2 valid ppl"]] == "1000.0"
  assert uni[col["ppl, last 80% of each row"]] == "990.0"
  assert bi[col["ppl / unigram"]] == "0.60" and "add-0.01" in bi[0]


def test_vocabulary_regimes(shared):
  # The 8k vocabulary is the small scale's default regime, with its own
  # budget; T5's keeps the first runs' budget; the paper scale has no other.
  assert sparse_lm.settings("small", "small") == (
      "small8k", {**sparse_lm.SCALES["small"], **sparse_lm.SMALL_VOCAB})
  assert sparse_lm.settings("small", "t5") == ("small",
                                                sparse_lm.SCALES["small"])
  assert sparse_lm.settings("paper", "small")[0] == "paper"
  with pytest.raises(ValueError, match="--vocab='bpe'"):
    sparse_lm.settings("small", "bpe")
  vocab = {"path": "/v/spm8000.model", "model_vocab_size": 8192}
  c = sparse_lm.run_config("switch", "small", (1, 1), shared, vocab=vocab,
                           seed=2)
  assert c.data.vocab_path == "/v/spm8000.model"
  assert c.model.vocab_size == 8192 and c.seed == 2
  assert c.data.text_layout == "wikitext"
  assert c.batch_size == sparse_lm.SMALL_VOCAB["batch_size"]
  assert c.num_train_steps == sparse_lm.SMALL_VOCAB["steps"]
  assert sparse_lm.run_config("switch", "small", (1, 1), shared, vocab=vocab,
                              steps=40).eval_every == 40 // 5
  t5 = sparse_lm.run_config("switch", "small", (1, 1), shared)
  assert t5.model.vocab_size == 32128 and t5.num_train_steps == 250
  assert t5.data.text_layout == "lines"
  assert (c.model.d_model, c.model.d_ffn, c.model.num_heads,
          c.model.moe.expert_d_ffn) == (128, 512, 2, 512)
  # Only the widths, the data's vocabulary and layout, the budget and the
  # seed differ.
  for cfg in (c, t5):
    cfg.model.vocab_size = cfg.seed = cfg.model.d_model = cfg.model.d_ffn = 0
    cfg.model.num_heads = cfg.model.moe.expert_d_ffn = 0
    cfg.data.vocab_path = ""
    cfg.data.text_layout = "lines"
    cfg.batch_size = cfg.eval_batch_size = cfg.num_train_steps = 0
    cfg.eval_every = cfg.log_every = cfg.checkpoint_every = 0
    cfg.warmup_steps = 0
  assert c.to_dict() == t5.to_dict()
  with pytest.raises(ValueError, match="for --scale=small"):
    sparse_lm.train_config(sparse_lm.model_config("gmlp", "paper", (1, 0)),
                           "paper", shared, vocab=vocab)


def test_tune_carves_c4_documents_and_scores_seeds_on_wikitext(
    shared, tmp_path, monkeypatch):
  # --tune's wiring, the trainer replaced: the two C4 samples joined and
  # every 10th document carved; search runs score on it once at the end,
  # the seeds train on the rest at their model's choice.
  import argparse  # pylint: disable=g-import-not-at-top
  import json  # pylint: disable=g-import-not-at-top
  from hypermixer_jax import experiment  # pylint: disable=g-import-not-at-top
  from hypermixer_jax.experiment import selection  # pylint: disable=g-import-not-at-top
  for i, f in enumerate(("c4_en_tfds_minimal_train_1000.jsonl",
                         "c4_en_train_00000_first1000.jsonl")):
    (shared / "c4" / f).write_text("".join(
        json.dumps({"text": f"doc {i}-{j}"}) + "\n" for j in range(15)))
  seen = []

  def fake_train(c, workdir):
    seen.append((c.seed, c.data.local_files.train,
                 c.data.local_files.validation, c.eval_every,
                 c.learning_rate, c.model.get("token_mixer"),
                 c.num_train_steps, c.warmup_steps))
    # The Transformer is best at the larger rate, sMLP at the smaller; at
    # 25 steps the Transformer is far above any bar.
    best = 3e-3 if c.model.token_mixer == "attention" else 1e-3
    short = c.num_train_steps == 25 and c.model.token_mixer == "attention"
    return {"eval": {"perplexity": 1e4 if short else 100 + 1e4 * abs(
        c.learning_rate - best) + c.seed}}
  monkeypatch.setattr(sparse_lm.experiment, "train", fake_train)
  monkeypatch.setattr(sparse_lm, "run_summary", lambda r, t: {})
  monkeypatch.setattr(sparse_lm, "heldout_last80", lambda c, w: {})
  monkeypatch.setattr(sparse_lm, "lm_baselines", lambda c: {
      "train": c.data.local_files.train, "scored": c.data.local_files.validation
      if c.eval_split == "validation" else None, "all": {"unigram": 1000.0}})
  exp = experiment.Experiment(tmp_path / "out",
                              argparse.Namespace(report_only=False))

  def config(name, depth, seed=0, length=50):
    return sparse_lm.run_config(name, "small", depth, shared, seed=seed,
                                steps=length)
  plan = {"smlp_deterministic": {"depth": [1, 1]},
          "switch": {"depth": [1, 1]}}
  split, searched, chosen, runs, base = sparse_lm.tune(
      exp, plan, [0, 1], "b", config, 16 * 128, (1e-3, 3e-3))
  joined = (pathlib.Path(split["train"]["path"]).parent / "c4_sample.jsonl")
  assert joined.read_text().count("\n") == 30
  assert (split["validation"]["documents"], split["train"]["documents"]) == (
      3, 27)
  assert "doc 0-0" in pathlib.Path(split["validation"]["path"]).read_text()
  assert base["train"] == split["train"]["path"]
  wiki = str(shared / "wikitext-2-raw/wiki.valid.raw")
  select = [s for s in seen if s[0] == selection.SEED]
  assert len(select) == 8 and all(
      s[1] == split["train"]["path"] and s[2] == split["validation"]["path"]
      and s[3] == 50 for s in select)
  assert {m: c["lr"] for m, c in chosen.items()} == {
      "smlp_deterministic": 1e-3, "switch": 3e-3}
  final = [s for s in seen if s[0] != selection.SEED]
  assert [(s[0], s[1], s[2], s[4]) for s in final] == [
      (0, split["train"]["path"], wiki, 1e-3),
      (1, split["train"]["path"], wiki, 1e-3),
      (0, split["train"]["path"], wiki, 3e-3),
      (1, split["train"]["path"], wiki, 3e-3)]
  assert [r["setting"]["lr"] for r in runs["switch"]] == [3e-3, 3e-3]

  # --budget_check=25: each choice trained 25 steps on the carved train part
  # (seed 100, its warm-up share), scored on the carved documents, whose
  # baselines set the bar (0.6 x unigram); the rule picks the 50 used.
  seen.clear()
  scores, vbase = sparse_lm.length_check(
      exp, plan, (split, searched, chosen, runs, base), [25], config, "b")
  assert sorted((s[4], s[6], s[7]) for s in seen) == [
      (1e-3, 25, 1), (3e-3, 25, 1)]
  assert all(s[0] == selection.SEED and s[2] == split["validation"]["path"]
             for s in seen)
  assert vbase["scored"] == split["validation"]["path"]
  # Each length run records the dispatch, decay rule and carve, as the
  # search's.
  tag = sparse_lm.run_tag(split)
  assert tag["carved_validation_sha256"] == split["validation"]["sha256"]
  assert {k: v for k, v in exp.runs["b/budget/steps=25/model=switch"].items()
          if k in tag} == tag
  assert scores == {25: {"smlp_deterministic": 200.0, "switch": 1e4},
                    50: {"smlp_deterministic": 200.0, "switch": 200.0}}
  section = selection.length_section(scores, 600.0, "0.6 x unigram", list(
      plan), 50, {"smlp_deterministic": "sMLP", "switch": "Switch"})
  assert "the rule picks 50 steps, the length used: confirmed" in section
  assert "| Switch | 10000.0 | 200.0 |" in section
  assert selection.shortest_length(scores, 1e5, list(plan)) == 25
  assert selection.shortest_length(scores, 150.0, list(plan)) is None
