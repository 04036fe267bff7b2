"""Bad input data stops the pipeline from inside the tf.data graph.

``data_check(ok, *parts)`` is an in-graph assertion whose message is
carried out of tf.data between markers; ``Pipeline`` turns the failing
iterator's error back into a ``DataError`` (``data_error_from``) naming the
file, the line, the value and the fix.
"""
from __future__ import annotations

import re

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
  # Imported here: ``DataError`` above is caught by code that imports no
  # TensorFlow (the synthetic task's runs, the command line's errors).
  import tensorflow as tf  # pylint: disable=g-import-not-at-top

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
