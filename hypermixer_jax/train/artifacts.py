"""Checkpoints as artifacts: parameters alone, evaluation and prediction.

* ``write_params`` / ``export_params``: the parameters without optimiser
  state or input position, as an Orbax checkpoint (``<dir>/<step>/state``
  holding ``{"params": ...}``) that ``config.init_checkpoint`` and
  ``load_params`` read like a training checkpoint; a fraction of its size.
  An export also holds the run's ``config.json`` and its vocabulary (a copy
  under ``vocab/``, ``vocabulary.json`` with its path and SHA-256), so that
  ``--mode=evaluate|predict --workdir=EXPORT`` needs nothing else.
* ``load_params``: parameters of a training or an exported checkpoint,
  restored straight into the shardings of the current mesh.
* ``evaluate_checkpoint``: the task's evaluation of a workdir's latest (or a
  given) step, without training (``main.py --mode=evaluate``).
* ``predict_file``: an input file in, JSONL out (``main.py --mode=predict``):
  labels and class probabilities for classifiers, the filled-in tokens for
  masked LM; output line k answers input line k.
"""
from __future__ import annotations

import itertools
import json
import os
import re
from typing import Any

from absl import logging
from etils import epath
import flax
import flax.linen as nn
import jax
import ml_collections
import numpy as np

from hypermixer_jax import heads
from hypermixer_jax import models
from hypermixer_jax import sharding
from hypermixer_jax.models import zoo
from hypermixer_jax.train import checkpoint as ckpt_lib
from hypermixer_jax.train import config_checks
from hypermixer_jax.train import preflight
from hypermixer_jax.train import run_config
from hypermixer_jax.train import storage

PyTree = Any


def write_params(directory: str | os.PathLike, params: PyTree,
                 step: int = 0, *, overwrite: bool = False) -> str:
  """Saves ``params`` alone as checkpoint ``step`` under ``directory``
  (a step already there is replaced only with ``overwrite``: the new step
  is written beside it first, in ``.staging-<step>/``, and swapped in once
  complete, so that a save that fails leaves the old one in place).

  Every process must call it (Orbax writes each host's shards).
  """
  directory = os.fspath(directory)
  root = epath.Path(directory)
  staging = root / f".staging-{step}"
  old = root / f".replaced-{step}"

  def recover():
    # A swap cut short left the old step aside (and maybe part of the new
    # one, never marked finished, in its place).
    if old.exists() and step not in ckpt_lib.finished_steps(directory):
      if (root / str(step)).exists():
        (root / str(step)).rmtree()
      ckpt_lib.move_folder(old, root / str(step))
      logging.warning("Put back %s as %s/%d (a replacement was cut short).",
                      old, directory, step)
    if staging.exists():   # a save or swap cut short: never swapped in
      staging.rmtree()
  ckpt_lib.on_primary(recover, "recovering an export cut short")
  with ckpt_lib.Checkpointer(directory, save_every=0, keep=None) as ck:
    held = step in ck.all_steps()
  if held and not overwrite:
    raise config_checks.ConfigError(
        f"--output={directory} already holds step {step}; pass "
        "--overwrite to replace it, or another --output.")
  with ckpt_lib.Checkpointer(os.fspath(staging) if held else directory,
                             save_every=0, keep=None,
                             async_save=False) as ck:
    if not ck.save(step, {"params": params}, {}, force=True):
      raise ckpt_lib.CheckpointError(
          f"{ck.directory}: step {step} was not written (already there).")
  if held:
    def swap():
      # The old step moves aside first and is removed last: a crash in
      # between leaves both copies (put back by the next call), never
      # neither.
      if old.exists():
        old.rmtree()
      ckpt_lib.move_folder(root / str(step), old)
      ckpt_lib.move_folder(staging / str(step), root / str(step))
      old.rmtree()
      if staging.exists():   # an object store keeps no empty folder
        staging.rmtree()
    ckpt_lib.on_primary(swap, "replacing the exported step")
  return directory


def abstract_params(config: ml_collections.ConfigDict,
                    mesh: jax.sharding.Mesh, rules) -> PyTree:
  """``ShapeDtypeStruct`` params of ``config.model``, sharded on ``mesh``."""
  boxed = zoo.abstract_variables(config.model)["params"]
  shardings = sharding.logical_shardings(boxed, mesh, rules)
  return jax.tree.map(
      lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
      nn.unbox(boxed), shardings)


