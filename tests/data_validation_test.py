"""Bad input data is refused with the file, line and value; never trained on.

Also: the tf.data JSON reader equals ``json.loads``, and a restored pipeline
does not re-read the examples before its position (O(1) restart).
"""
import json
import os

import numpy as np
import pytest
import tensorflow as tf

from hypermixer_jax import data
from hypermixer_jax.data import sources
from hypermixer_jax.data import testing

SHARED = os.environ.get("HYPERMIXER_SHARED_DATA", os.path.join(
    os.path.dirname(__file__), "..", "..", "shared", "data"))


@pytest.fixture(scope="module")
def vocab(tmp_path_factory):
  return testing.tiny_vocab(str(tmp_path_factory.mktemp("vocab")))


def _sst2(vocab, path, **kw):
  cfg = data.default_data_config()
  cfg.update(task="glue_sst2", vocab_path=vocab, seq_len=16, **kw)
  cfg.local_files.train = str(path)
  return cfg


def _read_all(cfg, batch_size=2):
  p = data.build_pipeline(cfg, "train", batch_size=batch_size, seed=0,
                          repeat=False, shuffle=False)
  return list(p)


def _raised(error, fn, match=None) -> BaseException:
  """What ``fn()`` raises (an ``error``), without its traceback.

  ``pytest.raises(...) as e`` keeps a cycle (the traceback holds the frame
  that holds ``e``) and with it the failed pipeline's tf.data iterator, until
  the garbage collector frees it; destroying an old autotuned iterator then
  waits for its model thread (measured: one collection of this module's
  leftovers stalled ~20 s of wall time with ~0 CPU). Dropped here, the
  iterator is freed at once.
  """
  with pytest.raises(error, match=match) as caught:
    fn()
  err = caught.value.with_traceback(None)
  del caught
  if isinstance(err, data.DataError):
    # The pipeline raises it without tf.data's error as its context, whose
    # traceback would keep the failed iterator alive in any caller.
    assert err.__context__ is None, repr(err.__context__)
  return err


def _write(path, text: str | bytes):
  mode = "wb" if isinstance(text, bytes) else "w"
  with open(path, mode) as f:
    f.write(text)
  return str(path)


SST2_ROWS = "sentence\tlabel\ngood film .\tpositive\nbad film .\tnegative\n"


def test_good_file_reads_every_row(vocab, tmp_path):
  path = _write(tmp_path / "ok.tsv", SST2_ROWS + "fine .\t1\nmeh .\t0\n")
  labels = np.concatenate([b["label"] for b in _read_all(_sst2(vocab, path))])
  np.testing.assert_array_equal(labels, [1, 0, 1, 0])


@pytest.mark.parametrize("value", ["positive_typo", "", "2", "-1"])
def test_unknown_label_names_file_line_value(vocab, tmp_path, value):
  path = _write(tmp_path / "train.tsv",
                SST2_ROWS + f"a typo .\t{value}\nlast .\tpositive\n")
  msg = str(_raised(data.DataError, lambda: _read_all(_sst2(vocab, path))))
  assert f"{path}:4: label '{value}' is not one of" in msg
  assert "negative, positive" in msg and "[0, 2)" in msg


def test_unlabelled_snli_rows_are_dropped_not_refused(vocab, tmp_path):
  rows = [{"premise": "a .", "hypothesis": "b .", "label": lab}
          for lab in ("neutral", "-", "entailment", -1)]
  path = _write(tmp_path / "snli.jsonl",
                "".join(json.dumps(r) + "\n" for r in rows))
  cfg = data.default_data_config()
  cfg.update(task="glue_snli", vocab_path=vocab, seq_len=16)
  cfg.local_files.train = path
  labels = np.concatenate([b["label"] for b in _read_all(cfg)])
  np.testing.assert_array_equal(labels, [1, 0])


