"""Data sources: TFDS, or local JSONL / TSV / text shards, as seqio sources.

Local files let a user with C4 or GLUE on disk train without any download.
Every local reader yields the same feature names as the TFDS datasets after
our rekeying (``text`` for corpora; ``text_a``, ``text_b``, ``label`` for
sentence (pair) classification; ``image``, ``label`` for images).
"""
from __future__ import annotations

import csv
import json
import os
import sys
from typing import Callable, Mapping, Sequence

import seqio
import tensorflow as tf

# Some GLUE/NLI fields are long; the csv module's default limit is 128 kB.
csv.field_size_limit(sys.maxsize)


def file_format(pattern: str) -> str:
  """'jsonl' | 'tsv' | 'text', from the file extension of ``pattern``."""
  name = pattern.rstrip("*").lower()
  for ext, fmt in ((".jsonl", "jsonl"), (".json", "jsonl"), (".tsv", "tsv"),
                   (".txt", "text"), (".raw", "text")):
    if name.endswith(ext) or f"{ext}-" in name or f"{ext}." in name:
      return fmt
  raise ValueError(f"Cannot tell the format of {pattern!r} from its extension: "
                   "use .jsonl, .tsv (with a header line), .txt or .raw.")


def split_patterns(patterns: str | Sequence[str]) -> list[str]:
  if isinstance(patterns, str):
    patterns = patterns.split(",")
  return [p.strip() for p in patterns if p.strip()]


def check_local_files(split_to_pattern: Mapping[str, str]) -> None:
  """Raises FileNotFoundError naming the split whose pattern matches nothing."""
  for split, patterns in split_to_pattern.items():
    pats = split_patterns(patterns)
    if not seqio.utils.list_files(pats):
      raise FileNotFoundError(
          f"local_files[{split!r}] = {patterns!r} matches no file.")


def _rows(path: str):
  """Dict rows of a local file (JSONL object, TSV with header, or text line)."""
  fmt = file_format(path)
  with tf.io.gfile.GFile(path, "r") as f:
    if fmt == "jsonl":
      for line in f:
        if line.strip():
          yield json.loads(line)
    elif fmt == "tsv":
      yield from csv.DictReader(f, delimiter="\t", quoting=csv.QUOTE_NONE)
    else:
      for line in f:
        if line.strip():
          yield {"text": line.rstrip("\n")}


def _first(row: Mapping[str, object], aliases: Sequence[str], path: str):
  for a in aliases:
    if a in row:
      return row[a]
  raise KeyError(f"{path}: none of the columns {list(aliases)} in row with "
                 f"keys {sorted(row)}")


def make_reader(fields: Mapping[str, Sequence[str]],
                label_names: Sequence[str] | None = None,
                ) -> Callable[[tf.Tensor], tf.data.Dataset]:
  """A seqio ``read_file_fn`` mapping local rows to string/int features.

  Args:
    fields: output feature -> accepted column names (first match wins), e.g.
      ``{"text_a": ("premise", "sentence1")}``. A feature named ``label`` is
      converted to int64: integers are kept, strings are looked up in
      ``label_names``; rows with an unknown label (e.g. SNLI's "-") are
      dropped.
    label_names: class names in label order.
  """
  names = {n: i for i, n in enumerate(label_names or ())}

  def gen(path):
    path = path.decode() if isinstance(path, bytes) else str(path)
    for row in _rows(path):
      out = {}
      for feat, aliases in fields.items():
        value = _first(row, aliases, path)
        if feat == "label":
          value = str(value).strip()
          if value.lstrip("-").isdigit():
            value = int(value)
          elif value in names:
            value = names[value]
          else:
            value = None
        out[feat] = value
      if out.get("label", 0) is None:
        continue
      yield out

  signature = {f: tf.TensorSpec([], tf.int64 if f == "label" else tf.string)
               for f in fields}

  @tf.autograph.experimental.do_not_convert
  def read_file_fn(path: tf.Tensor) -> tf.data.Dataset:
    return tf.data.Dataset.from_generator(gen, args=(path,),
                                          output_signature=signature)

  return read_file_fn


@tf.autograph.experimental.do_not_convert
def image_reader(path: tf.Tensor) -> tf.data.Dataset:
  """Reads a ``filename<TAB>class_index`` TSV into {image bytes, label}.

  File names are relative to the TSV's folder or to its ``images/`` subfolder
  (the layout of shared/data/imagenet_sample).
  """
  def gen(p):
    p = p.decode() if isinstance(p, bytes) else str(p)
    root = os.path.dirname(p)
    with tf.io.gfile.GFile(p, "r") as f:
      for row in csv.DictReader(f, delimiter="\t", quoting=csv.QUOTE_NONE):
        name = row.get("filename") or row["file_name"]
        image = os.path.join(root, "images", name)
        if not tf.io.gfile.exists(image):
          image = os.path.join(root, name)
        yield {"image": image,
               "label": int(row.get("class_index", row.get("label")))}

  ds = tf.data.Dataset.from_generator(
      gen, args=(path,), output_signature={
          "image": tf.TensorSpec([], tf.string),
          "label": tf.TensorSpec([], tf.int64)})
  return ds.map(lambda ex: {"image": tf.io.read_file(ex["image"]),
                            "label": ex["label"]})


def local_source(split_to_pattern: Mapping[str, str],
                 read_file_fn: Callable[[tf.Tensor], tf.data.Dataset],
                 ) -> seqio.FileDataSource:
  """A seqio FileDataSource over local shards (one file = one shard)."""
  return seqio.FileDataSource(
      read_file_fn=read_file_fn,
      split_to_filepattern={s: split_patterns(p)
                            for s, p in split_to_pattern.items()},
      # Deterministic order inside a shard; files interleave in fixed order.
      cycle_length=4, block_length=16)


def tfds_source(name: str, data_dir: str | None,
                splits: Mapping[str, str], decoders=None) -> seqio.TfdsDataSource:
  """A read-only TFDS source (never triggers a download)."""
  return seqio.TfdsDataSource(tfds_name=name, tfds_data_dir=data_dir,
                              splits=dict(splits), decoders=decoders,
                              read_only=True)