def _checkpoint_path(workdir: str, step: int | None) -> str:
  """The step folder (or the checkpoints folder for the latest step).

  Raises:
    CheckpointError: naming ``workdir`` when it holds no checkpoint.
  """
  path = os.fspath(workdir).rstrip("/")
  if (storage.path(path) / "checkpoints").is_dir():
    path = os.path.join(path, "checkpoints")
  steps = (sorted(int(d.name) for d in storage.path(path).iterdir()
                  if d.name.isdigit())
           if storage.path(path).is_dir() else [])
  if not steps and not os.path.basename(path).isdigit():
    raise ckpt_lib.CheckpointError(
        f"no checkpoint in {workdir} ("
        f"{'no step folder' if storage.path(workdir).is_dir() else 'no such folder'}"
        "): give the --workdir of a trained run (it has checkpoints/) or an "
        "exported folder.")
  if step is None:
    return path
  step_dir = os.path.join(path, str(step))
  if not storage.path(step_dir).is_dir():
    raise FileNotFoundError(f"no checkpoint step {step} in {path}; steps "
                            f"there: {steps}.")
  return step_dir


def load_params(config: ml_collections.ConfigDict, workdir: str,
                step: int | None = None, mesh=None, rules=None
                ) -> tuple[PyTree, int]:
  """``(params, step)`` of ``workdir``'s checkpoint (latest or ``step``).

  ``workdir`` may be a training workdir, its ``checkpoints`` folder or an
  exported parameters folder. Without ``step``, the newest step that reads
  (``checkpoint.load_pretrained_step``: a damaged step, or one that a running
  training's retention removes while it is read, gives way to the newest
  other). The parameters are then in memory: retention can no longer take
  them away. Raises ValueError naming every parameter that does not fit
  ``config.model``.
  """
  if mesh is None:
    mesh = sharding.build_mesh(config.mesh)
    rules = sharding.get_rules(config.sharding)
  return ckpt_lib.load_pretrained_step(_checkpoint_path(workdir, step),
                                       abstract_params(config, mesh, rules),
                                       reinit=())


def export_params(config: ml_collections.ConfigDict, workdir: str,
                  output: str, step: int | None = None, *,
                  overwrite: bool = False) -> str:
  """Writes the parameters of ``workdir``'s checkpoint to ``output``, with
  the config and the vocabulary that ``--mode=evaluate|predict`` of
  ``output`` read (``run_config.write``).

  ``output`` must be new, empty or an export (which gains the step);
  ``overwrite`` replaces a step it holds and writes into any folder.
  """
  _check_not_the_run(workdir, output)
  source = _run_folders(_resolved(workdir))[1]
  foreign = _check_export_folder(output, overwrite, config, source)
  params, found = load_params(config, workdir, step)
  if foreign:   # --overwrite: another run's steps would be read as this one's
    def remove():
      for s in foreign:
        (storage.path(output) / str(s)).rmtree()
      logging.warning("Removed step(s) %s of another run from %s "
                      "(--overwrite).", foreign, output)
    ckpt_lib.on_primary(remove, "removing another run's exported steps")
  write_params(output, params, found, overwrite=overwrite)
  if jax.process_index() == 0:
    run_config.write(config, output, vocabulary=True)
    _record_source(output, found, source, removed=foreign)
  n = sum(x.size for x in jax.tree.leaves(params))
  logging.info("exported %d parameters (step %d) of %s to %s", n, found,
               workdir, output)
  return output


def _same_content(a: str, b: str) -> bool:
  """Whether the files ``a`` and ``b`` (local or remote) hold the same
  bytes; False when either cannot be read."""
  try:
    return storage.path(a).read_bytes() == storage.path(b).read_bytes()
  except (OSError, ValueError):
    return False


def _resolved(path: str) -> str:
  path = os.fspath(path)
  return (os.path.realpath(path) if storage.is_local(path)
          else path.rstrip("/"))


