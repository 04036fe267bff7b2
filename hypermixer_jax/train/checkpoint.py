"""Checkpoints: one small wrapper around ``orbax.checkpoint.CheckpointManager``.

A checkpoint step holds two items:

* ``state``: the train state (params, optimiser state, step), written with
  ``ocp.args.StandardSave`` and restored with ``ocp.args.StandardRestore``
  into *abstract* targets (``jax.ShapeDtypeStruct`` carrying the shardings of
  the current mesh), so a checkpoint written on 8 devices restores on 1 and
  the other way round;
* ``data``: the input pipeline's position (``pipeline.get_state()``, with
  the tf.data iterator state), as JSON, one file per process
  (``multihost.DataStateHandler``: each host writes and reads its own).

Saves are asynchronous, every ``save_every`` steps, keeping the newest
``keep`` (Orbax's ``max_to_keep``); a save is also due when Orbax's
``reached_preemption`` says the job is being preempted.

``Checkpointer.restore_latest`` falls back to the newest step that restores
when the newest ones are damaged (truncated files, garbage metadata, an
emptied folder), logging each skipped step and why; it never deletes one, and
when step folders exist but none restores it stops with an error naming
them, rather than starting from scratch over them.

``load_pretrained`` reads the parameters of another run (fine-tuning): every
parameter must match in path and shape except the ones under the prefixes
named to be re-initialised (the new head); anything else is an error naming
every offending path.
"""
from __future__ import annotations

import logging
import os
import re
from typing import Any, Sequence

from etils import epath
import jax
import numpy as np
import orbax.checkpoint as ocp

from hypermixer_jax import heads
from hypermixer_jax.models import common
from hypermixer_jax.train import multihost

PyTree = Any
STATE = "state"
DATA = "data"


class CheckpointError(RuntimeError):
  """No usable checkpoint where one is expected; the message names it."""


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


