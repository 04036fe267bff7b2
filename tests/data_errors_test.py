"""Clear errors for bad data configs, and the classification metrics."""
import numpy as np
import pytest

from hypermixer_jax import data
from hypermixer_jax.data import testing


@pytest.fixture(scope="module")
def vocab(tmp_path_factory):
  return testing.tiny_vocab(str(tmp_path_factory.mktemp("vocab")))


def _build(cfg, split="train"):
  return data.build_pipeline(cfg, split, batch_size=2, seed=0, repeat=False,
                             shuffle=False)


def _text_config(vocab, tmp_path, task="c4_mlm"):
  cfg = data.default_data_config()
  cfg.task = task
  cfg.vocab_path = vocab
  cfg.local_files = {"train": testing.write_corpus(str(tmp_path / "c4"))}
  return cfg


def test_missing_data_dir(vocab, tmp_path):
  cfg = _text_config(vocab, tmp_path)
  cfg.local_files = {}
  cfg.data_dir = str(tmp_path / "nowhere")
  with pytest.raises(FileNotFoundError, match="data_dir.*does not exist"):
    _build(cfg)


def test_missing_local_files(vocab, tmp_path):
  cfg = _text_config(vocab, tmp_path)
  cfg.local_files = {"train": str(tmp_path / "none-*.jsonl")}
  with pytest.raises(FileNotFoundError, match="matches no file"):
    _build(cfg)
  # A path without wildcards (which seqio lists as it is) is checked too,
  # at the build, for every format (evaluate reads no preflight).
  for name in ("dev_typo.tsv", "dev_typo.jsonl"):
    cfg.local_files = {"train": str(tmp_path / name)}
    with pytest.raises(FileNotFoundError, match=(
        rf"^data.local_files.train = '{tmp_path / name}': {tmp_path / name} "
        "does not exist; check the path.$")):
      _build(cfg)
  with pytest.raises(ValueError, match="no entry for split 'validation'"):
    _build(_text_config(vocab, tmp_path), "validation")
  # A configuration error main.py prints in one line (not a traceback).
  from hypermixer_jax.train import workdir as workdir_lib  # pylint: disable=g-import-not-at-top
  with pytest.raises(workdir_lib.user_errors()):
    _build(_text_config(vocab, tmp_path), "validation")


def test_local_files_of_no_data_are_named(vocab, tmp_path):
  # An empty (or blank) file gave StopIteration at the first batch.
  cfg = _text_config(vocab, tmp_path)
  for name, text in (("empty.jsonl", ""), ("blank.jsonl", "\n  \n")):
    (tmp_path / name).write_text(text)
    cfg.local_files = {"train": str(tmp_path / name)}
    with pytest.raises(data.DataError, match=(
        f"^--config.data.local_files.train: {tmp_path / name} holds no line "
        "of data \\(empty or blank\\); pass the file\\(s\\) of that split.$")):
      _build(cfg)
  # One file of data among empty ones reads.
  (tmp_path / "one.jsonl").write_text('{"text": "a b c d"}\n')
  cfg.local_files = {"train": f"{tmp_path / 'empty.jsonl'},"
                              f"{tmp_path / 'one.jsonl'}"}
  _build(cfg)


def test_unreadable_vocabulary(vocab, tmp_path):
  cfg = _text_config(vocab, tmp_path)
  cfg.vocab_path = str(tmp_path / "missing.model")
  with pytest.raises(FileNotFoundError, match="missing.model.*train_vocab"):
    _build(cfg)
  bad = tmp_path / "bad.model"
  bad.write_bytes(b"this is not a sentencepiece model")
  cfg.vocab_path = str(bad)
  with pytest.raises(ValueError, match="not a valid SentencePiece model"):
    _build(cfg)


@pytest.mark.parametrize("task,seq_len", [("c4_mlm", 7), ("glue_mnli", 4),
                                          ("glue_sst2", 2)])
def test_sequence_length_below_minimum(vocab, tmp_path, task, seq_len):
  cfg = _text_config(vocab, tmp_path, task)
  cfg.seq_len = seq_len
  with pytest.raises(ValueError, match=f"seq_len={seq_len} is below"):
    _build(cfg)


def test_bad_task_and_image_sizes(tmp_path):
  cfg = data.default_data_config()
  cfg.task = "glue_cola"
  with pytest.raises(ValueError, match="Unknown data.task"):
    _build(cfg)
  cfg.task = "imagenet_patches"
  cfg.image_size, cfg.patch_size = 30, 16
  with pytest.raises(ValueError, match="multiple of patch_size"):
    _build(cfg)


def test_packing_refused_for_classification(vocab, tmp_path):
  cfg = _text_config(vocab, tmp_path, "glue_mnli")
  path = str(tmp_path / "pairs.tsv")
  testing.write_pairs_tsv(path, 8)
  cfg.local_files = {"train": path}
  cfg.packing = True
  with pytest.raises(ValueError, match="Packing is not supported"):
    next(iter(_build(cfg)))


def test_metrics():
  labels = np.array([1, 0, 1, 1, 0, -1])
  preds = np.array([1, 1, 0, 1, 0, 1])
  # Labels -1 (hidden test labels) are ignored: 3 of 5 right.
  assert data.task_metrics("glue_sst2", preds, labels) == {"accuracy": 0.6}
  out = data.task_metrics("glue_qqp", np.eye(2)[preds], labels)  # logits
  tp, fp, fn = 2, 1, 1
  assert out["accuracy"] == 0.6
  np.testing.assert_allclose(out["f1"], 2 * tp / (2 * tp + fp + fn))


