"""Data sources: TFDS, or local JSONL / TSV / text shards, as seqio sources.

Local files let a user with C4 or GLUE on disk train without any download.
Every local reader yields the same feature names as the TFDS datasets after
our rekeying (``text`` for corpora; ``text_a``, ``text_b``, ``label`` for
sentence (pair) classification; ``image``, ``label`` for images), plus
``source`` (``file:line``) that error messages quote.

The readers are tf.data graphs end to end (``TextLineDataset`` and string
ops, no Python generator or ``py_function``), and their iterators can be
checkpointed (``Pipeline`` saves the tf.data iterator state instead of
replaying the stream). A local reader comes in two halves (``LocalReader``):
the interleave of files only hands over blocks of raw numbered lines, and
one parallel map after it checks and parses the rows, so parsing spreads
over the host's cores however many files there are.

The parts, by source kind: ``formats`` (JSONL / TSV / text rows as string
ops), ``wikitext`` (WikiText articles), ``image_reader`` here (labels TSV +
image files), ``tfds_source`` here (TFDS, read-only); ``checks`` carries a
bad row's message out of the graph: it stops the pipeline with a
``DataError`` naming the file, the line, the value and what was expected
(``data_check``), never a silent drop.
"""
from __future__ import annotations

import gzip
import io
from typing import Any, Callable, Mapping, Sequence

import numpy as np
import seqio
import tensorflow as tf
import tensorflow_datasets as tfds

from hypermixer_jax.data import formats
from hypermixer_jax.data import wikitext
# Re-exported: the names a pipeline stage and its tests use from here.
from hypermixer_jax.data.checks import DataError  # noqa: F401
from hypermixer_jax.data.checks import data_check
from hypermixer_jax.data.checks import data_error_from  # noqa: F401
from hypermixer_jax.data.formats import json_unescape  # noqa: F401
from hypermixer_jax.data.wikitext import TEXT_LAYOUTS
from hypermixer_jax.data.wikitext import wikitext_detokenize  # noqa: F401


def file_format(pattern: str) -> str:
  """'jsonl' | 'tsv' | 'text', from the file extension of ``pattern``."""
  name = pattern.rstrip("*").lower()
  for ext, fmt in ((".jsonl", "jsonl"), (".json", "jsonl"), (".tsv", "tsv"),
                   (".txt", "text"), (".raw", "text")):
    if name.endswith(ext) or f"{ext}-" in name or f"{ext}." in name:
      return fmt
  raise DataError(f"Cannot tell the format of {pattern!r} from its extension: "
                  "use .jsonl, .tsv (with a header line), .txt or .raw (each "
                  "may end in .gz).")


def split_patterns(patterns: str | Sequence[str]) -> list[str]:
  if isinstance(patterns, str):
    patterns = patterns.split(",")
  return [p.strip() for p in patterns if p.strip()]


def check_local_files(split_to_pattern: Mapping[str, str]) -> None:
  """Raises FileNotFoundError naming the split whose pattern matches nothing,
  ValueError for a pattern whose format is unknown or mixed."""
  for split, patterns in split_to_pattern.items():
    pats = split_patterns(patterns)
    # seqio lists a path without wildcards as it is, found or not (a
    # glob's matches exist: not asked again, one request each on gs://).
    missing = [p for p in pats if not any(c in p for c in "*?[")
               and not tf.io.gfile.exists(p)]
    if missing:
      raise FileNotFoundError(
          f"data.local_files.{split} = {patterns!r}: {missing[0]} does not "
          "exist; check the path.")
    if not seqio.utils.list_files(pats):
      raise FileNotFoundError(
          f"data.local_files.{split} = {patterns!r} matches no file.")
    if len({file_format(p) for p in pats}) > 1:
      raise DataError(f"data.local_files.{split} = {patterns!r} mixes file "
                      "formats; use one of .jsonl, .tsv, .txt per split.")
    files = seqio.utils.list_files(pats)
    # (An empty TSV has its own message, naming the header it needs.)
    if file_format(pats[0]) != "tsv" and not any(_has_text(f) for f in files):
      raise DataError(
          f"--config.data.local_files.{split}: {', '.join(files[:3])}"
          f"{' ...' if len(files) > 3 else ''} "
          f"{'holds' if len(files) == 1 else 'hold'} no line of data (empty "
          "or blank); pass the file(s) of that split.")


