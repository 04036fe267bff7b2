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
over the host's cores however many files there are. JSON lines are read with a small string-op parser for
flat objects (the C4 / NLI layout): a field's string value, or an integer.

Bad rows stop the pipeline with a ``DataError`` naming the file, the line,
the value and what was expected (see ``data_check``), never a silent drop.
"""
from __future__ import annotations

import re
from typing import Callable, Mapping, Sequence

import numpy as np
import seqio
import tensorflow as tf
import tensorflow_datasets as tfds

# Error messages travel out of tf.data inside an Assert between these markers
# (``Pipeline`` turns them back into a ``DataError``).
_OPEN, _CLOSE = "<<HMDATA ", " HMDATA>>"
_MESSAGE = re.compile(re.escape(_OPEN) + "(.*?)" + re.escape(_CLOSE), re.S)


class DataError(ValueError):
  """Bad input data: the message names the file, line and value."""


def data_error_from(error: Exception) -> DataError | None:
  """The ``DataError`` carried by a tf.data error raised by ``data_check``."""
  match = _MESSAGE.search(str(getattr(error, "message", error)))
  if match is None:
    return None
  return DataError(match.group(1).replace("\\'", "'").replace('\\"', '"'))


def data_check(ok: tf.Tensor, *parts) -> tf.Operation | tf.Tensor:
  """An in-graph check whose failure becomes a ``DataError(''.join(parts))``.

  ``parts`` are strings or scalar string/int tensors; use the result as a
  control dependency of what must not run on bad data. For a block of rows,
  ``ok`` is a vector and the vector ``parts`` give each row's value: the
  message is that of the first row that fails.
  """
  def message(parts):
    pieces = [p if isinstance(p, str) else
              (p if p.dtype == tf.string else tf.strings.as_string(p))
              for p in parts]
    return tf.strings.join([_OPEN, *pieces, _CLOSE])

  ok = tf.convert_to_tensor(ok)
  if ok.shape.rank == 0:
    return tf.debugging.Assert(ok, [message(parts)], summarize=1)

  # A block of rows: the message names the first row that fails (vector
  # parts are per row; when none fails, index len(ok) picks a padding).
  first = tf.argmax(tf.cast(tf.concat([tf.logical_not(ok), [True]], 0),
                            tf.int32), output_type=tf.int32)
  picked = [p if isinstance(p, str) or p.shape.rank == 0 else
            tf.gather(tf.concat([p, tf.zeros([1], p.dtype)], 0), first)
            for p in parts]
  return tf.debugging.Assert(tf.reduce_all(ok), [message(picked)],
                             summarize=1)


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
  """Raises FileNotFoundError naming the split whose pattern matches nothing,
  ValueError for a pattern whose format is unknown or mixed."""
  for split, patterns in split_to_pattern.items():
    pats = split_patterns(patterns)
    if not seqio.utils.list_files(pats):
      raise FileNotFoundError(
          f"data.local_files.{split} = {patterns!r} matches no file.")
    if len({file_format(p) for p in pats}) > 1:
      raise ValueError(f"data.local_files.{split} = {patterns!r} mixes file "
                       "formats; use one of .jsonl, .tsv, .txt per split.")


# ---------------------------------------------------------------------------
# Lines and fields, as string ops.
# ---------------------------------------------------------------------------


def _check_line(path: tf.Tensor, number: tf.Tensor, line: tf.Tensor
                ) -> tf.Tensor:
  """``line`` without a final '\\r', checked to be valid UTF-8."""
  line = tf.strings.regex_replace(line, "\r$", "")
  valid = tf.equal(tf.strings.unicode_transcode(
      line, "UTF-8", "UTF-8", errors="replace", replacement_char=0xFFFD), line)
  with tf.control_dependencies([data_check(
      valid, path, ":", number, ": the line is not valid UTF-8; re-encode "
      "the file as UTF-8 (e.g. iconv -f latin1 -t utf-8).")]):
    return tf.identity(line)


def _numbered_lines(path: tf.Tensor) -> tf.data.Dataset:
  """(line number from 1, checked line) of one file, parsed in this file's
  own chain (WikiText articles, TSV headers)."""
  lines = tf.data.TextLineDataset(path).enumerate(start=1)
  return lines.map(lambda number, line: (number, _check_line(path, number,
                                                             line)),
                   num_parallel_calls=tf.data.AUTOTUNE)


def _raw_lines(meta: Mapping[str, tf.Tensor], rows: tf.data.Dataset
               ) -> tf.data.Dataset:
  """``(meta, (number, line))`` for each of one file's ``rows``.

  No function runs per line here: this is the part of a reader that runs
  inside the interleave of files, and its rows are checked and parsed by one
  parallel map after it (``LocalReader``). ``meta`` holds what the parse
  needs from the file (its path; a TSV's column positions).
  """
  return tf.data.Dataset.zip((tf.data.Dataset.from_tensors(meta).repeat(),
                              rows))


def _last_where(cond: tf.Tensor, values: tf.Tensor) -> tf.Tensor:
  """``values[j]`` for the last ``j <= i`` with ``cond[j]``, else -1."""
  k = tf.cumsum(tf.cast(cond, tf.int32))
  return tf.gather(tf.concat([[-1], tf.boolean_mask(values, cond)], 0), k)


def _hex_value(c: tf.Tensor) -> tf.Tensor:
  return tf.where(c <= 57, c - 48, tf.where(c <= 70, c - 55, c - 87))


_SIMPLE_ESCAPES = {ord("n"): 10, ord("t"): 9, ord("r"): 13, ord("b"): 8,
                   ord("f"): 12}


def json_unescape(raw: tf.Tensor) -> tf.Tensor:
  """The value of a JSON string body (escapes still in place), as UTF-8.

  Bodies without ``\\u`` escapes take a few literal replacements; the others
  the general (vectorised) path.
  """
  # An escaped backslash first becomes \x01 (JSON strings hold no raw
  # control characters), so that what follows it is not read as an escape.
  simple = tf.strings.regex_replace(raw, r"\\\\", "\x01")
  has_u = tf.strings.regex_full_match(simple, r"(?s).*\\u.*")
  has_escape = tf.strings.regex_full_match(raw, r"(?s).*\\.*")

  def replace():
    out = simple
    for char, code in ((*_SIMPLE_ESCAPES.items(), (ord('"'), ord('"')),
                        (ord("/"), ord("/")))):
      out = tf.strings.regex_replace(out, "\\\\" + re.escape(chr(char)),
                                     chr(code))
    return tf.strings.regex_replace(out, "\x01", "\\\\")

  if raw.shape.rank == 0:
    return tf.cond(has_u, lambda: _json_unescape_general(raw),
                   lambda: tf.cond(has_escape, replace, lambda: raw))
  # A block: the literal replacements where any body needs them, the general
  # path for the bodies with \\u only.
  replaced = tf.cond(tf.reduce_any(has_escape & ~has_u), replace,
                     lambda: simple)
  out = tf.where(has_escape, replaced, raw)
  rows = tf.where(has_u)
  general = tf.map_fn(_json_unescape_general, tf.gather_nd(raw, rows),
                      fn_output_signature=tf.string)
  return tf.tensor_scatter_nd_update(out, rows, general)


def _json_unescape_general(raw: tf.Tensor) -> tf.Tensor:
  """``json_unescape`` for any body, vectorised over code points.

  Vectorised over code points: an escape starts at a backslash preceded by
  an even run of backslashes; ``\\uXXXX`` (and surrogate pairs) become their
  code point, ``\\n`` etc. their control character, ``\\x`` becomes ``x``.
  """
  cp = tf.strings.unicode_decode(raw, "UTF-8")
  n = tf.size(cp)
  idx = tf.range(n)
  backslash = tf.equal(cp, 92)
  run = idx - _last_where(~backslash, idx)  # backslashes ending at i
  start = backslash & tf.equal(run % 2, 1)
  padded = tf.concat([cp, tf.fill([12], 48)], 0)
  shifted = lambda x, k: x[k:k + n]  # noqa: E731
  nxt = shifted(padded, 1)
  uval = sum(_hex_value(shifted(padded, 2 + k)) * 16 ** (3 - k)
             for k in range(4))
  is_u = start & tf.equal(nxt, ord("u"))
  value = nxt
  for char, code in _SIMPLE_ESCAPES.items():
    value = tf.where(tf.equal(nxt, char), code, value)
  value = tf.where(is_u, uval, value)
  low = shifted(tf.concat([uval, tf.zeros([6], tf.int32)], 0), 6)
  low_is_u = shifted(tf.concat([is_u, tf.zeros([6], tf.bool)], 0), 6)
  pair = (is_u & (uval >= 0xD800) & (uval < 0xDC00) & low_is_u
          & (low >= 0xDC00) & (low < 0xE000))
  value = tf.where(pair, 0x10000 + (uval - 0xD800) * 1024 + (low - 0xDC00),
                   value)
  out = tf.where(start, value, cp)
  length = tf.where(is_u, tf.where(pair, 12, 6), 2)
  covered = tf.maximum(_last_where(start, idx + length), 0)
  keep = idx >= tf.concat([[0], covered], 0)[:n]
  return tf.strings.unicode_encode(tf.boolean_mask(out, keep), "UTF-8")


_JSON_STRING = r'"((?:[^"\\]|\\.)*)"'


def _json_field(line: tf.Tensor, key: str
                ) -> tuple[tf.Tensor, tf.Tensor, tf.Tensor]:
  """(found, is a number, value as written) of top-level ``key`` of a flat
  JSON object: a string's body still has its escapes (``json_unescape``).

  A key is matched only after ``{`` or ``,`` (a quote inside a string value
  is escaped, so it cannot start a key); the value is a string or a number.
  """
  pattern = (r'^\s*\{(?:.*?,)?\s*"' + re.escape(key) + r'"\s*:\s*(?:'
             + _JSON_STRING + r'|(-?[0-9][0-9.eE+-]*)|null)\s*[,}].*$')
  found = tf.strings.regex_full_match(line, pattern)
  string = tf.strings.regex_replace(line, pattern, r"\1", replace_global=False)
  number = tf.strings.regex_replace(line, pattern, r"\2", replace_global=False)
  is_number = found & (tf.strings.length(number) > 0)
  return found, is_number, tf.where(is_number, number, string)


def _label_id(value: tf.Tensor, where: list, label_names: Sequence[str],
              allow_unlabelled: bool) -> tuple[tf.Tensor, tf.Operation]:
  """(int64 label, check) of a label column value: a name or an integer."""
  value = tf.strings.strip(value)
  names = tf.constant(list(label_names), tf.string)
  matches = tf.equal(value[..., None], names)   # [..., labels]
  named = tf.reduce_any(matches, axis=-1)
  is_int = tf.strings.regex_full_match(value, "-?[0-9]+")
  as_int = tf.strings.to_number(tf.where(is_int, value, "0"), tf.int64)
  unlabelled = tf.constant(allow_unlabelled) & (
      tf.equal(value, "-") | tf.equal(as_int, -1) & is_int)
  in_range = is_int & (as_int >= 0) & (as_int < len(label_names))
  ok = named | in_range | unlabelled
  label = tf.where(named,
                   tf.argmax(tf.cast(matches, tf.int64), axis=-1,
                             output_type=tf.int64),
                   tf.where(in_range, as_int, tf.constant(-1, tf.int64)))
  allowed = ", ".join(label_names)
  check = data_check(
      ok, *where, ": label '", value, "' is not one of the labels ",
      f"({allowed}) nor an integer in [0, {len(label_names)})"
      + (" (nor '-' or -1 for unlabelled)" if allow_unlabelled else "")
      + "; fix or remove the row.")
  return label, check


def _open_lines(path, fields):
  del fields
  return _raw_lines({"path": path},
                    tf.data.TextLineDataset(path).enumerate(start=1))


def _parse_jsonl(meta, number, line, fields):
  path = meta["path"]
  where = [path, ":", number]
  line = _check_line(path, number, line)
  out, checks = {}, []
  for feat, aliases in fields.items():
    found, is_number, value = (tf.constant(False), tf.constant(False),
                               tf.constant(""))
    for alias in reversed(aliases):  # first alias wins
      f, n, v = _json_field(line, alias)
      value, is_number = tf.where(f, v, value), tf.where(f, n, is_number)
      found = found | f
    # One unescape per field, after the alias is chosen.
    value = tf.where(is_number | ~found, tf.where(found, value, ""),
                     json_unescape(value))
    checks.append(data_check(
        found, *where, ": no field ", " or ".join(map(repr, aliases)),
        " (a string or integer) in this JSON line; each line must be a "
        "flat JSON object."))
    out[feat] = value
  return out, where, checks


def _open_tsv(path, fields, extra_meta=None):
  """A TSV with a header line; its columns are looked up by name."""
  lines = _numbered_lines(path)
  header = lines.take(1).reduce(tf.constant(""), lambda _, x: x[1])
  has_rows = lines.skip(1).take(1).reduce(tf.constant(False),
                                          lambda *_: tf.constant(True))
  columns = tf.strings.split(header, "\t")
  column_of, checks = [], [
      data_check(tf.strings.length(header) > 0, path,
                 ": the file is empty; a TSV needs a header line naming its "
                 f"columns ({', '.join(a[0] for a in fields.values())}) and "
                 "at least one row."),
      data_check(has_rows, path, ": the file has a header line and no rows.")]
  for aliases in fields.values():
    hits = tf.concat([tf.where(tf.equal(columns, a))[:, 0] for a in aliases]
                     + [tf.constant([-1], tf.int64)], 0)
    column_of.append(hits[0])
    checks.append(data_check(
        hits[0] >= 0, path, ":1: no column ", " or ".join(map(repr, aliases)),
        " in the header '", header, "'."))
  with tf.control_dependencies(checks):
    meta = {"path": path, "num_columns": tf.size(columns),
            "columns": tf.stack(column_of), **(extra_meta or {})}
  return _raw_lines(meta, tf.data.TextLineDataset(path).enumerate(start=1)
                    .skip(1))


def _parse_tsv(meta, number, line, fields):
  """A block of TSV rows (``line`` a vector) -> one vector per field."""
  path, num_columns = meta["path"], meta["num_columns"]
  where = [path, ":", number]
  cells = tf.strings.split(_check_line(path, number, line), "\t")
  counts = tf.cast(cells.row_lengths(), tf.int32)
  count = data_check(
      tf.equal(counts, num_columns), *where, ": the row has ", counts,
      " tab-separated fields, the header has ", num_columns, ".")
  with tf.control_dependencies([count]):
    table = cells.to_tensor(default_value="", shape=tf.stack(
        [tf.size(line), num_columns]))
  out = {feat: table[:, meta["columns"][i]] for i, feat in enumerate(fields)}
  return out, where, []


def _parse_text(meta, number, line, fields):
  del fields
  path = meta["path"]
  return ({"text": _check_line(path, number, line)}, [path, ":", number], [])


# ---------------------------------------------------------------------------
# WikiText (Merity et al. 2016): articles, not lines.
# ---------------------------------------------------------------------------
TEXT_LAYOUTS = ("lines", "wikitext")

# A stripped line ``= Title =`` starts an article; ``= = Section = =`` (any
# depth) is a heading inside it.
_WIKITEXT_TITLE = r"= [^=](.*[^=])? ="
_WIKITEXT_HEADING = r"(= )+[^=](.*[^=])?( =)+"
# WikiText's own tokenization, undone (order matters: number separators
# before the general punctuation rule).
_WIKITEXT_DETOKENIZE = (
    (r" @-@ ", "-"), (r" @,@ ", ","), (r" @\.@ ", "."),
    (r'" ([^"]*?) "', r'"\1"'),
    (r"([(\[]) ", r"\1"), (r" ([)\]])", r"\1"),
    (r" ([.,;:!?%])", r"\1"), (r" '(s|re|ve|ll|d|m|t)\b", r"'\1"),
    (r"  +", " "),
)


def wikitext_detokenize(text: tf.Tensor) -> tf.Tensor:
  """A WikiText line as plain text: ``@-@``/``@,@``/``@.@`` joined, no
  spaces inside brackets and quotes or before punctuation and clitics."""
  for pattern, rewrite in _WIKITEXT_DETOKENIZE:
    text = tf.strings.regex_replace(text, pattern, rewrite)
  return tf.strings.strip(text)


def _open_wikitext(path, fields):
  """One row per WikiText article (``text_layout='wikitext'``).

  WikiText's files hold one paragraph or heading per line with blank lines
  between them; read line by line, each heading (`` = = History = = ``)
  would be an example of its own and each paragraph a separate document.
  Here a top-level `` = Title = `` line starts a new example, blank lines
  are dropped, headings keep their words without the ``=`` markup, the
  lines are joined with newlines and detokenized (``wikitext_detokenize``).
  The row's line number is that of the article's first line.
  """
  del fields
  lines = _numbered_lines(path).map(
      lambda number, line: (number, line, tf.constant(False)))
  # A sentinel title after the last line flushes the last article.
  end = tf.data.Dataset.from_tensors(
      (tf.constant(0, tf.int64), tf.constant(""), tf.constant(True)))

  def step(state, element):
    text, first = state
    number, line, is_end = element
    stripped = tf.strings.strip(line)
    blank = tf.equal(tf.strings.length(stripped), 0)
    title = is_end | tf.strings.regex_full_match(stripped, _WIKITEXT_TITLE)
    heading = tf.strings.regex_full_match(stripped, _WIKITEXT_HEADING)
    words = tf.where(heading, tf.strings.regex_replace(
        stripped, r"^(= )+(.*?)( =)+$", r"\2"), stripped)
    # Padded, so that a separator at the end of a line (``1932 @,@``) still
    # has the spaces the rules expect.
    content = wikitext_detokenize(tf.strings.join([" ", words, " "]))
    empty = tf.equal(tf.strings.length(text), 0)
    joined = tf.where(empty, content,
                      tf.strings.join([text, "\n", content]))
    new_text = tf.where(title, tf.where(is_end, "", content),
                        tf.where(blank, text, joined))
    new_first = tf.where(title | (empty & ~blank), number, first)
    emit = title & ~empty
    return (new_text, new_first), (first, text, emit)

  articles = lines.concatenate(end).scan(
      (tf.constant(""), tf.constant(0, tf.int64)), step)
  articles = articles.filter(lambda number, text, emit: emit).map(
      lambda number, text, emit: (number, text))
  return _raw_lines({"path": path}, articles)


def _parse_wikitext(meta, number, text, fields):
  del fields  # the article's lines were checked in its file's chain
  return {"text": text}, [meta["path"], ":", number], []


# format -> (open, parse, drop blank lines)
_FORMATS = {"jsonl": (_open_lines, _parse_jsonl, True),
            "tsv": (_open_tsv, _parse_tsv, False),
            "text": (_open_lines, _parse_text, True),
            "wikitext": (_open_wikitext, _parse_wikitext, False)}


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
  shards cost 1.45x the CPU per example of the same rows in one file
  (experiments/README.md, Input pipelines).
  """

  def __init__(self, open_fn, to_features, drop_blank: bool, per_row=None):
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
        keep = tf.strings.length(tf.strings.strip(line)) > 0
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
      article, see ``_open_wikitext``). Other formats ignore it.

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
    if "label" in out:
      label, check = _label_id(out["label"], where, label_names or (),
                               allow_unlabelled)
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
    return _open_tsv(path, fields, {"prefix": prefix})

  @tf.autograph.experimental.do_not_convert
  def to_features(meta, number, line):
    out, where, checks = _parse_tsv(meta, number, line, fields)
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
      image = tf.where(absolute, name,
                       tf.strings.join([meta["prefix"], "/", name]))
      return {"image": image, "label": value,
              "source": tf.strings.join([*where[:2],
                                         tf.strings.as_string(number),
                                         " (", image, ")"])}

  @tf.autograph.experimental.do_not_convert
  def read_image(row):
    return {**row, "image": tf.io.read_file(row["image"])}

  return LocalReader(open_file, to_features, drop_blank=False,
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
    formats = {file_format(p[0]) for p in patterns.values()}
    if len(formats) > 1:
      return _MultiFormatSource(patterns, read_file_fn)
    read_file_fn = read_file_fn(formats.pop())
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
  8.9-11k without; experiments/README.md, Input pipelines). Remote files
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
    if shard_info:
      if len(files) < shard_info.num_shards:
        raise ValueError(
            f"{len(files)} files cannot be split among "
            f"{shard_info.num_shards} hosts (seqio then shards by example).")
      files_ds = files_ds.shard(shard_info.num_shards, shard_info.index)
    if shuffle:
      files_ds = files_ds.shuffle(len(files), seed=seed)
    remote = any("://" in f for f in files)
    blocks = files_ds.interleave(
        self._local_reader.lines, cycle_length=self._cycle_length,
        block_length=self._block_length,
        num_parallel_calls=tf.data.AUTOTUNE if remote else None)
    return self._local_reader.parse(blocks)


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


def tfds_source(name: str, data_dir: str | None,
                splits: Mapping[str, str], decoders=None) -> seqio.TfdsDataSource:
  """A read-only TFDS source (never triggers a download)."""
  return seqio.TfdsDataSource(tfds_name=name, tfds_data_dir=data_dir,
                              splits=dict(splits), decoders=decoders,
                              read_only=True)
