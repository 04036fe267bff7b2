"""The experiments' vocabulary store: one committed copy of each vocabulary,
by digest, that a study restores instead of training a different one."""
import argparse
import hashlib
import json
import lzma
import pathlib

import pytest

from hypermixer_jax import experiment
from hypermixer_jax.data import testing
from hypermixer_jax.data import train_vocab
from hypermixer_jax.experiment import vocab as vocab_lib


@pytest.fixture(scope="module")
def built(tmp_path_factory):
  """A study that built its vocabulary: (results root, text, its record)."""
  root = tmp_path_factory.mktemp("results")
  text = root.parent / "train.txt"
  text.write_text("\n".join(testing.sentences(300)) + "\n")
  exp = experiment.Experiment(root / "study",
                              argparse.Namespace(report_only=False))
  vocab = exp.vocab(str(text), ("text",), 60, trained_on="train.txt")
  return root, text, vocab


def _no_training(monkeypatch):
  def refuse(*args, **kwargs):
    raise AssertionError("trained a vocabulary the store holds")
  monkeypatch.setattr(train_vocab, "train", refuse)


def test_the_store_holds_one_compressed_copy_named_by_its_digest(built):
  root, _, vocab = built
  stored = list((root / "vocab").iterdir())
  assert [p.name for p in stored] == [vocab["sha256"][:16] + ".model.xz"]
  raw = lzma.decompress(stored[0].read_bytes())
  assert hashlib.sha256(raw).hexdigest() == vocab["sha256"]
  assert raw == pathlib.Path(vocab["path"]).read_bytes()
  record = json.loads((root / "study" / "results.json").read_text())["vocab"]
  assert record == dict(pieces=60, sha256=vocab["sha256"],
                        model_vocab_size=256,
                        stored=f"../vocab/{stored[0].name}",
                        trained_on="train.txt")
  assert (root / "study" / record["stored"]).resolve() == stored[0].resolve()


def test_a_study_restores_its_recorded_vocabulary(built, monkeypatch):
  root, text, vocab = built
  working = pathlib.Path(vocab["path"])
  working.unlink()                       # a fresh checkout has no copy
  _no_training(monkeypatch)
  again = experiment.Experiment(root / "study").vocab(
      str(text), ("text",), 60, trained_on="train.txt")
  assert again == vocab and working.exists()
  # A second study that uses the same vocabulary shares the stored copy.
  other = vocab_lib.small_vocab(root / "other", str(text), ("text",), 60,
                                store_dir=root / "vocab",
                                digest=vocab["sha256"])
  assert other["sha256"] == vocab["sha256"]
  assert len(list((root / "vocab").iterdir())) == 1


def test_a_stored_file_of_other_content_is_refused(built, tmp_path):
  _, _, vocab = built
  store = tmp_path / "vocab"
  store.mkdir()
  bad = store / vocab_lib.stored_name(vocab["sha256"])
  bad.write_bytes(lzma.compress(b"not the vocabulary"))
  with pytest.raises(ValueError, match=f"{bad}: its content is not the "
                     "vocabulary of SHA-256 .*restore the file from git"):
    vocab_lib.small_vocab(tmp_path / "study", "unused.txt", ("text",), 60,
                          store_dir=store, digest=vocab["sha256"])
  assert not (tmp_path / "study" / "vocab" / "spm60.model").exists()