class Checkpointer:
  """Saves and restores ``(state, data position)`` pairs under ``directory``.

  Args:
    directory: where the step folders go (created if absent).
    save_every: save when ``step % save_every == 0``; 0 disables periodic
      saves (forced saves, e.g. at the end of a run, and preemption saves
      still happen).
    keep: ``max_to_keep`` (None or 0 keeps all).
    async_save: write in a background thread (training goes on meanwhile).
  """

  def __init__(self, directory: str | os.PathLike, *, save_every: int = 1000,
               keep: int | None = 3, async_save: bool = True):
    self.directory = os.fspath(directory)
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
        self.directory, options=options, item_names=(STATE, DATA))

  def latest_step(self) -> int | None:
    """The newest complete checkpoint step, or None."""
    return self.manager.latest_step()

  def all_steps(self) -> Sequence[int]:
    return self.manager.all_steps()

  def reached_preemption(self, step: int) -> bool:
    """True when the job received a preemption notice (all hosts agree)."""
    return self.manager.reached_preemption(step)

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
    ``should_save``) are skipped unless ``force``, and a step is never
    written twice.
    """
    if step in self.manager.all_steps():
      return False
    if not (force or self.should_save(step)):
      return False
    args = ocp.args.Composite(**{
        STATE: ocp.args.StandardSave(state),
        DATA: multihost.DataStateSave(_jsonable(data_state)),
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
    """
    step = self.latest_step() if step is None else step
    if step is None:
      raise FileNotFoundError(f"no checkpoint in {self.directory}")
    restored = self.manager.restore(step, args=ocp.args.Composite(**{
        STATE: ocp.args.StandardRestore(abstract_state),
        DATA: multihost.DataStateRestore(),
    }))
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

    Damaged newer steps are skipped with a warning naming the folder and the
    error, and left on disk. Returns None only when the directory holds no
    step folder at all.

    Raises:
      CheckpointError: step folders exist but none restores (each is named
        with its error), so that a run never starts from scratch over them.
    """
    complete = set(self.all_steps())
    on_disk = self.step_folders()
    failures = []
    for step in sorted(complete | set(on_disk), reverse=True):
      folder = os.path.join(self.directory, str(step))
      if step not in complete:
        failures.append((folder, "not a finished checkpoint (no commit "
                                 "marker or metadata Orbax recognises)"))
      else:
        try:
          state, data_state = self.restore(step, abstract_state)
        except Exception as e:  # pylint: disable=broad-except
          failures.append((folder, _short(e)))
        else:
          for f, why in failures:
            logging.warning("Checkpoint %s skipped (left on disk): %s", f,
                            why)
          if failures:
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
        "folders away (e.g. mv STEP STEP.bad) to resume from an older one, "
        "or use a new --workdir.")

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

  def __enter__(self) -> "Checkpointer":
    return self

  def __exit__(self, *exc) -> None:
    self.close()


def _short(e: Exception) -> str:
  """One line of an exception (Orbax/tensorstore errors span pages)."""
  text = " ".join(str(e).split())
  return f"{type(e).__name__}: {text[:400]}{'...' if len(text) > 400 else ''}"


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


def _reader(directory: str) -> ocp.CheckpointManager:
  """Read-only manager that can read item metadata without a target."""
  return ocp.CheckpointManager(
      directory,
      options=ocp.CheckpointManagerOptions(read_only=True, create=False),
      item_handlers={STATE: ocp.PyTreeCheckpointHandler(),
                     DATA: multihost.DataStateHandler()})


def resolve_checkpoint(path: str | os.PathLike) -> tuple[str, int]:
  """``(manager directory, step)`` for a workdir, checkpoints dir or step dir.

  Accepts ``WORKDIR`` (uses ``WORKDIR/checkpoints``), a checkpoints folder
  (latest step) or one step folder ``.../checkpoints/<step>``.
  """
  path = os.fspath(path).rstrip("/")
  if not epath.Path(path).exists():
    raise FileNotFoundError(
        f"config.init_checkpoint={path!r} does not exist; give a run's "
        "workdir, its checkpoints folder or one step folder.")
  if (epath.Path(path) / "checkpoints").is_dir():
    path = os.fspath(epath.Path(path) / "checkpoints")
  base = epath.Path(path).name
  if base.isdigit() and (epath.Path(path) / STATE).is_dir():
    return os.fspath(epath.Path(path).parent), int(base)
  manager = _reader(path)
  step = manager.latest_step()
  manager.close()
  if step is None:
    raise FileNotFoundError(f"init checkpoint {path!r} holds no checkpoint")
  return path, step


def load_pretrained(path: str | os.PathLike, params: PyTree,
                    reinit: Sequence[str] | None = None, *,
                    collection: str = "params") -> PyTree:
  """Returns ``params`` with every leaf not under ``reinit`` read from ``path``.

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
  """
  if reinit is None:
    reinit = (heads.param_modules_regex(),)
  directory, step = resolve_checkpoint(path)
  manager = _reader(directory)
  try:
    meta = manager.item_metadata(step)[STATE]
    meta = getattr(meta, "tree", meta)
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
    if errors:
      raise ValueError(
          f"init checkpoint {directory}/{step} does not fit the model "
          f"(re-initialised: {list(reinit)}):\n" + "\n".join(errors)
          + _layout_hint(new, saved))
    # Abstract target of the saved leaves to read only, with the new
    # shardings and dtypes; the rest of the saved tree is left on disk.
    target = _nest({key: _saved_target(src, new[k], saved[key])
                    for k, src in sources.items() for key in src[1]})
    restored = manager.restore(step, args=ocp.args.Composite(**{
        STATE: ocp.args.PyTreeRestore(
            item={collection: target},
            restore_args={collection: jax.tree.map(
                lambda s: ocp.ArrayRestoreArgs(sharding=s.sharding,
                                               dtype=s.dtype,
                                               global_shape=s.shape), target)},
            partial_restore=True)}))[STATE][collection]
  finally:
    manager.close()
  read = _flatten(restored)
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
  return jax.ShapeDtypeStruct(tuple(saved_leaf.shape), new_leaf.dtype,
                              sharding=sharding)


def _assemble(src, read: dict, new_leaf):
  kind, keys, index = src
  if kind == "same":
    return read[keys[0]]
  if kind == "stack":
    out = jax.numpy.stack([read[k] for k in keys])
  else:
    out = read[keys[0]][index]
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
