"""What a run does to its workdir besides checkpoints: lock, config, logs.

* ``WorkdirLock``: one job per workdir. An exclusive ``flock`` on
  ``workdir/.lock`` held for the whole run; the kernel drops it when the
  process dies (``kill -9`` included), so a killed job never leaves it stuck.
  A second job is refused with the holder's host, PID and start time, which
  the holder writes into the file.
* ``save_config``: the resolved config of every run, as
  ``config.json`` (the latest) and ``configs/<UTC time>-step<N>.json``.
* ``truncate_logs``: on resume from step S, drops what the interrupted run
  logged after S from ``metrics.jsonl`` and from the TensorBoard event files
  (the resumed run logs those steps again), so no step appears twice.

Only process 0 calls these (the workdir is shared by the hosts of a job).
"""
from __future__ import annotations

import contextlib
import datetime
import fcntl
import glob
import json
import os
import socket

from absl import logging
import ml_collections

LOCK_FILE = ".lock"
METRICS_FILE = "metrics.jsonl"


def user_errors() -> tuple[type[Exception], ...]:
  """Errors whose message is the whole story (main.py exits with it)."""
  from hypermixer_jax import data as data_lib  # pylint: disable=g-import-not-at-top
  from hypermixer_jax.train import checkpoint as ckpt_lib  # pylint: disable=g-import-not-at-top
  from hypermixer_jax.train import config_checks  # pylint: disable=g-import-not-at-top
  return (data_lib.DataError, config_checks.ConfigError,
          ckpt_lib.CheckpointError, WorkdirLocked, FileNotFoundError)


def guard(config: ml_collections.ConfigDict, workdir: str, *,
          is_main: bool) -> contextlib.AbstractContextManager:
  """Checks before anything is built or compiled, and the run's lock.

  Validates every config field (``config_checks``), checks that what the
  input pipeline emits fits the model (``data.check_fits_model``), and
  returns the context that holds the workdir lock on process 0.
  """
  from hypermixer_jax import data as data_lib  # pylint: disable=g-import-not-at-top
  from hypermixer_jax.train import config_checks  # pylint: disable=g-import-not-at-top
  config_checks.validate(config)
  data_lib.check_fits_model(config.data, config.model)
  return WorkdirLock(workdir) if is_main else contextlib.nullcontext()


def start_logs(config: ml_collections.ConfigDict, workdir: str,
               start_step: int, *, is_main: bool) -> None:
  """Before the first log record of a run: its config, and no step twice.

  Call with the step the run starts from, before the metric writer opens.
  """
  if not is_main:
    return
  save_config(config, workdir, start_step)
  truncate_logs(workdir, start_step, redo_eval_at_resume_step=(
      start_step >= int(config.num_train_steps)))


class WorkdirLocked(RuntimeError):
  """Another live job holds the workdir."""


class WorkdirLock:
  """Context manager holding ``workdir/.lock`` (see the module docstring)."""

  def __init__(self, workdir: str):
    self.path = os.path.join(workdir, LOCK_FILE)
    self._fd = None

  def acquire(self) -> "WorkdirLock":
    if "://" in self.path:
      logging.warning("Workdir %s is not a local path: no lock is taken; "
                      "make sure no other job uses it.",
                      os.path.dirname(self.path))
      return self
    os.makedirs(os.path.dirname(self.path), exist_ok=True)
    fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
      fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
      holder = os.pread(fd, 4096, 0).decode("utf-8", "replace")
      os.close(fd)
      try:
        who = json.loads(holder)
        desc = (f"host {who['host']}, PID {who['pid']}, running since "
                f"{who['since']}")
      except (ValueError, KeyError):
        desc = f"holder unknown ({holder!r})"
      raise WorkdirLocked(
          f"{os.path.dirname(self.path)} is in use by another job ({desc}). "
          "Stop that job or pass another --workdir. (The lock is released "
          "when its holder exits or is killed; it is never stale.)") from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps({
        "host": socket.gethostname(), "pid": os.getpid(),
        "since": datetime.datetime.now(datetime.timezone.utc).isoformat(
            timespec="seconds")}).encode(), 0)
    os.fsync(fd)
    self._fd = fd
    return self

  def release(self) -> None:
    if self._fd is not None:
      fcntl.flock(self._fd, fcntl.LOCK_UN)
      os.close(self._fd)
      self._fd = None

  def __enter__(self) -> "WorkdirLock":
    return self.acquire()

  def __exit__(self, *exc) -> None:
    self.release()


