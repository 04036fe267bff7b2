"""Checkpoints: one small wrapper around ``orbax.checkpoint.CheckpointManager``.

A checkpoint step holds three items:

* ``state``: the train state (params, optimiser state, step), written with
  ``ocp.args.StandardSave`` and restored with ``ocp.args.StandardRestore``
  into *abstract* targets (``jax.ShapeDtypeStruct`` carrying the shardings of
  the current mesh), so a checkpoint written on 8 devices restores on 1 and
  the other way round;
* ``data``: the input pipeline's position (``pipeline.get_state()``, with
  the tf.data iterator state), as JSON, one file per process
  (``multihost.DataStateHandler``: each host writes and reads its own);
* ``fingerprints``: one fingerprint per array of the state
  (``integrity.record``, computed on the devices), written by the primary
  process as JSON.

Saves are asynchronous, every ``save_every`` steps, keeping the newest
``keep`` (Orbax's ``max_to_keep``); a save is also due when Orbax's
``reached_preemption`` says the job is being preempted. That needs
``jax.distributed`` (its preemption service turns SIGTERM into a step that
all hosts agree on); a training run of one process (a GPU host, a CPU, a
notebook) gets the same from ``SigtermNotice``: SIGTERM is recorded and the
next step saves and stops, a second SIGTERM terminates at once. ``restore``
recomputes the fingerprints and checks that every restored float is finite:
a mismatch (a flipped bit, a zeroed block) makes the step damaged exactly as
an unreadable one. Steps saved before fingerprints existed restore with the
finiteness check alone (with a warning); a step without fingerprints where
an older step of the folder has them lost them and is damaged
(``expect_fingerprints``).

``Checkpointer.restore_latest`` (training, which holds the workdir) falls
back to the newest step that restores when the newest ones are damaged
(truncated files, garbage metadata, an emptied folder, a fingerprint
mismatch, NaN/Inf); a read that fails for the storage or the host (a
timeout, no permission, no memory: ``of_environment``) stops the run
instead, setting nothing aside. It moves each damaged step newer than it to
``<checkpoints>_damaged/<step>-<time>/`` beside the steps' folder (never
deleted; outside it, where Orbax's clean-up of unfinished folders, which on
``gs://`` takes any folder without a commit file, never reaches), so that the
resumed run saves that step again (older damaged steps stay where they
are). When step folders exist but none
restores it stops with an error naming them, rather than starting from
scratch over them. Readers of another run's steps (``load_pretrained``:
evaluate, predict, export, ``init_checkpoint``) fall back the same way but
move nothing, and log the step they use.

``load_pretrained`` reads the parameters of another run (fine-tuning): every
parameter must match in path and shape except the ones under the prefixes
named to be re-initialised (the new head); anything else is an error naming
every offending path.
"""
from __future__ import annotations

import logging
import os
import re
import signal
import sys
import threading
import time
from typing import Any, Callable, Sequence

from etils import epath
import jax
import numpy as np
import orbax.checkpoint as ocp

from hypermixer_jax import heads
from hypermixer_jax.models import common
from hypermixer_jax.train import integrity
from hypermixer_jax.train import multihost
from hypermixer_jax.train import storage

PyTree = Any
STATE = "state"
DATA = "data"
FINGERPRINTS = integrity.ITEM
# Where damaged steps are moved: ``damaged_folder``; earlier versions
# moved them into the checkpoints folder's own ``damaged/``.
DAMAGED = "damaged"


def damaged_folder(directory: str | os.PathLike) -> epath.Path:
  """Where ``set_aside`` moves the damaged steps of the checkpoints folder
  ``directory``: ``<directory>_damaged``, beside it."""
  return epath.Path(f"{os.fspath(directory).rstrip('/')}_{DAMAGED}")


class CheckpointError(RuntimeError):
  """No usable checkpoint where one is expected; the message names it."""


class InitCheckpointMismatch(CheckpointError, ValueError):
  """An ``init_checkpoint`` whose arrays do not fit the model; the message
  names the paths and the fix."""


class IntegrityError(CheckpointError):
  """A step read back differs from its fingerprints or holds NaN/Inf."""


def abstract_like(tree: PyTree, shardings: PyTree | None = None) -> PyTree:
  """``jax.ShapeDtypeStruct`` tree of ``tree`` carrying ``shardings``.

  ``tree`` may hold arrays or ``ShapeDtypeStruct``s; ``shardings`` (same
  structure, or None to keep each leaf's own sharding) are the shardings the
  restored arrays should have on the *current* mesh.
  """
  if shardings is None:
    return jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype,
                                       sharding=getattr(x, "sharding", None)),
        tree)
  return jax.tree.map(
      lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
      tree, shardings)


class SigtermNotice:
  """SIGTERM as a preemption notice in a run of one process.

  Orbax's ``reached_preemption`` asks ``jax.distributed``'s preemption
  service, which a single process usually does not start, so SIGTERM would
  kill it without a save. While open, the first SIGTERM only sets
  ``received`` (and gives the signal back its previous handler, so that a
  second one terminates at once); ``close`` restores that handler. Nothing is
  installed where ``jax.distributed`` runs (its service agrees on the step,
  one process or many) or off the main thread (Python allows handlers only
  there). A previous handler that Python did not install (None) comes back
  as the default action.
  """

  def __init__(self):
    self.received = False
    self._previous = None
    if (jax.process_count() == 1 and not jax.distributed.is_initialized()
        and threading.current_thread() is threading.main_thread()):
      previous = signal.signal(signal.SIGTERM, self._on_sigterm)
      self._previous = signal.SIG_DFL if previous is None else previous

  def _on_sigterm(self, signum, frame) -> None:
    del signum, frame
    self.received = True
    signal.signal(signal.SIGTERM, self._previous)
    logging.warning("SIGTERM received: saving a checkpoint after the current "
                    "step, then stopping (a second SIGTERM terminates now).")

  def close(self) -> None:
    if self._previous is not None and not self.received:
      signal.signal(signal.SIGTERM, self._previous)
    self._previous = None