def open_text(path: str, mode: str = "r"):
  """A local or remote file (``tf.io.gfile``), read decompressed where its
  name ends in ``.gz`` (as the pipeline's readers do)."""
  if not path.lower().endswith(".gz"):
    return tf.io.gfile.GFile(path, mode)
  raw = gzip.GzipFile(fileobj=tf.io.gfile.GFile(path, "rb"), mode="rb")
  return raw if mode == "rb" else io.TextIOWrapper(raw, encoding="utf-8")


def _has_text(path: str, chunk: int = 1 << 16) -> bool:
  """Whether a file holds anything but whitespace (read in chunks, up to
  the first that does)."""
  with open_text(path, "rb") as f:
    while True:
      block = f.read(chunk)
      if not block:
        return False
      if block.strip():
        return True


# format -> (open, parse, drop blank lines)
_FORMATS = {"jsonl": (formats.open_lines, formats.parse_jsonl, True),
            "tsv": (formats.open_tsv, formats.parse_tsv, "empty"),
            "text": (formats.open_lines, formats.parse_text, True),
            "wikitext": (wikitext.open_wikitext, wikitext.parse_wikitext,
                         False)}


# Lines per block that a file's chain hands to the interleave of files (the
# interleave's block_length of lines before).
LINES_PER_BLOCK = 16


class LocalReader:
  """A seqio ``read_file_fn`` in two halves, so that files scale.

  ``lines(path)`` is one file's numbered raw lines in blocks of
  ``LINES_PER_BLOCK`` (with what the parse needs from the file, e.g. a TSV's
  column positions): no function runs per line, so it is cheap inside the
  interleave of files. ``parse(ds)`` checks and parses a block of rows at a
  time into features (vectorised string ops: one op per block instead of
  one per row) in a parallel map after the interleave, then yields the rows
  (and runs ``per_row``, e.g. reading an image file, on each). Calling the
  reader reads one file whole (``parse(lines(path))``).

  With a parallel map per line inside each file's chain, SST-2 read as 8
  shards cost 1.45x the CPU per example of the same rows in one file (a
  one-off measurement; docs/performance.md, Input pipelines, has the command).
  """

  def __init__(self, open_fn, to_features, drop_blank: bool | str,
               per_row=None):
    """``drop_blank``: True drops lines of whitespace alone; ``'empty'``
    only empty lines (a TSV's line of tabs is a row of empty fields, which
    its checks name)."""
    self._open = open_fn
    self._to_features = to_features
    self._drop_blank = drop_blank
    self._per_row = per_row

  def lines(self, path: tf.Tensor) -> tf.data.Dataset:
    """Blocks of ``LINES_PER_BLOCK`` rows: the interleave hands over a block
    at a time (a line at a time, its hand-offs cost more than parsing a
    short SST-2 row)."""
    return self._open(path).batch(LINES_PER_BLOCK)

  def parse(self, ds: tf.data.Dataset) -> tf.data.Dataset:
    """Blocks from ``lines`` (of any files) -> rows of features."""
    def block(meta, row):
      number, line = row
      if self._drop_blank:
        keep = tf.strings.length(
            tf.strings.strip(line) if self._drop_blank is True
            else tf.strings.regex_replace(line, "\r$", "")) > 0
        number, line = (tf.boolean_mask(number, keep),
                        tf.boolean_mask(line, keep))
      # A block holds rows of one file: its meta is the same in every row.
      return self._to_features({k: v[0] for k, v in meta.items()}, number,
                               line)

    ds = ds.map(block, num_parallel_calls=tf.data.AUTOTUNE).unbatch()
    if self._per_row is not None:
      ds = ds.map(self._per_row, num_parallel_calls=tf.data.AUTOTUNE)
    return ds

  def __call__(self, path: tf.Tensor) -> tf.data.Dataset:
    return self.parse(self.lines(path))


