"""The real TFDS code paths of C4, GLUE/SNLI and ImageNet, under mock_data."""
import numpy as np
import pytest
import tensorflow_datasets as tfds

from hypermixer_jax import data
from hypermixer_jax.data import testing


@pytest.fixture(scope="module")
def vocab(tmp_path_factory):
  return testing.tiny_vocab(str(tmp_path_factory.mktemp("vocab")))


def _first(cfg, split, **kw):
  with tfds.testing.mock_data(num_examples=6,
                              policy=tfds.testing.MockPolicy.USE_CODE):
    p = data.build_pipeline(cfg, split, batch_size=3, seed=0, repeat=False,
                            shuffle=split == "train", **kw)
    return next(iter(p))


@pytest.mark.parametrize("task,packing", [("c4_mlm", True), ("c4_lm", False)])
def test_c4(vocab, task, packing):
  cfg = data.default_data_config()
  cfg.update(task=task, vocab_path=vocab, seq_len=16, packing=packing,
             shuffle_buffer_size=8)
  batch = _first(cfg, "train")
  # MLM also gives BERT's masked_lm_positions: 3 = ceil(0.15 * 16) slots.
  assert set(batch) == {"inputs", "targets", "weights", "segment_ids",
                        "positions"} | ({"masked_positions"}
                                        if task == "c4_mlm" else set())
  if task == "c4_mlm":
    assert batch["masked_positions"].shape == (3, 3)
  for k in ("inputs", "targets", "segment_ids", "positions"):
    assert batch[k].shape == (3, 16) and batch[k].dtype == np.int32
  assert batch["weights"].dtype == np.float32
  assert (batch["segment_ids"] > 0).any()


def test_c4_lm_rows_are_the_tfds_documents_tokenised(vocab):
  """The unshuffled validation rows are the mocked C4 documents in order,
  each tokenised by the SentencePiece model with EOS appended (cut at
  seq_len), and the inputs are the targets shifted right after a 0."""
  import seqio  # pylint: disable=g-import-not-at-top
  cfg = data.default_data_config()
  cfg.update(task="c4_lm", vocab_path=vocab, seq_len=16, packing=False)
  with tfds.testing.mock_data(num_examples=6,
                              policy=tfds.testing.MockPolicy.USE_CODE):
    batch = next(iter(data.build_pipeline(cfg, "validation", batch_size=3,
                                          seed=0, repeat=False,
                                          shuffle=False)))
    texts = [ex["text"].numpy().decode()
             for ex in tfds.load("c4/en", split="validation").take(3)]
  pieces = seqio.SentencePieceVocabulary(vocab)
  for row, text in enumerate(texts):
    want = (pieces.encode(text) + [1])[:16]               # EOS id 1
    n = len(want)
    np.testing.assert_array_equal(batch["targets"][row, :n], want)
    np.testing.assert_array_equal(batch["weights"][row, :n], 1.0)
    np.testing.assert_array_equal(batch["weights"][row, n:], 0.0)
    np.testing.assert_array_equal(batch["inputs"][row, :n],
                                  [0] + want[:n - 1])


@pytest.mark.parametrize("task,split,classes", [
    ("glue_sst2", "validation", 2), ("glue_mnli", "validation_mismatched", 3),
    ("glue_qnli", "train", 2), ("glue_qqp", "train", 2),
    ("glue_snli", "validation", 3)])
def test_glue(vocab, task, split, classes):
  cfg = data.default_data_config()
  cfg.update(task=task, vocab_path=vocab, seq_len=20)
  batch = _first(cfg, split)
  assert set(batch) == {"inputs", "token_type_ids", "segment_ids", "label"}
  assert batch["inputs"].shape == (3, 20) and batch["label"].shape == (3,)
  assert batch["label"].dtype == np.int32
  assert ((batch["label"] >= 0) & (batch["label"] < classes)).all()
  cls_id = 90 + 100 - 2  # <extra_id_1> of a 90-piece vocabulary
  np.testing.assert_array_equal(batch["inputs"][:, 0], cls_id)
  if task != "glue_sst2":
    assert (batch["token_type_ids"] == 1).any()


@pytest.mark.parametrize("split", ["train", "validation"])
def test_imagenet(split):
  cfg = data.default_data_config()
  cfg.update(task="imagenet_patches", image_size=32, patch_size=8,
             shuffle_buffer_size=8)
  batch = _first(cfg, split)
  assert batch["inputs"].shape == (3, 16, 8 * 8 * 3)
  assert batch["inputs"].dtype == np.float32
  assert batch["label"].dtype == np.int32
  assert np.isfinite(batch["inputs"]).all()


