"""experiments/mlm_perplexity.py: the paper's setting, matched sizes, one
held-out set for every model, the table, and a toy run end to end."""
import json
import math
import sys

import flax.linen as nn
import jax
import matplotlib.image
import ml_collections
import pytest

from hypermixer_jax import experiment
from hypermixer_jax.experiment import mlm
from hypermixer_jax.models import common
from hypermixer_jax.models import zoo

import script_modules

mlm_perplexity = script_modules.load("experiments/mlm_perplexity.py")


# The tests count the same paper-size and small models again (mlm.params
# counts each twice): each config is traced once for the module.
pytestmark = pytest.mark.usefixtures("models_traced_once")


def test_paper_scale_is_the_papers_setting():
  cfgs = mlm.model_configs("paper")
  bert, gmlp, amlp = cfgs["attention"], cfgs["gmlp"], cfgs["amlp"]
  assert (bert.block, bert.position_embeddings, bert.num_layers,
          bert.d_model, bert.d_ffn, bert.mixer_kwargs.num_heads) == (
              "post_ln", "learned", 12, 768, 3072, 12)
  for m in (gmlp, amlp):
    assert (m.block, m.position_embeddings, m.num_layers, m.d_model,
            m.d_ffn) == ("gmlp", "none", 36, 512, 3072)
    assert m.mixer_kwargs.toeplitz is True
  assert "tiny_attention_dim" not in gmlp.mixer_kwargs
  assert amlp.mixer_kwargs.tiny_attention_dim == 64
  # The paper's capacities: BERT-base 110M, gMLP 36 layers 102M.
  assert abs(mlm.params(bert)["total"] / 110e6 - 1) < 0.01
  assert abs(mlm.params(gmlp)["total"] / 102e6 - 1) < 0.01
  c = mlm.train_config(gmlp, "paper", None)
  assert (c.batch_size, c.num_train_steps, c.learning_rate, c.warmup_steps,
          c.decay, c.b1, c.b2, c.data.seq_len) == (
              2048, 125_000, 7e-4, 10_000, "linear", 0.9, 0.999, 128)
  assert c.data.task == "c4_mlm" and c.data.mlm.select_rate == 0.15
  assert not any(c.data.local_files.values())     # full C4 through TFDS


def test_built_models_have_what_the_configs_say():
  """gMLP: no position table, a Toeplitz kernel of 2N - 1 weights per layer;
  aMLP: a single head of 64; BERT: learned positions."""
  names = {}
  for mixer, m in mlm.model_configs("small").items():
    params = nn.unbox(zoo.abstract_variables(m)["params"])
    flat = {common.path_str(k): v.shape
            for k, v in jax.tree_util.tree_leaves_with_path(params)}
    names[mixer] = flat
  assert any("pos_embedding" in k for k in names["attention"])
  for mixer in ("gmlp", "amlp"):
    assert not any("pos_embedding" in k for k in names[mixer])
    kernels = [v for k, v in names[mixer].items()
               if k.endswith("spatial/kernel")]
    assert kernels == [(2 * 128 - 1,)] * 6
  qkv = [v for k, v in names["amlp"].items()
         if "tiny_attention/qkv" in k and k.endswith("kernel")]
  assert qkv == [(128, 3 * 64)] * 6
  assert not any("tiny_attention" in k for k in names["gmlp"])


def test_small_models_have_equal_capacity():
  p = {m: mlm.params(c) for m, c in mlm.model_configs("small").items()}
  for mixer in ("gmlp", "amlp"):
    for kind in ("total", "non_embedding"):
      assert abs(p[mixer][kind] / p["attention"][kind] - 1) < 0.05, (
          mixer, kind, p)


@pytest.mark.slow
def test_match_finds_the_nearest_d_ffn():
  """Against a brute-force search over every multiple of 16 up to 256 (the
  count grows with d_ffn; the target lies near 112)."""
  m = mlm.model_config("amlp", d_model=32, num_layers=2, d_ffn=64,
                       seq_len=16)
  target = mlm.params(m)["total"] + 7_000
  got = mlm.match(m, target)

  def count(f):
    c = ml_collections.ConfigDict(m.to_dict())
    c.d_ffn = f
    return mlm.params(c)["total"]
  best = min(range(16, 257, 16), key=lambda f: abs(count(f) - target))
  assert got.d_ffn == best != m.d_ffn
  assert got.mixer_kwargs.tiny_attention_dim == 64


def test_unknown_model_is_refused():
  with pytest.raises(ValueError, match="mixer 'fnet'; this experiment "
                     "compares attention, gmlp, amlp"):
    mlm.model_config("fnet", d_model=32, num_layers=1, d_ffn=64, seq_len=16)


