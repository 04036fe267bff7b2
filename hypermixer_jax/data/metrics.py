"""Classification metrics per task (accuracy; F1 of the positive class for
QQP), usable directly or as seqio ``metric_fns`` (``targets, predictions``)."""
from __future__ import annotations

import numpy as np


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


def f1(targets, predictions) -> dict[str, float]:
  """Binary F1 with class 1 as positive (GLUE's QQP/MRPC convention)."""
  targets, predictions = _as_arrays(targets, predictions)
  tp = np.sum((predictions == 1) & (targets == 1))
  fp = np.sum((predictions == 1) & (targets != 1))
  fn = np.sum((predictions != 1) & (targets == 1))
  denom = 2 * tp + fp + fn
  return {"f1": float(2 * tp / denom) if denom else 0.0}


def task_metrics(task_name: str, predictions, labels) -> dict[str, float]:
  """Metrics of ``task_name`` ('glue_qqp' adds F1 to accuracy).

  Args:
    task_name: a name from ``TASK_NAMES`` (fingerprint suffixes allowed).
    predictions: class ids [B] or logits [B, C].
    labels: int [B]; negative labels (hidden test labels) are ignored.
  """
  base = task_name.split("__")[0]
  out = accuracy(labels, predictions)
  if base == "glue_qqp":
    out.update(f1(labels, predictions))
  return out
