"""Checkpoints as artifacts: parameters alone, evaluation and prediction.

* ``write_params`` / ``export_params``: the parameters without optimiser
  state or input position, as an Orbax checkpoint (``<dir>/<step>/state``
  holding ``{"params": ...}``) that ``config.init_checkpoint`` and
  ``load_params`` read like a training checkpoint; a fraction of its size.
* ``load_params``: parameters of a training or an exported checkpoint,
  restored straight into the shardings of the current mesh.
* ``evaluate_checkpoint``: the task's evaluation of a workdir's latest (or a
  given) step, without training (``main.py --mode=evaluate``).
* ``predict_file``: an input file in, JSONL out (``main.py --mode=predict``):
  labels and class probabilities for classifiers, the filled-in tokens for
  masked LM.
"""
from __future__ import annotations

import os
from typing import Any

from absl import logging
import flax
import flax.linen as nn
import jax
import ml_collections

from hypermixer_jax import heads
from hypermixer_jax import models
from hypermixer_jax import sharding
from hypermixer_jax.models import zoo
from hypermixer_jax.train import checkpoint as ckpt_lib
from hypermixer_jax.train import storage

PyTree = Any


def write_params(directory: str | os.PathLike, params: PyTree,
                 step: int = 0) -> str:
  """Saves ``params`` alone as checkpoint ``step`` under ``directory``.

  Every process must call it (Orbax writes each host's shards).
  """
  directory = os.fspath(directory)
  ck = ckpt_lib.Checkpointer(directory, save_every=0, keep=None,
                             async_save=False)
  try:
    if step in ck.all_steps():
      raise FileExistsError(f"{directory} already holds step {step}; "
                            "choose another output directory.")
    ck.save(step, {"params": params}, {}, force=True)
  finally:
    ck.close()
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
  """The step folder (or the checkpoints folder for the latest step)."""
  path = os.fspath(workdir).rstrip("/")
  if (storage.path(path) / "checkpoints").is_dir():
    path = os.path.join(path, "checkpoints")
  if step is None:
    return path
  step_dir = os.path.join(path, str(step))
  if not storage.path(step_dir).is_dir():
    steps = sorted(int(d.name) for d in storage.path(path).iterdir()
                   if d.name.isdigit())
    raise FileNotFoundError(f"no checkpoint step {step} in {path}; steps "
                            f"there: {steps}.")
  return step_dir


def load_params(config: ml_collections.ConfigDict, workdir: str,
                step: int | None = None, mesh=None, rules=None
                ) -> tuple[PyTree, int]:
  """``(params, step)`` of ``workdir``'s checkpoint (latest or ``step``).

  ``workdir`` may be a training workdir, its ``checkpoints`` folder or an
  exported parameters folder. Raises ValueError naming every parameter that
  does not fit ``config.model``.
  """
  if mesh is None:
    mesh = sharding.build_mesh(config.mesh)
    rules = sharding.get_rules(config.sharding)
  path = _checkpoint_path(workdir, step)
  _, found = ckpt_lib.resolve_checkpoint(path)
  params = ckpt_lib.load_pretrained(path, abstract_params(config, mesh, rules),
                                    reinit=())
  return params, found


def export_params(config: ml_collections.ConfigDict, workdir: str,
                  output: str, step: int | None = None) -> str:
  """Writes the parameters of ``workdir``'s checkpoint to ``output``."""
  params, found = load_params(config, workdir, step)
  write_params(output, params, found)
  n = sum(x.size for x in jax.tree.leaves(params))
  logging.info("exported %d parameters (step %d) of %s to %s", n, found,
               workdir, output)
  return output


# ---------------------------------------------------------------------------
# Prediction.
# ---------------------------------------------------------------------------
MASK_MARKER = "[MASK]"
CLASSIFIER_HEADS = tuple(n for n, h in heads.HEADS.items()
                         if h.kind == "classes")
MODEL_KWARGS = heads.MODEL_KWARGS


