"""``--mode=verify``: every checkpoint step of a workdir or an export, checked.

Each step is read in full (every array of its state, into the shapes and
dtypes its own metadata gives, spread over the local devices: no config is
needed), its arrays compared with the fingerprints saved with it and checked
for NaN/Inf, and each process's input position parsed and checked against
its SHA-256. The table says, per step, ``ok``, ``ok, no fingerprint`` (saved
before fingerprints were recorded: read and finite, nothing to compare),
``damaged`` with what failed,
or ``set aside`` for the steps a training run moved to
``checkpoints_damaged/`` (``checkpoint.damaged_folder``; earlier versions:
``checkpoints/damaged/``).
"""
from __future__ import annotations

import dataclasses
import os

from etils import epath
import jax
import numpy as np

from hypermixer_jax.train import checkpoint as ckpt_lib
from hypermixer_jax.train import integrity
from hypermixer_jax.train import multihost

OK = "ok"
NO_FINGERPRINT = "ok, no fingerprint"
DAMAGED = "damaged"
SET_ASIDE = "set aside"


@dataclasses.dataclass
class Row:
  """One line of the table: a step (or a set-aside folder) and its state."""
  step: str
  status: str
  what: str = ""


def checkpoints_folder(path: str | os.PathLike) -> tuple[str, int | None]:
  """``(folder holding the step folders, the one step or None)`` of a
  workdir, its ``checkpoints`` folder, an export or one step folder."""
  path = epath.Path(os.fspath(path).rstrip("/"))
  if not path.is_dir():
    raise FileNotFoundError(f"--workdir={path} is not a folder; give a run's "
                            "workdir, an exported folder or one step folder.")
  if (path / "checkpoints").is_dir():
    return os.fspath(path / "checkpoints"), None
  if path.name.isdigit() and (path / ckpt_lib.STATE).is_dir():
    return os.fspath(path.parent), int(path.name)
  return os.fspath(path), None


def verify(path: str | os.PathLike) -> list[Row]:
  """One ``Row`` per step folder of ``path`` (newest first), then the
  set-aside ones. Raises FileNotFoundError when it holds no step at all."""
  directory, only = checkpoints_folder(path)
  on_disk = ([only] if only is not None else
             [int(p.name) for p in epath.Path(directory).iterdir()
              if p.name.isdigit()])
  aside = [] if only is not None else [
      f"{folder.name}/{p.name}"
      for folder in (ckpt_lib.damaged_folder(directory),
                     epath.Path(directory) / ckpt_lib.DAMAGED)
      for p in sorted(folder.glob("*"))]
  if not on_disk and not aside:
    raise FileNotFoundError(
        f"no checkpoint step in {directory}: give the --workdir of a trained "
        "run (it has checkpoints/) or an exported folder.")
  ckpt_lib.quiet_failed_reads()
  manager = ckpt_lib.reader(directory)
  try:
    finished = set(manager.all_steps())
    # A training run's steps each hold their input positions; an export's
    # (or one saved with none) hold none or an empty one, and then none is
    # expected.
    positioned = any(_holds_position(
        epath.Path(directory) / str(s) / ckpt_lib.DATA) for s in on_disk)
    rows = [_check(manager, directory, step, finished, positioned)
            for step in sorted(set(on_disk), reverse=True)]
  finally:
    manager.close()
  return rows + [Row(name.split("/")[-1], SET_ASIDE, name) for name in aside]


