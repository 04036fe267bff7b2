"""An experiment's grid and its record, ``results.json``: each cell run
once under its key, shared by processes, resumed after a kill."""
from __future__ import annotations

import argparse
import contextlib
import copy
import fcntl
import itertools
import json
import os
import pathlib
import time
from typing import Any, Callable, Iterable, Sequence

from hypermixer_jax.experiment.digests import config_fingerprint
from hypermixer_jax.experiment.flags import REPO
from hypermixer_jax.experiment.vocab import small_vocab
from hypermixer_jax.experiment.vocab import stored_name


def grid(**axes: Sequence[Any]) -> list[dict[str, Any]]:
  """Every combination of the named axes, the first axis slowest.

  ``grid(model=("a", "b"), seed=(0, 1))`` ->
  ``[{'model': 'a', 'seed': 0}, {'model': 'a', 'seed': 1}, ...]``.
  """
  for name, values in axes.items():
    if isinstance(values, (str, bytes)) or not len(values):  # pylint: disable=g-explicit-length-test
      raise ValueError(f"grid axis {name}={values!r} must be a non-empty "
                       "sequence of values (e.g. seed=(0, 1, 2)).")
  names = list(axes)
  return [dict(zip(names, values))
          for values in itertools.product(*axes.values())]


def cell_key(prefix: str, cell: dict[str, Any]) -> str:
  """``prefix/name=value/...``: a cell's key in ``results.json``."""
  parts = [prefix] if prefix else []
  parts += [f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}"
            for k, v in cell.items()]
  return "/".join(parts)