def _input_rows(path: str, columns: list[tuple[str, ...]]) -> list[list[str]]:
  """Texts of each example: ``.txt`` (fields separated by tabs) or
  ``.tsv`` / ``.jsonl`` with the task's columns (``columns[i]``: aliases)."""
  import csv  # pylint: disable=g-import-not-at-top
  import json  # pylint: disable=g-import-not-at-top
  rows = []
  with storage.path(path).open("r") as f:
    if path.endswith((".jsonl", ".json")):
      records = [(i, json.loads(l)) for i, l in enumerate(f, 1) if l.strip()]
    elif path.endswith(".tsv"):
      records = list(enumerate(csv.DictReader(f, delimiter="\t",
                                              quoting=csv.QUOTE_NONE), 2))
    else:
      records = []
      for i, line in enumerate(f, 1):
        if line.strip():
          fields = line.rstrip("\n").split("\t")
          if len(fields) != len(columns):
            raise ValueError(
                f"{path}:{i}: {len(fields)} tab-separated field(s), the task "
                f"needs {len(columns)} ({', '.join(c[0] for c in columns)}).")
          rows.append(fields)
      return rows
  for i, rec in records:
    texts = []
    for aliases in columns:
      found = [a for a in aliases if a in rec]
      if not found:
        raise ValueError(f"{path}:{i}: none of the columns {list(aliases)} "
                         f"(has {sorted(rec)}).")
      texts.append(str(rec[found[0]]))
    rows.append(texts)
  return rows


def _prediction_data(config, input_path: str, tmpdir: str):
  """(data config reading the input as split 'predict', input records)."""
  import json  # pylint: disable=g-import-not-at-top
  from hypermixer_jax.data import tasks  # pylint: disable=g-import-not-at-top
  data = ml_collections.ConfigDict(config.data.to_dict())
  task = data.task
  if task in tasks.CLASSIFICATION:
    spec = tasks.CLASSIFICATION[task]
    rows = _input_rows(input_path, list(spec.columns))
    local = os.path.join(tmpdir, "predict.jsonl")
    names = [c[0] for c in spec.columns]
    with open(local, "w", encoding="utf-8") as f:
      for texts in rows:   # the label is unused; the reader needs one
        f.write(json.dumps({**dict(zip(names, texts)), "label": 0}) + "\n")
    records = [dict(zip(names, texts)) for texts in rows]
  elif task.startswith("imagenet_patches"):
    [files] = zip(*_input_rows(input_path, [("filename", "file_name")]))
    root = (os.path.dirname(os.path.abspath(input_path))
            if storage.is_local(input_path) else input_path.rsplit("/", 1)[0])
    local = os.path.join(tmpdir, "predict.tsv")
    with open(local, "w", encoding="utf-8") as f:
      f.write("filename\tlabel\n")
      for name in files:
        f.write(f"{os.path.join(root, name)}\t0\n")
    records = [{"filename": n} for n in files]
  else:
    raise ValueError(f"--mode=predict for data.task={task!r}: classifiers "
                     f"read a GLUE/SNLI or image task's columns; for masked "
                     f"LM give a .txt with {MASK_MARKER} marks.")
  with data.unlocked():
    data.local_files = ml_collections.ConfigDict({"predict": local})
  return data, records