@pytest.mark.parametrize("text, message", [
    ("", "the file is empty; a TSV needs a header line"),
    ("sentence\tlabel\n", "the file has a header line and no rows"),
    ("text\tlabel\nx\t0\n", ":1: no column 'sentence' in the header"),
    ("sentence\tlabel\nx\t0\ty\n", ":2: the row has 3 tab-separated fields"),
])
def test_empty_header_only_or_malformed_tsv(vocab, tmp_path, text, message):
  path = _write(tmp_path / "train.tsv", text)
  e = _raised(data.DataError, lambda: _read_all(_sst2(vocab, path)),
              match=message)
  assert path in str(e)


def test_non_utf8_bytes_name_file_and_line(vocab, tmp_path):
  path = _write(tmp_path / "latin1.tsv",
                SST2_ROWS.encode() + "caf\xe9 .\t1\n".encode("latin-1"))
  with pytest.raises(data.DataError,
                     match=f"{path}:4: the line is not valid UTF-8"):
    _read_all(_sst2(vocab, path))
  corpus = _write(tmp_path / "c4.jsonl", b'{"text": "ok"}\n{"text": "\xff"}\n')
  cfg = data.default_data_config()
  cfg.update(task="c4_mlm", vocab_path=vocab, seq_len=16)
  cfg.local_files.train = corpus
  with pytest.raises(data.DataError, match=f"{corpus}:2: the line is not"):
    _read_all(cfg)


def test_jsonl_without_the_field(vocab, tmp_path):
  corpus = _write(tmp_path / "c4.jsonl", '{"text": "ok"}\n{"txt": "x"}\n')
  cfg = data.default_data_config()
  cfg.update(task="c4_lm", vocab_path=vocab, seq_len=16)
  cfg.local_files.train = corpus
  with pytest.raises(data.DataError, match=f"{corpus}:2: no field 'text'"):
    _read_all(cfg)


def _jpeg(seed: int) -> bytes:
  image = np.random.default_rng(seed).integers(0, 255, (40, 48, 3), np.uint8)
  return tf.io.encode_jpeg(image).numpy()


