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
import flax.linen as nn
import jax
import ml_collections

from hypermixer_jax import models
from hypermixer_jax import sharding
from hypermixer_jax.models import zoo
from hypermixer_jax.train import checkpoint as ckpt_lib

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
  if os.path.isdir(os.path.join(path, "checkpoints")):
    path = os.path.join(path, "checkpoints")
  if step is None:
    return path
  step_dir = os.path.join(path, str(step))
  if not os.path.isdir(step_dir):
    steps = sorted(int(d) for d in os.listdir(path) if d.isdigit())
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