def _padded(batch: dict, size: int) -> dict:
  """Rows repeated up to ``size`` (a fixed batch shape; extras dropped)."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  n = len(next(iter(batch.values())))
  if n == size:
    return batch
  idx = np.minimum(np.arange(size), n - 1)
  return {k: np.asarray(v)[idx] for k, v in batch.items()}


def _mlm_batches(config, input_path: str, batch_size: int):
  """(batches, records) of ``.txt`` lines with ``[MASK]`` marks."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  from hypermixer_jax.data import vocab as vocab_lib  # pylint: disable=g-import-not-at-top
  vocab_lib.check_vocab_path(config.data.vocab_path)
  vocab = vocab_lib.get_vocabulary(config.data.vocab_path,
                                   config.data.extra_ids)
  mask_id = vocab_lib.special_ids(vocab).mask
  n = int(config.data.seq_len)
  records, rows = [], []
  with storage.path(input_path).open("r") as f:
    for i, line in enumerate(f, 1):
      text = line.rstrip("\n")
      if not text.strip():
        continue
      pieces = text.split(MASK_MARKER)
      if len(pieces) < 2:
        raise ValueError(f"{input_path}:{i}: no {MASK_MARKER} to fill in.")
      ids = []
      for j, piece in enumerate(pieces):
        if j:
          ids.append(mask_id)
        if piece.strip():
          ids.extend(vocab.encode(piece.strip()))
      if len(ids) > n:
        raise ValueError(f"{input_path}:{i}: {len(ids)} tokens, more than "
                         f"data.seq_len={n}; shorten the line.")
      rows.append(ids)
      records.append({"text": text})
  batches = []
  for start in range(0, len(rows), batch_size):
    chunk = rows[start:start + batch_size]
    inputs = np.zeros((len(chunk), n), np.int32)
    segments = np.zeros((len(chunk), n), np.int32)
    for r, ids in enumerate(chunk):
      inputs[r, :len(ids)] = ids
      segments[r, :len(ids)] = 1
    positions = np.broadcast_to(np.arange(n, dtype=np.int32), inputs.shape)
    batches.append({"inputs": inputs, "segment_ids": segments,
                    "positions": positions.copy()})
  return batches, records, vocab, mask_id


def predict_file(config: ml_collections.ConfigDict, workdir: str,
                 input_path: str, output_path: str, *,
                 step: int | None = None, top_k: int = 5) -> int:
  """Predictions of ``workdir``'s checkpoint for ``input_path``, as JSONL.

  Classifiers (``classify``, ``pair_classify``, ``image``): one line per
  example, ``{..input columns.., "label": name, "label_id": k,
  "probabilities": {name: p}}``; the input is a ``.txt`` (one example a
  line, the two texts of a pair separated by a tab; image paths for image
  tasks), or a ``.tsv``/``.jsonl`` with the task's columns. It goes through
  the task's own evaluation preprocessing (tokenisation, truncation, image
  crop). Masked LM: a ``.txt`` whose lines hold ``[MASK]`` marks; each line
  gives ``{"text", "filled": text with the top-1 tokens, "masks": [{"position",
  "top": [{"token", "id", "probability"}] x top_k}]}``.

  Runs on the devices of process 0 (other processes return at once).
  Returns the number of examples written.
  """
  import json  # pylint: disable=g-import-not-at-top
  import tempfile  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  from hypermixer_jax import data as data_lib  # pylint: disable=g-import-not-at-top
  head = models.model_facts(config.model).head
  if head not in CLASSIFIER_HEADS + ("mlm",):
    raise ValueError(f"--mode=predict supports the heads "
                     f"{CLASSIFIER_HEADS + ('mlm',)}, not {head!r}.")
  if jax.process_index() != 0:
    return 0
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

  written = 0
  storage.path(output_path).parent.mkdir(parents=True, exist_ok=True)
  with tempfile.TemporaryDirectory() as tmp, storage.path(output_path).open(
      "w") as out:
    if head == "mlm":
      batches, records, vocab, mask_id = _mlm_batches(config, input_path,
                                                      batch_size)
      for batch in batches:
        probs = jax.nn.softmax(run(batch), axis=-1)
        for r in range(len(batch["inputs"])):
          rec = records[written]
          ids = batch["inputs"][r]
          masks = []
          filled = rec["text"]
          for pos in np.flatnonzero(ids == mask_id):
            p = np.asarray(probs[r, pos])
            top = np.argsort(-p)[:top_k]
            masks.append({"position": int(pos), "top": [
                {"token": vocab.decode([int(t)]), "id": int(t),
                 "probability": float(p[t])} for t in top]})
            filled = filled.replace(MASK_MARKER, masks[-1]["top"][0]["token"],
                                    1)
          out.write(json.dumps({**rec, "filled": filled, "masks": masks})
                    + "\n")
          written += 1
    else:
      from hypermixer_jax.data import tasks  # pylint: disable=g-import-not-at-top
      data, records = _prediction_data(config, input_path, tmp)
      spec = tasks.CLASSIFICATION.get(data.task)
      names = (list(spec.label_names) if spec else
               [str(k) for k in range(config.model.num_classes)])
      pipe = data_lib.build_pipeline(data, "predict", batch_size=batch_size,
                                     seed=config.seed, repeat=False,
                                     shuffle=False)
      for batch in pipe:
        probs = np.asarray(jax.nn.softmax(run(batch), axis=-1))
        for p in probs:
          k = int(np.argmax(p))
          out.write(json.dumps({
              **records[written], "label": names[k], "label_id": k,
              "probabilities": {names[j]: float(p[j])
                                for j in range(len(p))}}) + "\n")
          written += 1
      if written != len(records):
        raise RuntimeError(f"{written} predictions for {len(records)} "
                           "inputs: the input pipeline dropped examples.")
  logging.info("wrote %d predictions of %s (step %d) to %s", written, workdir,
               found, output_path)
  return written