@pytest.mark.parametrize("damage", ["truncated", "not_jpeg"])
def test_corrupt_jpeg_names_file_and_line(tmp_path, damage):
  os.makedirs(tmp_path / "images")
  good = _jpeg(0)
  bad = good[:len(good) // 2] if damage == "truncated" else b"GIF89a" + good
  for name, blob in (("a.JPEG", good), ("b.JPEG", bad)):
    _write(tmp_path / "images" / name, blob)
  labels = _write(tmp_path / "labels.tsv",
                  "filename\tclass_index\na.JPEG\t3\nb.JPEG\t5\n")
  cfg = data.default_data_config()
  cfg.update(task="imagenet_patches", image_size=32, patch_size=16)
  cfg.local_files.train = labels
  msg = str(_raised(data.DataError, lambda: _read_all(cfg)))
  assert f"{labels}:3 (" in msg and "b.JPEG" in msg
  assert "not a complete JPEG" in msg


def test_local_files_field_by_field_on_a_locked_config(tmp_path):
  cfg = data.default_data_config()
  cfg.lock()
  cfg.local_files.train = "/x/train.tsv"      # what --config...train=F does
  cfg.local_files.validation = "/x/dev.tsv"
  assert data.config.local_files(cfg) == {"train": "/x/train.tsv",
                                          "validation": "/x/dev.tsv"}
  with pytest.raises(AttributeError):
    cfg.local_files.trian = "/x/train.tsv"


JSON_CASES = ["plain", 'quote " and \\ backslash', "tab\tnew\nline\r\x08\x0c",
              "caf\u00e9 \u4e2d \U0001F600", "\\u0041 not an escape", "", "/"]


@pytest.mark.parametrize("ensure_ascii", [True, False])
def test_json_reader_equals_json_loads(tmp_path, ensure_ascii):
  lines = [json.dumps({"url": "u,\"text\": \"x\"", "text": t, "n": 3},
                      ensure_ascii=ensure_ascii) for t in JSON_CASES]
  lines.append('{"text":"a\\/b","x":[1,{"y":2}]}')
  path = _write(tmp_path / "j.jsonl", "\n".join(lines) + "\n")
  # (JSON_CASES holds an empty string: parsed here, not refused.)
  reader = sources.local_reader("jsonl", {"text": ("text",)},
                                allow_empty_inputs=True)
  got = [r["text"].decode() for r in reader(tf.constant(path))
         .as_numpy_iterator()]
  assert got == [json.loads(line)["text"] for line in lines]


def test_json_reader_on_real_c4():
  path = os.path.join(SHARED, "c4", "c4_en_train_00000_first1000.jsonl")
  if not os.path.exists(path):
    pytest.skip(f"shared data not found at {path} (set HYPERMIXER_SHARED_DATA)")
  reader = sources.local_reader("jsonl", {"text": ("text",)})
  got = [r["text"].decode() for r in reader(tf.constant(path))
         .as_numpy_iterator()]
  with open(path, encoding="utf-8") as f:
    assert got == [json.loads(line)["text"] for line in f if line.strip()]


def test_restore_does_not_reread_the_stream(vocab, tmp_path):
  """A restored pipeline seeks: the rows before its position are never read.

  After the state is taken, every row already consumed is overwritten (same
  byte length) with a label that would stop any reader that parsed it; the
  restored pipeline still yields the uninterrupted stream.
  """
  sentences = testing.sentences(120, seed=3, max_words=6)
  rows = [f"{s}\t{i % 2}\n" for i, s in enumerate(sentences)]
  path = _write(tmp_path / "train.tsv", "sentence\tlabel\n" + "".join(rows))
  cfg = _sst2(vocab, path, shuffle_buffer_size=8)
  kw = dict(batch_size=4, seed=5, repeat=True, shuffle=True)
  pipeline = data.build_pipeline(cfg, "train", **kw)
  it = iter(pipeline)
  for _ in range(20):   # 80 of 120 rows consumed, the buffer holds 8 more
    next(it)
  state = json.loads(json.dumps(pipeline.get_state()))
  expected = [next(it) for _ in range(12)]  # crosses into epoch 2
  assert state["batch"] == 20 and "iterator" in state
  poisoned = ["x" * (len(r) - 3) + "\t9\n" for r in rows[:60]]
  _write(path, "sentence\tlabel\n" + "".join(poisoned + rows[60:]))
  resumed = data.build_pipeline(cfg, "train", **kw)
  resumed.set_state(state)
  it = iter(resumed)
  got = [next(it) for _ in range(7)]    # the rest of epoch 1
  assert resumed.batches_replayed == 0
  for a, b in zip(expected, got):
    for k in a:
      np.testing.assert_array_equal(a[k], b[k])
  # Epoch 2 starts from the top of the file again, and reads the poison.
  with pytest.raises(data.DataError, match="label '9'"):
    for _ in range(5):
      next(it)


def _model_config(**kw):
  import ml_collections  # pylint: disable=g-import-not-at-top
  return ml_collections.ConfigDict({"vocab_size": 32128, "num_classes": 2,
                                    **kw})


def test_truncated_sentencepiece_model_is_refused(vocab, tmp_path):
  from sentencepiece import sentencepiece_model_pb2 as pb  # pylint: disable=g-import-not-at-top
  with open(vocab, "rb") as f:
    model = pb.ModelProto.FromString(f.read())
  # A file cut between two pieces: what SentencePiece accepts silently (the
  # T5 model's first 1,000 bytes load as 76 pieces).
  cut = _write(tmp_path / "cut.model", model.SerializeToString()[
      :sum(len(pb.ModelProto(pieces=[p]).SerializeToString())
           for p in model.pieces[:40])])
  import sentencepiece as spm  # pylint: disable=g-import-not-at-top
  assert spm.SentencePieceProcessor(model_file=cut).GetPieceSize() == 40
  cfg = _sst2(vocab, _write(tmp_path / "t.tsv", SST2_ROWS))
  cfg.vocab_path = cut
  with pytest.raises(ValueError, match="cut.model.*truncated or damaged"):
    data.check_fits_model(cfg, _model_config())
  with pytest.raises(ValueError, match="truncated or damaged"):
    _read_all(cfg)
  t5 = os.path.join(SHARED, "t5_spm", "sentencepiece.model")
  if os.path.exists(t5):
    with open(t5, "rb") as f:
      cfg.vocab_path = _write(tmp_path / "t5_1000.model", f.read()[:1000])
    with pytest.raises(ValueError, match="76 pieces.*truncated or damaged"):
      data.check_fits_model(cfg, _model_config())


def test_every_emitted_id_is_below_model_vocab_size(vocab, tmp_path):
  cfg = _sst2(vocab, _write(tmp_path / "t.tsv", SST2_ROWS))
  size = data.vocab.get_vocabulary(vocab, cfg.extra_ids).vocab_size  # 190
  data.check_fits_model(cfg, _model_config(vocab_size=size))
  with pytest.raises(ValueError, match=(
      rf"model.vocab_size={size - 1} is too small.*ids up to {size - 1}.*"
      r"\[MASK\]=.*--config.model.vocab_size=256")):
    data.check_fits_model(cfg, _model_config(vocab_size=size - 1))
  # What the pipeline emits is indeed below that size.
  ids = np.concatenate([b["inputs"].ravel() for b in _read_all(cfg)])
  assert ids.max() == size - 2  # [CLS]; [MASK] is size - 1
  with pytest.raises(ValueError, match="num_classes=2 but glue_mnli has 3"):
    cfg.task = "glue_mnli"
    data.check_fits_model(cfg, _model_config(num_classes=2))


def _corrupt_inside(blob: bytes) -> bytes:
  """Intact SOI/EOI markers and headers, garbage from the scan's start (so
  that any crop's decode reaches it)."""
  out = bytearray(blob)
  for i in range(blob.index(b"\xff\xda") + 16, len(out) - 2):
    out[i] = 0xFF if i % 7 == 0 else out[i] ^ 0x5A
  return bytes(out)


def _image_cfg(labels, **kw):
  cfg = data.default_data_config()
  cfg.update(task="imagenet_patches", image_size=32, patch_size=16, **kw)
  cfg.local_files.train = cfg.local_files.validation = labels
  return cfg


@pytest.mark.parametrize("split", ["train", "validation"])
def test_jpeg_corrupt_inside_names_file_and_line(tmp_path, split):
  bad = _corrupt_inside(_jpeg(1))
  with pytest.raises(tf.errors.InvalidArgumentError):
    tf.io.decode_jpeg(bad)  # the decoder itself refuses it
  os.makedirs(tmp_path / "images")
  rows = ["filename\tclass_index"]
  # 70 rows: the bad one sits in the second decode group.
  for i in range(70):
    _write(tmp_path / "images" / f"{i}.jpg", bad if i == 66 else _jpeg(i))
    rows.append(f"{i}.jpg\t{i % 5}")
  labels = _write(tmp_path / "labels.tsv", "\n".join(rows) + "\n")
  cfg = _image_cfg(labels)
  msg = str(_raised(data.DataError, lambda: list(data.build_pipeline(
      cfg, split, batch_size=4, seed=0, repeat=False, shuffle=False))))
  assert msg.startswith(f"{labels}:68 (") and "66.jpg" in msg, msg
  assert "image decoder fails on this file" in msg and "drop its row" in msg


def test_good_images_all_decode_in_order(tmp_path):
  # The guarded decode keeps every example and its order (labels 0..69).
  os.makedirs(tmp_path / "images")
  rows = ["filename\tclass_index"]
  for i in range(70):
    _write(tmp_path / "images" / f"{i}.jpg", _jpeg(i))
    rows.append(f"{i}.jpg\t{i % 7}")
  cfg = _image_cfg(_write(tmp_path / "labels.tsv", "\n".join(rows) + "\n"))
  batches = list(data.build_pipeline(cfg, "validation", batch_size=8, seed=0,
                                     repeat=False, shuffle=False))
  labels = np.concatenate([b["label"] for b in batches])
  np.testing.assert_array_equal(labels, np.arange(70) % 7)


def test_tfds_record_named_when_its_image_fails():
  # The TFDS path: the record's file_name (after the prefix) is the source.
  from hypermixer_jax.data import images
  good = _jpeg(0)
  ds = tf.data.Dataset.from_tensor_slices({
      "image": [good, _corrupt_inside(good), good],
      "label": tf.constant([1, 2, 3], tf.int64),
      "source": ["n01_1.JPEG", "n01_2.JPEG", "n01_3.JPEG"]})
  out = images.preprocess(ds, train=False, image_size=32, patch_size=16,
                          min_crop_area=0.08, crop_fraction=1.0,
                          num_classes=10,
                          source_prefix="TFDS imagenet2012 file_name=")
  err = sources.data_error_from(
      _raised(tf.errors.InvalidArgumentError, lambda: list(out)))
  assert str(err).startswith("TFDS imagenet2012 file_name=n01_2.JPEG: the "
                             "image decoder fails"), err
  # And a TFDS label outside [0, num_classes).
  out = images.preprocess(ds.take(1).map(lambda ex: {**ex, "label": ex[
      "label"] + 9}), train=False, image_size=32, patch_size=16,
                          min_crop_area=0.08, crop_fraction=1.0,
                          num_classes=10, source_prefix="TFDS x file_name=")
  assert str(sources.data_error_from(_raised(
      tf.errors.InvalidArgumentError, lambda: list(out)))).startswith(
      "TFDS x file_name=n01_1.JPEG: class index 10 is not in [0, 10)")


@pytest.mark.parametrize("value", ["10", "-1", "cat", "3.5", ""])
def test_class_index_outside_num_classes_names_file_line(tmp_path, value):
  os.makedirs(tmp_path / "images")
  for i in range(3):
    _write(tmp_path / "images" / f"{i}.jpg", _jpeg(i))
  labels = _write(tmp_path / "labels.tsv", "filename\tclass_index\n"
                  f"0.jpg\t9\n1.jpg\t{value}\n2.jpg\t0\n")
  cfg = _image_cfg(labels, num_classes=10)
  e = _raised(data.DataError, lambda: list(data.build_pipeline(
      cfg, "train", batch_size=1, seed=0, repeat=False, shuffle=False)))
  assert str(e) == (
      f"{labels}:3: class index '{value}' is not an integer in [0, 10) "
      "(data.num_classes=10); fix the row, or if the data has more classes "
      "set --config.data.num_classes and --config.model.num_classes.")


def test_model_num_classes_below_data_num_classes_stops_at_start():
  from hypermixer_jax import models
  cfg = data.default_data_config()
  cfg.update(task="imagenet_patches", num_classes=1000)
  model = models.get_model_config("mixer_cifar")  # 10 classes
  with pytest.raises(ValueError) as e:
    data.check_fits_model(cfg, model)
  assert ("model.num_classes=10 is below data.num_classes=1000" in str(e.value)
          and "--config.model.num_classes=1000" in str(e.value))
  cfg.num_classes = 10
  data.check_fits_model(cfg, model)  # equal: fine


def test_evaluation_image_is_the_centre_crop_normalised_in_patch_order():
  """A 40x48 JPEG, evaluated at 16x16 with crop_fraction 16/40 (the shorter
  side already 16 / crop_fraction: no resampling): rows 12-27 and columns
  16-31 of the decoded image, (x / 255 - mean) / std, cut into 8x8 patches
  row by row, each patch's pixels row by row with their 3 channels."""
  from hypermixer_jax.data import images
  blob = _jpeg(5)
  ds = tf.data.Dataset.from_tensor_slices({
      "image": [blob], "label": tf.constant([3], tf.int64),
      "source": ["x.jpg"]})
  out = next(iter(images.preprocess(
      ds, train=False, image_size=16, patch_size=8, min_crop_area=1.0,
      crop_fraction=16 / 40, num_classes=10)))
  pixels = tf.io.decode_jpeg(blob, channels=3).numpy().astype(np.float64)
  crop = (pixels[12:28, 16:32] / 255 - np.array(images.MEAN_RGB)) / np.array(
      images.STDDEV_RGB)
  want = np.stack([crop[r * 8:(r + 1) * 8, c * 8:(c + 1) * 8].reshape(-1)
                   for r in range(2) for c in range(2)])
  assert out["inputs"].shape == (4, 8 * 8 * 3)
  np.testing.assert_allclose(out["inputs"].numpy(), want, rtol=1e-5,
                             atol=1e-4)
  assert int(out["label"]) == 3
