"""Heads and their tasks: the one table that the models, the zoo, training
and evaluation read.

| head | families | output | loss reads | loss | final metrics |
| --- | --- | --- | --- | --- | --- |
| ``mlm`` | text | ``[B, P, vocab]`` at ``masked_positions`` ``[B, P]`` (``[B, N, vocab]`` without) | ``targets``, ``weights`` [B, N] | token cross-entropy | loss, accuracy, perplexity |
| ``causal_lm`` | text, smlp | ``[B, N, vocab]`` | ``targets``, ``weights`` | token cross-entropy | loss, accuracy, perplexity |
| ``classify`` | text, continuous | ``[B, classes]`` | ``label`` (``weights`` [B]) | example cross-entropy | loss, accuracy (+ the task's F1) |
| ``pair_classify`` | text | ``[B, classes]`` | ``label`` (``weights``) | example cross-entropy | loss, accuracy (+ F1) |
| ``image`` | continuous | ``[B, classes]`` | ``label`` (``weights``) | example cross-entropy | loss, accuracy |
| ``regression`` | continuous | ``[B, N, out_dim]`` | ``targets``, ``weights`` [B, N] | mean squared error | loss, mse |

Every loss returns ``(loss, metrics)`` with ``metrics["denominator"]`` the
weight it averages over (tokens or examples), so evaluation sums
``metric x denominator`` over batches and divides once (``eval_sums`` /
``finalize``): batches of any size, and the padding examples of a last
batch, average exactly. Task-level metrics beyond the head's (F1 of QQP)
are named by ``hypermixer_jax.data.metrics.metric_names``.

MLM at the selected positions only: the input pipeline gives
``masked_positions [B, P]`` (BERT's ``max_predictions_per_seq`` slots: the
selected positions first, then unselected ones whose weight is 0), the model
computes logits only there, and the loss gathers ``targets``/``weights`` at
the same positions, so it equals the full head's loss on ``[B, N]``.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Callable, Mapping

import jax
import jax.numpy as jnp
import optax

Array = jax.Array
Batch = Mapping[str, Array]
Metrics = dict[str, Array]
# (weights [B, N], segment_ids [B, N] | None) -> weights: the model's say on
# which positions carry loss (models.ModelFacts.loss_weights).
LossWeights = Callable[[Array, Array | None], Array]

# Batch keys every model reads (when present) besides ``inputs``.
MODEL_KWARGS = ("segment_ids", "token_type_ids", "positions")


@dataclasses.dataclass(frozen=True)
class Head:
  """One row of the table (see the module docstring)."""
  name: str
  families: tuple[str, ...]
  kind: str                       # 'tokens' | 'classes' | 'values'
  loss_keys: tuple[str, ...]      # batch keys the loss needs
  module: str | None              # the head's parameter module in the model
  model_keys: tuple[str, ...] = ()  # head-specific model inputs (optional)


HEADS: dict[str, Head] = {h.name: h for h in (
    Head("mlm", ("text",), "tokens", ("targets", "weights"), "mlm_head",
         ("masked_positions",)),
    # The causal LM's output layer is the tied token embedding (encoder).
    Head("causal_lm", ("text", "smlp"), "tokens", ("targets", "weights"),
         None),
    Head("classify", ("text", "continuous"), "classes", ("label",),
         "classifier"),
    Head("pair_classify", ("text",), "classes", ("label",), "classifier"),
    Head("image", ("continuous",), "classes", ("label",), "classifier"),
    Head("regression", ("continuous",), "values", ("targets", "weights"),
         "regression_head"),
)}


def get(name: str) -> Head:
  """The head called ``name``; ValueError listing the heads otherwise."""
  if name not in HEADS:
    raise ValueError(f"unknown head {name!r}; heads are {tuple(HEADS)}.")
  return HEADS[name]


def param_modules_regex() -> str:
  """Regular expression of the heads' own parameter paths (what fine-tuning
  re-initialises by default)."""
  names = sorted({h.module for h in HEADS.values() if h.module})
  return rf"({'|'.join(names)})(/|$)"


def names_for(family: str) -> tuple[str, ...]:
  """Heads available to a model family."""
  return tuple(n for n, h in HEADS.items() if family in h.families)


def model_inputs(batch: Batch, head: str) -> tuple[Array, dict[str, Array]]:
  """The model's positional input and keyword inputs found in ``batch``."""
  keys = MODEL_KWARGS + get(head).model_keys
  return batch["inputs"], {k: batch[k] for k in keys if k in batch}


def check_batch(head: str, batch: Batch) -> None:
  """ValueError naming the keys ``head``'s loss needs that ``batch`` lacks."""
  missing = [k for k in ("inputs",) + get(head).loss_keys if k not in batch]
  if missing:
    raise ValueError(f"head {head!r} needs batch keys {missing}; the batch "
                     f"has {sorted(batch)} (see CONTRIBUTING.md, Batches).")


# ---------------------------------------------------------------------------
# Losses.
# ---------------------------------------------------------------------------
def _weighted_mean(values: Array, weights: Array) -> tuple[Array, Array]:
  denom = jnp.sum(weights)
  return jnp.sum(values * weights) / jnp.maximum(denom, 1e-8), denom


def at_masked_positions(batch: Batch) -> Batch:
  """``targets``/``weights`` gathered at ``masked_positions`` when given."""
  pos = batch.get("masked_positions")
  if pos is None:
    return batch
  take = lambda x: jnp.take_along_axis(x, pos, axis=1)
  return {**batch, "targets": take(batch["targets"]),
          "weights": take(batch["weights"])}