# ---------------------------------------------------------------------------
# Evaluation without training.
# ---------------------------------------------------------------------------
@flax.struct.dataclass
class ParamsOnly:
  """What the evaluation step reads of a train state: its parameters."""
  params: Any


def evaluate_checkpoint(config: ml_collections.ConfigDict, workdir: str,
                        step: int | None = None) -> dict[str, float]:
  """The task's evaluation of ``workdir``'s checkpoint (latest or ``step``).

  The same evaluation as during training (``config.eval_split``,
  ``eval_steps`` batches of ``eval_batch_size``), on the parameters alone,
  so exported parameters evaluate too. The metrics are logged and written to
  ``workdir/evaluations/<split>_step<N>.json`` (process 0).
  """
  import json  # pylint: disable=g-import-not-at-top
  from hypermixer_jax.train import evaluation  # pylint: disable=g-import-not-at-top
  from hypermixer_jax import data as data_lib  # pylint: disable=g-import-not-at-top
  mesh = sharding.build_mesh(config.mesh)
  rules = sharding.get_rules(config.sharding)
  params, found = load_params(config, workdir, step, mesh, rules)
  state = ParamsOnly(params=params)
  pcount = jax.process_count()
  if config.eval_batch_size % pcount:
    raise ValueError(f"eval_batch_size={config.eval_batch_size} must be "
                     f"divisible by the {pcount} processes.")

  def pipeline(split, batch_size):
    return data_lib.build_pipeline(
        config.data, split, batch_size=batch_size // pcount,
        shard_index=jax.process_index(), num_shards=pcount, seed=config.seed,
        repeat=False, shuffle=False)

  # The training loop's own evaluator, on the parameters alone.
  result = evaluation.TaskEvaluator(evaluation.Context(
      config=config, workdir=workdir, model=models.build_model(config.model),
      facts=models.model_facts(config.model), mesh=mesh, rules=rules,
      state_shardings=ParamsOnly(
          params=jax.tree.map(lambda x: x.sharding, params)),
      pipeline=pipeline, write_image=lambda *a: None,
      is_main=jax.process_index() == 0)).run(state, found)
  line = (f"evaluation of {workdir} step {found} on {config.eval_split}: "
          + ", ".join(f"{k}={v:.5g}" for k, v in result.items()))
  logging.info("%s", line)
  if jax.process_index() == 0:
    print(line, flush=True)
    out_dir = storage.path(workdir) / "evaluations"
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"{config.eval_split}_step{found}.json").write_text(
        json.dumps({"step": found, **result}, indent=1))
  return result