def save_config(config: ml_collections.ConfigDict, workdir: str,
                start_step: int) -> str:
  """Writes the resolved config of this run; returns the per-run file."""
  text = config.to_json_best_effort(indent=1, sort_keys=True)
  stamp = datetime.datetime.now(datetime.timezone.utc).strftime(
      "%Y%m%dT%H%M%SZ")
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  folder = os.path.join(workdir, "configs")
  tf.io.gfile.makedirs(folder)
  path = os.path.join(folder, f"{stamp}-step{start_step}.json")
  for p in (path, os.path.join(workdir, "config.json")):
    with tf.io.gfile.GFile(p, "w") as f:
      f.write(text + "\n")
  return path


def _keep(split: str, step: int, resume_step: int, redo_eval: bool) -> bool:
  if split == "eval" and redo_eval:
    return step < resume_step
  return step <= resume_step


def truncate_logs(workdir: str, resume_step: int, *,
                  redo_eval_at_resume_step: bool = False) -> int:
  """Drops records logged after ``resume_step``; returns how many.

  ``redo_eval_at_resume_step``: the run will evaluate ``resume_step`` again
  (a finished run restarted), so its earlier evaluation goes too.
  """
  dropped = _truncate_jsonl(workdir, resume_step, redo_eval_at_resume_step)
  dropped += _truncate_tensorboard(workdir, resume_step,
                                   redo_eval_at_resume_step)
  if dropped:
    logging.info("Dropped %d log records after step %d (logged by the "
                 "interrupted run; this run logs those steps again).",
                 dropped, resume_step)
  return dropped


def _truncate_jsonl(workdir, resume_step, redo_eval) -> int:
  path = os.path.join(workdir, METRICS_FILE)
  if not os.path.exists(path):
    return 0
  kept, dropped = [], 0
  with open(path, encoding="utf-8") as f:
    for line in f:
      try:
        rec = json.loads(line)
        keep = _keep(rec.get("split", "train"), int(rec["step"]),
                     resume_step, redo_eval)
      except (ValueError, KeyError):  # a line cut short by a kill
        keep = False
      if keep:
        kept.append(line if line.endswith("\n") else line + "\n")
      else:
        dropped += 1
  if dropped:
    with open(path + ".tmp", "w", encoding="utf-8") as f:
      f.writelines(kept)
    os.replace(path + ".tmp", path)
  return dropped


def _truncate_tensorboard(workdir, resume_step, redo_eval) -> int:
  files = sorted(glob.glob(os.path.join(workdir, "tensorboard",
                                        "**", "events.out.tfevents.*"),
                           recursive=True))
  if not files:
    return 0
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  from tensorflow.core.util import event_pb2  # pylint: disable=g-import-not-at-top
  total = 0
  for path in files:
    kept, dropped = [], 0
    try:
      for record in tf.data.TFRecordDataset(path).as_numpy_iterator():
        event = event_pb2.Event.FromString(record)
        tags = [v.tag for v in event.summary.value]
        split = "eval" if tags and all(t.startswith("eval/") for t in tags) \
            else "train"
        if not event.HasField("summary") or _keep(split, event.step,
                                                  resume_step, redo_eval):
          kept.append(record)
        else:
          dropped += 1
    except tf.errors.DataLossError:  # a record cut short by a kill
      dropped += 1
    if dropped:
      with tf.io.TFRecordWriter(path + ".tmp") as w:
        for record in kept:
          w.write(record)
      os.replace(path + ".tmp", path)
      total += dropped
  return total