def test_tfds_train_split_slices_the_train_split(vocab):
  # mock_data ignores split slicing, so check what TFDS is asked to read.
  from hypermixer_jax.data import tasks  # pylint: disable=g-import-not-at-top
  cfg = data.default_data_config()
  cfg.update(task="glue_qnli", vocab_path=vocab, seq_len=20)
  loader = tasks.get_task(cfg).source.tfds_dataset
  assert loader._map_split("train") == "train"  # pylint: disable=protected-access
  cfg.tfds_train_split = "train[:10%]"
  sliced = tasks.get_task(cfg)
  assert sliced.source.tfds_dataset._map_split("train") == "train[:10%]"  # pylint: disable=protected-access
  assert sliced.source.tfds_dataset._map_split("validation") == "validation"  # pylint: disable=protected-access
  # A validation split carved from train (a hyperparameter search's): both
  # expressions are read, and the task's name differs from the plain one's.
  cfg.tfds_validation_split = "train[:1%]"
  carved = tasks.get_task(cfg)
  assert carved.source.tfds_dataset._map_split("validation") == "train[:1%]"  # pylint: disable=protected-access
  assert carved.source.tfds_dataset._map_split("train") == "train[:10%]"  # pylint: disable=protected-access
  assert len({sliced.name, carved.name, tasks.get_task(
      cfg.copy_and_resolve_references()).name}) == 2
  # Unset, an image task's name is the one it had before the fields.
  img = data.default_data_config()
  img.task = "imagenet_patches"
  assert tasks.get_task(img).name == "imagenet_patches"
  img.tfds_validation_split = "train[:1%]"
  assert tasks.get_task(img).source.tfds_dataset._map_split(  # pylint: disable=protected-access
      "validation") == "train[:1%]"
  assert tasks.get_task(img).name != "imagenet_patches"


def test_image_normalization_inception_is_the_releases_scaling():
  """The same images under both settings: ImageNet mean/std inputs mapped
  back to pixels and scaled by (x - 127.5) / 127.5 give the other's."""
  from hypermixer_jax.data import images  # pylint: disable=g-import-not-at-top
  cfg = data.default_data_config()
  cfg.update(task="imagenet_patches", image_size=16, patch_size=4,
             shuffle_buffer_size=8)
  assert cfg.image_normalization == "imagenet"
  imagenet = _first(cfg, "validation")["inputs"]           # [3, 16, 48]
  cfg.image_normalization = "inception"
  inception = _first(cfg, "validation")["inputs"]
  # Patches are flattened (row, column, channel): channel = index mod 3.
  pixels = (imagenet.reshape(3, 16, 16, 3) * np.array(images.STDDEV_RGB)
            + np.array(images.MEAN_RGB)) * 255
  np.testing.assert_allclose(inception.reshape(3, 16, 16, 3),
                             (pixels - 127.5) / 127.5, atol=1e-5)
  assert inception.min() >= -1 and inception.max() <= 1
  cfg.image_normalization = "inception_v3"
  with pytest.raises(ValueError, match="data.image_normalization="
                     "'inception_v3'; choose from \\('imagenet', "
                     "'inception'\\)"):
    _first(cfg, "validation")


def test_c4_from_the_real_tfds_directory(shared_data, tmp_path):
  """The TFDS path on real records: the shared c4/en 3.0.1 shards under
  ``data_dir/c4/en/3.0.1`` give the documents of their JSONL form,
  tokenised; the shard folder itself as data_dir is named in one
  line (TFDS's own error advised a download)."""
  import json  # pylint: disable=g-import-not-at-top
  import seqio  # pylint: disable=g-import-not-at-top
  shards = shared_data / "c4" / "tfds_c4_en_3.0.1_minimal"
  version = tmp_path / "c4" / "en" / "3.0.1"
  version.mkdir(parents=True)
  for f in shards.iterdir():
    (version / f.name).symlink_to(f)
  spm = str(shared_data / "t5_spm" / "sentencepiece.model")
  cfg = data.default_data_config()
  cfg.update(task="c4_lm", vocab_path=spm, seq_len=32, packing=False,
             data_dir=str(tmp_path))
  batch = next(iter(data.build_pipeline(cfg, "validation", batch_size=4,
                                        seed=0, repeat=False, shuffle=False)))
  lines = (shared_data / "c4" /
           "c4_en_tfds_minimal_validation_200.jsonl").read_text().splitlines()
  pieces = seqio.SentencePieceVocabulary(spm)
  assert len(lines) == 200
  # The first row starts a document of the file (TFDS interleaves the two
  # shards, so which one is TFDS's order); a long document goes on in the
  # next rows, cut at seq_len.
  docs = [pieces.encode(json.loads(line)["text"]) + [1] for line in lines]
  first = [d for d in docs if d[:32] == list(batch["targets"][0])]
  assert len(first) == 1 and len(first[0]) > 64
  np.testing.assert_array_equal(batch["targets"][1], first[0][32:64])
  cfg.data_dir = str(shards)
  with pytest.raises(data.DataError, match=(
      f"^--config.data.data_dir={shards}: TFDS finds no prepared "
      f"c4/en:3\\.\\*\\.\\* there \\(it read {shards}/c4/en/3.1.0/\\); point "
      "data_dir at the folder that holds c4/en/<version>/")):
    next(iter(data.build_pipeline(cfg, "validation", batch_size=4, seed=0,
                                  repeat=False, shuffle=False)))