def _check(manager, directory: str, step: int, finished: set[int],
           positioned: bool) -> Row:
  if step not in finished:
    return Row(str(step), DAMAGED, ckpt_lib.UNFINISHED)
  try:
    meta = manager.item_metadata(step)[ckpt_lib.STATE]
    meta = getattr(meta, "tree", meta)
    devices = np.asarray(jax.local_devices())
    mesh = jax.sharding.Mesh(devices, ("all",))
    target = jax.tree.map(
        lambda m: jax.ShapeDtypeStruct(tuple(m.shape), m.dtype,
                                       sharding=_spread(m.shape, mesh)),
        meta)
    restored = ckpt_lib.read_tree(manager, directory, step, target)
    _check_positions(epath.Path(directory) / str(step) / ckpt_lib.DATA,
                     positioned)
    record = restored[ckpt_lib.FINGERPRINTS]
    found = integrity.problems(restored[ckpt_lib.STATE], record,
                               complete=True)
  except Exception as e:  # pylint: disable=broad-except
    return Row(str(step), DAMAGED,
               ckpt_lib.one_line(e) + _empty_files(directory, step))
  if found:
    return Row(str(step), DAMAGED, "; ".join(found))
  if record is None:
    return Row(str(step), NO_FINGERPRINT,
               "saved before fingerprints were recorded; read and finite")
  # (complete=True: every array has its entry and every entry its array.)
  return Row(str(step), OK, f"{len(record['arrays'])} arrays match")


def _empty_files(directory: str, step: int) -> str:
  """`` (empty files: ...)`` when the step holds 0-byte files (Orbax writes
  none: a crash or a full disk left them), else ``''``."""
  folder = epath.Path(directory) / str(step)
  empty = sorted(os.fspath(f.relative_to(folder))
                 for f in ckpt_lib.files_under(folder) if f.stat().length == 0)
  if not empty:
    return ""
  more = f" and {len(empty) - 3} more" if len(empty) > 3 else ""
  return f" (empty files: {', '.join(empty[:3])}{more})"


def _spread(shape, mesh: jax.sharding.Mesh) -> jax.sharding.NamedSharding:
  """The first axis the devices divide is split over them (a large array
  need not fit one device); replicated when none is."""
  n = mesh.devices.size
  spec = [None] * len(shape)
  for axis, size in enumerate(shape):
    if size % n == 0:
      spec[axis] = "all"
      break
  return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*spec))


def _position_files(folder: epath.Path) -> set[str]:
  """The input-position files (``process_I-of-N.json``, or the older
  single file) in a step's data folder."""
  if not folder.is_dir():
    return set()
  return {f.name for f in folder.iterdir()
          if multihost.FILE_PATTERN.match(f.name)
          or f.name == multihost.LEGACY_FILE}


def _holds_position(folder: epath.Path) -> bool:
  """Whether one of the step's input-position files holds a position."""
  for name in _position_files(folder):
    try:
      multihost.checked_position(multihost.read_position(folder / name),
                                 name)
      return True
    except (OSError, ValueError):
      continue
  return False


def _check_positions(folder: epath.Path, expected: bool) -> None:
  """Every process's input position file is there (``process_I-of-N.json``
  for each I of its N, as a resume reads them) and parses as JSON; where
  ``expected`` (other steps of the run hold positions), one is there and
  each holds a position (``multihost.checked_position``)."""
  if not folder.is_dir():
    raise FileNotFoundError(f"{folder} is missing")
  names = {f.name for f in folder.iterdir()}
  counts = {int(m.group(2)) for n in names
            if (m := multihost.FILE_PATTERN.match(n))}
  if expected and not _position_files(folder):
    raise FileNotFoundError(
        f"{folder} holds no input position file (process_I-of-N.json), "
        "though the run's other steps do")
  for count in sorted(counts):
    for index in range(count):
      if multihost.process_file(index, count) not in names:
        raise FileNotFoundError(
            f"{folder / multihost.process_file(index, count)} is missing "
            f"(the input position of process {index} of {count})")
  for f in folder.glob("*.json"):
    state = multihost.read_position(f)
    if expected:
      multihost.checked_position(state, f)


def format_table(rows: list[Row]) -> str:
  """The rows as an aligned text table (step, status, what failed)."""
  head = Row("step", "status", "what failed / checked")
  width = [max(len(getattr(r, f)) for r in [head, *rows])
           for f in ("step", "status")]
  return "\n".join(f"{r.step:>{width[0]}}  {r.status:<{width[1]}}  {r.what}"
                   .rstrip() for r in [head, *rows])