def _run_folders(run: str) -> tuple[str, str, str]:
  """(the folder read, the run's root, its checkpoints folder): --workdir
  may be the run, its checkpoints folder or one step folder."""
  parts = run.rstrip("/").split("/")
  if parts[-1].isdigit() and len(parts) > 1 and parts[-2] == "checkpoints":
    parts = parts[:-2]
  elif parts[-1] == "checkpoints":
    parts = parts[:-1]
  root = "/".join(parts)
  return run.rstrip("/"), root, root + "/checkpoints"


def _check_not_the_run(workdir: str, output: str) -> None:
  """Refuses, even with ``--overwrite``, an export into the folder it reads
  or into the run's checkpoints: its parameters-only step (and config)
  would replace the run's training state."""
  out = _resolved(output)
  # By the path as given (made absolute) and with links resolved: either
  # side may be a link (a checkpoints folder on another disk).
  forms = [_run_folders(storage.absolute(workdir)),
           _run_folders(_resolved(workdir))]
  folders = {g(f) for fs in forms for f in fs for g in (str, _resolved)}
  ckpts = {g(fs[2]) for fs in forms for g in (str, _resolved)}
  if out in folders or any(out.startswith(c + "/") for c in ckpts):
    raise config_checks.ConfigError(
        f"--output={output} is the run it exports (--workdir={workdir}) or "
        "its checkpoints; an export there would replace the run's training "
        "state: pass another folder.")


# An export's record of the run each of its steps came from.
SOURCES = "exported_from.json"


def _sources(output: str) -> dict[str, str]:
  path = storage.path(output) / SOURCES
  return json.loads(path.read_text()) if path.exists() else {}


def _record_source(output: str, step: int, source: str,
                   removed: list[int] = ()) -> None:
  kept = {s: r for s, r in _sources(output).items()
          if int(s) not in removed}
  storage.replace(storage.path(output) / SOURCES, json.dumps(
      {**kept, str(step): source}, indent=1, sort_keys=True) + "\n")


def _check_export_folder(output: str, overwrite: bool,
                         config: ml_collections.ConfigDict,
                         source: str | None = None) -> list[int]:
  """Refuses to mix an export's files into a folder that holds others,
  steps of a model of other shapes or vocabulary (their config.json would
  be replaced by this one's, and they would no longer load), or steps of
  another run than ``source`` (the run's root; evaluate, predict and
  fine-tuning read the latest step, whichever run it came from). Returns
  the other run's steps, which ``--overwrite`` removes."""
  out = storage.path(output)
  if out.exists() and not out.is_dir():
    raise config_checks.ConfigError(
        f"--output={output} is a file; export writes a folder: pass a new "
        "folder's path.")
  saved = out / run_config.CONFIG_FILE
  if saved.exists() and not overwrite:
    theirs = run_config.load(saved)   # its vocab_path: the export's copy
    fields = [f for f in run_config.shape_fields(theirs, config)
              if f not in run_config.OPTIMIZER_LAYOUT   # (params only)
              and not (f == "data.vocab_path" and _same_content(
                  theirs["data"]["vocab_path"], config.data.vocab_path))]
    if fields:
      raise config_checks.ConfigError(
          f"--output={output} holds the export of another model (its "
          f"{saved} differs in {', '.join(fields)}); export into another "
          "folder, or pass --overwrite to replace its config.")
  # What --mode=evaluate writes into an export, besides the export's own.
  export = {run_config.CONFIG_FILE, run_config.VOCAB_DIR,
            run_config.VOCAB_RECORD, SOURCES, "evaluations"}
  # Steps, and a replacement's own folders (``write_params``).
  others = sorted(p.name for p in out.iterdir()
                  if p.name not in export and not p.name.isdigit()
                  and not re.fullmatch(r"\.(staging|replaced)-\d+", p.name)
                  ) if out.is_dir() else []
  if others and not overwrite:
    raise config_checks.ConfigError(
        f"--output={output} is a folder with other files than an export's "
        f"({', '.join(others[:3])}{', ...' if len(others) > 3 else ''}); "
        "pass a new or empty folder, or --overwrite to write into it.")
  if source is None or not out.is_dir():
    return []
  sources = _sources(output)
  foreign = sorted(int(p.name) for p in out.iterdir() if p.name.isdigit()
                   and sources.get(p.name) != source)
  if foreign and not overwrite:
    runs = sorted({sources.get(str(s), "a run not recorded") for s in foreign})
    raise config_checks.ConfigError(
        f"--output={output} holds step(s) {foreign} exported from another "
        f"run ({', '.join(runs)}); this run's step beside them would not be "
        "the one evaluate, predict or fine-tuning read: export into another "
        "folder, or pass --overwrite to replace them.")
  return foreign


