"""WikiText files as articles (``data.text_layout='wikitext'``)."""
import re

import numpy as np
import pytest
import tensorflow as tf

from hypermixer_jax import data
from hypermixer_jax.data import sources

SAMPLE = (
    " \n"
    " = Alpha Beta = \n"
    " \n"
    " Alpha is a 1 @,@ 200 @-@ km river , \" very long \" ( 3 @.@ 5 % ) . \n"
    " \n"
    " = = History = = \n"
    " \n"
    " It 's old ; really : old ! \n"
    " Second paragraph . \n"
    " \n"
    " = = = Late history = = = \n"
    " \n"
    " = Gamma = \n"
    " \n"
    " Gamma [ x ] ? \n"
)
EXPECTED = [
    ("2", "Alpha Beta\n"
          "Alpha is a 1,200-km river, \"very long\" (3.5%).\n"
          "History\n"
          "It's old; really: old!\n"
          "Second paragraph.\n"
          "Late history"),
    ("13", "Gamma\nGamma [x]?"),
]


def _read(path, layout):
  reader = sources.local_reader("text", {"text": ("text",)},
                                text_layout=layout)
  return [(r["source"].decode().rsplit(":", 1)[1], r["text"].decode())
          for r in reader(tf.constant(str(path))).as_numpy_iterator()]


def test_wikitext_articles(tmp_path):
  path = tmp_path / "wiki.valid.raw"
  path.write_text(SAMPLE, encoding="utf-8")
  assert _read(path, "wikitext") == EXPECTED
  # The line layout: every non-empty line its own example, markup kept.
  lines = _read(path, "lines")
  assert len(lines) == 8
  assert lines[0] == ("2", " = Alpha Beta = ")


def test_wikitext_text_before_first_title_and_no_title(tmp_path):
  path = tmp_path / "a.txt"
  path.write_text(" intro line . \n = T = \n body \n", encoding="utf-8")
  assert _read(path, "wikitext") == [("1", "intro line."), ("2", "T\nbody")]
  path.write_text(" just text \n\n more \n", encoding="utf-8")
  assert _read(path, "wikitext") == [("1", "just text\nmore")]


def test_unknown_layout_is_refused(tmp_path):
  with pytest.raises(ValueError, match="data.text_layout='paragraphs'; valid "
                     "layouts: lines, wikitext"):
    sources.local_reader("text", {"text": ("text",)}, text_layout="paragraphs")
  path = tmp_path / "x.raw"
  path.write_text(SAMPLE, encoding="utf-8")
  cfg = data.default_data_config()
  cfg.update(task="c4_mlm", text_layout="paragraphs")
  cfg.local_files.validation = str(path)
  with pytest.raises(ValueError, match="data.text_layout='paragraphs'"):
    data.build_pipeline(cfg, "validation", batch_size=2, seed=0,
                        repeat=False, shuffle=False)


def _reference_articles(text):
  """The articles by another route: split the file at its title lines."""
  out, current = [], []
  for line in text.split("\n"):
    if re.fullmatch(r" = [^=].* = ", line):
      if current:
        out.append(current)
      current = [line]
    elif line.strip():
      current.append(line)
  return out + [current]


def test_real_wikitext_2(shared_data):
  path = shared_data / "wikitext-2-raw/wiki.valid.raw"
  ours = _read(path, "wikitext")
  raw = path.read_text(encoding="utf-8")
  ref = _reference_articles(raw)
  assert len(ours) == len(ref) == 60
  for (_, text), lines in zip(ours, ref):
    assert "@-@" not in text and " = " not in text and " ," not in text
    # Only spaces, the heading markup and the '@' around number separators
    # are removed: the other characters come through in order.
    words = "".join(re.sub(r"^ (= )+(.*?)( =)+ $", r"\2", ln)
                    for ln in lines)
    words = re.sub(r" @([-,.])@ ", r"\1", words)
    assert re.sub(r"\s", "", words) == re.sub(r"\s", "", text)
    assert text.count("\n") == len(lines) - 1
  assert ours[0][0] == "2" and ours[0][1].startswith("Homarus gammarus\n")


def test_real_wikitext_2_through_mlm_task(shared_data):
  """Article rows are full 128-token rows but for each article's last."""
  counts = {}
  for layout in ("wikitext", "lines"):
    cfg = data.default_data_config()
    cfg.update(task="c4_mlm", seq_len=128, text_layout=layout,
               vocab_path=str(shared_data / "t5_spm/sentencepiece.model"))
    cfg.local_files.validation = str(
        shared_data / "wikitext-2-raw/wiki.valid.raw")
    batches = list(data.build_pipeline(cfg, "validation", batch_size=256,
                                       seed=0, repeat=False, shuffle=False))
    seg = np.concatenate([b["segment_ids"] for b in batches])
    weights = np.concatenate([b["weights"] for b in batches])
    lengths = (seg > 0).sum(1)
    counts[layout] = (len(lengths), int((lengths < 128).sum()),
                      int(lengths.sum()), int(weights.sum()))
    # 15% of every row's tokens (rounded, at least one) carry the loss.
    np.testing.assert_array_equal(
        weights.sum(1), np.maximum(1, np.round(0.15 * lengths)))
  rows, short, tokens, masked = counts["wikitext"]
  assert short <= 60 < rows  # at most one short row per article
  # Line by line, every heading and paragraph was a (short) row of its own.
  assert counts["lines"][1] > 1000
  assert 250_000 < tokens < 350_000 and masked > 0.14 * tokens
