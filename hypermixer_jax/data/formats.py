"""Rows of local JSONL / TSV / text files as tf.data string ops.

A format is a pair of functions: ``open_*(path, fields)`` yields one file's
``(meta, (line number, raw line))`` with no function per line (it runs
inside the interleave of files), and ``parse_*(meta, numbers, lines,
fields)`` checks and parses a block of those rows at once into
``(features, where, checks)`` (``where`` names the rows for messages,
``checks`` are ``data_check`` ops). JSON lines are read with a small
string-op parser for flat objects (the C4 / NLI layout): a field's string
value, or an integer.
"""
from __future__ import annotations

import re
from typing import Mapping, Sequence

import tensorflow as tf

from hypermixer_jax.data.checks import data_check


def check_line(path: tf.Tensor, number: tf.Tensor, line: tf.Tensor
                ) -> tf.Tensor:
  """``line`` without a final '\\r', checked to be valid UTF-8."""
  line = tf.strings.regex_replace(line, "\r$", "")
  valid = tf.equal(tf.strings.unicode_transcode(
      line, "UTF-8", "UTF-8", errors="replace", replacement_char=0xFFFD), line)
  # A NUL byte (a binary file, or a failed conversion) would become <unk>.
  no_nul = tf.logical_not(tf.strings.regex_full_match(line, r"(?s).*\x00.*"))
  with tf.control_dependencies([data_check(
      valid, path, ":", number, ": the line is not valid UTF-8; re-encode "
      "the file as UTF-8 (e.g. iconv -f latin1 -t utf-8)."), data_check(
          no_nul, path, ":", number, ": the line holds a NUL byte (code 0); "
          "fix or remove the row (is this a text file?).")]):
    return tf.identity(line)


def check_inputs(out: Mapping[str, tf.Tensor], where: list,
                 fields: Mapping[str, Sequence[str]]) -> list[tf.Operation]:
  """Checks that no input field (every field but ``label``) of a row is
  empty or blank: an empty sentence would train as an empty input. Tasks
  that want empty inputs pass ``data.allow_empty_inputs``."""
  return [data_check(
      tf.strings.length(tf.strings.strip(out[feat])) > 0, *where,
      f": the {' / '.join(map(repr, fields[feat]))} field is empty; fill or "
      "remove the row (or pass --config.data.allow_empty_inputs=True if the "
      "task wants empty inputs).")
          for feat in out if feat != "label"]


def text_lines(path: tf.Tensor) -> tf.data.Dataset:
  """The lines of one file; a gzip file (``.gz``, as allenai/c4's
  ``c4-train.NNNNN-of-01024.json.gz`` shards) is read decompressed."""
  gzip = tf.strings.regex_full_match(tf.strings.lower(path), r".*\.gz")
  return tf.data.TextLineDataset(
      path, compression_type=tf.where(gzip, "GZIP", ""))


def numbered_lines(path: tf.Tensor) -> tf.data.Dataset:
  """(line number from 1, checked line) of one file, parsed in this file's
  own chain (WikiText articles, TSV headers)."""
  lines = text_lines(path).enumerate(start=1)
  return lines.map(tf.autograph.experimental.do_not_convert(
      lambda number, line: (number, check_line(path, number, line))),
                   num_parallel_calls=tf.data.AUTOTUNE)


def raw_lines(meta: Mapping[str, tf.Tensor], rows: tf.data.Dataset
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


# Traced once per process (a fixed signature), not again in every pipeline
# build that parses JSON lines.
@tf.function(input_signature=[tf.TensorSpec([], tf.string)], autograph=False)
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


def label_id(value: tf.Tensor, where: list, label_names: Sequence[str],
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


def open_lines(path, fields):
  del fields
  return raw_lines({"path": path},
                    text_lines(path).enumerate(start=1))


def parse_jsonl(meta, number, line, fields):
  path = meta["path"]
  where = [path, ":", number]
  line = check_line(path, number, line)
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
        " (a string or integer) in this JSON line, or the line is not "
        "valid JSON (cut short?); each line must be a flat JSON object."))
    out[feat] = value
  return out, where, checks


def open_tsv(path, fields, extra_meta=None):
  """A TSV with a header line; its columns are looked up by name."""
  lines = numbered_lines(path)
  header = lines.take(1).reduce(tf.constant(""), lambda _, x: x[1])
  # Empty lines are no rows (the reader drops them).
  has_rows = lines.skip(1).filter(
      lambda _, line: tf.strings.length(
          tf.strings.regex_replace(line, "\r$", "")) > 0).take(1).reduce(
              tf.constant(False), lambda *_: tf.constant(True))
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
  return raw_lines(meta, text_lines(path).enumerate(start=1)
                    .skip(1))


def parse_tsv(meta, number, line, fields):
  """A block of TSV rows (``line`` a vector) -> one vector per field."""
  path, num_columns = meta["path"], meta["num_columns"]
  where = [path, ":", number]
  cells = tf.strings.split(check_line(path, number, line), "\t")
  counts = tf.cast(cells.row_lengths(), tf.int32)
  count = data_check(
      tf.equal(counts, num_columns), *where, ": the row has ", counts,
      " tab-separated fields, the header has ", num_columns, ".")
  with tf.control_dependencies([count]):
    table = cells.to_tensor(default_value="", shape=tf.stack(
        [tf.size(line), num_columns]))
  out = {feat: table[:, meta["columns"][i]] for i, feat in enumerate(fields)}
  return out, where, []


def parse_text(meta, number, line, fields):
  del fields
  path = meta["path"]
  return ({"text": check_line(path, number, line)}, [path, ":", number], [])