# ---------------------------------------------------------------------------
# Prediction.
# ---------------------------------------------------------------------------
MASK_MARKER = "[MASK]"
CLASSIFIER_HEADS = tuple(n for n, h in heads.HEADS.items()
                         if h.kind == "classes")
MODEL_KWARGS = heads.MODEL_KWARGS


BLANK = "blank line"


def _check_input(path: str) -> None:
  """A predict input that is a folder or does not exist stops in one line."""
  from hypermixer_jax.data.checks import DataError  # pylint: disable=g-import-not-at-top
  kinds = ("(.txt one example a line, .tsv or .jsonl with the task's "
           "columns)")
  if epath.Path(path).is_dir():
    raise DataError(f"--input={path} is a folder; pass a file {kinds}.")
  if not epath.Path(path).exists():
    raise DataError(f"--input={path}: no such file; check the path (a file "
                    f"{kinds}).")


def _check_output(path: str) -> None:
  """A predict output that names a folder stops in one line."""
  if os.fspath(path).endswith("/") or epath.Path(path).is_dir():
    raise config_checks.ConfigError(
        f"--output={path} is a folder; predict writes one JSONL file: pass "
        "a file's path (e.g. predictions.jsonl).")


def _read_lines(path: str) -> list[str]:
  """The lines of a predict input; a folder, or a line that is not UTF-8
  text, stops with the file (and line) like a bad training row."""
  from hypermixer_jax.data.checks import DataError  # pylint: disable=g-import-not-at-top
  _check_input(path)
  lines = epath.Path(path).read_bytes().split(b"\n")
  if lines[-1] == b"":
    lines.pop()
  out = []
  for i, line in enumerate(lines, 1):
    try:
      out.append(line.decode("utf-8").rstrip("\r"))
    except UnicodeDecodeError as e:
      raise DataError(
          f"{path}:{i}: the line is not valid UTF-8 (byte {e.start + 1}); "
          "re-encode the file as UTF-8 (e.g. iconv -f latin1 -t utf-8), or "
          "is it a text file?") from None
  return out


def _input_rows(path: str, columns: list[tuple[str, ...]]
                ) -> list[list[str] | None]:
  """Texts of each example, one entry per input line (``None``: a blank
  line): a ``.txt`` (fields separated by tabs), or a ``.tsv`` (after its
  header line) / ``.jsonl`` with the task's columns (``columns[i]``:
  aliases)."""
  from hypermixer_jax.data.sources import DataError  # pylint: disable=g-import-not-at-top
  lines = _read_lines(path)
  if path.endswith((".jsonl", ".json")):
    records = [(i, json.loads(l) if l.strip() else None)
               for i, l in enumerate(lines, 1)]
  elif path.endswith(".tsv"):
    header = lines[0].split("\t") if lines else []
    records = [(i, dict(zip(header, l.split("\t"))) if l.strip() else None)
               for i, l in enumerate(lines[1:], 2)]
  else:
    rows = []
    for i, line in enumerate(lines, 1):
      if not line.strip():
        rows.append(None)
        continue
      fields = line.split("\t")
      if len(fields) != len(columns):
        raise DataError(
            f"{path}:{i}: {len(fields)} tab-separated field(s), the task "
            f"needs {len(columns)} ({', '.join(c[0] for c in columns)}).")
      rows.append(fields)
    return rows
  rows = []
  for i, rec in records:
    if rec is None:
      rows.append(None)
      continue
    texts = []
    for aliases in columns:
      found = [a for a in aliases if a in rec]
      if not found:
        raise DataError(f"{path}:{i}: none of the columns {list(aliases)} "
                        f"(has {sorted(rec)}).")
      texts.append(str(rec[found[0]]))
    rows.append(texts)
  return rows


