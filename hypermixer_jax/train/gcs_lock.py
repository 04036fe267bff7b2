"""The workdir lock on Cloud Storage, where ``flock`` cannot work.

The lock is the object ``gs://BUCKET/WORKDIR/.lock``, holding its holder's
host, PID and start time (google-cloud-storage, the only client that sets
GCS preconditions; install it with the ``gcs`` extra):

* acquire: the object is created only if absent, an upload with the
  precondition ``ifGenerationMatch=0``, which GCS applies atomically: of two
  jobs racing for one workdir exactly one gets it, the other is refused;
* heartbeat: the holder rewrites it every ``heartbeat_s`` (precondition: the
  generation it wrote last), so its ``updated`` time shows that it is alive;
* release: deleted (precondition: its own generation) when the run ends,
  normally or by an exception or a preemption save;
* stale: a job killed without clean-up (``kill -9``, a VM lost) leaves the
  object behind. One whose last heartbeat is older than ``stale_s`` is taken
  over (precondition: that stale generation, so again one contender wins);
  a fresher one refuses the new job with the holder, the heartbeat's age and
  the command that removes the lock by hand when the holder is known dead.

Staleness compares the object's ``updated`` time (set by GCS's clock) with
this host's clock; hosts synchronised by NTP (Cloud VMs are) differ by far
less than ``stale_s``.
"""
from __future__ import annotations

import datetime
import threading
from typing import Any, Callable

from absl import logging

HEARTBEAT_S = 60.0
STALE_S = 300.0


def split_url(url: str) -> tuple[str, str]:
  """``gs://bucket/a/b`` -> ``("bucket", "a/b")``."""
  if not url.startswith("gs://"):
    raise ValueError(f"not a gs:// path: {url!r}")
  bucket, _, name = url[len("gs://"):].partition("/")
  return bucket, name


def _bucket(name: str) -> Any:
  try:
    from google.cloud import storage  # pylint: disable=g-import-not-at-top
  except ImportError:
    raise ImportError(
        "a gs:// workdir is locked through google-cloud-storage: pip install "
        "'hypermixer_jax[gcs]' (or google-cloud-storage).") from None
  return storage.Client().bucket(name)


def _now() -> datetime.datetime:
  return datetime.datetime.now(datetime.timezone.utc)


class GcsLock:
  """Holds ``url`` (a ``gs://`` object) as described in the module docstring.

  Args:
    url: the lock object, ``gs://bucket/workdir/.lock``.
    payload: the text written into it (who holds it).
    locked_error: the exception class raised when another job holds it.
    describe: the holder's description from the object's text.
    heartbeat_s / stale_s: see the module docstring.
    bucket: a ``google.cloud.storage.Bucket`` (tests pass a fake one).
    now: the clock (UTC ``datetime``).
  """

  def __init__(self, url: str, payload: str, *,
               locked_error: type[Exception] = RuntimeError,
               describe: Callable[[str], str] = str,
               heartbeat_s: float = HEARTBEAT_S, stale_s: float = STALE_S,
               bucket: Any = None,
               now: Callable[[], datetime.datetime] = _now):
    self.url = url
    bucket_name, self._name = split_url(url)
    self._bucket = bucket if bucket is not None else _bucket(bucket_name)
    self._payload = payload
    self._error = locked_error
    self._describe = describe
    self._heartbeat_s = heartbeat_s
    self._stale_s = stale_s
    self._now = now
    self.generation = None
    self._stop = threading.Event()
    self._thread = None

  def acquire(self) -> "GcsLock":
    from google.api_core import exceptions  # pylint: disable=g-import-not-at-top
    held = self._bucket.get_blob(self._name)
    expected = 0        # create only if absent
    if held is not None:
      age = (self._now() - held.updated).total_seconds()
      if age < self._stale_s:
        raise self._error(self._refusal(held, age))
      logging.warning("Taking over the stale lock %s (last heartbeat %.0f s "
                      "ago, more than %.0f s): %s", self.url, age,
                      self._stale_s, _text(held))
      expected = held.generation
    blob = self._bucket.blob(self._name)
    try:
      blob.upload_from_string(self._payload, if_generation_match=expected)
    except exceptions.PreconditionFailed:
      # Another job created or took it over between the read and the write.
      held = self._bucket.get_blob(self._name)
      raise self._error(self._refusal(held, 0.0)) from None
    self.generation = blob.generation
    self._stop.clear()
    self._thread = threading.Thread(target=self._beat, daemon=True,
                                    name="workdir-lock-heartbeat")
    self._thread.start()
    return self

  def _refusal(self, held: Any, age: float) -> str:
    who = self._describe(_text(held)) if held is not None else "released"
    return (f"{self.url.rsplit('/', 1)[0]} is in use by another job ({who}; "
            f"its lock {self.url} was renewed {age:.0f} s ago). Stop that job "
            f"or pass another --workdir. A lock not renewed for {self._stale_s:.0f}"
            f" s (its holder died) is taken over; if the holder is known to be "
            f"dead, remove it now: gcloud storage rm {self.url}")

  def _beat(self) -> None:
    from google.api_core import exceptions  # pylint: disable=g-import-not-at-top
    while not self._stop.wait(self._heartbeat_s):
      blob = self._bucket.blob(self._name)
      try:
        blob.upload_from_string(self._payload,
                                if_generation_match=self.generation)
        self.generation = blob.generation
      except exceptions.PreconditionFailed:
        logging.error("Workdir lock %s was taken over by another job (this "
                      "one did not renew it for %.0f s): two jobs now write "
                      "this workdir; stop one.", self.url, self._stale_s)
        return
      except Exception as e:  # pylint: disable=broad-except
        logging.warning("Workdir lock %s: heartbeat failed (%s); retrying.",
                        self.url, e)

  def release(self) -> None:
    from google.api_core import exceptions  # pylint: disable=g-import-not-at-top
    if self._thread is not None:
      self._stop.set()
      self._thread.join()
      self._thread = None
    if self.generation is None:
      return
    try:
      self._bucket.blob(self._name).delete(if_generation_match=self.generation)
    except (exceptions.NotFound, exceptions.PreconditionFailed):
      logging.warning("Workdir lock %s was no longer this job's at release.",
                      self.url)
    self.generation = None


def _text(blob: Any) -> str:
  try:
    return blob.download_as_text()
  except Exception:  # pylint: disable=broad-except
    return "holder unknown"