def _shared(tmp_path, shared_data, lines=400, c4_docs=None):
  """A shared folder with the real vocabulary and C4 sample (its first
  ``c4_docs`` documents; None: all) and the first ``lines`` lines of
  WikiText-2 validation."""
  root = tmp_path / "shared"
  (root / "wikitext-2-raw").mkdir(parents=True)
  (root / "t5_spm").symlink_to(shared_data / "t5_spm")
  if c4_docs is None:
    (root / "c4").symlink_to(shared_data / "c4")
  else:
    (root / "c4").mkdir()
    docs = (shared_data / mlm.C4_TRAIN).read_text(encoding="utf-8")
    (root / mlm.C4_TRAIN).write_text(
        "".join(docs.splitlines(keepends=True)[:c4_docs]), encoding="utf-8")
  text = (shared_data / mlm.WIKITEXT_VALID).read_text(encoding="utf-8")
  (root / mlm.WIKITEXT_VALID).write_text(
      "\n".join(text.split("\n")[:lines]) + "\n", encoding="utf-8")
  return root


def test_every_model_gets_the_same_held_out_set(shared_data, tmp_path):
  shared = _shared(tmp_path, shared_data)
  cfgs = {m: mlm.train_config(c, "small", shared)
          for m, c in mlm.model_configs("small").items()}
  for c in cfgs.values():
    assert c.data.text_layout == "wikitext" and c.eval_steps == 8
    assert c.data.local_files.validation.endswith("wiki.valid.raw")
    assert c.data.local_files.train.endswith(mlm.C4_TRAIN)
  sets = {m: mlm.held_out(c) for m, c in cfgs.items()}
  assert len({json.dumps(s, sort_keys=True) for s in sets.values()}) == 1
  s = sets["attention"]
  assert 0.14 * s["tokens"] < s["scored_tokens"] < 0.16 * s["tokens"]
  # The digest sees the masking: another seed masks other tokens.
  other = cfgs["gmlp"].copy_and_resolve_references()
  other.seed = 1
  assert mlm.held_out(other)["digest"] != s["digest"]
  # Only the model differs between the runs.
  a, g = (cfgs[m].to_dict() for m in ("attention", "gmlp"))
  assert a.pop("model") != g.pop("model") and a == g


def test_table_rows_put_the_paper_beside_ours():
  sizes = {m: {"model": c.to_dict(), "params": mlm.params(c)}
           for m, c in mlm.model_configs("paper").items()}
  runs = {"attention": [{"eval": {"perplexity": p}}
                        for p in (120., 122., 124.)],
          "gmlp": [{"eval": {"perplexity": p}} for p in (99., 100., 101.)]}
  base = {"unigram": 200.0, "bigram": 150.0, "bigram_k": 0.01}
  rows = {r[0]: r for r in mlm.table_rows(runs, sizes, base)}
  assert rows["BERT (Transformer)"][6] == "122.0 ± 2.0 (n=3)"
  assert rows["BERT (Transformer)"][7] == "0.61"        # 122 / 200
  assert rows["BERT (Transformer)"][9] == "4.26 (12 layers, 110M)"
  assert rows["gMLP"][1:4] == [36, 512, 3072]
  # The paper has gMLP above BERT; ours is below, by Welch's test.
  assert rows["gMLP"][8].startswith("disagrees: -22.0 [")
  assert rows["gMLP"][9] == "4.35 (36 layers, 102M)"
  assert rows["aMLP"][6] == "not run"
  assert rows["aMLP"][9] == "not in PAPERS.md"
  assert rows["bigram (add-0.01)"][6:8] == ["150.0", "0.75"]


@pytest.mark.slow
def test_toy_run_end_to_end(shared_data, tmp_path, monkeypatch):
  # 100 C4 documents: the baselines count an epoch of the training text.
  shared = _shared(tmp_path, shared_data, lines=60, c4_docs=100)
  monkeypatch.setattr(mlm, "SMALL", dict(
      mlm.SMALL, d_model=32, bert_d_ffn=64, mlp_layers=2, bert_layers=1,
      bert_heads=1, seq_len=32, batch_size=8, steps=4, warmup=1, evals=2,
      eval_batch_size=8))
  # One model: that every model is trained and scored on the same rows is
  # test_every_model_gets_the_same_held_out_set's, their matching and sizes
  # the tests above; the models not run keep their rows in the table.
  monkeypatch.setattr(mlm, "MODELS", ("attention",))
  out = tmp_path / "out"
  monkeypatch.setattr(sys, "argv", [
      "mlm_perplexity.py", "--scale=small", f"--out={out}", "--vocab=t5",
      "--seeds=0",
      f"--shared={shared}", f"--compilation_cache={tmp_path / 'cache'}"])
  mlm_perplexity.main()
  saved = json.loads((out / "results.json").read_text())
  base = saved["baselines"]["small/s4/vocab=t5/seed=0"]
  ho = base["held_out"]
  assert ho["rows"] == 8 * 8      # eval_batches x eval_batch_size
  assert base["scored_tokens"] == ho["scored_tokens"]
  assert base["unigram"] > 1 and base["bigram"] > 1 and base["bigram_k"] > 0
  for mixer in mlm.MODELS:
    run = saved["runs"][f"small/s4/vocab=t5/model={mixer}/seed=0"]
    assert run["held_out"] == ho
    assert sorted(run["eval_curve"], key=int) == ["2", "4"]
    ev = run["eval"]
    assert math.isclose(ev["perplexity"], math.exp(ev["loss"]), rel_tol=1e-5)
    assert ev["denominator"] == ho["scored_tokens"] if "denominator" in ev \
        else True
  table = (out / "table.md").read_text()
  assert "(small scale, 4 steps)" in table
  assert not list(out.glob("table_s*.md"))
  for text in ("BERT (Transformer)", "gMLP", "4.26 (12 layers",
               f"{ho['scored_tokens']:,} selected", "unigram (train counts"):
    assert text in table
  assert matplotlib.image.imread(str(out / "mlm_perplexity.png")).size