def local_reader(fmt: str, fields: Mapping[str, Sequence[str]],
                 label_names: Sequence[str] | None = None,
                 allow_unlabelled: bool = False,
                 text_layout: str = "lines",
                 allow_empty_inputs: bool = False,
                 ) -> LocalReader:
  """A seqio ``read_file_fn`` mapping rows of ``fmt`` files to features.

  Args:
    fmt: 'jsonl' (flat objects), 'tsv' (header line naming the columns) or
      'text' (``text_layout``).
    fields: output feature -> accepted column names (first match wins), e.g.
      ``{"text_a": ("premise", "sentence1")}``. A feature named ``label`` is
      converted to int64: a name from ``label_names`` or an integer in
      ``[0, len(label_names))``; anything else stops the pipeline with a
      ``DataError`` naming the file, line, value and the allowed labels.
    label_names: class names in label order.
    allow_unlabelled: '-' and -1 are read as -1 (SNLI's pairs without a gold
      label, dropped later by the task).
    text_layout: how a text file divides into examples: 'lines' (each
      non-empty line is one ``text``) or 'wikitext' (one per WikiText
      article, see ``wikitext.open_wikitext``). Other formats ignore it.
    allow_empty_inputs: keep rows whose input fields are empty; by default
      such a row stops the pipeline naming its file and line, like any bad
      row.

  Every row also carries ``source`` = ``"file:line"`` for later messages.
  """

  if text_layout not in TEXT_LAYOUTS:
    raise ValueError(f"data.text_layout={text_layout!r}; valid layouts: "
                     f"{', '.join(TEXT_LAYOUTS)}.")
  if fmt == "text" and text_layout == "wikitext":
    fmt = "wikitext"
  open_rows, parse, drop_blank = _FORMATS[fmt]

  @tf.autograph.experimental.do_not_convert
  def open_file(path):
    return open_rows(path, fields)

  @tf.autograph.experimental.do_not_convert
  def to_features(meta, number, line):
    out, where, checks = parse(meta, number, line, fields)
    if not allow_empty_inputs:
      checks += formats.check_inputs(out, where, fields)
    if "label" in out:
      label, check = formats.label_id(out["label"], where,
                                      label_names or (), allow_unlabelled)
      out["label"] = label
      checks.append(check)
    with tf.control_dependencies(checks):
      out["source"] = tf.strings.join(
          [meta["path"], ":", tf.strings.as_string(number)])
    return out

  return LocalReader(open_file, to_features, drop_blank)