class Checkpointer:
  """Saves and restores ``(state, data position)`` pairs under ``directory``.

  Args:
    directory: where the step folders go (created if absent).
    save_every: save when ``step % save_every == 0``; 0 disables periodic
      saves (forced saves, e.g. at the end of a run, and preemption saves
      still happen).
    keep: ``max_to_keep`` (None or 0 keeps all).
    async_save: write in a background thread (training goes on meanwhile).
    sigterm: a training run's checkpointer: in a run of one process, SIGTERM
      is a preemption notice (``SigtermNotice``) until ``close``.
    check_data: ``check_data(data_state, path)`` raises where a restored
      input position is not one (e.g. ``multihost.checked_position``): the
      step then does not restore, as one with a damaged array.
  """

  def __init__(self, directory: str | os.PathLike, *, save_every: int = 1000,
               keep: int | None = 3, async_save: bool = True,
               sigterm: bool = False,
               check_data: Callable[[Any, str], Any] | None = None):
    self.directory = os.fspath(directory)
    self._check_data = check_data
    self._sigterm = SigtermNotice() if sigterm else None
    self._save_every = int(save_every)
    # The save interval is ours (``step % save_every``): Orbax's own policy
    # also saves the first step of every run, which restarts would repeat.
    options = ocp.CheckpointManagerOptions(
        max_to_keep=keep or None,
        enable_async_checkpointing=async_save,
        create=True,
        cleanup_tmp_directories=True,
    )
    self.manager = ocp.CheckpointManager(
        manager_path(self.directory), options=options,
        item_names=(STATE, DATA, FINGERPRINTS))

  def latest_step(self) -> int | None:
    """The newest complete checkpoint step, or None."""
    return self.manager.latest_step()

  def all_steps(self) -> Sequence[int]:
    return self.manager.all_steps()

  def reached_preemption(self, step: int) -> bool:
    """True when the job received a preemption notice (all hosts agree), or
    this one process a SIGTERM (``sigterm``)."""
    # Asked at every step: in a multi-host job it is a synchronisation point.
    reached = self.manager.reached_preemption(step)
    return reached or bool(self._sigterm and self._sigterm.received)

  @property
  def notice_received(self) -> bool:
    """Whether this process got a SIGTERM notice while open (``sigterm``),
    even after the last step, when no save or stop followed it."""
    return bool(self._sigterm and self._sigterm.received)

  def should_save(self, step: int, *, preempted: bool | None = None) -> bool:
    """Periodic save due at ``step``, or preemption.

    ``preempted``: the caller's ``reached_preemption(step)`` of this step,
    so that the (multi-host, synchronising) question is asked once per step.
    """
    if preempted is None:
      preempted = self.reached_preemption(step)
    return (self._save_every > 0 and step % self._save_every == 0) or preempted

  def save(self, step: int, state: PyTree, data_state: Any = None, *,
           force: bool = False) -> bool:
    """Starts an asynchronous save of ``state`` and the pipeline position.

    Returns True if a save was started: steps that are not due (see
    ``should_save``) are skipped unless ``force``, and a finished step is
    never written twice (a damaged one is moved away by ``restore_latest``
    first, so the resumed run writes it again). The fingerprints are
    computed here, on the devices, before the state can change.

    Raises:
      FloatingPointError: an array of ``state`` holds NaN/Inf (named, with
        the latest checkpoint kept); nothing is written, so a state that is
        not finite never becomes the newest step nor pushes a good one out
        of the retention.
    """
    if step in self.manager.all_steps():
      return False
    if not (force or self.should_save(step)):
      return False
    try:
      fingerprints = integrity.record(state, f"step {step}")
    except FloatingPointError as e:
      raise FloatingPointError(
          f"{e} The latest checkpoint is step {self.latest_step()} in "
          f"{self.directory}.") from None
    args = ocp.args.Composite(**{
        STATE: ocp.args.StandardSave(state),
        DATA: multihost.DataStateSave(_jsonable(data_state)),
        FINGERPRINTS: ocp.args.JsonSave(fingerprints),
    })
    return self.manager.save(step, args=args, force=True)

  def restore(self, step: int | None, abstract_state: PyTree
              ) -> tuple[PyTree, Any]:
    """Restores ``step`` (default: latest) into ``abstract_state``.

    ``abstract_state`` is a tree of ``jax.ShapeDtypeStruct`` with the
    shardings wanted on the current mesh (see ``abstract_like``); the saved
    mesh does not matter. Returns ``(state, data_state)``, ``data_state``
    being this process's input position (None when the checkpoint was
    written by a different number of processes).

    In a multi-process job every process reads its own part; the step
    restores only where every process read it (a part damaged on one host
    fails the step on all of them, so that they never resume from
    different steps or wait for each other in the checks).

    Raises:
      IntegrityError: the restored arrays differ from the step's
        fingerprints, or hold NaN/Inf.
      CheckpointError: another process could not read its part.
    """
    step = self.latest_step() if step is None else step
    if step is None:
      raise FileNotFoundError(f"no checkpoint in {self.directory}")
    items = {STATE: ocp.args.StandardRestore(abstract_state),
             DATA: multihost.DataStateRestore()}
    try:
      # Inside: a host whose listing fails meets the others' barrier below.
      if expect_fingerprints(self.directory, step):
        items[FINGERPRINTS] = ocp.args.JsonRestore()
      restored, error = self.manager.restore(
          step, args=ocp.args.Composite(**items)), None
    except Exception as e:  # pylint: disable=broad-except
      restored, error = None, e
      _meet_restore_barrier(self.manager)
    # After the restore's barrier (met above either way): a position that
    # only this process finds bad is agreed on below, never waited for.
    if error is None and self._check_data and restored[DATA] is not None:
      try:
        self._check_data(restored[DATA], os.path.join(
            self.directory, str(step), DATA, multihost.process_file(
                jax.process_index(), jax.process_count())))
      except Exception as e:  # pylint: disable=broad-except
        error = e
    if not _on_every_process(error is None):
      if error is not None:
        raise error
      raise CheckpointError(f"{self.directory}/{step}: another process "
                            "could not read its part of this step")
    check_restored(restored[STATE], restored[FINGERPRINTS]
                   if FINGERPRINTS in items else None,
                   f"{self.directory}/{step}")
    return restored[STATE], restored[DATA]

  def step_folders(self) -> list[int]:
    """Steps that have a folder on disk, complete or not, newest first."""
    directory = epath.Path(self.directory)
    if not directory.is_dir():
      return []
    return sorted((int(p.name) for p in directory.iterdir()
                   if p.name.isdigit()), reverse=True)

  def restore_latest(self, abstract_state: PyTree
                     ) -> tuple[int, PyTree, Any] | None:
    """``(step, state, data_state)`` of the newest step that restores.

    For the training run that owns the folder: each damaged newer step is
    named in a warning with why, and moved to ``damaged_folder``'s
    ``<step>-<time>/``
    (``set_aside``) so that training saves that step again. Returns None
    only when the directory holds no step folder at all.

    Raises:
      CheckpointError: step folders exist but none restores (each is named
        with its error), so that a run never starts from scratch over them.
    """
    quiet_failed_reads()
    # Orbax's clean-up of unfinished folders runs in a thread from the
    # manager's start: done before the listing, so that no folder it is
    # deleting is read or set aside. (Orbax 0.12 has no public call; its
    # save waits the same way.)
    getattr(self.manager, "_maybe_await_cleanup_tmp_directory",
            lambda: None)()
    # Process 0's listing, so that every process tries the same steps.
    finished = set(self.all_steps())
    listed = _from_process_0(
        [2 * s + (s in finished)
         for s in sorted(finished | set(self.step_folders()), reverse=True)])
    complete = {v // 2 for v in listed if v % 2}
    failures = []
    for step in (v // 2 for v in listed):
      folder = os.path.join(self.directory, str(step))
      if step not in complete:
        failures.append((folder, UNFINISHED))
      else:
        try:
          state, data_state = self.restore(step, abstract_state)
        except Exception as e:  # pylint: disable=broad-except
          # Every process agrees, so that none falls back alone.
          if not _on_every_process(not of_environment(e)):
            raise CheckpointError(
                f"{folder} could not be read now ("
                + (one_line(e) if of_environment(e) else
                   "an error of the storage or host on another process")
                + "): not a sign of damage, so nothing is set aside and no "
                "older step is used. Run again once it passes (--mode=verify "
                f"--workdir=... reads each step).") from e
          failures.append((folder, one_line(e)))
        else:
          if failures:
            self.set_aside([f for f, _ in failures])
            logging.warning("Resuming from step %d, the newest step that "
                            "restores.", step)
          return step, state, data_state
      logging.warning("Checkpoint %s does not restore: %s", *failures[-1])
    if not failures:
      return None
    raise CheckpointError(
        f"{self.directory} holds checkpoint steps but none restores:\n"
        + "\n".join(f"  {f}: {why}" for f, why in failures)
        + "\nNot starting from scratch over them. Move the damaged step "
        f"folders away (e.g. into {damaged_folder(self.directory)}/) to start "
        "again from init_checkpoint or from scratch, or use a new --workdir; "
        "--mode=verify --workdir=... lists what failed in each.")

  def set_aside(self, folders: Sequence[str]) -> None:
    """Moves each damaged step folder to ``damaged_folder``'s
    ``<step>-<UTC time>/``
    (the primary process moves; all processes then see the new step
    list)."""
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())

    def move():
      for folder in folders:
        name = f"{epath.Path(folder).name}-{stamp}"
        target = damaged_folder(self.directory) / name
        n = 1
        while target.exists():   # the same step damaged twice in a second
          n += 1
          target = target.parent / f"{name}.{n}"
        target.parent.mkdir(parents=True, exist_ok=True)
        move_folder(epath.Path(folder), target)
        logging.warning("Checkpoint %s moved to %s (kept, not deleted); this "
                        "run saves that step again.", folder, target)
    on_primary(move, "setting damaged checkpoints aside")
    self.manager.reload()

  def wait_until_finished(self) -> None:
    """Blocks until the pending asynchronous save (if any) is on disk."""
    self.manager.wait_until_finished()

  def close(self) -> None:
    """Waits for the pending save and stops Orbax's threads (call it on
    every exit path: a manager left open at interpreter shutdown fails with
    'cannot schedule new futures after interpreter shutdown')."""
    self.manager.wait_until_finished()
    # Orbax starts a clean-up of temporary folders in a thread when the
    # manager is created and waits for it only before the first save; a run
    # that stops earlier (a bad init_checkpoint) must wait for it here, or it
    # fails at interpreter shutdown. No public API for it in Orbax 0.12.
    wait_cleanup = getattr(self.manager, "_maybe_await_cleanup_tmp_directory",
                           None)
    if wait_cleanup is not None:
      wait_cleanup()
    self.manager.close()
    if self._sigterm is not None:
      self._sigterm.close()

  def __enter__(self) -> "Checkpointer":
    return self

  def __exit__(self, *exc) -> None:
    self.close()


def move_folder(source: epath.Path, target: epath.Path) -> None:
  """A rename on a disk; on an object store, where folders cannot be
  renamed (a store's own "move" copies each object too), a copy of every
  file and then the removal of the source."""
  if "://" not in os.fspath(source):
    source.rename(target)
    return
  # Orbax's commit markers last: a copy cut short never looks finished.
  for f in sorted(files_under(source),
                  key=lambda f: f.name in _COMMIT_MARKERS):
    dest = target / f.relative_to(source)
    dest.parent.mkdir(parents=True, exist_ok=True)
    f.copy(dest)
  source.rmtree()


# The files whose presence makes Orbax call a step finished.
_COMMIT_MARKERS = ("commit_success.txt", "_CHECKPOINT_METADATA")


def files_under(folder: epath.Path):
  """Every file below ``folder`` (epath's ``rglob`` refuses object stores)."""
  for entry in folder.iterdir():
    if entry.is_dir():
      yield from files_under(entry)
    else:
      yield entry


UNFINISHED = ("not a finished checkpoint (no commit marker or metadata Orbax "
              "recognises)")


class _LeftoverReadErrors(logging.Filter):
  """Drops asyncio's report of a TensorStore read whose failure nobody
  awaited (the read of a damaged step already failed with the first)."""

  def filter(self, record: logging.LogRecord) -> bool:
    error = record.exc_info[1] if record.exc_info else None
    return not (str(record.msg).startswith("Task exception was never "
                                           "retrieved")
                and error is not None and "tensorstore_spec" in str(error))


def quiet_failed_reads() -> None:
  """Drops the reports of a failed Orbax read's leftover callbacks.

  When a read fails (a damaged step), Orbax's event loop closes while
  TensorStore still completes the step's other reads; each completion then
  reports ``RuntimeError('Event loop is closed')`` through
  ``sys.unraisablehook``, hundreds of tracebacks that bury the one-line
  reason; a second array whose read failed too is logged by asyncio as
  "Task exception was never retrieved" with TensorStore's error, or, when
  its coroutine is collected, reported through ``sys.unraisablehook`` as
  "Exception ignored in: <coroutine object _read_array_index_and_device_put>"
  with the array's whole TensorStore spec (dozens of lines each), at a time
  that depends on the garbage collector. Only those reports are dropped;
  every other goes on. Installed once per process, before a read that may
  fail.
  """
  asyncio_log = logging.getLogger("asyncio")
  if not any(isinstance(f, _LeftoverReadErrors) for f in asyncio_log.filters):
    asyncio_log.addFilter(_LeftoverReadErrors())
  previous = sys.unraisablehook
  if getattr(previous, "_drops_closed_loop", False):
    return

  def hook(report):
    closed = (isinstance(report.exc_value, RuntimeError)
              and str(report.exc_value) == "Event loop is closed")
    if not (closed or _orbax_coroutine(report.object)):
      previous(report)

  hook._drops_closed_loop = True  # pylint: disable=protected-access
  sys.unraisablehook = hook


def _orbax_coroutine(obj: Any) -> bool:
  """A coroutine of Orbax's own (an array read's leftover)."""
  code = getattr(obj, "cr_code", None)
  return code is not None and f"{os.sep}orbax{os.sep}checkpoint{os.sep}" in (
      code.co_filename)


def has_fingerprints(directory: str | os.PathLike, step: int) -> bool:
  """True when ``step`` records fingerprints (steps saved before they
  existed do not)."""
  return (epath.Path(directory) / str(step) / FINGERPRINTS).is_dir()


# Errors of the storage or the host, not of a step's files: TensorStore's
# status codes in its messages, and Python's own types.
_ENVIRONMENT_STATUS = ("UNAVAILABLE", "DEADLINE_EXCEEDED", "RESOURCE_EXHAUSTED",
                       "PERMISSION_DENIED", "UNAUTHENTICATED")


# TensorFlow's file system (``gs://`` through etils.epath) raises these; their
# messages carry no status code.
_ENVIRONMENT_TF_ERRORS = ("UnavailableError", "DeadlineExceededError",
                          "ResourceExhaustedError", "PermissionDeniedError",
                          "UnauthenticatedError")


# fsspec's gcsfs (``gs://`` through etils without TensorFlow) raises a plain
# ``HttpError`` whose ``code`` is the HTTP status, once its own retries are
# spent; aiohttp's response errors carry it as ``status``. These statuses
# say the store failed (a timeout, throttling, a server error), not the file.
_ENVIRONMENT_HTTP = (408, 429, *range(500, 600))
_HTTP_ERRORS = {"HttpError", "ClientResponseError"}
# aiohttp's errors of a request that got no response.
_NO_RESPONSE_ERRORS = {"ClientConnectionError", "ServerTimeoutError"}


def of_environment(e: BaseException | None) -> bool:
  """True when ``e`` (or an error it was raised from) says the storage or
  the host failed (a timeout, a refused connection, throttling, a server
  error, no permission, no memory) rather than that the step's files are
  damaged: retrying may read the step."""
  seen = set()
  while e is not None and id(e) not in seen:
    seen.add(id(e))
    if isinstance(e, (ConnectionError, TimeoutError, PermissionError,
                      MemoryError)):
      return True
    names = {t.__name__ for t in type(e).__mro__}
    if names & set(_ENVIRONMENT_TF_ERRORS):
      return True
    if names & _NO_RESPONSE_ERRORS or names & _HTTP_ERRORS and getattr(
        e, "code", getattr(e, "status", None)) in _ENVIRONMENT_HTTP:
      return True
    if any(code in str(e) for code in _ENVIRONMENT_STATUS):
      return True
    e = e.__cause__ or e.__context__
  return False


def expect_fingerprints(directory: str | os.PathLike, step: int) -> bool:
  """True when ``step`` records fingerprints, to be checked on restore.
  Without them a step restores with the NaN/Inf check alone (a warning
  says so) when it was saved before they existed; when an older step of
  the folder has them, this one lost them (a partial copy, a deleted
  file) and is damaged: ``IntegrityError``."""
  if has_fingerprints(directory, step):
    return True
  older = [int(p.name) for p in epath.Path(directory).iterdir()
           if p.name.isdigit() and int(p.name) < step
           and has_fingerprints(directory, int(p.name))]
  if older:
    raise IntegrityError(
        f"{directory}/{step}: no fingerprints ({FINGERPRINTS}/), though "
        f"the older step {max(older)} has them: the file was lost (a partial "
        "copy?), so the step is treated as damaged")
  logging.warning("%s/%d has no fingerprints (saved before they existed): "
                  "restored with the NaN/Inf check alone.", directory, step)
  return False


def check_restored(tree: PyTree, record: Any, where: str, *,
                   prefix: str = "") -> None:
  """Raises ``IntegrityError`` naming ``where`` and the arrays when ``tree``
  (as read back) differs from the fingerprint ``record`` or holds NaN/Inf
  (``integrity.problems``)."""
  found = integrity.problems(tree, record, prefix=prefix)
  if found:
    raise IntegrityError(f"{where}: " + "; ".join(found))


def _short(e: BaseException) -> str:
  """``e``'s message on one line, without the spec TensorStore appends."""
  text = " ".join(str(e).split())
  for cut in (" [tensorstore_spec=", " See full TensorStore details:"):
    text = text.split(cut)[0]
  return text


def one_line(e: Exception) -> str:
  """One line of an exception (Orbax/tensorstore errors span pages; the
  JSON spec TensorStore appends says nothing the error did not), with the
  error it was raised from (e.g. Orbax's "error while reading array index"
  from TensorStore's, which names the array file and what is wrong)."""
  text = _short(e)[:400] + ("..." if len(_short(e)) > 400 else "")
  cause = e.__cause__
  if cause is not None and _short(cause) and _short(cause) not in text:
    text += f" (from {type(cause).__name__}: {_short(cause)[:300]})"
  return f"{type(e).__name__}: {text}"


def _jsonable(x: Any) -> Any:
  """Makes a pipeline state JSON-serialisable (NumPy scalars and arrays)."""
  if isinstance(x, dict):
    return {str(k): _jsonable(v) for k, v in x.items()}
  if isinstance(x, (list, tuple)):
    return [_jsonable(v) for v in x]
  if isinstance(x, np.ndarray):
    return x.tolist()
  if isinstance(x, np.generic):
    return x.item()
  return x


# ---------------------------------------------------------------------------
# Fine-tuning from another run's checkpoint.
# ---------------------------------------------------------------------------


def _flatten(tree: PyTree) -> dict[str, Any]:
  return {common.path_str(p): x
          for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


def manager_path(directory: str | os.PathLike) -> str:
  """``directory`` as Orbax takes it: a local path made absolute (Orbax's
  array storage refuses relative ones), an object-store URL unchanged."""
  return storage.absolute(directory)


def reader(directory: str) -> ocp.CheckpointManager:
  """A manager that reads item metadata without a target and never writes.

  Not Orbax's ``read_only=True``: that logs a warning for each option it
  overrides; these options already save and delete nothing.
  """
  return ocp.CheckpointManager(
      manager_path(directory),
      options=ocp.CheckpointManagerOptions(
          save_interval_steps=0, max_to_keep=None, create=False,
          cleanup_tmp_directories=False),
      item_handlers={STATE: ocp.PyTreeCheckpointHandler(),
                     DATA: multihost.DataStateHandler(),
                     FINGERPRINTS: ocp.JsonCheckpointHandler()})


def resolve_checkpoint(path: str | os.PathLike) -> tuple[str, int]:
  """``(manager directory, step)`` for a workdir, checkpoints dir or step dir.

  Accepts ``WORKDIR`` (uses ``WORKDIR/checkpoints``), a checkpoints folder
  (latest step) or one step folder ``.../checkpoints/<step>``.
  """
  directory, steps, _ = _steps_to_try(path)
  return directory, steps[0]


def _meet_restore_barrier(manager: ocp.CheckpointManager) -> None:
  """After a failed read in a multi-process job: Orbax's restore ends in a
  barrier of every process, which the failed read skipped; meet the other
  processes there (under the name its checkpointer gives it), so that all
  of them reach the agreement that follows (``_on_every_process``).
  tests/multiprocess_test.py checks the name."""
  if jax.process_count() > 1:
    ocp.multihost.sync_global_processes(ocp.multihost.unique_barrier_key(
        "Checkpointer:restore", prefix=getattr(
            manager._checkpointer,  # pylint: disable=protected-access
            "_barrier_sync_key_prefix", None)))


def on_primary(fn, what: str) -> None:
  """``fn()`` on process 0 alone (moving or deleting folders), then every
  process agrees on how it went: a failure raises on every process rather
  than leaving the others waiting for process 0 (a collective: every
  process must call it)."""
  error = None
  if jax.process_index() == 0:
    try:
      fn()
    except Exception as e:  # pylint: disable=broad-except
      error = e
  if not _on_every_process(error is None):
    if error is not None:
      raise error
    raise CheckpointError(f"process 0 failed while {what}; see its log.")


def _on_every_process(ok: bool) -> bool:
  """True where ``ok`` holds on every process of the job (a collective:
  every process must call it)."""
  if jax.process_count() == 1:
    return ok
  from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
  # int32, not bool: gloo's CPU collectives mis-size one-byte predicates.
  return bool(np.all(multihost_utils.process_allgather(np.int32(ok))))


def _from_process_0(values: list[int]) -> list[int]:
  """Process 0's ``values`` on every process (a collective)."""
  if jax.process_count() == 1:
    return values
  from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
  n = int(multihost_utils.broadcast_one_to_all(np.int64(len(values))))
  padded = np.zeros(max(n, 1), np.int64)
  padded[:min(n, len(values))] = values[:n]
  return [int(v) for v in
          multihost_utils.broadcast_one_to_all(padded)[:n]]


def _steps_to_try(path: str | os.PathLike) -> tuple[str, list[int], bool]:
  """``(manager directory, finished steps newest first, explicit)``; a step
  folder gives only its own step (``explicit``: no fallback)."""
  path = os.fspath(path).rstrip("/")
  if not epath.Path(path).exists():
    raise FileNotFoundError(
        f"checkpoint path {path!r} (config.init_checkpoint or --step) does "
        "not exist; give a run's workdir, its checkpoints folder or one "
        "step folder.")
  if (epath.Path(path) / "checkpoints").is_dir():
    path = os.fspath(epath.Path(path) / "checkpoints")
  base = epath.Path(path).name
  if base.isdigit() and (epath.Path(path) / STATE).is_dir():
    return os.fspath(epath.Path(path).parent), [int(base)], True
  manager = _listing(lambda: reader(path))
  steps = _finished_steps(manager)
  manager.close()
  if not steps:
    raise FileNotFoundError(f"checkpoint path {path!r} holds no finished "
                            "checkpoint step")
  return path, steps, False


def _listing(fn, tries: int = 5):
  """``fn()``, tried again when a step folder vanishes while Orbax lists
  the steps (the retention of a training writing there)."""
  for attempt in range(tries):
    try:
      return fn()
    except FileNotFoundError:
      if attempt == tries - 1:
        raise
      time.sleep(0.05)


def finished_steps(directory: str | os.PathLike) -> list[int]:
  """The finished steps of ``directory`` now, newest first (read on this
  process alone: no collective)."""
  manager = reader(os.fspath(directory))
  try:
    return _finished_steps(manager)
  finally:
    manager.close()


def _finished_steps(manager: ocp.CheckpointManager) -> list[int]:
  """The finished steps on disk now, newest first."""
  def listed():
    manager.reload()
    return sorted(manager.all_steps(), reverse=True)
  return _listing(listed)


class _Unreadable(Exception):
  """A step that cannot be read (damaged, or removed while being read)."""


# Fallbacks of one read before giving up (steps removed by a running
# training's retention while being read are retried on the newest one).
MAX_READ_TRIES = 8


def load_pretrained(path: str | os.PathLike, params: PyTree,
                    reinit: Sequence[str] | None = None, *,
                    collection: str = "params") -> PyTree:
  """``params`` with every leaf not under ``reinit`` read from ``path``
  (``load_pretrained_step`` without the step)."""
  return load_pretrained_step(path, params, reinit, collection=collection)[0]


def load_pretrained_step(path: str | os.PathLike, params: PyTree,
                         reinit: Sequence[str] | None = None, *,
                         collection: str = "params") -> tuple[PyTree, int]:
  """``(params, step)``: ``params`` with every leaf not under ``reinit``
  read from ``path``'s newest step that reads, and that step.

  The arrays read are checked against the step's fingerprints and for
  NaN/Inf. A step that does not read (damaged, or removed by a running
  training's checkpoint retention while being read) is named in a warning
  and the newest other step is read instead; nothing is moved or deleted
  (``path`` may be another run's). A step folder given as ``path`` is read
  or refused, never replaced by another step.

  Args:
    path: a run's workdir, its checkpoints folder, or one step folder.
    params: the freshly initialised parameters of the new model (sharded
      arrays; the loaded ones get the same shardings).
    reinit: regular expressions matched (``re.match``) against the
      ``/``-joined parameter paths; matching leaves keep their new
      initialisation and the checkpoint's leaves under them are ignored (the
      pretraining head). ``None``: every head's own parameters
      (``heads.param_modules_regex()``, as ``config.init_reinit``); ``()``:
      load everything.
    collection: name of the parameter subtree inside the saved state.

  Raises:
    ValueError: naming every path that is missing from the checkpoint,
      unexpected in it, or of a different shape. Nothing is loaded partially.
    CheckpointError: no step reads (each named with why).
  """
  if reinit is None:
    reinit = (heads.param_modules_regex(),)
  directory, steps, explicit = _steps_to_try(path)
  # Process 0's listing, and a step read only where every process read it:
  # the processes of a job never load different steps.
  steps = _from_process_0(steps)
  quiet_failed_reads()
  failures: list[tuple[int, str]] = []
  manager = _listing(lambda: reader(directory))
  try:
    while True:
      step = steps[0]
      try:
        loaded, error = _load_step(manager, directory, step, params, reinit,
                                   collection), None
      except _Unreadable as e:
        loaded, error = None, e
      if _on_every_process(error is None):
        return loaded, step
      failures.append((step, str(error) if error else
                       "another process could not read its part"))
      tried = {s for s, _ in failures}
      steps = _from_process_0(
          [s for s in _finished_steps(manager) if s not in tried])
      if explicit or not steps or len(failures) >= MAX_READ_TRIES:
        raise CheckpointError(_unreadable_message(directory, failures,
                                                  explicit))
      if steps[0] > step:   # what retention does while a run trains
        logging.warning("Checkpoint %s/%d went away while being read (the "
                        "checkpoint retention of a running training?); "
                        "reading the newer step %d.", directory, step,
                        steps[0])
      else:
        logging.warning("Checkpoint %s/%d does not read: %s; reading step %d "
                        "instead.", directory, step, failures[-1][1],
                        steps[0])
  finally:
    manager.close()


def _unreadable_message(directory: str, failures, explicit: bool) -> str:
  if explicit:
    step, why = failures[0]
    return (f"checkpoint {directory}/{step} does not read: {why}. Choose "
            f"another step (--mode=verify --workdir={directory} checks each).")
  return (f"no step of {directory} reads:\n"
          + "\n".join(f"  {directory}/{s}: {why}" for s, why in failures)
          + f"\n--mode=verify --workdir={directory} checks each step.")


def _load_step(manager: ocp.CheckpointManager, directory: str, step: int,
               params: PyTree, reinit: Sequence[str],
               collection: str) -> PyTree:
  """``load_pretrained_step`` of one step; ``_Unreadable`` if it does not
  read, ValueError if it does not fit ``params``. In a job of several
  processes they agree that every one read the step's metadata before any
  starts the (collective) restore, one whose read fails inside it meets the
  others at its closing barrier, and they agree that every one read its
  part before the (collective) checks of what was read."""
  try:
    meta = manager.item_metadata(step)[STATE]
    meta = getattr(meta, "tree", meta)
    why = ("" if isinstance(meta, dict) else
           f"no readable metadata in {directory}/{step}/{STATE}")
  except Exception as e:  # pylint: disable=broad-except
    why = one_line(e)
  if not _on_every_process(not why):
    raise _Unreadable(why or "another process could not read its metadata")
  if collection not in meta:
    raise ValueError(f"checkpoint {directory}/{step} has no "
                     f"{collection!r} subtree (has {sorted(meta)})")
  saved = _flatten(meta[collection])
  new = _flatten(params)
  patterns = [re.compile(r) for r in reinit]
  skip = lambda k: any(p.match(k) for p in patterns)  # noqa: E731
  sources = {k: _source(k, new, saved) for k in new if not skip(k)}
  used = {key for src in sources.values() if src for key in src[1]}
  errors = []
  for k in sorted(k for k, src in sources.items() if src is None):
    errors.append(f"  missing from checkpoint: {k} {tuple(new[k].shape)}")
  for k in sorted(set(saved) - used):
    if not skip(k):
      errors.append(f"  unexpected in checkpoint: {k} "
                    f"{tuple(saved[k].shape)}")
  for k, src in sorted(sources.items()):
    if src and (bad := _shape_error(k, src, new, saved)):
      errors.append(bad)
  if not sources:
    raise InitCheckpointMismatch(
        f"init checkpoint {directory}/{step}: init_reinit={list(reinit)} "
        f"re-initialises every one of the model's {len(new)} parameter "
        "arrays, so nothing would be loaded; narrow init_reinit, or train "
        "from scratch without init_checkpoint.")
  if errors:
    raise InitCheckpointMismatch(
        f"init checkpoint {directory}/{step} does not fit the model "
        f"(re-initialised: {list(reinit)}): give the model fields its run "
        "was trained with (its config.json), or add the differing parts to "
        f"init_reinit; {len(errors)} path(s):\n" + "\n".join(errors)
        + _layout_hint(new, saved))
  # Abstract target of the saved leaves to read only, with the new
  # shardings and the saved dtypes (the fingerprints are of the saved bits;
  # cast after the check); the rest of the saved tree is left on disk.
  target = _nest({key: _saved_target(src, new[k], saved[key])
                  for k, src in sources.items() for key in src[1]})
  try:
    restored, why = read_tree(manager, directory, step,
                              {collection: target}), ""
  except Exception as e:  # pylint: disable=broad-except
    _meet_restore_barrier(manager)
    restored, why = None, one_line(e)
  # (The checks below are collective on sharded arrays: all or none.)
  if not _on_every_process(not why):
    raise _Unreadable(why or "another process could not read its part")
  try:
    check_restored(restored[STATE][collection],
                   restored.get(FINGERPRINTS), f"{directory}/{step}",
                   prefix=f"{collection}/")
  except Exception as e:  # pylint: disable=broad-except
    raise _Unreadable(one_line(e)) from e
  read = _flatten(restored[STATE][collection])
  loaded = {k: _assemble(src, read, new[k]) for k, src in sources.items()}
  converted = sum(src[0] != "same" for src in sources.values())
  logging.info("Loaded %d parameter arrays from %s/%d (%d converted between "
               "the scanned and unrolled layer layouts); re-initialised %d "
               "(%s).", len(loaded), directory, step, converted,
               len(new) - len(loaded),
               ", ".join(k for k in sorted(new) if skip(k)))
  flat, treedef = jax.tree_util.tree_flatten_with_path(params)
  return jax.tree_util.tree_unflatten(
      treedef, [loaded.get(common.path_str(p), x) for p, x in flat])


def read_tree(manager: ocp.CheckpointManager, directory: str, step: int,
               target: PyTree) -> dict[str, Any]:
  """``{STATE: the leaves of target read, FINGERPRINTS: the record or
  None}``; ``target`` is a (partial) tree of ``jax.ShapeDtypeStruct``
  carrying the shardings and dtypes to read into."""
  items = {STATE: ocp.args.PyTreeRestore(
      item=target,
      restore_args=jax.tree.map(
          lambda s: ocp.ArrayRestoreArgs(sharding=s.sharding, dtype=s.dtype,
                                         global_shape=s.shape), target),
      partial_restore=True)}
  if expect_fingerprints(directory, step):
    items[FINGERPRINTS] = ocp.args.JsonRestore()
  restored = manager.restore(step, args=ocp.args.Composite(**items))
  return {STATE: restored[STATE],
          FINGERPRINTS: restored[FINGERPRINTS] if FINGERPRINTS in items
                        else None}


# Layer layouts: a scanned stack holds ``.../stack/layers/layer/<leaf>`` with a
# leading [L] axis, an unrolled one ``.../stack/layer_<i>/<leaf>``
# (``models.encoders.LayerStack``). A checkpoint of either loads into either.
_SCANNED = re.compile(r"(.*)/layers/layer/(.*)$")
_UNROLLED = re.compile(r"(.*)/layer_(\d+)/(.*)$")


def _source(key: str, new: dict, saved: dict):
  """Where the new leaf ``key`` comes from: ``("same", [key], 0)``,
  ``("stack", [layer_0 key, ...], 0)`` or ``("slice", [scanned key], i)``;
  None if the checkpoint has no such leaf."""
  if key in saved:
    return "same", [key], 0
  if m := _SCANNED.match(key):
    keys = [f"{m[1]}/layer_{i}/{m[2]}" for i in range(new[key].shape[0])]
    if keys and all(k in saved for k in keys):
      return "stack", keys, 0
  elif (m := _UNROLLED.match(key)) and f"{m[1]}/layers/layer/{m[3]}" in saved:
    return "slice", [f"{m[1]}/layers/layer/{m[3]}"], int(m[2])
  return None


def _shape_error(key: str, src, new: dict, saved: dict) -> str:
  kind, keys, _ = src
  want = tuple(new[key].shape)
  have = tuple(saved[keys[0]].shape)
  if kind == "stack":
    want = want[1:]
  elif kind == "slice":
    layers = {k for k in new if (m := _UNROLLED.match(k))
              and f"{m[1]}/layers/layer/{m[3]}" == keys[0]}
    want = (len(layers),) + want
  if have == want:
    return ""
  if kind == "same":
    return f"  shape mismatch: {key} checkpoint {have} vs model {want}"
  return (f"  shape mismatch: {key} from checkpoint {keys[0]} {have} vs "
          f"model {want} ({kind} of the layer layouts)")


def _layout_hint(new: dict, saved: dict) -> str:
  scanned = lambda keys: any(_SCANNED.match(k) for k in keys)  # noqa: E731
  unrolled = lambda keys: any(_UNROLLED.match(k) for k in keys)  # noqa: E731
  if scanned(new) != scanned(saved) or unrolled(new) != unrolled(saved):
    return ("\n(the checkpoint and the model differ in model.scan_layers; "
            "leaves of matching layers convert between the layouts, so the "
            "mismatch above is in the layers themselves: compare "
            "model.num_layers and the layer's fields with the checkpoint's "
            "config.json)")
  return ""


def _spec_sharding(sharding, drop: bool):
  """``sharding`` without (``drop``) or with an unsharded leading axis."""
  if not isinstance(sharding, jax.sharding.NamedSharding):
    return sharding
  spec = tuple(sharding.spec)
  spec = spec[1:] if drop else (None,) + spec
  return jax.sharding.NamedSharding(sharding.mesh,
                                    jax.sharding.PartitionSpec(*spec))


def _saved_target(src, new_leaf, saved_leaf):
  """The abstract leaf to restore a saved leaf of ``src`` into."""
  sharding = getattr(new_leaf, "sharding", None)
  if src[0] == "stack":
    sharding = _spec_sharding(sharding, drop=True)
  elif src[0] == "slice":
    sharding = _spec_sharding(sharding, drop=False)
  return jax.ShapeDtypeStruct(tuple(saved_leaf.shape), saved_leaf.dtype,
                              sharding=sharding)


def _assemble(src, read: dict, new_leaf):
  kind, keys, index = src
  if kind == "same":
    return read[keys[0]].astype(new_leaf.dtype)
  if kind == "stack":
    out = jax.numpy.stack([read[k] for k in keys])
  else:
    out = read[keys[0]][index]
  out = out.astype(new_leaf.dtype)
  sharding = getattr(new_leaf, "sharding", None)
  return jax.device_put(out, sharding) if sharding is not None else out


def _nest(flat: dict) -> dict:
  """Nested dict from ``/``-joined keys."""
  out: dict = {}
  for key, leaf in flat.items():
    node = out
    parts = key.split("/")
    for part in parts[:-1]:
      node = node.setdefault(part, {})
    node[parts[-1]] = leaf
  return out
