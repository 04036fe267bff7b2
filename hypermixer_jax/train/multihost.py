"""What each host keeps for itself in a checkpoint: its input position.

Orbax writes the JSON item of a checkpoint from the primary process only, but
every process reads its own shard of the input, so every process has its own
position in it. ``gather_data_states`` collects all of them (a collective:
every process calls it at the same save) into one JSON-able record, and
``own_data_state`` picks this process's entry back out at restore.

With one process the state is stored as it is, so single-host checkpoints
keep their format.
"""
from __future__ import annotations

import json
from typing import Any

from absl import logging
import jax
from jax.experimental import multihost_utils
import numpy as np

_KEY = "per_process"


def _allgather_bytes(payload: bytes) -> list[bytes]:
  """Every process's ``payload``, in process order (collective)."""
  n = np.asarray([len(payload)], np.int64)
  sizes = np.asarray(multihost_utils.process_allgather(n)).reshape(-1)
  buf = np.zeros(int(sizes.max()), np.uint8)
  buf[:len(payload)] = np.frombuffer(payload, np.uint8)
  rows = np.asarray(multihost_utils.process_allgather(buf))
  rows = rows.reshape(len(sizes), -1)
  return [rows[i, :int(s)].tobytes() for i, s in enumerate(sizes)]


def gather_data_states(state: Any) -> Any:
  """The record to save: ``state`` itself, or all processes' states."""
  if jax.process_count() == 1:
    return state
  payloads = _allgather_bytes(json.dumps(state).encode("utf-8"))
  return {_KEY: [json.loads(p.decode("utf-8")) for p in payloads]}


def own_data_state(record: Any) -> Any | None:
  """This process's input position from a saved record, or None.

  None (with a warning) when the checkpoint was written by a different
  number of processes: the shards differ, so no exact position exists and
  the pipeline starts again from the beginning of its shard.
  """
  if record is None:
    return None
  saved = (len(record[_KEY]) if isinstance(record, dict) and _KEY in record
           else 1)
  if saved != jax.process_count():
    logging.warning(
        "the checkpoint's input positions were saved by %d process(es), this "
        "run has %d: the input shards differ, so the pipeline starts from "
        "the beginning instead of resuming its position.", saved,
        jax.process_count())
    return None
  if saved == 1:
    return record
  return record[_KEY][jax.process_index()]
