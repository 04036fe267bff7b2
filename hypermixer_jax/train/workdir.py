"""What a run does to its workdir besides checkpoints: lock, config, logs.

* ``WorkdirLock``: one job per workdir. On a local disk an exclusive
  ``flock`` on ``workdir/.lock`` held for the whole run; the kernel drops it
  when the process dies (``kill -9`` included), so a killed job never leaves
  it stuck. On ``gs://`` (no flock there) an object created with a generation
  precondition and renewed by a heartbeat (``gcs_lock``; a killed holder's
  lock is taken over once stale). Other object stores (``s3://`` ...) are
  not locked (a warning says so). A second job is refused with the holder's
  host, PID and start time, which the holder writes into the lock.
* ``save_config``: the resolved config of every run, as
  ``config.json`` (the latest) and ``configs/<UTC time>-step<N>.json``.
* ``truncate_logs``: on resume from step S, drops what the interrupted run
  logged after S from ``metrics.jsonl`` and from the TensorBoard event files
  (the resumed run logs those steps again), so no step appears twice (a
  finished run started again evaluates its last step again: every
  evaluator's records of it go, the ``config.evals`` extras' included).

Only process 0 calls these (the workdir is shared by the hosts of a job).
All file access goes through ``storage`` (``etils.epath``), so a workdir may
be local or ``gs://``.
"""
from __future__ import annotations

import contextlib
import datetime
import fcntl
import json
import os
import socket

from absl import logging
import ml_collections

from hypermixer_jax.train import preflight
from hypermixer_jax.train import storage

LOCK_FILE = ".lock"
METRICS_FILE = "metrics.jsonl"


def user_errors() -> tuple[type[Exception], ...]:
  """Errors whose message is the whole story (main.py exits with it)."""
  from hypermixer_jax import data as data_lib  # pylint: disable=g-import-not-at-top
  from hypermixer_jax.train import checkpoint as ckpt_lib  # pylint: disable=g-import-not-at-top
  from hypermixer_jax.models.moe import tmoe  # pylint: disable=g-import-not-at-top
  from hypermixer_jax.train import config_checks  # pylint: disable=g-import-not-at-top
  from hypermixer_jax import sharding  # pylint: disable=g-import-not-at-top
  return (data_lib.DataError, config_checks.ConfigError,
          ckpt_lib.CheckpointError, WorkdirLocked, preflight.WorkdirError,
          FileNotFoundError, tmoe.ExpertMeshError, sharding.MeshError)


def guard(config: ml_collections.ConfigDict, workdir: str, *,
          is_main: bool) -> contextlib.AbstractContextManager:
  """Checks before anything is built or compiled, and the run's lock.

  Validates every config field and that the model builds
  (``config_checks``), checks that what the
  input pipeline emits fits the model (``data.check_fits_model``), the
  batch sizes, data files and workdir (``preflight``) and that the config
  fits the workdir's checkpoints (``run_config.check_fits_checkpoints``),
  and returns the context that holds the workdir lock on process 0.
  """
  from hypermixer_jax import data as data_lib  # pylint: disable=g-import-not-at-top
  from hypermixer_jax.train import config_checks  # pylint: disable=g-import-not-at-top
  from hypermixer_jax.train import run_config  # pylint: disable=g-import-not-at-top
  config_checks.validate(config)
  config_checks.check_model(config.model)
  data_lib.check_fits_model(config.data, config.model)
  preflight.check_batches(config)
  preflight.check_data_files(config)
  if is_main:
    preflight.check_writable(workdir)
  run_config.check_fits_checkpoints(config, workdir)
  run_config.check_accumulator(config, workdir)
  return WorkdirLock(workdir) if is_main else contextlib.nullcontext()


