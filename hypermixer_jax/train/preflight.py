"""Checks before a run builds anything, and the one line a full disk ends
it with.

Each stop names the path or field and the fix, before any step runs where
possible (``workdir.guard`` calls the checks):

* ``check_writable``: the workdir is a folder that can be written (a file,
  a read-only mount or a full disk is found by writing, since root ignores
  file modes);
* ``check_batches``: every batch size the run uses divides over the devices
  that split the batch (checked at the start, not at the first evaluation);
* ``check_data_files``: each local data file the run reads exists and reads;
* ``inside``: a file name from the config meant to be relative to the
  workdir stays in it.

A disk that fills during a run fails in many places at once (Orbax's writer
threads, TensorBoard, ``metrics.jsonl``): ``quiet_disk_full`` counts their
errors instead of printing them, and ``disk_full_error`` is the one line,
with the newest checkpoint folder.
"""
from __future__ import annotations

import contextlib
import errno
import glob
import os
import tempfile

import ml_collections

from hypermixer_jax.train import storage


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


# What a full disk's errors say (TensorStore: RESOURCE_EXHAUSTED: Error
# writing local file ...); an accelerator's out-of-memory error says neither.
_DISK_FULL = ("No space left on device", "RESOURCE_EXHAUSTED: Error writing",
              "RESOURCE_EXHAUSTED: Error opening")


def _about_disk(text: str) -> bool:
  return any(m in text for m in _DISK_FULL)


def disk_full(e: BaseException) -> OSError | None:
  """The ``ENOSPC`` error behind ``e`` (raised directly, or as the cause or
  context of a library's own exception), if any."""
  seen = set()
  while e is not None and id(e) not in seen:
    seen.add(id(e))
    if isinstance(e, OSError) and e.errno == errno.ENOSPC:
      return e
    if _about_disk(str(e)):   # TensorStore's errors carry only the text
      return OSError(errno.ENOSPC, "No space left on device")
    e = e.__cause__ or e.__context__
  return None


class _DiskFullFilter:
  """After the first record of a full disk, drops every warning and error
  and counts them (Orbax's writer threads log one traceback per file they
  fail to write; the run's summary line says it once)."""

  def __init__(self):
    self.dropped = 0

  def filter(self, record) -> bool:
    text = record.getMessage()
    if record.exc_info and record.exc_info[1] is not None:
      text += f" {record.exc_info[1]}"
    if record.levelno >= 30 and (self.dropped or _about_disk(text)):
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
  kept = (f"the newest checkpoint folder is step {steps[-1]} in "
          f"{os.path.join(os.fspath(workdir), 'checkpoints')}; free space "
          "(or lower --config.keep_checkpoints) and run the same command "
          "again: it resumes from there." if steps else
          "no checkpoint was saved yet; free space and run it again.")
  return WorkdirError(
      f"No space left on the disk of --workdir={workdir}: stopped, {kept}")


def check_batches(config: ml_collections.ConfigDict, *,
                  training: bool = True) -> None:
  """Every batch size the run uses divides over the devices that split the
  batch (mesh axes ``data``, ``fsdp``, ``expert``), checked at the start
  rather than at the first evaluation; ``training=False``: the evaluation's
  alone (``--mode=evaluate``)."""
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
  sizes = {"batch_size": config.batch_size} if training else {}
  if int(config.eval_every) >= 0 or not training:
    sizes["eval_batch_size"] = config.eval_batch_size
  for name, spec in (config.get("evals") or {}).items() if training else ():
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
  _check_eval_split(config, training)


# GLUE's test splits in TFDS hold no labels (every one is -1); SNLI's do.
UNLABELLED_TFDS_TESTS = ("glue_sst2", "glue_mnli", "glue_qnli", "glue_qqp")


def _check_eval_split(config: ml_collections.ConfigDict,
                      training: bool) -> None:
  """The evaluation split can be scored: a GLUE test split read from TFDS
  has no labels (-1, which the loss would read as the last class), and the
  whole split (``eval_steps=-1``) of the synthetic task must be finite (0
  examples is an endless stream, which would never end)."""
  from hypermixer_jax.data import config as data_config  # pylint: disable=g-import-not-at-top
  from hypermixer_jax.data import synthetic  # pylint: disable=g-import-not-at-top
  from hypermixer_jax.train import config_checks  # pylint: disable=g-import-not-at-top
  if training and int(config.eval_every) < 0:
    return
  split, task = config.eval_split, config.data.task
  if (task in UNLABELLED_TFDS_TESTS and split.startswith("test")
      and not data_config.local_files(config.data)):   # read from TFDS
    raise config_checks.ConfigError(
        f"eval_split={split!r}: {task}'s test split in TFDS holds no labels "
        "(-1), so it cannot be scored; evaluate on 'validation' (the GLUE "
        "dev set), and write the test split's predictions with "
        "--mode=predict.")
  if task != "synthetic_pairs" or int(config.eval_steps) >= 0:
    return
  if not synthetic.num_examples(config.data.synthetic, split):
    raise config_checks.ConfigError(
        f"eval_steps=-1 evaluates the whole {config.eval_split!r} split, "
        "which data.synthetic.num_eval_examples=0 makes an endless stream; "
        "set --config.data.synthetic.num_eval_examples to a split size, or "
        "--config.eval_steps to a number of batches.")


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
