"""WikiText (Merity et al. 2016) files read as articles, not lines
(``data.text_layout='wikitext'``), and WikiText's tokenization undone."""
from __future__ import annotations

import tensorflow as tf

from hypermixer_jax.data.formats import numbered_lines
from hypermixer_jax.data.formats import raw_lines


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


def open_wikitext(path, fields):
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
  lines = numbered_lines(path).map(tf.autograph.experimental.do_not_convert(
      lambda number, line: (number, line, tf.constant(False))))
  # A sentinel title after the last line flushes the last article.
  end = tf.data.Dataset.from_tensors(
      (tf.constant(0, tf.int64), tf.constant(""), tf.constant(True)))

  @tf.autograph.experimental.do_not_convert
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
  plain = tf.autograph.experimental.do_not_convert
  articles = articles.filter(plain(lambda number, text, emit: emit)).map(
      plain(lambda number, text, emit: (number, text)))
  return raw_lines({"path": path}, articles)


def parse_wikitext(meta, number, text, fields):
  del fields  # the article's lines were checked in its file's chain
  return {"text": text}, [meta["path"], ":", number], []