def test_another_budget_reports_beside_the_main_report(tmp_path):
  default = mlm.SMALL["steps"]
  assert mlm.report_names("small", default) == ("table", "mlm_perplexity")
  assert mlm.report_names("small", 3 * default) == (
      f"table_s{3 * default}", f"mlm_perplexity_s{3 * default}")
  assert mlm.report_names("paper", mlm.PAPER_SIZES["steps"])[0] == "table"
  # The harness writes the named table and leaves table.md alone.
  exp = experiment.Experiment(str(tmp_path), None)
  exp.write_table("main", "| a |", name="table")
  exp.write_table("longer", "| b |", "notes", name="table_s6000")
  assert (tmp_path / "table.md").read_text() == "## main\n\n| a |\n"
  assert (tmp_path / "table_s6000.md").read_text() == (
      "## longer\n\n| b |\n\nnotes\n")


def test_bert_diagnostics_change_one_choice_at_berts_size():
  cfgs = mlm.model_configs("small")
  bert = cfgs["attention"].to_dict()
  for name, change in mlm.DIAGNOSTICS.items():
    c = cfgs[name].to_dict()
    assert {k for k in c if c[k] != bert[k]} == set(change), name
    assert all(c[k] == v for k, v in change.items())
  p = {m: mlm.params(cfgs[m])["total"] for m in cfgs}
  assert p["attention_pre_ln"] == p["attention"]          # an LN moved
  # The learned [N, d] position table is gone.
  assert p["attention"] - p["attention_sinusoidal"] == (
      mlm.SMALL["seq_len"] * mlm.SMALL["d_model"])
  # A diagnostic's row: its perplexity and ratio, no verdict against BERT.
  sizes = {m: {"model": c.to_dict(), "params": mlm.params(c)}
           for m, c in cfgs.items()}
  runs = {"attention_pre_ln": [{"eval": {"perplexity": 300.0}}]}
  rows = {r[0]: r for r in mlm.table_rows(runs, sizes, {"unigram": 600.0,
                                                         "bigram": 500.0,
                                                         "bigram_k": 0.1})}
  row = rows["BERT, pre-LN blocks (diagnostic)"]
  assert row[6:9] == ["300.0 (n=1)", "0.50", ""]
  assert "BERT, sinusoidal positions (diagnostic)" not in rows


def test_depth_diagnostics_trade_ffn_width_for_layers_at_berts_size():
  cfgs = mlm.model_configs("small")
  bert = cfgs["attention"].to_dict()
  p_bert = mlm.params(cfgs["attention"])["total"]
  # 3 / 4 layers at d = 128: the FFN narrows to 256 / 128 (by hand: a
  # layer is 4 d^2 + 4 d attention, 2 d f + f + d FFN and 4 d of LN).
  for name, layers, d_ffn in (("attention_deeper", 3, 256),
                              ("attention_deepest", 4, 128)):
    c = cfgs[name].to_dict()
    assert {k for k in c if c[k] != bert[k]} == {"num_layers", "d_ffn"}
    assert (c["num_layers"], c["d_ffn"]) == (layers, d_ffn), name
    d = c["d_model"]
    layer = lambda f: 4 * d * d + 4 * d + 2 * d * f + f + d + 4 * d  # noqa
    assert (mlm.params(cfgs[name])["total"] - p_bert
            == layers * layer(d_ffn) - 2 * layer(bert["d_ffn"]))
    assert abs(mlm.params(cfgs[name])["total"] / p_bert - 1) < 0.005


def test_unknown_model_on_the_command_line_names_the_choices(
    tmp_path, monkeypatch):
  monkeypatch.setattr(sys, "argv", [
      "mlm_perplexity.py", "--models=attention,bert_pre", f"--out={tmp_path}"])
  with pytest.raises(SystemExit, match="--models: bert_pre unknown; the "
                     "models are attention, gmlp, amlp, attention_pre_ln, "
                     "attention_sinusoidal"):
    mlm_perplexity.main()
  assert not (tmp_path / "results.json").exists()
