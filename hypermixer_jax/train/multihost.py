"""What each host keeps for itself in a checkpoint: its input position.

Every process reads its own shard of the input, so every process has its own
position in it (``Pipeline.get_state()``, which holds the tf.data iterator
state with its shuffle buffer: megabytes per host). ``DataStateHandler`` is
the Orbax handler of the checkpoint's ``data`` item: every process writes its
own file ``process_<i>-of-<n>.json`` into the item folder, in Orbax's
asynchronous save and commit protocol, and reads back only its own. The file
carries the SHA-256 of its position (``read_position`` checks it), so a
changed byte that still parses as JSON makes the step damaged instead of
resuming at another position or blaming the config. Nothing
is gathered between hosts (t5x keeps one dataset checkpoint per host the same
way), so the cost of a save per host does not grow with the number of hosts.

A checkpoint written by a different number of processes has different input
shards: no exact position exists, so the pipeline starts again from the
beginning of its shard (with a warning). Checkpoints of earlier versions (one
``metadata`` JSON file, all processes' positions gathered in it) still
restore.
"""
from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import re
import threading
from typing import Any

from absl import logging
from etils import epath
import jax
import orbax.checkpoint as ocp

LEGACY_FILE = "metadata"        # JsonCheckpointHandler's file name
_LEGACY_KEY = "per_process"      # all processes' positions in that file
FILE_PATTERN = re.compile(r"process_(\d+)-of-(\d+)\.json$")
# A position file: {"sha256": <digest of the position's JSON>,
# "input_position": <the position>} (files of earlier versions: the position).
_DIGEST, _POSITION = "sha256", "input_position"


def process_file(index: int, count: int) -> str:
  return f"process_{index}-of-{count}.json"


def _digest(payload: str) -> str:
  return hashlib.sha256(payload.encode()).hexdigest()


def encode_position(item: Any) -> str:
  """The text of a position file: ``item`` as JSON with its digest."""
  payload = json.dumps(item)
  return f'{{"{_DIGEST}": "{_digest(payload)}", "{_POSITION}": {payload}}}'


def read_position(path: epath.PathLike) -> Any:
  """The position held by the file ``path`` (``encode_position``'s text, or
  an earlier version's bare JSON); a ValueError naming the file where it is
  not JSON or its position differs from its digest."""
  text = epath.Path(path).read_text()
  try:
    record = json.loads(text)
  except ValueError as e:
    raise ValueError(f"{path} is not JSON ({e}): the checkpoint is "
                     "damaged") from e
  if not (isinstance(record, dict) and set(record) == {_DIGEST, _POSITION}):
    return record
  if _digest(json.dumps(record[_POSITION])) != record[_DIGEST]:
    raise ValueError(f"{path}: its input position differs from its sha256 "
                     "digest (a changed byte): the checkpoint is damaged")
  return record[_POSITION]


def _process() -> tuple[int, int]:
  """(index, count) of this JAX process (patched by tests)."""
  return jax.process_index(), jax.process_count()


class DataStateHandler(ocp.AsyncCheckpointHandler):
  """Saves this process's input position; restores this process's own.

  ``restore`` returns None, with a warning, when the checkpoint was written
  by a different number of processes, None when the position was saved as
  None, and raises FileNotFoundError when this process's file is missing.
  """

  async def async_save(self, directory: epath.Path,
                       args: "DataStateSave") -> list[ocp.Future]:
    index, count = _process()
    payload = encode_position(args.item)

    async def write() -> None:
      (epath.Path(directory) / process_file(index, count)).write_text(payload)

    # Awaits Orbax's signal that the (temporary) item folder exists, which
    # the primary process creates, then writes in the commit thread.
    return [ocp.future.CommitFutureAwaitingContractedSignals(
        write(), name="data_state_save")]

  def save(self, directory: epath.Path, args: "DataStateSave") -> None:
    async def run():
      for f in await self.async_save(directory, args):
        f.result()
    # In a thread: the caller may already run an event loop.
    thread = threading.Thread(target=asyncio.run, args=(run(),))
    thread.start()
    thread.join()

  def restore(self, directory: epath.Path,
              args: "DataStateRestore | None" = None) -> Any | None:
    del args
    directory = epath.Path(directory)
    index, count = _process()
    own = directory / process_file(index, count)
    if own.exists():
      return read_position(own)
    legacy = directory / LEGACY_FILE
    if legacy.exists():
      return _own_from_legacy(json.loads(legacy.read_text()), index, count)
    saved = sorted({int(m.group(2)) for p in directory.iterdir()
                    if (m := FILE_PATTERN.match(p.name))})
    if saved and count not in saved:
      _warn_process_count(saved[0], count)
      return None
    raise FileNotFoundError(
        f"{directory} holds no input position for process {index} of "
        f"{count} ({process_file(index, count)} is missing): the checkpoint "
        "is incomplete.")

  def metadata(self, directory: epath.Path) -> None:
    del directory
    return None


@ocp.args.register_with_handler(DataStateHandler, for_save=True)
@dataclasses.dataclass
class DataStateSave(ocp.args.CheckpointArgs):
  """This process's input position (a JSON-able tree)."""
  item: Any


@ocp.args.register_with_handler(DataStateHandler, for_restore=True)
@dataclasses.dataclass
class DataStateRestore(ocp.args.CheckpointArgs):
  """Restores this process's input position."""


def _warn_process_count(saved: int, count: int) -> None:
  logging.warning(
      "the checkpoint's input positions were saved by %d process(es), this "
      "run has %d: the input shards differ, so the pipeline starts from the "
      "beginning instead of resuming its position.", saved, count)


def checked_position(state: Any, path: Any) -> dict:
  """``state``, read from the input-position file ``path`` of a training
  run; a ValueError naming the file unless it holds a position (an object
  with the epoch and batch a pipeline resumes at): the training loop's
  checkpointer (``Checkpointer(check_data=...)``) and verify then count its
  step as damaged, as a missing file, instead of restarting the data stream
  or blaming the config."""
  if not (isinstance(state, dict) and all(
      isinstance(state.get(k), int) and not isinstance(state.get(k), bool)
      and state[k] >= 0 for k in ("epoch", "batch"))):
    shown = json.dumps(state)
    raise ValueError(
        f"{path} holds no input position ({shown[:60]}"
        f"{'...' if len(shown) > 60 else ''}: no epoch and batch): the "
        "checkpoint is damaged")
  return state


def _own_from_legacy(record: Any, index: int, count: int) -> Any | None:
  """This process's position from an earlier version's single record."""
  if record is None:
    return None
  gathered = isinstance(record, dict) and _LEGACY_KEY in record
  saved = len(record[_LEGACY_KEY]) if gathered else 1
  if saved != count:
    _warn_process_count(saved, count)
    return None
  return record[_LEGACY_KEY][index] if gathered else record
