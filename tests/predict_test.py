"""``--mode=predict``: a checkpoint and an input file in, JSONL out."""
import importlib.util
import json
import os

import flax.linen as nn
import jax
import numpy as np
import pytest

from hypermixer_jax import data as data_lib
from hypermixer_jax import models
from hypermixer_jax.train import artifacts
from hypermixer_jax.train import config_checks
from hypermixer_jax.train import run_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _load(name, arg):
  spec = importlib.util.spec_from_file_location(
      f"cfg_{name}", os.path.join(ROOT, "configs", f"{name}.py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config(arg)


def _tiny(config, shared_data):
  config.model.update(num_layers=1, d_model=16, d_ffn=32, max_len=24,
                      dropout_rate=0.0)
  config.model.mixer_kwargs.hyper_dim = 8
  config.data.seq_len = 24
  config.data.vocab_path = str(shared_data / "t5_spm" / "sentencepiece.model")
  config.eval_batch_size = 8
  return config


_INITIALISED = {}


def _write_random_checkpoint(config, path, seed=0):
  """Random parameters of ``config.model`` written to ``path``; the model
  and its parameters (built once per model config and seed for the module:
  several tests predict with the same one)."""
  key = (config.model.to_json(), seed)
  if key not in _INITIALISED:
    model = models.build_model(config.model)
    x = models.zoo.dummy_inputs(config.model, batch=1)
    _INITIALISED[key] = model, nn.unbox(jax.jit(model.init)(
        jax.random.key(seed), np.zeros(x.shape, x.dtype))["params"])
  model, params = _INITIALISED[key]
  artifacts.write_params(path, params, step=3)
  return model, params


def _apply(model, params, inputs, **kwargs):
  """The model applied directly, as one program (op by op, each of its
  operations would be compiled on its own)."""
  return jax.jit(model.apply)({"params": params}, inputs, **kwargs)


def _read(path):
  with open(path, encoding="utf-8") as f:
    return [json.loads(l) for l in f]


def test_classifier_predictions_match_the_model_on_the_eval_pipeline(
    tmp_path, shared_data):
  config = _tiny(_load("glue", "sst2,hypermixer"), shared_data)
  model, params = _write_random_checkpoint(config, tmp_path / "ckpt")
  # 11 sentences (not a multiple of the batch): the padded last batch.
  rows = open(shared_data / "glue" / "SST-2" / "dev.tsv",
              encoding="utf-8").read().splitlines()[:12]
  (tmp_path / "in.tsv").write_text("\n".join(rows) + "\n", encoding="utf-8")
  sentences = [r.split("\t")[0] for r in rows[1:]]
  (tmp_path / "in.txt").write_text("\n".join(sentences) + "\n",
                                   encoding="utf-8")
  n = artifacts.predict_file(config, str(tmp_path / "ckpt"),
                             str(tmp_path / "in.tsv"), str(tmp_path / "a.jsonl"))
  assert n == 11
  got = _read(tmp_path / "a.jsonl")
  assert [g["sentence"] for g in got] == sentences
  assert all(g["label"] in ("negative", "positive") for g in got)
  # Reference: the task's own evaluation pipeline on the same rows, and the
  # model applied directly.
  data = config.data
  data.local_files = {"validation": str(tmp_path / "in.tsv")}
  batch = next(iter(data_lib.build_pipeline(
      data, "validation", batch_size=16, seed=0, repeat=False, shuffle=False)))
  logits = _apply(model, params, batch["inputs"],
                  segment_ids=batch["segment_ids"],
                  token_type_ids=batch["token_type_ids"])
  want = np.asarray(jax.nn.softmax(logits))
  probs = np.array([[g["probabilities"]["negative"],
                     g["probabilities"]["positive"]] for g in got])
  np.testing.assert_allclose(probs, want, rtol=1e-5, atol=1e-6)
  assert [g["label_id"] for g in got] == list(want.argmax(-1))
  # A .txt of sentences gives the same predictions, and so does an export
  # of the checkpoint with the config read back from it (its own copy of
  # the vocabulary, found wherever the folder is moved).
  artifacts.export_params(config, str(tmp_path / "ckpt"),
                          str(tmp_path / "export"))
  (tmp_path / "export").rename(tmp_path / "moved")
  exported = run_config.get_config(str(tmp_path / "moved"))
  assert exported.data.vocab_path == str(tmp_path / "moved" / "vocab" /
                                         "sentencepiece.model")
  artifacts.predict_file(exported, str(tmp_path / "moved"),
                         str(tmp_path / "in.txt"), str(tmp_path / "b.jsonl"))
  assert [g["probabilities"] for g in _read(tmp_path / "b.jsonl")] == [
      g["probabilities"] for g in got]


def test_pair_task_txt_needs_two_fields(tmp_path, shared_data):
  config = _tiny(_load("glue", "qnli,hypermixer"), shared_data)
  _write_random_checkpoint(config, tmp_path / "ckpt")
  (tmp_path / "in.txt").write_text("what is it?\tit is a test.\nonly one\n",
                                   encoding="utf-8")
  with pytest.raises(ValueError, match=r"in.txt:2: 1 tab-separated field\(s\), "
                     "the task needs 2 \\(question, sentence\\)"):
    artifacts.predict_file(config, str(tmp_path / "ckpt"),
                           str(tmp_path / "in.txt"), str(tmp_path / "o.jsonl"))


def test_mlm_fills_masks(tmp_path, shared_data):
  config = _tiny(_load("c4_mlm", "hypermixer"), shared_data)
  model, params = _write_random_checkpoint(config, tmp_path / "ckpt")
  (tmp_path / "in.txt").write_text(
      "The capital of France is [MASK].\n[MASK] cats and [MASK] dogs\n",
      encoding="utf-8")
  n = artifacts.predict_file(config, str(tmp_path / "ckpt"),
                             str(tmp_path / "in.txt"), str(tmp_path / "o.jsonl"),
                             top_k=3)
  assert n == 2
  got = _read(tmp_path / "o.jsonl")
  assert [len(g["masks"]) for g in got] == [1, 2]
  vocab = data_lib.vocab.get_vocabulary(config.data.vocab_path)
  mask_id = data_lib.vocab.special_ids(vocab).mask
  # Reference: the whole sentence tokenized as training does, its word
  # (one piece) replaced by [MASK]; the model applied directly. (Encoded
  # alone, "." would gain SentencePiece's word-start marker.)
  whole, word = vocab.encode("The capital of France is Paris."), vocab.encode(
      "Paris")
  assert len(word) == 1 and vocab.encode(".") != whole[-1:]
  ids = [mask_id if i == word[0] else i for i in whole]
  x = np.zeros((1, 24), np.int32)
  x[0, :len(ids)] = ids
  seg = (np.arange(24) < len(ids)).astype(np.int32)[None]
  logits = _apply(model, params, x, segment_ids=seg)
  pos = ids.index(mask_id)
  p = np.asarray(jax.nn.softmax(logits[0, pos]))
  [mask] = got[0]["masks"]
  assert mask["position"] == pos
  assert [t["id"] for t in mask["top"]] == list(np.argsort(-p)[:3])
  np.testing.assert_allclose([t["probability"] for t in mask["top"]],
                             np.sort(p)[::-1][:3], rtol=1e-5)
  assert got[0]["filled"] == ("The capital of France is "
                              f"{mask['top'][0]['token']}.")
  assert MASK not in got[1]["filled"]


MASK = artifacts.MASK_MARKER


def test_unsupported_head_is_named(tmp_path):
  config = _load("default", "")
  with pytest.raises(config_checks.ConfigError) as e:
    artifacts.predict_file(config, str(tmp_path), "x.txt", "y.jsonl")
  assert str(e.value) == (
      "--mode=predict supports the heads classify, pair_classify, image, mlm, "
      "not model.head='regression' of this checkpoint; use --mode=evaluate "
      "for its metrics.")


@pytest.mark.parametrize("name", ["existing", "new/"])
def test_an_output_folder_is_refused_before_the_checkpoint_is_read(
    tmp_path, shared_data, name):
  config = _tiny(_load("glue", "sst2,hypermixer"), shared_data)
  (tmp_path / "existing").mkdir()
  (tmp_path / "in.txt").write_text("one\n", encoding="utf-8")
  out = f"{tmp_path}/{name}"
  with pytest.raises(config_checks.ConfigError, match=(
      rf"^--output={out} is a folder; predict writes one JSONL file: pass a "
      r"file's path \(e.g. predictions.jsonl\).$")):
    artifacts.predict_file(config, str(tmp_path / "no_checkpoint"),
                           str(tmp_path / "in.txt"), out)
  assert not (tmp_path / "new").exists()


def test_lines_stay_aligned_with_blank_truncated_and_unicode_lines(
    tmp_path, shared_data):
  """Output line k answers input line k: a blank line gives nulls and a
  reason, a line longer than data.seq_len says so (checked against what the
  pipeline kept), non-ASCII text comes back as written."""
  config = _tiny(_load("glue", "sst2,hypermixer"), shared_data)
  model, params = _write_random_checkpoint(config, tmp_path / "ckpt")
  long = " ".join(["remarkably"] * 40)
  lines = ["a fine film", "", "déjà vu — ça marche ✓", long, "   ", "bad"]
  (tmp_path / "in.txt").write_text("\n".join(lines) + "\n", encoding="utf-8")
  n = artifacts.predict_file(config, str(tmp_path / "ckpt"),
                             str(tmp_path / "in.txt"),
                             str(tmp_path / "out" / "o.jsonl"))
  assert n == 4
  text = (tmp_path / "out" / "o.jsonl").read_text(encoding="utf-8")
  assert "déjà vu — ça marche ✓" in text and "\\u" not in text
  got = [json.loads(l) for l in text.splitlines()]
  assert [g["sentence"] for g in got] == [
      "a fine film", "", "déjà vu — ça marche ✓", long, "", "bad"]
  for k in (1, 4):
    assert got[k] == {"sentence": "", "label": None, "label_id": None,
                      "probabilities": None, "reason": "blank line"}
  # Reference: the task's pipeline on the non-blank lines; truncated means
  # the full row ([CLS] tokens [SEP]) is longer than what the pipeline kept.
  vocab = data_lib.vocab.get_vocabulary(config.data.vocab_path)
  kept = [l for l in lines if l.strip()]
  rows = tmp_path / "ref.tsv"
  rows.write_text("sentence\tlabel\n" + "".join(f"{l}\t0\n" for l in kept),
                  encoding="utf-8")
  data = config.data
  data.local_files = {"validation": str(rows)}
  batch = next(iter(data_lib.build_pipeline(
      data, "validation", batch_size=8, seed=0, repeat=False, shuffle=False)))
  real = batch["segment_ids"].sum(1)[:len(kept)]
  need = [len(vocab.encode(l)) + 2 for l in kept]
  assert list(real) == [min(k, 24) for k in need]
  predicted = [g for g in got if g["label"] is not None]
  assert [g["truncated"] for g in predicted] == [k > 24 for k in need] == [
      False, False, True, False]
  want = np.asarray(jax.nn.softmax(_apply(
      model, params, batch["inputs"], segment_ids=batch["segment_ids"],
      token_type_ids=batch["token_type_ids"])))[:len(kept)]
  np.testing.assert_allclose([[g["probabilities"]["negative"],
                               g["probabilities"]["positive"]]
                              for g in predicted], want, rtol=1e-5, atol=1e-6)


def test_tsv_and_jsonl_blank_rows_keep_their_place(tmp_path, shared_data):
  config = _tiny(_load("glue", "qnli,hypermixer"), shared_data)
  _write_random_checkpoint(config, tmp_path / "ckpt")
  (tmp_path / "in.tsv").write_text(
      "question\tsentence\nwhy?\tbecause.\n\nhow?\tlike so.\n",
      encoding="utf-8")
  (tmp_path / "in.jsonl").write_text(
      '{"question": "why?", "sentence": "because."}\n\n'
      '{"question": "how?", "sentence": "like so."}\n', encoding="utf-8")
  outs = []
  for name in ("in.tsv", "in.jsonl"):
    artifacts.predict_file(config, str(tmp_path / "ckpt"),
                           str(tmp_path / name), str(tmp_path / "o.jsonl"))
    outs.append(_read(tmp_path / "o.jsonl"))
  assert outs[0] == outs[1]
  assert [g["question"] for g in outs[0]] == ["why?", "", "how?"]
  assert outs[0][1]["reason"] == "blank line"


def test_mlm_lines_that_cannot_be_filled_keep_their_place(
    tmp_path, shared_data):
  config = _tiny(_load("c4_mlm", "hypermixer"), shared_data)
  _write_random_checkpoint(config, tmp_path / "ckpt")
  words = " ".join(["word"] * 30)
  lines = ["[MASK] is here", "", "no mark at all", f"a [MASK] then {words}",
           f"{words} and a late [MASK]", "deux [MASK] ✓"]
  (tmp_path / "in.txt").write_text("\n".join(lines) + "\n", encoding="utf-8")
  n = artifacts.predict_file(config, str(tmp_path / "ckpt"),
                             str(tmp_path / "in.txt"),
                             str(tmp_path / "o.jsonl"))
  got = _read(tmp_path / "o.jsonl")
  assert n == 3 and [g["text"] for g in got] == lines
  assert got[1] == {"text": "", "filled": None, "masks": None,
                    "reason": "blank line"}
  assert got[2]["reason"] == "no [MASK] to fill in"
  assert got[4]["masks"] is None and got[4]["reason"].endswith(
      "tokens and a [MASK] after data.seq_len=24")
  # Cut to seq_len, its mark inside: predicted, flagged.
  assert got[3]["truncated"] is True and len(got[3]["masks"]) == 1
  assert [got[k]["truncated"] for k in (0, 5)] == [False, False]
  assert got[5]["filled"].startswith("deux ") and "✓" in got[5]["filled"]


def test_no_partial_output_file(tmp_path, shared_data, monkeypatch):
  """A failure while writing leaves neither the output nor a temporary
  file; an earlier output stays as it was."""
  config = _tiny(_load("glue", "sst2,hypermixer"), shared_data)
  _write_random_checkpoint(config, tmp_path / "ckpt")
  (tmp_path / "in.txt").write_text("one\ntwo\nthree\n", encoding="utf-8")
  out = tmp_path / "out"
  out.mkdir()
  (out / "o.jsonl").write_text("earlier\n")
  calls = []
  real_dumps = json.dumps

  def failing_dumps(obj, **kwargs):
    # The output lines only (json is one module: Orbax's reads use it too).
    if kwargs.get("ensure_ascii") is False:
      calls.append(obj)
    if len(calls) == 2:
      raise OSError("disk full")
    return real_dumps(obj, **kwargs)

  monkeypatch.setattr(artifacts.json, "dumps", failing_dumps)
  with pytest.raises(OSError, match="disk full"):
    artifacts.predict_file(config, str(tmp_path / "ckpt"),
                           str(tmp_path / "in.txt"), str(out / "o.jsonl"))
  assert os.listdir(out) == ["o.jsonl"]
  assert (out / "o.jsonl").read_text() == "earlier\n"