def test_gzip_shards_read_as_their_text(vocab, tmp_path):
  """allenai/c4's shards are gzip JSONL (c4-train.00000-of-01024.json.gz):
  read decompressed, the same batches as the plain files (a TSV too)."""
  import gzip  # pylint: disable=g-import-not-at-top
  import shutil  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  from hypermixer_jax.data.checks import DataError  # pylint: disable=g-import-not-at-top
  cfg = _text_config(vocab, tmp_path)
  zipped = tmp_path / "gz"
  zipped.mkdir()
  for i, plain in enumerate(sorted((tmp_path / "c4").glob("corpus-*.jsonl"))):
    with open(plain, "rb") as f, gzip.open(
        zipped / f"c4-train.{i:05d}-of-00002.json.gz", "wb") as g:
      shutil.copyfileobj(f, g)
  want = list(_build(cfg))
  cfg.local_files = {"train": str(zipped / "c4-train.*-of-00002.json.gz")}
  got = list(_build(cfg))
  assert len(got) == len(want) > 0
  for a, b in zip(got, want):
    for k in b:
      np.testing.assert_array_equal(a[k], b[k])
  # The vocabulary trainer reads them too; an empty .gz holds no data.
  from hypermixer_jax.data import train_vocab  # pylint: disable=g-import-not-at-top
  assert (list(train_vocab.iter_text(str(zipped / "*.json.gz")))
          == list(train_vocab.iter_text(str(tmp_path / "c4" / "*.jsonl"))))
  with gzip.open(zipped / "empty.json.gz", "wb"):
    pass
  cfg.local_files = {"train": str(zipped / "empty.json.gz")}
  with pytest.raises(DataError, match="holds no line of data"):
    _build(cfg)
  tsv = tmp_path / "pairs.tsv"
  testing.write_pairs_tsv(str(tsv), 6)
  with open(tsv, "rb") as f, gzip.open(str(tsv) + ".gz", "wb") as g:
    shutil.copyfileobj(f, g)
  pairs = _text_config(vocab, tmp_path, task="glue_mnli")
  batches = {}
  for name in ("pairs.tsv", "pairs.tsv.gz"):
    pairs.local_files = {"train": str(tmp_path / name)}
    batches[name] = list(_build(pairs))
  assert len(batches["pairs.tsv"]) == len(batches["pairs.tsv.gz"]) == 3
  for a, b in zip(batches["pairs.tsv"], batches["pairs.tsv.gz"]):
    for k in a:
      np.testing.assert_array_equal(a[k], b[k])


def test_image_rows_name_a_missing_file_and_resolve_from_the_tsv(tmp_path):
  """A row whose image does not exist is named in one line (was a TF
  traceback, or 'one of the files is corrupt' for .JPEG names); a name that
  starts with images/ is relative to the TSV's folder even when that folder
  has an images/ subfolder (was looked up under images/images/)."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  from hypermixer_jax.data.checks import DataError  # pylint: disable=g-import-not-at-top
  (tmp_path / "images").mkdir()
  pixels = np.full((8, 8, 3), 100, np.uint8)
  (tmp_path / "images" / "a.JPEG").write_bytes(
      tf.io.encode_jpeg(pixels).numpy())
  cfg = data.default_data_config()
  cfg.update(task="imagenet_patches", image_size=8, patch_size=4,
             num_classes=2, crop_fraction=1.0)
  tsv = tmp_path / "labels.tsv"
  tsv.write_text("filename\tclass_index\na.JPEG\t0\nimages/a.JPEG\t1\n")
  cfg.local_files.validation = str(tsv)
  assert [int(l) for b in _build(cfg, "validation") for l in b["label"]] == [
      0, 1]
  for name in ("missing.JPEG", "missing.jpg"):
    tsv.write_text(f"filename\tclass_index\n{name}\t0\n")
    with pytest.raises(DataError, match=(
        rf"{tmp_path}/images/{name} does not exist; fix its path in the TSV "
        r"that names it \(relative to the TSV's folder or its images/ "
        r"folder\) or drop its row.$")):
      list(_build(cfg, "validation"))


def test_empty_tsv_lines_are_skipped_and_an_unknown_format_named(
    vocab, tmp_path):
  """An empty line in a TSV (a trailing one, as editors leave) is no row, as
  Python's csv reads it; a line of tabs is a row of empty fields (named).
  A file of no known format stops in one line (main prints it, no
  traceback)."""
  from hypermixer_jax.data.checks import DataError  # pylint: disable=g-import-not-at-top
  from hypermixer_jax.train import workdir as workdir_lib  # pylint: disable=g-import-not-at-top
  cfg = _text_config(vocab, tmp_path, task="glue_sst2")
  tsv = tmp_path / "sst2.tsv"
  tsv.write_text("sentence\tlabel\na fine film\t1\n\nno good\t0\n\r\n\n")
  cfg.local_files = {"train": str(tsv)}
  labels = [int(l) for b in _build(cfg) for l in b["label"]]
  assert labels == [1, 0]
  tsv.write_text("sentence\tlabel\n\n\r\n")      # a header and empty lines
  with pytest.raises(DataError, match="a header line and no rows"):
    list(_build(cfg))
  tsv.write_text("sentence\tlabel\na fine film\t1\n\t\n")
  with pytest.raises(DataError, match=r"sst2.tsv:3: .*empty"):
    list(_build(cfg))
  cfg.local_files = {"train": str(tmp_path / "sst2.csv")}
  (tmp_path / "sst2.csv").write_text("sentence,label\n")
  with pytest.raises(workdir_lib.user_errors(), match=(
      r"Cannot tell the format of .*sst2.csv' from its extension")):
    _build(cfg)