class Experiment:
  """Results of one experiment directory, saved after every run."""

  def __init__(self, out: os.PathLike | str, args: argparse.Namespace | None
               = None):
    self.out = pathlib.Path(out)
    self.out.mkdir(parents=True, exist_ok=True)
    self.path = self.out / "results.json"
    self.data: dict[str, Any] = {"runs": {}}
    if self.path.exists():
      self.data = json.loads(self.path.read_text(encoding="utf-8"))
    # The record as this process last read or wrote it: what differs from
    # it in ``data`` is this process's own change, not yet written
    # (``_merge``).
    self._seen = copy.deepcopy(self.data)
    # A report (--report_only) trains nothing and keeps the recorded
    # command's arguments. Each run also keeps the arguments of the command
    # that ran it: the top-level ``args`` are only the last command's.
    self.report_only = bool(getattr(args, "report_only", False))
    self.args = None
    if args is not None and not self.report_only:
      self.args = {k: _portable(v) for k, v in vars(args).items()}
      self.data["args"] = self.args
    self._t0 = time.time()
    self._ran = False      # whether this process ran a cell (wall_s_total)

  @property
  def runs(self) -> dict[str, Any]:
    return self.data["runs"]

  def workdir(self, key: str) -> str:
    # Absolute: Orbax refuses relative checkpoint paths.
    return str((self.out / "runs" / key).resolve())

  def reload(self) -> None:
    """Merges in what other processes recorded in ``results.json``."""
    with self._locked():
      self._merge()

  @contextlib.contextmanager
  def _locked(self):
    """Holds ``results.json.lock`` (``flock``): one process at a time reads,
    merges and writes the record."""
    with open(self.out / "results.json.lock", "a", encoding="utf-8") as f:
      fcntl.flock(f, fcntl.LOCK_EX)
      try:
        yield
      finally:
        fcntl.flock(f, fcntl.LOCK_UN)

  def _merge(self) -> None:
    """``data`` := the record on disk with this process's own changes since
    it last read it. Several processes may work on one experiment (e.g. one
    per core, with --order=reverse): each one's runs, retired runs,
    baselines and fields are kept, and a copy this process read before
    another changed it (a run retired and recorded again elsewhere) never
    writes the old version back."""
    if not self.path.exists():
      return
    text = self.path.read_text(encoding="utf-8")
    disk = json.loads(text)
    seen, merged = self._seen, {}
    for field in {**disk, **self.data}:
      mine, theirs = self.data.get(field, _NONE), disk.get(field, _NONE)
      if field in _BY_KEY and all(isinstance(v, dict) or v is _NONE
                                  for v in (mine, theirs)):
        merged[field] = _merge_entries(
            {} if theirs is _NONE else theirs,
            self.data.setdefault(field, {}),
            _dict_or_empty(seen.get(field, {})))
      else:
        merged[field] = _newer(mine, theirs, seen.get(field, _NONE))
    merged = {k: v for k, v in merged.items() if v is not _NONE}
    # (A copy of its own: records are not shared with ``data``.)
    self.data, self._seen = merged, json.loads(text)

  def _claim(self, key: str) -> bool:
    """True when this process may run ``key``; False after waiting for
    another live process that claimed it (its result is then merged in)."""
    path = self._claim_path(key)
    path.parent.mkdir(exist_ok=True)
    while True:
      try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
      except FileExistsError:
        try:
          pid = int(path.read_text() or 0)
          # Empty: another process between creating it and writing its PID.
          fresh = not pid and time.time() - path.stat().st_mtime < 60
        except (OSError, ValueError):
          pid, fresh = 0, False
        if fresh:
          time.sleep(1)
          continue
        if pid and pid != os.getpid() and _alive(pid):
          time.sleep(10)
          self.reload()
          if key in self.runs:
            return False
          continue
        self._take_over(path, pid)  # its process died
        continue
      with os.fdopen(fd, "w") as f:
        f.write(str(os.getpid()))
      self.reload()   # recorded (and its claim gone) since it was looked for
      if key in self.runs:
        path.unlink(missing_ok=True)
        return False
      return True

  def _take_over(self, path: pathlib.Path, dead: int) -> None:
    """Removes the claim ``path`` of the dead process ``dead``, unless it
    holds another since it was read: two processes that both saw the dead
    PID take it over one at a time (under ``results.json.lock``), and the
    second finds the first's claim (or none yet) and leaves it."""
    with self._locked():
      try:
        now = int(path.read_text() or 0)
        age = time.time() - path.stat().st_mtime
      except (OSError, ValueError):
        return
      # An empty claim is stale only when old: a fresh one is another
      # process between creating it and writing its PID.
      if now == dead and (dead or age >= 60):
        path.unlink(missing_ok=True)

  def _claim_path(self, key: str) -> pathlib.Path:
    return self.out / "claims" / (key.replace("/", "__") + ".pid")

  def _claimed_elsewhere(self, key: str) -> bool:
    """Whether another live process holds ``key``'s claim (and has not
    recorded it yet)."""
    if self.report_only or key in self.runs:
      return False
    path = self._claim_path(key)
    try:
      pid = int(path.read_text() or 0)
    except (OSError, ValueError):
      return False
    return bool(pid) and pid != os.getpid() and _alive(pid)

  def run(self, key: str, fn: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """``fn()``'s result under ``key``; skipped when already recorded (by
    this or another process working on the same directory)."""
    self.reload()
    if key not in self.runs and self._claim(key):
      t0 = time.time()
      result = dict(fn())
      result.setdefault("wall_s", time.time() - t0)
      result.setdefault("ran_on", ran_on())
      if self.args is not None:
        result.setdefault("args", self.args)
      self._ran = True
      self.runs[key] = result
      self.save()
      # Recorded: the claim goes (a PID reused after a restart would
      # otherwise hold it).
      self._claim_path(key).unlink(missing_ok=True)
      print(f"[{self.out.name}] {key}: "
            + json.dumps({k: v for k, v in result.items()
                          if not isinstance(v, (dict, list))}), flush=True)
    return self.runs[key]

  def adopt(self, key: str, config, source: os.PathLike | str,
            source_key: str, source_config) -> dict[str, Any] | None:
    """Records another experiment's run as this one's ``key``, instead of
    training it again, when both train the same run: ``source_key`` is
    recorded in ``source``'s ``results.json`` and ``source_config`` (the
    config the source trained it with) has ``config``'s fingerprint (equal
    settings, files of equal content). The record keeps where it came from
    (``adopted_from``). Returns it, or None (nothing recorded) when the
    source lacks the run or the configs differ (``run`` then trains it), or
    in a report (which records nothing)."""
    self.reload()
    if key in self.runs or self.report_only:
      return self.runs.get(key)
    source = pathlib.Path(source)
    path = source / "results.json"
    if not path.exists():
      return None
    run = json.loads(path.read_text(encoding="utf-8"))["runs"].get(source_key)
    if run is None or (config_fingerprint(config)
                       != config_fingerprint(source_config)):
      return None
    self.runs[key] = dict(run, adopted_from=f"{source.name}: {source_key}")
    self.save()
    print(f"[{self.out.name}] {key}: adopted from {source.name} "
          f"({source_key}), the same config", flush=True)
    return self.runs[key]

  def supersede(self, key: str, why: str) -> None:
    """Retires ``key``'s recorded result: it moves to ``superseded[key]``
    (``key#2`` ... for a key retired again) with ``why`` (kept, for the
    record) and its work directory to ``runs/superseded/`` under the same
    name (a run there would resume from its checkpoints),
    so that the cell runs again. A report leaves the cell out."""
    result = self.runs.pop(key)
    retired = self.data.setdefault("superseded", {})
    # A key retired before keeps that record too: ``key#2``, ``key#3`` ...
    name = key
    for n in itertools.count(2):
      if name not in retired and not (
          self.out / "runs" / "superseded" / name).exists():
        break
      name = f"{key}#{n}"
    retired[name] = dict(result, superseded_because=why)
    print(f"[{self.out.name}] {key}: superseded ({why})", flush=True)
    if self.report_only:   # a report changes nothing on disk
      return
    old = pathlib.Path(self.workdir(key))
    if old.exists():
      dest = self.out / "runs" / "superseded" / name
      dest.parent.mkdir(parents=True, exist_ok=True)
      old.rename(dest)
    self.save()

  def cell(self, key: str, fn: Callable[[], dict[str, Any]]
           ) -> dict[str, Any] | None:
    """A grid cell's result: ``run(key, fn)``, or in a report
    (``--report_only``) the recorded result, None where there is none."""
    if self.report_only:
      self.reload()
      return self.runs.get(key)
    return self.run(key, fn)

  def cells(self, prefix: str, cells: Iterable[dict[str, Any]],
            fn: Callable[[dict[str, Any], str], dict[str, Any]],
            by: str = "model",
            expect: Callable[[dict[str, Any]], dict[str, Any]] | None = None
            ) -> dict[Any, list[dict[str, Any]]]:
    """Every cell under ``cell_key(prefix, cell)`` (``fn(cell, key)`` runs
    it), grouped by ``cell[by]`` in grid order: ``{value: [result, ...]}``
    (e.g. each model's seeds); a report leaves out the cells not recorded.

    ``expect(cell)``: fields (e.g. the parameter count) a recorded result
    of the cell must hold; a result that holds other values was made by
    another setting of the cell, and is retired (``supersede``) and run
    again rather than mixed into the current setting's seeds."""
    cells = {cell_key(prefix, c): c for c in cells}

    def check(key: str) -> None:
      if key in self.runs:
        want = expect(cells[key])
        got = {k: self.runs[key].get(k) for k in want}
        if got != want:
          self.supersede(key, f"recorded {got}, the cell now has {want}")
    results = self.share([(k, lambda c=c, k=k: fn(c, k))
                          for k, c in cells.items()],
                         before=check if expect is not None else None)
    for key, result in results.items():
      # A result this process waited for was recorded by another, which
      # may expect another setting (another --lrs, older code).
      want = {} if expect is None or result is None else expect(cells[key])
      got = {k: (result or {}).get(k) for k in want}
      if got != want and not self.report_only:
        raise RuntimeError(
            f"{self.out}: {key} was recorded by another process with {got}, "
            f"where this command's cell has {want}: the two commands on this "
            "--out disagree (e.g. another --lrs); stop one and run the other "
            "again.")
    out: dict[Any, list[dict[str, Any]]] = {}
    for key, c in cells.items():
      result = results[key]
      if result is not None:
        out.setdefault(c[by], []).append(result)
    return out

  def share(self, jobs: Sequence[tuple[str, Callable[[], dict[str, Any]]]],
            before: Callable[[str], None] | None = None
            ) -> dict[str, dict[str, Any] | None]:
    """``{key: cell(key, fn)}`` for each ``(key, fn)`` of ``jobs``, taken
    in order but skipping the keys another live process is running (checked
    afresh before each): processes working on the same jobs share them out
    instead of queueing behind each other's claims. Where every job left is
    taken, wait for the first. ``before(key)``: called just before a job's
    cell (e.g. to retire a record made at another setting)."""
    results: dict[str, dict[str, Any] | None] = {}
    queue = list(jobs)
    while queue:
      job = next((j for j in queue if not self._claimed_elsewhere(j[0])),
                 queue[0])
      queue.remove(job)
      key, fn = job
      if before is not None:
        before(key)
      results[key] = self.cell(key, fn)
    return results

  def baseline(self, key: str, fn: Callable[[], dict[str, Any]],
               tag: dict[str, Any] | None = None) -> dict[str, Any]:
    """The trivial baselines recorded under ``key`` in ``results.json``'s
    ``baselines``: ``fn()``, computed and saved the first time they are
    asked for (a report computes a missing one without saving it).
    ``tag``: fields the record holds (e.g. the digest of the data fitted
    on); a record holding other values is computed again."""
    bases = self.data.setdefault("baselines", {})
    tag = dict(tag or {})
    if key not in bases or any(bases[key].get(k) != v
                               for k, v in tag.items()):
      bases[key] = dict(fn(), **tag)
      self.save()
    return bases[key]

  def vocab(self, patterns: str | Sequence[str], fields: Sequence[str],
            size: int, trained_on: str) -> dict[str, Any]:
    """``small_vocab`` built in this directory (or restored from the store
    beside it, ``vocab_store``, by the digest recorded before) and recorded
    in ``results.json``: its digest, its stored file relative to this
    directory, and what it was trained on."""
    vocab = small_vocab(self.out, patterns, fields, size,
                        store_dir=self.vocab_store,
                        digest=self.data.get("vocab", {}).get("sha256"))
    record = {k: v for k, v in vocab.items() if k != "path"}
    self.save(vocab={**record, "stored": "../vocab/" + stored_name(
        vocab["sha256"]), "trained_on": trained_on})
    return vocab

  @property
  def vocab_store(self) -> pathlib.Path:
    """The experiments' vocabulary store (one copy of each, by digest)."""
    return self.out.parent / "vocab"

  def save(self, **extra) -> None:
    """Records ``extra`` and writes ``results.json``; a report
    (``--report_only``) keeps them in memory only: it reads the record and
    never rewrites it (what it computes now from today's defaults, e.g. a
    config's sizes, would misstate the runs recorded)."""
    self.data.update(extra)
    if self.report_only:
      return
    with self._locked():
      self._merge()
      tmp = self.path.with_suffix(f".json.{os.getpid()}.tmp")
      text = json.dumps(self.data, indent=1, default=float)
      tmp.write_text(text, encoding="utf-8")
      tmp.replace(self.path)
      self._seen = json.loads(text)

  def write_table(self, title: str, table: str, notes: str = "", *,
                  name: str = "table") -> str:
    """Writes ``<name>.md`` (title, table, notes) and prints it."""
    text = f"## {title}\n\n{table}\n"
    if notes:
      text += f"\n{notes.strip()}\n"
    (self.out / f"{name}.md").write_text(text, encoding="utf-8")
    if self._ran:  # a report from recorded runs adds no run time
      self.save(wall_s_total=self.data.get("wall_s_total", 0.0)
                + time.time() - self._t0)
    print(text, flush=True)
    return text

  def figure_path(self, name: str) -> str:
    return str(self.out / f"{name}.png")

  def save_figure(self, fig, name: str) -> None:
    """Writes ``fig`` as ``<name>.png`` beside the table."""
    fig.savefig(self.figure_path(name), dpi=120)


# The record's fields merged entry by entry between processes (one
# process's model sizes, plan or length verdicts keep the other's), where
# they are dicts on both sides (a study may record ``sizes`` as a list).
_BY_KEY = ("runs", "superseded", "baselines", "splits", "sizes", "plan",
           "length_checks")


_NONE = object()   # a field or entry that one side does not hold


def _newer(mine: Any, theirs: Any, seen: Any) -> Any:
  """One field or entry: this process's value where it changed it since
  ``seen`` (what it last read or wrote; ``_NONE``: absent), else the one on
  disk. An unchanged value equal to the disk's stays the same object, so
  that code holding it keeps seeing the record's."""
  if mine is not _NONE and (seen is _NONE or not _same(seen, mine)):
    return mine      # added or changed here
  if mine is _NONE and seen is not _NONE:   # removed here ...
    return _NONE if theirs is _NONE or _same(theirs, seen) else theirs
  if mine is not _NONE and theirs is not _NONE and _same(mine, theirs):
    return mine
  return theirs


def _merge_entries(disk: dict, mine: dict, seen: dict) -> dict:
  """``disk`` with the entries ``mine`` added or changed since ``seen``
  (what this process last read or wrote), and without those it removed
  since then (unless another process has changed them meanwhile). Written
  into ``mine`` itself, which code may hold (``splits = data['splits']``)."""
  out = {key: _newer(mine.get(key, _NONE), disk.get(key, _NONE),
                     seen.get(key, _NONE)) for key in {**disk, **mine}}
  mine.clear()
  mine.update((k, v) for k, v in out.items() if v is not _NONE)
  return mine


def _dict_or_empty(value: Any) -> dict:
  return value if isinstance(value, dict) else {}


def _same(a: Any, b: Any) -> bool:
  """Equal as recorded (a NaN equals a NaN)."""
  return a == b or (json.dumps(a, sort_keys=True, default=float)
                    == json.dumps(b, sort_keys=True, default=float))


def _portable(value: Any) -> Any:
  """A path inside the repository's folder as a path relative to the
  repository (recorded commands carry no machine's absolute paths)."""
  if isinstance(value, str) and os.path.isabs(value):
    rel = os.path.relpath(value, REPO)
    if rel.split(os.sep)[:2] != [os.pardir, os.pardir]:
      return rel
  return value


def ran_on() -> str:
  """Where this process computes: JAX's backend and device kind, with the
  float32 matmul precision where it is set (a GPU's default may use TF32),
  e.g. ``'cpu: cpu'`` or ``'gpu: NVIDIA H200 (matmul precision highest)'``.
  Records made before this field ran on CPUs."""
  import jax  # pylint: disable=g-import-not-at-top
  device = jax.devices()[0]
  text = f"{device.platform}: {device.device_kind}"
  precision = jax.config.jax_default_matmul_precision
  return text + (f" (matmul precision {precision})" if precision else "")


# What ``ran_on`` says of a CPU; records made before the field ran on CPUs.
CPU = "cpu: cpu"


def where_ran(groups: dict[str, Iterable[dict[str, Any]]], end: str = ""
              ) -> str:
  """A table note saying where each group of runs ran ({label: runs}),
  e.g. ``'Ran on: cpu: cpu (n=500); gpu: NVIDIA H200 (matmul precision
  highest) (n=5,000, n=50,000).'`` followed by ``end``; '' when every run
  ran on CPUs."""
  labels: dict[str, list[str]] = {}
  for label, runs in groups.items():
    for on in sorted({r.get("ran_on", CPU) for r in runs}):
      labels.setdefault(on, []).append(label)
  if set(labels) <= {CPU}:
    return ""
  return "Ran on: " + "; ".join(
      f"{on} ({', '.join(names)})" for on, names in labels.items()) + "." + end


def _alive(pid: int) -> bool:
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:
    return True
  return True
