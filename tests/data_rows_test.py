"""Rows that would train silently on nothing are refused with file and line
like any bad row: a NUL byte, an empty or blank input field (unless
``data.allow_empty_inputs``)."""
import json

import numpy as np
import pytest

from hypermixer_jax import data
from hypermixer_jax.data import testing

SST2 = "sentence\tlabel\ngood film .\tpositive\n"


@pytest.fixture(scope="module")
def vocab(tmp_path_factory):
  return testing.tiny_vocab(str(tmp_path_factory.mktemp("vocab")))


def _read(vocab, task, path, **fields):
  cfg = data.default_data_config()
  cfg.update(task=task, vocab_path=vocab, seq_len=16, **fields)
  cfg.local_files.train = str(path)
  return list(data.build_pipeline(cfg, "train", batch_size=1, seed=0,
                                  repeat=False, shuffle=False))


def test_a_nul_byte_names_file_and_line(vocab, tmp_path):
  path = tmp_path / "train.tsv"
  path.write_bytes(SST2.encode() + b"bad\x00 film .\t0\n")
  with pytest.raises(data.DataError, match=(
      f"^{path}:3: the line holds a NUL byte \\(code 0\\); fix or remove the "
      r"row \(is this a text file\?\).$")):
    _read(vocab, "glue_sst2", path)


def test_an_empty_or_blank_input_names_file_line_and_field(vocab, tmp_path):
  path = tmp_path / "train.tsv"
  path.write_text(SST2 + "\tnegative\n   \t1\n")
  with pytest.raises(data.DataError, match=(
      f"^{path}:3: the 'sentence' field is empty; fill or remove the row "
      r"\(or pass --config.data.allow_empty_inputs=True if the task wants "
      r"empty inputs\).$")):
    _read(vocab, "glue_sst2", path)
  rows = _read(vocab, "glue_sst2", path, allow_empty_inputs=True)
  np.testing.assert_array_equal([int(r["label"][0]) for r in rows],
                                [1, 0, 1])
  for empty in rows[1:]:   # [CLS] and [SEP] only: no sentence
    assert int((empty["segment_ids"] > 0).sum()) == 2


def test_an_empty_second_sentence_of_a_pair_is_named(vocab, tmp_path):
  path = tmp_path / "snli.jsonl"
  rows = [{"premise": "a dog .", "hypothesis": "an animal .",
           "label": "entailment"},
          {"premise": "a cat .", "hypothesis": "", "label": "neutral"}]
  path.write_text("".join(json.dumps(r) + "\n" for r in rows))
  with pytest.raises(data.DataError, match=(
      f"^{path}:2: the 'hypothesis' / 'sentence2' field is empty")):
    _read(vocab, "glue_snli", path)
