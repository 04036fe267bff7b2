"""Real text and images from ../shared/data through the pipelines."""
import csv
import json
import pathlib

import numpy as np
import pytest

from hypermixer_jax import data
from hypermixer_jax.data import vocab as vocab_lib


def _config(shared, task, files, **kw):
  cfg = data.default_data_config()
  cfg.update(task=task, vocab_path=str(shared / "t5_spm/sentencepiece.model"),
             **kw)
  cfg.local_files = files
  return cfg


def _batches(cfg, split, n, **kw):
  p = data.build_pipeline(cfg, split, seed=0, **{
      "batch_size": 16, "repeat": False, "shuffle": False, **kw})
  out = []
  for b in p:
    out.append(b)
    if len(out) == n:
      break
  return out


@pytest.mark.parametrize("packing", [False, True])
def test_c4_mlm_masking_rates(shared_data, packing):
  cfg = _config(shared_data, "c4_mlm",
                {"train": str(shared_data / "c4/c4_en_train_00000_first1000.jsonl")},
                seq_len=128, packing=packing, shuffle_buffer_size=256)
  batches = _batches(cfg, "train", 8, shuffle=True)
  ids = vocab_lib.special_ids(vocab_lib.get_vocabulary(cfg.vocab_path, 100))
  inputs, targets, weights, seg, pos = (
      np.concatenate([b[k] for b in batches]) for k in
      ("inputs", "targets", "weights", "segment_ids", "positions"))
  assert inputs.shape == (128, 128) and inputs.dtype == np.int32
  assert weights.dtype == np.float32
  real = seg > 0
  sel = weights > 0
  assert not (sel & ~real).any()  # never on padding
  assert abs(sel.sum() / real.sum() - 0.15) < 0.01
  masked = (inputs == ids.mask) & sel
  kept = (inputs == targets) & sel
  replaced = sel & ~masked & ~kept
  assert abs(masked.sum() / sel.sum() - 0.8) < 0.03
  assert abs(kept.sum() / sel.sum() - 0.1) < 0.03
  assert abs(replaced.sum() / sel.sum() - 0.1) < 0.03
  assert (inputs[real & ~sel] == targets[real & ~sel]).all()
  assert (inputs[replaced] < ids.num_regular).all()
  # Positions restart at 0 in every segment.
  starts = np.diff(np.pad(seg, ((0, 0), (1, 0))), axis=1) != 0
  assert (pos[starts & real] == 0).all()
  if packing:
    assert seg.max() > 1
    assert real.mean() > 0.85  # seqio packs greedily, not perfectly


def test_c4_lm_targets_are_next_tokens(shared_data):
  cfg = _config(shared_data, "c4_lm",
                {"validation": str(shared_data / "c4/c4_en_train_00000_first1000.jsonl")},
                seq_len=64, packing=True)
  b = _batches(cfg, "validation", 1)[0]
  same = (b["segment_ids"][:, 1:] == b["segment_ids"][:, :-1]) & (
      b["segment_ids"][:, 1:] > 0)
  np.testing.assert_array_equal(b["inputs"][:, 1:][same],
                                b["targets"][:, :-1][same])
  np.testing.assert_array_equal(b["weights"], b["segment_ids"] > 0)
  assert (b["targets"] == 1).any()  # EOS closes each document


def _tsv_labels(path, column):
  with open(path) as f:
    return [r[column] for r in csv.DictReader(f, delimiter="\t",
                                              quoting=csv.QUOTE_NONE)]


@pytest.mark.parametrize("task,path,names", [
    ("glue_sst2", "glue/SST-2/dev.tsv", None),
    ("glue_qnli", "glue/QNLI/dev.tsv", ("entailment", "not_entailment")),
    ("glue_mnli", "nli/mnli_dev_matched.jsonl",
     ("entailment", "neutral", "contradiction")),
    ("glue_snli", "nli/snli_dev.jsonl",
     ("entailment", "neutral", "contradiction"))])
def test_glue_labels_and_pairs(shared_data, task, path, names):
  cfg = _config(shared_data, task, {"validation": str(shared_data / path)},
                seq_len=64)
  batches = _batches(cfg, "validation", 4)
  labels = np.concatenate([b["label"] for b in batches])
  if path.endswith(".tsv"):
    raw = _tsv_labels(shared_data / path, "label")
  else:
    raw = [json.loads(l)["label"] for l in open(shared_data / path)]
  expected = [int(r) if names is None else names.index(r) for r in raw[:64]]
  np.testing.assert_array_equal(labels, expected)
  ids = vocab_lib.special_ids(vocab_lib.get_vocabulary(cfg.vocab_path, 100))
  b = batches[0]
  assert b["inputs"].shape == (16, 64) and b["label"].dtype == np.int32
  assert (b["inputs"][:, 0] == ids.cls).all()
  n_sep = (b["inputs"] == ids.sep).sum(1)
  np.testing.assert_array_equal(n_sep, 1 if task == "glue_sst2" else 2)
  lengths = b["segment_ids"].sum(1)
  np.testing.assert_array_equal(b["inputs"][np.arange(16), lengths - 1],
                                ids.sep)
  if task != "glue_sst2":  # type 1 from just after the first [SEP]
    first_sep = np.argmax(b["inputs"] == ids.sep, axis=1)
    np.testing.assert_array_equal(b["token_type_ids"].sum(1),
                                  lengths - first_sep - 1)


def test_imagenet_sample(shared_data):
  labels_tsv = shared_data / "imagenet_sample/labels.tsv"
  cfg = data.default_data_config()
  cfg.update(task="imagenet_patches", image_size=224, patch_size=16)
  cfg.local_files = {"validation": str(labels_tsv), "train": str(labels_tsv)}
  b = _batches(cfg, "validation", 1, batch_size=8)[0]
  assert b["inputs"].shape == (8, 196, 768) and b["inputs"].dtype == np.float32
  expected = [int(x) for x in _tsv_labels(labels_tsv, "class_index")[:8]]
  np.testing.assert_array_equal(b["label"], expected)
  assert -2.2 < b["inputs"].min() and b["inputs"].max() < 2.7  # normalised
  train = _batches(cfg, "train", 1, batch_size=8, shuffle=True)[0]
  assert train["inputs"].shape == (8, 196, 768)


def test_train_vocab_on_wikitext(shared_data, tmp_path):
  from hypermixer_jax.data import train_vocab
  path = train_vocab.train(str(shared_data / "wikitext-2-raw/wiki.valid.raw"),
                           str(tmp_path / "wiki"), 500, max_sentences=800)
  cfg = _config(shared_data, "c4_lm",
                {"validation": str(shared_data / "wikitext-2-raw/wiki.test.raw")},
                seq_len=32)
  cfg.vocab_path = path
  b = _batches(cfg, "validation", 1, batch_size=4)[0]
  assert b["targets"].max() < 500 and b["inputs"].shape == (4, 32)
  # The same text in another folder gives the same bytes: the recorded
  # SHA-256 of an experiment's vocabulary reproduces wherever it is built.
  (tmp_path / "elsewhere").mkdir()
  again = train_vocab.train(
      str(shared_data / "wikitext-2-raw/wiki.valid.raw"),
      str(tmp_path / "elsewhere" / "wiki"), 500, max_sentences=800)
  assert pathlib.Path(again).read_bytes() == pathlib.Path(path).read_bytes()
  assert str(tmp_path) not in pathlib.Path(path).read_bytes().decode(
      "latin-1")