def image_reader(num_classes: int) -> LocalReader:
  """A reader of ``filename<TAB>class_index`` TSVs into {image bytes, label}.

  File names are absolute, or relative to the TSV's folder or to its
  ``images/`` subfolder (the layout of shared/data/imagenet_sample). A class
  index that is not an integer in ``[0, num_classes)`` stops the pipeline
  naming the file, line, value and range (``num_classes`` is
  ``data.num_classes``, which ``check_fits_model`` checks against the
  model's at start).
  """

  fields = {"image": ("filename", "file_name"),
            "label": ("class_index", "label")}

  @tf.autograph.experimental.do_not_convert
  def open_file(path: tf.Tensor) -> tf.data.Dataset:
    root = tf.strings.regex_replace(path, "/?[^/]*$", "")
    images = tf.strings.join([root, "/images"])
    prefix = tf.where(tf.size(tf.io.matching_files(images)) > 0, images,
                      root)
    return formats.open_tsv(path, fields, {"prefix": prefix, "root": root})

  @tf.autograph.experimental.do_not_convert
  def to_features(meta, number, line):
    out, where, checks = formats.parse_tsv(meta, number, line, fields)
    label = tf.strings.strip(out["label"])
    is_int = tf.strings.regex_full_match(label, "-?[0-9]{1,9}")
    value = tf.strings.to_number(tf.where(is_int, label, "-1"), tf.int64)
    checks.append(data_check(
        is_int & (value >= 0) & (value < num_classes), *where,
        ": class index '", label, f"' is not an integer in [0, "
        f"{num_classes}) (data.num_classes={num_classes}); fix the row, or "
        "if the data has more classes set --config.data.num_classes and "
        "--config.model.num_classes."))
    with tf.control_dependencies(checks):
      name = out["image"]
      absolute = tf.strings.regex_full_match(name, "/.*|[a-z0-9]+://.*")
      # A name that starts with images/ is relative to the TSV's folder.
      prefix = tf.where(tf.strings.regex_full_match(name, "images/.*"),
                        meta["root"], meta["prefix"])
      image = tf.where(absolute, name, tf.strings.join([prefix, "/", name]))
      return {"image": image, "label": value,
              "source": tf.strings.join([*where[:2],
                                         tf.strings.as_string(number),
                                         " (", image, ")"])}

  @tf.autograph.experimental.do_not_convert
  def read_image(row):
    return {**row, "image": tf.io.read_file(row["image"])}

  return LocalReader(open_file, to_features, drop_blank="empty",
                     per_row=read_image)


def local_source(split_to_pattern: Mapping[str, str],
                 read_file_fn: Callable[[tf.Tensor], tf.data.Dataset]
                 | Callable[[str], Callable[[tf.Tensor], tf.data.Dataset]],
                 *, by_format: bool = False) -> seqio.FileDataSource:
  """A seqio FileDataSource over local shards (one file = one shard).

  With ``by_format``, ``read_file_fn`` is called with the split's file format
  ('jsonl', 'tsv', 'text') and returns the reader (one format per split;
  the source reads the split asked for, so each split gets its own source
  function).
  """
  patterns = {s: split_patterns(p) for s, p in split_to_pattern.items()}
  if by_format:
    kinds = {file_format(p[0]) for p in patterns.values()}
    if len(kinds) > 1:
      return _MultiFormatSource(patterns, read_file_fn)
    read_file_fn = read_file_fn(kinds.pop())
  return _file_source(patterns, read_file_fn)


def _file_source(patterns, read_file_fn) -> seqio.FileDataSource:
  # Deterministic order inside a shard; files interleave in fixed order.
  if isinstance(read_file_fn, LocalReader):
    return _LocalFileSource(read_file_fn, patterns)
  return seqio.FileDataSource(read_file_fn=read_file_fn,
                              split_to_filepattern=patterns,
                              cycle_length=4, block_length=16)


