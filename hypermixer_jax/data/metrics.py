"""The official metrics of each task, defined once.

GLUE reports accuracy for every classification task here and adds F1 of the
positive class only where the benchmark's official metric includes it (QQP;
MRPC, not a task of this project, likewise): Wang et al. 2019, Table 1. The
functions are usable directly or as seqio ``metric_fns`` (``targets,
predictions``); the training loop's evaluation computes the same F1 from
summed confusion counts with ``f1_from_counts``.
"""
from __future__ import annotations

import numpy as np

# Task -> its official metrics, for the tasks whose metric is more than the
# loss of their head (the classification tasks).
_F1_TASKS = ("glue_qqp",)
_ACCURACY_TASKS = ("glue_sst2", "glue_mnli", "glue_qnli", "glue_snli",
                   "imagenet_patches")


def metric_names(task_name: str) -> tuple[str, ...]:
  """The official metrics of ``task_name`` (fingerprint suffixes allowed).

  ``("accuracy", "f1")`` for QQP, ``("accuracy",)`` for the other
  classification tasks, ``()`` for tasks measured by their loss alone
  (language modelling, the synthetic regression).
  """
  base = task_name.split("__")[0]
  if base in _F1_TASKS:
    return ("accuracy", "f1")
  if base in _ACCURACY_TASKS or base.startswith("imagenet_patches"):
    return ("accuracy",)
  return ()


def _as_arrays(targets, predictions):
  targets = np.asarray(targets)
  predictions = np.asarray(predictions)
  if predictions.ndim == targets.ndim + 1:  # logits or probabilities
    predictions = predictions.argmax(-1)
  keep = targets >= 0  # GLUE test labels are -1 (hidden)
  return targets[keep], predictions[keep]


def accuracy(targets, predictions) -> dict[str, float]:
  targets, predictions = _as_arrays(targets, predictions)
  return {"accuracy": float(np.mean(targets == predictions))
                      if targets.size else float("nan")}


def f1_from_counts(tp: float, fp: float, fn: float) -> float:
  """Binary F1 ``2 tp / (2 tp + fp + fn)``; 0 when nothing is positive."""
  denom = 2 * tp + fp + fn
  return float(2 * tp / denom) if denom else 0.0


def f1(targets, predictions) -> dict[str, float]:
  """Binary F1 with class 1 as positive (GLUE's QQP/MRPC convention)."""
  targets, predictions = _as_arrays(targets, predictions)
  tp = np.sum((predictions == 1) & (targets == 1))
  fp = np.sum((predictions == 1) & (targets != 1))
  fn = np.sum((predictions != 1) & (targets == 1))
  return {"f1": f1_from_counts(tp, fp, fn)}


def task_metrics(task_name: str, predictions, labels) -> dict[str, float]:
  """The official metrics (``metric_names``) of ``task_name``; accuracy
  for tasks that name none (language modelling, the synthetic task).

  Args:
    task_name: a name from ``TASK_NAMES`` (fingerprint suffixes allowed).
    predictions: class ids [B] or logits [B, C].
    labels: int [B]; negative labels (hidden test labels) are ignored.
  """
  fns = {"accuracy": accuracy, "f1": f1}
  out = {}
  for name in metric_names(task_name) or ("accuracy",):
    out.update(fns[name](labels, predictions))
  return out