def with_loss_weights(batch: Batch, loss_weights: LossWeights | None
                      ) -> Batch:
  """The batch whose token ``weights`` have passed through the model's
  ``loss_weights`` (``ModelFacts.loss_weights``: sMLP with partial-prediction
  routing zeroes each row's routing prefix); unchanged when None."""
  if loss_weights is None or "weights" not in batch:
    return batch
  return {**batch, "weights": loss_weights(batch["weights"],
                                           batch.get("segment_ids"))}


def is_argmax(logits: Array, labels: Array) -> Array:
  """``argmax(logits, -1) == labels`` (first maximum wins, as argmax).

  Computed from two plain max-reductions: the label's logit equals the row's
  maximum and every logit before the label is below it. XLA's CPU backend
  lowers ``argmax`` to a variadic (value, index) reduce that it does not
  vectorise; over a 32k vocabulary that took 2.5% of a GLUE-size MLM train
  step, more than the softmax.
  """
  best = jnp.max(logits, -1)
  at = jnp.take_along_axis(logits, labels[..., None], -1)[..., 0]
  idx = jax.lax.broadcasted_iota(jnp.int32, logits.shape, logits.ndim - 1)
  before = jnp.max(jnp.where(idx < labels[..., None], logits, -jnp.inf), -1)
  return (at == best) & ((before < best) | (labels == 0))


def compute_loss(head: str, outputs: Array, batch: Batch, *,
                 loss_weights: LossWeights | None = None
                 ) -> tuple[Array, Metrics]:
  """Task loss of ``outputs`` (the model's output for ``head``) on ``batch``.

  Computed in float32 whatever the compute dtype. Returns ``(loss,
  metrics)``; metrics hold ``loss``, ``denominator`` and, except for
  regression, ``accuracy``. ``loss_weights``: see ``with_loss_weights``.
  """
  kind = get(head).kind
  outputs = outputs.astype(jnp.float32)
  if kind == "tokens":
    batch = at_masked_positions(with_loss_weights(batch, loss_weights))
    targets, weights = batch["targets"], batch["weights"].astype(jnp.float32)
    ce = optax.softmax_cross_entropy_with_integer_labels(outputs, targets)
    loss, denom = _weighted_mean(ce, weights)
    correct = is_argmax(outputs, targets).astype(jnp.float32)
    accuracy, _ = _weighted_mean(correct, weights)
  elif kind == "classes":
    labels = batch["label"]
    ce = optax.softmax_cross_entropy_with_integer_labels(outputs, labels)
    weights = example_weights(batch)
    loss, denom = _weighted_mean(ce, weights)
    correct = (jnp.argmax(outputs, -1) == labels).astype(jnp.float32)
    accuracy, _ = _weighted_mean(correct, weights)
  else:
    targets = batch["targets"].astype(jnp.float32)
    weights = batch["weights"].astype(jnp.float32)
    se = jnp.mean(jnp.square(outputs - targets), axis=-1)  # [B, N]
    loss, denom = _weighted_mean(se, weights)
    return loss, {"loss": loss, "denominator": denom}
  return loss, {"loss": loss, "accuracy": accuracy, "denominator": denom}


def example_weights(batch: Batch) -> Array:
  """Per-example weights ``[B]`` of a classification batch (1 if absent)."""
  w = batch.get("weights")
  return (jnp.ones(batch["label"].shape, jnp.float32) if w is None
          else w.astype(jnp.float32))


# ---------------------------------------------------------------------------
# Evaluation: sums over batches, then the final metrics.
# ---------------------------------------------------------------------------
def eval_sums(head: str, outputs: Array, batch: Batch, *,
              task_metric_names: tuple[str, ...] = (),
              loss_weights: LossWeights | None = None) -> Metrics:
  """Summable statistics of one batch: ``<metric>_sum``, ``denominator``
  and, when the task's metrics include F1, the binary confusion counts
  ``tp``/``fp``/``fn`` (class 1 positive)."""
  _, metrics = compute_loss(head, outputs, batch, loss_weights=loss_weights)
  denom = metrics.pop("denominator")
  sums = {f"{k}_sum": v * denom for k, v in metrics.items()}
  sums["denominator"] = denom
  if "f1" in task_metric_names:
    if get(head).kind != "classes":
      raise ValueError(f"F1 needs a classification head, got {head!r}.")
    pred, label = jnp.argmax(outputs, -1), batch["label"]
    w = example_weights(batch)
    sums["tp"] = jnp.sum(w * ((pred == 1) & (label == 1)))
    sums["fp"] = jnp.sum(w * ((pred == 1) & (label != 1)))
    sums["fn"] = jnp.sum(w * ((pred != 1) & (label == 1)))
  return sums


def finalize(head: str, sums: Mapping[str, float]) -> dict[str, float]:
  """The head's metrics from summed statistics: averages of ``<metric>_sum``
  over the denominator, ``moe/...`` averaged over ``num_batches``,
  ``perplexity`` (token heads), ``mse`` (regression). (F1 from the counts:
  ``evaluation.finalize``, with the task's definition in
  ``hypermixer_jax.data.metrics``.)"""
  sums = {k: float(v) for k, v in sums.items()}
  denom = max(sums.pop("denominator", 0.0), 1e-12)
  batches = max(sums.pop("num_batches", 0.0), 1.0)
  out = {}
  for k, v in sums.items():
    if k.endswith("_sum"):
      out[k[:-4]] = v / denom
    elif k.startswith("moe/"):
      out[k] = v / batches
  kind = get(head).kind
  if kind == "tokens" and "loss" in out:
    out["perplexity"] = math.exp(min(out["loss"], 50.0))
  if kind == "values" and "loss" in out:
    out["mse"] = out["loss"]
  return out