def _prediction_data(config, input_path: str, tmpdir: str):
  """(data config reading the input as split 'predict', one record per
  input line: its columns, ``None`` for a blank line)."""
  from hypermixer_jax.data import tasks  # pylint: disable=g-import-not-at-top
  data = ml_collections.ConfigDict(config.data.to_dict())
  task = data.task
  if task in tasks.CLASSIFICATION:
    spec = tasks.CLASSIFICATION[task]
    names = [c[0] for c in spec.columns]
    rows = _input_rows(input_path, list(spec.columns))
    local = os.path.join(tmpdir, "predict.jsonl")
    with open(local, "w", encoding="utf-8") as f:
      for texts in filter(None, rows):   # the label is unused; the reader needs one
        f.write(json.dumps({**dict(zip(names, texts)), "label": 0}) + "\n")
  elif task.startswith("imagenet_patches"):
    names = ["filename"]
    rows = _input_rows(input_path, [("filename", "file_name")])
    root = (os.path.dirname(os.path.abspath(input_path))
            if storage.is_local(input_path) else input_path.rsplit("/", 1)[0])
    local = os.path.join(tmpdir, "predict.tsv")
    with open(local, "w", encoding="utf-8") as f:
      f.write("filename\tlabel\n")
      for [name] in filter(None, rows):
        f.write(f"{os.path.join(root, name)}\t0\n")
  else:
    raise config_checks.ConfigError(
        f"--mode=predict for data.task={task!r}: classifiers read a "
        f"GLUE/SNLI or image task's columns; for masked LM give a .txt with "
        f"{MASK_MARKER} marks.")
  with data.unlocked():
    data.local_files = ml_collections.ConfigDict({"predict": local})
  return data, [None if r is None else dict(zip(names, r)) for r in rows]


def _needed_tokens(config, records: list[dict | None]) -> list[int]:
  """Length of each text example's row before truncation: [CLS] a [SEP]
  (b [SEP]), as ``preprocessors.encode_pair`` builds it."""
  from hypermixer_jax.data import vocab as vocab_lib  # pylint: disable=g-import-not-at-top
  vocab = vocab_lib.get_vocabulary(config.data.vocab_path,
                                   config.data.extra_ids)
  return [1 + sum(len(vocab.encode(t)) + 1 for t in rec.values())
          for rec in records if rec is not None]


def _padded(batch: dict, size: int) -> dict:
  """Rows repeated up to ``size`` (a fixed batch shape; extras dropped)."""
  n = len(next(iter(batch.values())))
  if n == size:
    return batch
  idx = np.minimum(np.arange(size), n - 1)
  return {k: np.asarray(v)[idx] for k, v in batch.items()}


def _mlm_rows(config, input_path: str):
  """One ``(record, ids)`` per line of a ``.txt`` with ``[MASK]`` marks;
  ``ids`` is None for a line that cannot be predicted (the record says why),
  and a line longer than ``data.seq_len`` is cut (``truncated``) when its
  marks stay inside."""
  from hypermixer_jax.data import vocab as vocab_lib  # pylint: disable=g-import-not-at-top
  vocab_lib.check_vocab_path(config.data.vocab_path)
  vocab = vocab_lib.get_vocabulary(config.data.vocab_path,
                                   config.data.extra_ids)
  mask_id = vocab_lib.special_ids(vocab).mask
  glued = vocab_lib.continuation_encoder(vocab)
  n = int(config.data.seq_len)
  rows = []
  for text in _read_lines(input_path):
    pieces = text.split(MASK_MARKER)
    ids = []
    for j, piece in enumerate(pieces):
      if j:
        ids.append(mask_id)
      if piece.strip():
        # As training tokenizes the whole text: a piece after a space starts
        # a word (SentencePiece's word-start marker), one glued to the
        # [MASK] before it goes on from it (".", "s": no marker).
        start = j == 0 or piece[:1].isspace()
        ids.extend(vocab.encode(piece.strip()) if start
                   else glued(piece.rstrip()))
    why = (BLANK if not text.strip() else
           f"no {MASK_MARKER} to fill in" if len(pieces) < 2 else
           f"{len(ids)} tokens and a {MASK_MARKER} after data.seq_len={n}"
           if mask_id in ids[n:] else None)
    if why:
      rows.append(({"text": text, "filled": None, "masks": None,
                    "reason": why}, None))
    else:
      rows.append(({"text": text, "truncated": len(ids) > n}, ids[:n]))
  return rows, vocab, mask_id


