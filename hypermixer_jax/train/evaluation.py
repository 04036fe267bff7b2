"""Evaluation: the task's metrics summed exactly over an eval split.

The eval step returns *sums* (loss x denominator, accuracy x denominator,
binary confusion counts, MoE statistics) so that batches of any size, and the
padding examples of a last batch, average exactly. ``finalize`` turns them
into ``loss``, ``accuracy``, ``perplexity`` (token heads), ``f1`` (binary
classification, positive class 1) and ``moe/...``.
"""
from __future__ import annotations

import math
from typing import Any, Callable, Iterable

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from hypermixer_jax import sharding
from hypermixer_jax.train import steps

_TOKEN_HEADS = ("mlm", "causal_lm")
_CLASS_HEADS = ("classify", "pair_classify", "image")


def make_eval_step(model: nn.Module, head: str, num_classes: int
                   ) -> Callable[[Any, dict], dict]:
  """Pure ``(state, batch) -> sums`` for ``model`` / ``head``."""

  def eval_step(state, batch):
    inputs, kwargs = steps.model_inputs(batch)
    outputs, mutated = model.apply(
        {"params": state.params}, inputs, deterministic=True,
        mutable=steps.MUTABLE, **kwargs)
    _, metrics = steps.compute_loss(head, outputs, batch)
    denom = metrics.pop("denominator")
    sums = {f"{k}_sum": v * denom for k, v in metrics.items()}
    sums["denominator"] = denom
    moe = steps._moe_metrics(mutated.get("moe_metrics", {}))  # pylint: disable=protected-access
    sums.update({k: v for k, v in moe.items()})
    sums["num_batches"] = jnp.ones((), jnp.float32)
    if head in _CLASS_HEADS and num_classes == 2:
      pred = jnp.argmax(outputs, -1)
      label = batch["label"]
      w = batch.get("weights")
      w = jnp.ones(label.shape, jnp.float32) if w is None else w
      sums["tp"] = jnp.sum(w * ((pred == 1) & (label == 1)))
      sums["fp"] = jnp.sum(w * ((pred == 1) & (label == 0)))
      sums["fn"] = jnp.sum(w * ((pred == 0) & (label == 1)))
    return sums

  return eval_step


def finalize(sums: dict[str, float], head: str) -> dict[str, float]:
  """Averages of the summed metrics (see the module docstring)."""
  sums = {k: float(v) for k, v in sums.items()}
  denom = max(sums.pop("denominator", 0.0), 1e-12)
  batches = max(sums.pop("num_batches", 0.0), 1.0)
  out = {}
  for k, v in sums.items():
    if k.endswith("_sum"):
      out[k[:-4]] = v / denom
    elif k.startswith("moe/"):
      out[k] = v / batches
  if head in _TOKEN_HEADS and "loss" in out:
    out["perplexity"] = math.exp(min(out["loss"], 50.0))
  if "tp" in sums:
    tp, fp, fn = sums["tp"], sums["fp"], sums["fn"]
    out["f1"] = 2 * tp / max(2 * tp + fp + fn, 1e-12)
  if head == "regression" and "loss" in out:
    out["mse"] = out["loss"]
  return out


def evaluate(eval_step: Callable[[Any, dict], dict], state: Any,
             batches: Iterable[dict], mesh: jax.sharding.Mesh,
             rules: sharding.Rules, head: str, max_batches: int = -1
             ) -> dict[str, float]:
  """Runs ``eval_step`` over ``batches`` (host-local NumPy) and finalizes.

  ``eval_step`` must be jitted (``steps.jit_eval_step``); sums stay on the
  device until the end, so evaluation does not sync per batch.
  """
  total = None
  for i, local in enumerate(batches):
    if 0 <= max_batches <= i:
      break
    sums = eval_step(state, sharding.make_global_batch(local, mesh, rules))
    total = sums if total is None else jax.tree.map(jnp.add, total, sums)
  if total is None:
    raise ValueError("the evaluation split gave no batch")
  return finalize(jax.tree.map(np.asarray, jax.device_get(total)), head)