def logged_splits(workdir: str, step: int) -> set[str]:
  """The splits with a record of ``step`` in ``metrics.jsonl``."""
  path = storage.path(workdir) / METRICS_FILE
  out = set()
  for line in path.read_text().splitlines() if path.exists() else []:
    try:
      rec = json.loads(line)
      if int(rec["step"]) == step:
        out.add(rec.get("split", "train"))
    except (ValueError, KeyError, TypeError):  # a line cut short by a kill
      continue
  return out


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
    self.path = os.path.join(os.fspath(workdir), LOCK_FILE)
    self._fd = None
    self._remote = None

  def acquire(self) -> "WorkdirLock":
    holder = json.dumps({
        "host": socket.gethostname(), "pid": os.getpid(),
        "since": datetime.datetime.now(datetime.timezone.utc).isoformat(
            timespec="seconds")})
    if self.path.startswith("gs://"):
      from hypermixer_jax.train import gcs_lock  # pylint: disable=g-import-not-at-top
      self._remote = gcs_lock.GcsLock(
          self.path, holder, locked_error=WorkdirLocked,
          describe=_describe).acquire()
      return self
    if not storage.is_local(self.path):
      logging.warning("Workdir %s is not a local or gs:// path: no lock is "
                      "taken; make sure no other job uses it.",
                      os.path.dirname(self.path))
      return self
    os.makedirs(os.path.dirname(self.path), exist_ok=True)
    fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
      fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
      text = os.pread(fd, 4096, 0).decode("utf-8", "replace")
      os.close(fd)
      raise WorkdirLocked(
          f"{os.path.dirname(self.path)} is in use by another job "
          f"({_describe(text)}). "
          "Stop that job or pass another --workdir. (The lock is released "
          "when its holder exits or is killed; it is never stale.)") from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, holder.encode(), 0)
    os.fsync(fd)
    self._fd = fd
    return self

  def release(self) -> None:
    if self._remote is not None:
      self._remote.release()
      self._remote = None
    if self._fd is not None:
      fcntl.flock(self._fd, fcntl.LOCK_UN)
      os.close(self._fd)
      self._fd = None

  def __enter__(self) -> "WorkdirLock":
    return self.acquire()

  def __exit__(self, *exc) -> None:
    self.release()


def _describe(holder: str) -> str:
  """The lock holder's host, PID and start time, from the lock's text."""
  try:
    who = json.loads(holder)
    return f"host {who['host']}, PID {who['pid']}, running since {who['since']}"
  except (ValueError, KeyError, TypeError):
    return f"holder unknown ({holder!r})"


def save_config(config: ml_collections.ConfigDict, workdir: str,
                start_step: int) -> str:
  """Writes the resolved config of this run; returns the per-run file."""
  text = config.to_json_best_effort(indent=1, sort_keys=True)
  stamp = datetime.datetime.now(datetime.timezone.utc).strftime(
      "%Y%m%dT%H%M%SZ")
  folder = storage.path(workdir) / "configs"
  folder.mkdir(parents=True, exist_ok=True)
  path = folder / f"{stamp}-step{start_step}.json"
  for p in (path, storage.path(workdir) / "config.json"):
    storage.replace(p, text + "\n")   # never half a config after a kill
  return os.fspath(path)


def _keep(split: str, step: int, resume_step: int, redo_eval: bool) -> bool:
  """Whether a record stays: an evaluator's (any split but 'train') at the
  resume step goes when that step is evaluated again."""
  if split != "train" and redo_eval:
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
    logging.info("Dropped %d log records %s step %d (%s; this run logs "
                 "them again).", dropped,
                 "at" if redo_eval_at_resume_step else "after", resume_step,
                 "the finished run's evaluation of its last step"
                 if redo_eval_at_resume_step else "logged by the interrupted "
                 "run after its last checkpoint")
  return dropped


def _truncate_jsonl(workdir, resume_step, redo_eval) -> int:
  path = storage.path(workdir) / METRICS_FILE
  if not path.exists():
    return 0
  kept, dropped = [], 0
  for line in path.read_text().splitlines(keepends=True):
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
    storage.replace(path, "".join(kept))
  return dropped


def _truncate_tensorboard(workdir, resume_step, redo_eval) -> int:
  folder = storage.path(workdir) / "tensorboard"
  # (epath's walk loses the gs:// prefix with the fsspec backend; the writer
  # puts event files in the folder or one level below: add_scalars' runs.)
  files = sorted(p for pattern in ("events.out.tfevents.*",
                                   "*/events.out.tfevents.*")
                 for p in folder.glob(pattern)) if folder.exists() else []
  if not files:
    return 0
  from tensorboardX.proto import event_pb2  # pylint: disable=g-import-not-at-top
  total = 0
  for path in files:
    records, damaged = storage.read_records(path)
    kept, dropped = [], int(damaged)  # a record cut short by a kill
    for record in records:
      event = event_pb2.Event.FromString(record)
      tags = [v.tag for v in event.summary.value]
      split = "train" if tags and all(t.startswith("train/") for t in tags) \
          else "evaluation"
      if not event.HasField("summary") or _keep(split, event.step,
                                                resume_step, redo_eval):
        kept.append(record)
      else:
        dropped += 1
    if dropped:
      storage.replace(path, storage.encode_records(kept))
      total += dropped
  return total