def _mlm_batch(rows: list[list[int]], n: int) -> dict:
  inputs = np.zeros((len(rows), n), np.int32)
  segments = np.zeros((len(rows), n), np.int32)
  for r, ids in enumerate(rows):
    inputs[r, :len(ids)] = ids
    segments[r, :len(ids)] = 1
  positions = np.broadcast_to(np.arange(n, dtype=np.int32), inputs.shape)
  return {"inputs": inputs, "segment_ids": segments,
          "positions": positions.copy()}


def predict_file(config: ml_collections.ConfigDict, workdir: str,
                 input_path: str, output_path: str, *,
                 step: int | None = None, top_k: int = 5) -> int:
  """Predictions of ``workdir``'s checkpoint for ``input_path``, as JSONL.

  Output line k answers input line k (``.tsv``: data row k after the
  header); a line that cannot be predicted (blank; masked LM: no or a
  cut-off ``[MASK]``) gives nulls and a ``reason``. Text is written as is
  (UTF-8). The output appears only when complete (written under a
  temporary name, renamed at the end).

  Classifiers (``classify``, ``pair_classify``, ``image``): ``{..input
  columns.., "label": name, "label_id": k, "probabilities": {name: p}}``,
  plus ``"truncated"`` for text (the row was cut to ``data.seq_len``); the
  input is a ``.txt`` (one example a line, the two texts of a pair separated
  by a tab; image paths for image tasks), or a ``.tsv``/``.jsonl`` with the
  task's columns. It goes through the task's own evaluation preprocessing
  (tokenisation, truncation, image crop). Masked LM: a ``.txt`` whose lines
  hold ``[MASK]`` marks; each line gives ``{"text", "truncated", "filled":
  text with the top-1 tokens, "masks": [{"position", "top": [{"token", "id",
  "probability"}] x top_k}]}``.

  Runs on the devices of process 0 (other processes return at once).
  Returns the number of examples predicted.
  """
  head = models.model_facts(config.model).head
  if head not in CLASSIFIER_HEADS + ("mlm",):
    raise config_checks.ConfigError(
        f"--mode=predict supports the heads "
        f"{', '.join(CLASSIFIER_HEADS + ('mlm',))}, not model.head={head!r} "
        "of this checkpoint; use --mode=evaluate for its metrics.")
  if jax.process_index() != 0:
    return 0
  _check_input(input_path)           # before the checkpoint is read
  _check_output(output_path)
  mesh = sharding.build_mesh(config.mesh, devices=jax.local_devices())
  rules = sharding.get_rules(config.sharding)
  params, found = load_params(config, workdir, step, mesh, rules)
  model = models.build_model(config.model)
  batch_size = int(config.eval_batch_size)

  def apply(params, batch):
    kwargs = {k: batch[k] for k in MODEL_KWARGS if k in batch}
    return model.apply({"params": params}, batch["inputs"],
                       deterministic=True, **kwargs)

  forward = jax.jit(sharding.within(apply, mesh, rules))

  def run(batch):
    n = len(batch["inputs"])
    global_batch = sharding.make_global_batch(
        _padded({k: v for k, v in batch.items() if k == "inputs"
                 or k in MODEL_KWARGS}, batch_size), mesh, rules)
    return np.asarray(jax.device_get(forward(params, global_batch)))[:n]

  if head == "mlm":
    lines, written = _mlm_predictions(config, input_path, run, batch_size,
                                      top_k)
  else:
    lines, written = _classifier_predictions(config, input_path, run,
                                             batch_size)
  _write_jsonl(lines, output_path)
  cut = sum(bool(line.get("truncated")) for line in lines)
  logging.info("wrote %d predictions of %s (step %d) to %s (%d input lines; "
               "%d not predicted, %d truncated to data.seq_len)", written,
               workdir, found, output_path, len(lines), len(lines) - written,
               cut)
  return written