class _LocalFileSource(seqio.FileDataSource):
  """seqio's FileDataSource for ``LocalReader``: the files' interleave yields
  blocks of raw lines, parsed in one parallel map after it.

  On a local disk the interleave runs on the consumer's thread (reading lines
  costs little next to parsing them); a thread per file only added hand-offs
  (SST-2 as 8 shards on 2 cores: 7.4k examples/s with a parallel interleave,
  8.9-11k without, in one-off runs; docs/performance.md, Input pipelines).
  Remote files
  (``gs://`` ...) keep seqio's parallel interleave, which hides their read
  latency.
  """

  def __init__(self, reader: LocalReader, patterns):
    super().__init__(read_file_fn=reader.lines, split_to_filepattern=patterns,
                     cycle_length=4, block_length=1)
    self._local_reader = reader

  def get_dataset(self, split=tfds.Split.TRAIN, shuffle=True, seed=None,
                  shard_info=None, *, sequence_length=None, use_cached=False,
                  num_epochs=1):
    del sequence_length, use_cached, num_epochs  # as in seqio: unused
    files = self.list_shards(split)
    if not files:
      raise ValueError(f"No file matches {self._split_to_filepattern[split]}"
                       f" (split {split!r}).")
    files_ds = tf.data.Dataset.from_tensor_slices(np.array(files, dtype=str))
    # Whole files per host only where they divide evenly among the hosts:
    # otherwise (3 files, 2 hosts) one host's share would be a file short,
    # and as every host gives a batch its equal part, that host's examples
    # would be read more often. Then every host reads every file, in the
    # same order (the seed is every host's), and keeps its share of the
    # examples (seqio does so itself with fewer files than hosts).
    by_file = shard_info and len(files) % shard_info.num_shards == 0
    if by_file:
      files_ds = files_ds.shard(shard_info.num_shards, shard_info.index)
    if shuffle:
      files_ds = files_ds.shuffle(len(files), seed=seed)
    remote = any("://" in f for f in files)
    blocks = files_ds.interleave(
        self._local_reader.lines, cycle_length=self._cycle_length,
        block_length=self._block_length,
        num_parallel_calls=tf.data.AUTOTUNE if remote else None)
    examples = self._local_reader.parse(blocks)
    if shard_info and not by_file:
      examples = examples.shard(shard_info.num_shards, shard_info.index)
    return examples


class _MultiFormatSource(seqio.DataSource):
  """Splits in different formats (e.g. train.tsv, dev.jsonl)."""

  def __init__(self, patterns, make_reader_fn):
    self._sources = {
        s: _file_source({s: p}, make_reader_fn(file_format(p[0])))
        for s, p in patterns.items()}
    super().__init__(splits=list(patterns), num_input_examples=None,
                     caching_permitted=False)

  @property
  def supports_arbitrary_sharding(self) -> bool:
    return False

  def get_dataset(self, split=None, shuffle=True, seed=None,
                  shard_info=None, *, sequence_length=None,
                  use_cached=False, num_epochs=1):
    return self._sources[split].get_dataset(
        split=split, shuffle=shuffle, seed=seed, shard_info=shard_info,
        sequence_length=sequence_length, use_cached=use_cached,
        num_epochs=num_epochs)

  def list_shards(self, split: str) -> Sequence[str]:
    return self._sources[split].list_shards(split)


def tfds_not_prepared(data_dir: str | None, source: Any) -> DataError:
  """TFDS's "could not find data in ..." (which advises a download, and
  which this read-only source never does) as one line naming the folder
  TFDS reads, ``<data_dir>/<name>/<version>/``, from the task's
  ``seqio.TfdsDataSource``."""
  loader = getattr(source, "tfds_dataset", None)
  name = getattr(loader, "name", "the dataset")
  base = name.split(":")[0]
  try:
    folder = f" (it read {loader.builder.data_dir}/)"
  except Exception:  # pylint: disable=broad-except
    folder = ""
  return DataError(
      f"--config.data.data_dir={data_dir}: TFDS finds no prepared {name} "
      f"there{folder}; point data_dir at the folder that holds "
      f"{base}/<version>/ with the dataset's dataset_info.json and shards "
      "(a folder of those files alone, as tfds.builder_from_directory reads, "
      f"goes under {base}/<version>/), or use "
      "--config.data.local_files.* instead.")


def tfds_source(name: str, data_dir: str | None,
                splits: Mapping[str, str], decoders=None) -> seqio.TfdsDataSource:
  """A read-only TFDS source (never triggers a download; a dataset TFDS
  cannot find prepared: ``tfds_not_prepared``)."""
  return seqio.TfdsDataSource(tfds_name=name, tfds_data_dir=data_dir,
                              splits=dict(splits), decoders=decoders,
                              read_only=True)
