"""The files of a run, on a local disk or in Cloud Storage (``gs://``).

Every file a run writes or reads (checkpoints, ``metrics.jsonl``, TensorBoard
events, ``config.json``, ``configs/``, evaluations, predictions, exports,
pseudo-attention maps, profiles) goes through ``etils.epath``, the path layer
of t5x, big_vision and Orbax. For ``gs://`` epath uses ``tf.io.gfile`` when
TensorFlow is installed (it is: the input pipelines need it) and fsspec's
``gcsfs`` with ``EPATH_USE_TF=false``; Orbax writes array data through
TensorStore's own ``gcs`` driver.

Object stores differ from a disk in two ways that matter here, handled once:

* no appending: ``AppendFile`` appends locally and, on an object store, keeps
  the text and rewrites the whole object at each ``flush`` (an object write is
  atomic: readers see the old or the new object, never half of one);
* no atomic rename: ``replace`` writes a temporary file and renames it
  locally, and writes the object in one go on an object store.

Tested against a local GCS emulator (``tests/gcs_workdir_test.py``) through
gcsfs (``STORAGE_EMULATOR_HOST``), TensorStore (``TENSORSTORE_GCS_HTTP_URL``)
and google-cloud-storage. TensorFlow's GCS file system cannot be pointed at
an emulator: its endpoint ``https://www.googleapis.com/storage/v1/`` is built
into ``libtensorflow_framework`` and only ``GCS_*`` tuning variables are
read; epath's ``tf.io.gfile`` backend for ``gs://`` is therefore exercised on
real GCS only, running the same calls as the gcsfs backend.

``register_tensorboard`` lets tensorboardX write its event files through
epath too (its own ``gs://`` writer needs google-cloud-storage and does not
go through the path layer); ``read_records`` / ``encode_records`` read and
write TFRecord framing (event files) without TensorFlow's file system.
"""
from __future__ import annotations

import contextlib
import os
import struct
import tempfile
import threading

from etils import epath


def path(p: str | os.PathLike) -> epath.Path:
  """``p`` as an ``epath.Path`` (``gs://...`` or a local path)."""
  return epath.Path(p)


def is_local(p: str | os.PathLike) -> bool:
  """True for a path on this machine's file system (no ``scheme://``)."""
  return "://" not in os.fspath(p)


def absolute(p: str | os.PathLike) -> str:
  """A local path made absolute (from the current folder); an object-store
  URL unchanged."""
  p = os.fspath(p)
  return os.path.abspath(p) if is_local(p) else p


def unexpanded_home(flag: str, value: str, many: bool = False) -> str | None:
  """The one line for a path written ``~/...`` after ``=`` (no shell expands
  it there: it would name a folder ``~`` in the current one); ``many``: a
  comma-separated list. None for any other value."""
  parts = [p.strip() for p in value.split(",")] if many else [value]
  if not any(p == "~" or p.startswith("~/") for p in parts):
    return None
  fixed = ", ".join("$HOME" + p[1:] if p[:1] == "~" else p for p in parts)
  return (f"{flag}={value}: the shell does not expand '~' after '=', so it "
          f"would name a folder '~' in this one; write {flag}={fixed} or an "
          "absolute path.")


def replace(target: str | os.PathLike, data: bytes | str) -> None:
  """Writes ``data`` (text as UTF-8) to ``target`` so that readers see all
  of it or none.

  Locally the data go to a new temporary file in the target's folder,
  created exclusively without following links (``tempfile.mkstemp``:
  ``O_CREAT | O_EXCL | O_NOFOLLOW``, an unpredictable name), so a link
  planted in a shared folder cannot redirect the write; it is synced and
  renamed over the target (the rename replaces a link at the target, never
  the file it points to).
  """
  target = path(target)
  if isinstance(data, str):
    data = data.encode("utf-8")
  if not is_local(target):
    with target.open("wb") as f:
      f.write(data)
    return
  try:
    mode = os.stat(target, follow_symlinks=False).st_mode & 0o777
  except FileNotFoundError:
    mode = 0o644
  fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp",
                             dir=os.fspath(target.parent))
  try:
    with os.fdopen(fd, "wb") as f:
      f.write(data)
      f.flush()
      os.fsync(f.fileno())
    os.chmod(tmp, mode)
    os.replace(tmp, target)
  except BaseException:
    with contextlib.suppress(FileNotFoundError):   # e.g. a full disk
      os.unlink(tmp)
    raise