def _mlm_predictions(config: ml_collections.ConfigDict, input_path: str,
                     run, batch_size: int, top_k: int
                     ) -> tuple[list[dict], int]:
  """``predict_file``'s lines for a masked LM: the top ``top_k`` tokens of
  each ``[MASK]``, and the text with the top-1 tokens filled in."""
  rows, vocab, mask_id = _mlm_rows(config, input_path)
  todo = [(rec, ids) for rec, ids in rows if ids is not None]
  for start in range(0, len(todo), batch_size):
    chunk = todo[start:start + batch_size]
    batch = _mlm_batch([ids for _, ids in chunk], int(config.data.seq_len))
    probs = jax.nn.softmax(run(batch), axis=-1)
    for r, (rec, ids) in enumerate(chunk):
      masks = []
      filled = rec["text"]
      for pos in np.flatnonzero(np.asarray(ids) == mask_id):
        p = np.asarray(probs[r, pos])
        top = np.argsort(-p)[:top_k]
        masks.append({"position": int(pos), "top": [
            {"token": vocab.decode([int(t)]), "id": int(t),
             "probability": float(p[t])} for t in top]})
        filled = filled.replace(MASK_MARKER, masks[-1]["top"][0]["token"], 1)
      rec.update(filled=filled, masks=masks)
  return [rec for rec, _ in rows], len(todo)


def _classifier_predictions(config: ml_collections.ConfigDict,
                            input_path: str, run, batch_size: int
                            ) -> tuple[list[dict], int]:
  """``predict_file``'s lines for a classifier: label, id and probabilities
  of each input through the task's evaluation preprocessing."""
  import tempfile  # pylint: disable=g-import-not-at-top
  from hypermixer_jax import data as data_lib  # pylint: disable=g-import-not-at-top
  from hypermixer_jax.data import tasks  # pylint: disable=g-import-not-at-top
  with tempfile.TemporaryDirectory() as tmp:
    data, records = _prediction_data(config, input_path, tmp)
    spec = tasks.CLASSIFICATION.get(data.task)
    names = (list(spec.label_names) if spec else
             [str(k) for k in range(config.model.num_classes)])
    needed = iter(_needed_tokens(config, records) if spec else [])
    pipe = data_lib.build_pipeline(data, "predict", batch_size=batch_size,
                                   seed=config.seed, repeat=False,
                                   shuffle=False)
    predicted = [np.asarray(jax.nn.softmax(run(batch), axis=-1))
                 for batch in pipe]
  probs = iter(np.concatenate(predicted) if predicted else [])
  lines, written = [], 0
  for rec in records:
    if rec is None:
      lines.append({**({c[0]: "" for c in spec.columns} if spec else
                       {"filename": ""}), "label": None, "label_id": None,
                    "probabilities": None, "reason": BLANK})
      continue
    p = next(probs, None)
    if p is None:
      raise RuntimeError(f"{written} predictions for "
                         f"{sum(r is not None for r in records)} inputs: "
                         "the input pipeline dropped examples.")
    k = int(np.argmax(p))
    lines.append({**rec, "label": names[k], "label_id": k,
                  "probabilities": {names[j]: float(p[j])
                                    for j in range(len(p))},
                  **({"truncated": next(needed) > int(config.data.seq_len)}
                     if spec else {})})
    written += 1
  return lines, written


def _write_jsonl(lines: list[dict], output_path: str) -> None:
  """One JSON object a line, UTF-8 as is; the file appears only complete
  (``storage.replace``: a renamed temporary file on a disk, one object
  write on GCS, where a rename is a copy and a delete)."""
  storage.path(output_path).parent.mkdir(parents=True, exist_ok=True)
  storage.replace(output_path, "".join(
      json.dumps(line, ensure_ascii=False) + "\n" for line in lines))


# ---------------------------------------------------------------------------
# Evaluation without training.
# ---------------------------------------------------------------------------
@flax.struct.dataclass
class ParamsOnly:
  """What the evaluation step reads of a train state: its parameters."""
  params: Any


