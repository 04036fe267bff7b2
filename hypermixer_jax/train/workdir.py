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
  (the resumed run logs those steps again), so no step appears twice.

Only process 0 calls these (the workdir is shared by the hosts of a job).
All file access goes through ``storage`` (``etils.epath``), so a workdir may
be local or ``gs://``.
"""
from __future__ import annotations

import contextlib
import datetime
import errno
import fcntl
import glob
import json
import os
import socket
import tempfile

from absl import logging
import ml_collections

from hypermixer_jax.train import storage

LOCK_FILE = ".lock"
METRICS_FILE = "metrics.jsonl"


def user_errors() -> tuple[type[Exception], ...]:
  """Errors whose message is the whole story (main.py exits with it)."""
  from hypermixer_jax import data as data_lib  # pylint: disable=g-import-not-at-top
  from hypermixer_jax.train import checkpoint as ckpt_lib  # pylint: disable=g-import-not-at-top
  from hypermixer_jax.train import config_checks  # pylint: disable=g-import-not-at-top
  return (data_lib.DataError, config_checks.ConfigError,
          ckpt_lib.CheckpointError, WorkdirLocked, WorkdirError,
          FileNotFoundError)


def guard(config: ml_collections.ConfigDict, workdir: str, *,
          is_main: bool) -> contextlib.AbstractContextManager:
  """Checks before anything is built or compiled, and the run's lock.

  Validates every config field (``config_checks``), checks that what the
  input pipeline emits fits the model (``data.check_fits_model``), and
  returns the context that holds the workdir lock on process 0.
  """
  from hypermixer_jax import data as data_lib  # pylint: disable=g-import-not-at-top
  from hypermixer_jax.train import config_checks  # pylint: disable=g-import-not-at-top
  from hypermixer_jax.train import run_config  # pylint: disable=g-import-not-at-top
  config_checks.validate(config)
  data_lib.check_fits_model(config.data, config.model)
  check_batches(config)
  check_data_files(config)
  if is_main:
    check_writable(workdir)
  run_config.check_fits_checkpoints(config, workdir)
  return WorkdirLock(workdir) if is_main else contextlib.nullcontext()


class WorkdirError(RuntimeError):
  """The workdir cannot hold the run (a file, read-only, full); the message
  names the path and the fix."""


def inside(workdir: str, name: str, field: str) -> str:
  """``workdir/name`` for a file name from the config meant to be relative
  to the workdir (``field`` names it in the error); refused when absolute
  or when it leads out of the workdir (``..``, a link)."""
  from hypermixer_jax.train import config_checks  # pylint: disable=g-import-not-at-top
  name = os.fspath(name)
  path = os.path.join(os.fspath(workdir), name)
  if storage.is_local(workdir):
    root = os.path.realpath(workdir)
    escapes = os.path.commonpath([root, os.path.realpath(path)]) != root
  else:
    escapes = ".." in name.replace("\\", "/").split("/")
  if not name or os.path.isabs(name) or not storage.is_local(name) or escapes:
    raise config_checks.ConfigError(
        f"{field}={name!r} must be a file name relative to the workdir that "
        f"stays inside it (no absolute path, no '..'); e.g. "
        f"--config.{field}={os.path.basename(name) or 'out.png'}.")
  return path


def check_writable(workdir: str) -> None:
  """Stops before any step when ``workdir`` cannot be written (a file, a
  read-only or full file system), naming it and the fix.

  A file is created and removed (tests run as root, which ignores modes:
  only an actual write tells).
  """
  if not storage.is_local(workdir):
    return
  if os.path.exists(workdir) and not os.path.isdir(workdir):
    raise WorkdirError(f"--workdir={workdir} is a file, not a folder; pass "
                       "the path of a folder (created when absent).")
  try:
    os.makedirs(workdir, exist_ok=True)
    fd, probe = tempfile.mkstemp(prefix=".write-check.", dir=workdir)
    try:
      os.write(fd, b"\n")
      os.fsync(fd)
    finally:
      os.close(fd)
      os.unlink(probe)
  except OSError as e:
    raise WorkdirError(
        f"--workdir={workdir} cannot be written ({e.strerror or e}); "
        f"{_fix(e)}") from None


def _fix(e: OSError) -> str:
  if e.errno == errno.ENOSPC:
    return "free space on its disk (the run resumes from its last checkpoint)."
  if e.errno in (errno.ENOTDIR, errno.EEXIST):
    return "a path on the way is a file; pass another --workdir."
  return ("make it writable (a read-only mount, or no write permission) or "
          "pass another --workdir.")


def disk_full(e: BaseException) -> OSError | None:
  """The ``ENOSPC`` error behind ``e`` (raised directly, or as the cause or
  context of a library's own exception), if any."""
  seen = set()
  while e is not None and id(e) not in seen:
    seen.add(id(e))
    if isinstance(e, OSError) and e.errno == errno.ENOSPC:
      return e
    if "No space left on device" in str(e):
      return OSError(errno.ENOSPC, "No space left on device")
    e = e.__cause__ or e.__context__
  return None


_DISK_FULL = ("No space left on device", "RESOURCE_EXHAUSTED")


class _DiskFullFilter:
  """Drops the log records of a full disk (Orbax's writer threads log one
  traceback per file they fail to write; the run's summary line says it
  once) and counts them."""

  def __init__(self):
    self.dropped = 0

  def _about_disk(self, text: str) -> bool:
    return any(m in text for m in _DISK_FULL)

  def filter(self, record) -> bool:
    text = record.getMessage()
    if record.exc_info and record.exc_info[1] is not None:
      text += f" {record.exc_info[1]}"
    if record.levelno >= 30 and (self.dropped or self._about_disk(text)):
      self.dropped += 1
      return False
    return True

  def hook(self, default, exc_value) -> None:
    # After a full disk, the writers and event loops that libraries close
    # under their threads fail too: consequences, not news.
    if self.dropped or disk_full(exc_value) is not None:
      self.dropped += 1
    else:
      default()


@contextlib.contextmanager
def quiet_disk_full():
  """Within: a full disk's errors in library threads and logs are counted,
  not printed (``disk_full_error`` gives the one line). Once one was seen,
  the hooks stay for the rest of the process: writers that flush at exit
  fail the same way."""
  import logging as py_logging  # pylint: disable=g-import-not-at-top
  import sys  # pylint: disable=g-import-not-at-top
  import threading  # pylint: disable=g-import-not-at-top
  quiet = _DiskFullFilter()
  handlers = list(py_logging.getLogger().handlers)
  hooks = (threading.excepthook, sys.unraisablehook, sys.excepthook)
  for h in handlers:
    h.addFilter(quiet)
  threading.excepthook = lambda args: quiet.hook(
      lambda: hooks[0](args), args.exc_value)
  sys.unraisablehook = lambda args: quiet.hook(
      lambda: hooks[1](args), args.exc_value)
  # Callbacks of native threads (TensorStore's) report through excepthook.
  sys.excepthook = lambda *args: quiet.hook(lambda: hooks[2](*args), args[1])
  try:
    yield quiet
  finally:
    if not quiet.dropped:
      for h in handlers:
        h.removeFilter(quiet)
      threading.excepthook, sys.unraisablehook, sys.excepthook = hooks


def disk_full_error(workdir: str) -> WorkdirError:
  """The one line a run stops with when its disk is full."""
  from hypermixer_jax.train import run_config  # pylint: disable=g-import-not-at-top
  steps = run_config.checkpoint_steps(workdir)
  kept = (f"the last good checkpoint is step {steps[-1]} in "
          f"{os.path.join(os.fspath(workdir), 'checkpoints')}; free space "
          "(or lower --config.keep_checkpoints) and run the same command "
          "again: it resumes from there." if steps else
          "no checkpoint was saved yet; free space and run it again.")
  return WorkdirError(
      f"No space left on the disk of --workdir={workdir}: stopped, {kept}")


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


def check_batches(config: ml_collections.ConfigDict) -> None:
  """Every batch size the run uses divides over the devices that split the
  batch (mesh axes ``data``, ``fsdp``, ``expert``), checked at the start
  rather than at the first evaluation."""
  import jax  # pylint: disable=g-import-not-at-top
  from hypermixer_jax import sharding  # pylint: disable=g-import-not-at-top
  from hypermixer_jax.train import config_checks  # pylint: disable=g-import-not-at-top
  try:
    shape = dict(zip(sharding.MESH_AXES, sharding.mesh_shape(
        config.mesh, jax.device_count())))
  except ValueError:
    return   # the mesh's own error comes when it is built
  axes = ("data", "fsdp", "expert")
  split = shape["data"] * shape["fsdp"] * shape["expert"]
  sizes = {"batch_size": config.batch_size}
  if int(config.eval_every) >= 0:
    sizes["eval_batch_size"] = config.eval_batch_size
  for name, spec in (config.get("evals") or {}).items():
    if spec.get("batch_size") and int(spec.get("every", 0)) >= 0:
      sizes[f"evals.{name}.batch_size"] = spec["batch_size"]
  for field, size in sizes.items():
    if int(size) % split:
      fit = max(split, int(size) // split * split)
      raise config_checks.ConfigError(
          f"{field}={size} does not divide over the {split} devices that "
          f"split the batch (mesh {' x '.join(f'{a}={shape[a]}' for a in axes)}"
          f" of {jax.device_count()} devices); pass --config.{field}={fit} "
          "(a multiple of it) or another --config.mesh.")


def _splits_read(config: ml_collections.ConfigDict) -> list[str]:
  """The data splits a training run reads."""
  splits = ["train"]
  if int(config.eval_every) >= 0:
    splits.append(config.eval_split)
  for spec in (config.get("evals") or {}).values():
    if int(spec.get("every", 0)) >= 0:
      splits.append(spec.get("split") or config.eval_split)
  return list(dict.fromkeys(splits))


def check_data_files(config: ml_collections.ConfigDict) -> None:
  """Each local data file the run reads exists and can be read: a missing
  evaluation file would otherwise stop the run at its first evaluation.

  Local patterns only (``glob``; no TensorFlow imported here): the input
  pipeline checks the others when it is built.
  """
  from hypermixer_jax.data import config as data_config  # pylint: disable=g-import-not-at-top
  files = data_config.local_files(config.data)
  for split in _splits_read(config):
    if split not in files:
      continue   # the pipeline's own message names the missing entry
    field = f"--config.data.local_files.{split}"
    for pattern in (p.strip() for p in files[split].split(",")):
      if not pattern or not storage.is_local(pattern):
        continue
      names = sorted(glob.glob(pattern))
      if not names:
        raise FileNotFoundError(
            f"{field}: no file {pattern!r}"
            f"{' matches' if glob.has_magic(pattern) else ''}; check the "
            "path.")
      for name in names:
        try:
          with open(name, "rb") as f:
            f.read(1)
        except OSError as e:
          raise FileNotFoundError(
              f"{field}: {name} cannot be read ({e.strerror or e}); pass a "
              "readable file.") from None


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
      split = "eval" if tags and all(t.startswith("eval/") for t in tags) \
          else "train"
      if not event.HasField("summary") or _keep(split, event.step,
                                                resume_step, redo_eval):
        kept.append(record)
      else:
        dropped += 1
    if dropped:
      storage.replace(path, storage.encode_records(kept))
      total += dropped
  return total