class AppendFile:
  """A text file that grows by ``write`` (``metrics.jsonl``).

  Locally: opened in append mode and flushed at each ``flush``. On an object
  store: the existing text is read once, and the whole object is written at
  each ``flush`` (so what ``flush`` returned for is in the bucket, as a
  local flush is on disk).
  """

  def __init__(self, p: str | os.PathLike):
    self.path = path(p)
    self._local = is_local(self.path)
    self._lock = threading.Lock()
    if self._local:
      self._f = self.path.open("a", encoding="utf-8")
    else:
      self._text = ([self.path.read_text(encoding="utf-8")]
                    if self.path.exists() else [])
      self._dirty = False

  def write(self, text: str) -> None:
    with self._lock:
      if self._local:
        self._f.write(text)
      else:
        self._text.append(text)
        self._dirty = True

  def flush(self) -> None:
    with self._lock:
      if self._local:
        self._f.flush()
      elif self._dirty:
        self.path.write_text("".join(self._text), encoding="utf-8")
        self._dirty = False

  def close(self) -> None:
    self.flush()
    if self._local:
      self._f.close()


# ---------------------------------------------------------------------------
# TFRecord framing (TensorBoard event files), without TensorFlow's file system.
# Each record: uint64 length, uint32 masked CRC-32C of the length, the data,
# uint32 masked CRC-32C of the data (little-endian).
# ---------------------------------------------------------------------------
def _masked_crc(data: bytes) -> int:
  from tensorboardX import record_writer  # pylint: disable=g-import-not-at-top
  return record_writer.masked_crc32c(data)


def read_records(p: str | os.PathLike) -> tuple[list[bytes], bool]:
  """``(records, damaged)`` of a TFRecord file.

  Reading stops at the first record that is cut short or fails its checksum
  (a writer killed mid-write); ``damaged`` says that happened.
  """
  data = path(p).read_bytes()
  records, pos = [], 0
  while pos < len(data):
    head = data[pos:pos + 12]
    if len(head) < 12:
      return records, True
    (length,), (length_crc,) = struct.unpack("<Q", head[:8]), struct.unpack(
        "<I", head[8:])
    body = data[pos + 12:pos + 12 + length]
    tail = data[pos + 12 + length:pos + 16 + length]
    if (_masked_crc(head[:8]) != length_crc or len(body) < length
        or len(tail) < 4 or struct.unpack("<I", tail)[0] != _masked_crc(body)):
      return records, True
    records.append(body)
    pos += 16 + length
  return records, False


def encode_records(records: list[bytes]) -> bytes:
  """TFRecord framing of ``records`` (the inverse of ``read_records``)."""
  out = []
  for r in records:
    length = struct.pack("<Q", len(r))
    out += [length, struct.pack("<I", _masked_crc(length)), r,
            struct.pack("<I", _masked_crc(r))]
  return b"".join(out)


class _EventFile:
  """tensorboardX's record writer interface, over epath: the bytes written
  so far are kept and the whole object is written at each ``flush`` (event
  files of a run hold scalars and a few images: kilobytes to megabytes)."""

  def __init__(self, p: str):
    self._path = path(p)
    self._buffer = bytearray()
    self._written = 0

  def write(self, data: bytes) -> None:
    self._buffer += data

  def flush(self) -> None:
    if len(self._buffer) != self._written:
      self._path.write_bytes(bytes(self._buffer))
      self._written = len(self._buffer)

  def close(self) -> None:
    self.flush()


class _EventFileFactory:

  def open(self, p: str) -> _EventFile:
    return _EventFile(p)

  def directory_check(self, p: str) -> None:
    path(p).mkdir(parents=True, exist_ok=True)


def register_tensorboard(scheme: str = "gs") -> None:
  """tensorboardX writes ``scheme://`` event files through epath."""
  from tensorboardX import record_writer  # pylint: disable=g-import-not-at-top
  record_writer.register_writer_factory(scheme, _EventFileFactory())