def evaluate_checkpoint(config: ml_collections.ConfigDict, workdir: str,
                        step: int | None = None, *,
                        eval_steps: int | None = None) -> dict[str, float]:
  """The task's evaluation of ``workdir``'s checkpoint (latest or ``step``).

  The evaluation that training runs (``config.eval_split`` in batches of
  ``eval_batch_size``), on the parameters alone, so exported parameters
  evaluate too: ``eval_steps`` batches (-1: the whole split, as
  ``--mode=evaluate`` does by default; None: ``config.eval_steps``, as
  training did). The metrics, with ``examples`` (scored) and
  ``split_examples`` (the split's size, when known), are logged and written
  to ``workdir/evaluations/<split>_step<N>.json`` (process 0).
  """
  from hypermixer_jax.train import evaluation  # pylint: disable=g-import-not-at-top
  from hypermixer_jax import data as data_lib  # pylint: disable=g-import-not-at-top
  if jax.process_index() == 0 and os.path.isdir(workdir):
    # Its metrics go to workdir/evaluations: said before, not after, the
    # evaluation.
    preflight.check_writable(workdir)
  preflight.check_batches(config, training=False)
  mesh = sharding.build_mesh(config.mesh)
  rules = sharding.get_rules(config.sharding)
  params, found = load_params(config, workdir, step, mesh, rules)
  state = ParamsOnly(params=params)
  pcount = jax.process_count()
  if config.eval_batch_size % pcount:
    raise ValueError(f"eval_batch_size={config.eval_batch_size} must be "
                     f"divisible by the {pcount} processes.")
  steps = int(config.eval_steps if eval_steps is None else eval_steps)
  rows = [0]   # this host's examples scored

  def pipeline(split, batch_size):
    pipe = data_lib.build_pipeline(
        config.data, split, batch_size=batch_size // pcount,
        shard_index=jax.process_index(), num_shards=pcount, seed=config.seed,
        repeat=False, shuffle=False)
    for batch in itertools.islice(pipe, steps if steps >= 0 else None):
      rows[0] += len(batch["inputs"])
      yield batch

  # The training loop's own evaluator, on the parameters alone.
  result = evaluation.TaskEvaluator(evaluation.Context(
      config=config, workdir=workdir, model=models.build_model(config.model),
      facts=models.model_facts(config.model), mesh=mesh, rules=rules,
      state_shardings=ParamsOnly(
          params=jax.tree.map(lambda x: x.sharding, params)),
      pipeline=pipeline, write_image=lambda *a: None,
      is_main=jax.process_index() == 0), steps=steps).run(state, found)
  scored = _sum_over_processes(rows[0])
  size = scored if steps < 0 else split_size(config, config.eval_split)
  what = (f"{scored} of {size} examples" if size is not None else
          f"{scored} examples")
  line = (f"evaluation of {workdir} step {found} on {config.eval_split} "
          f"({what}): " + ", ".join(f"{k}={v:.5g}" for k, v in result.items()))
  if steps >= 0 and (size is None or scored < size):
    line += (f" (the first {steps} batches of {config.eval_batch_size}; "
             "--eval_steps=-1 scores the whole split)")
  logging.info("%s", line)
  if jax.process_index() == 0:
    print(line, flush=True)
    out_dir = storage.path(workdir) / "evaluations"
    out_dir.mkdir(parents=True, exist_ok=True)
    storage.replace(out_dir / f"{config.eval_split}_step{found}.json",
                    json.dumps({"step": found, "examples": scored,
                                "split_examples": size, **result}, indent=1))
  return result


def split_size(config: ml_collections.ConfigDict, split: str) -> int | None:
  """Examples in ``split`` when known without reading it (the synthetic
  task's size, a TFDS split's record count); None otherwise."""
  from hypermixer_jax.data import synthetic  # pylint: disable=g-import-not-at-top
  if config.data.task == "synthetic_pairs":
    return synthetic.num_examples(config.data.synthetic, split) or None
  from hypermixer_jax.data import tasks  # pylint: disable=g-import-not-at-top
  try:
    return tasks.get_task(config.data).source.num_input_examples(split)
  except Exception:  # pylint: disable=broad-except
    return None   # local files: their size is not recorded anywhere


def _sum_over_processes(n: int) -> int:
  if jax.process_count() == 1:
    return n
  from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
  return int(np.sum(multihost_utils.process_allgather(np.int64(n))))
