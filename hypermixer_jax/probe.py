"""Linear probes: what a trained encoder's features hold, without fine-tuning.

``pooled_features`` runs a classifier model (``head='classify'`` or
``'pair_classify'``) on a pipeline's rows and returns the input of its
classification layer: the pooled encoder output, exactly what the classifier
reads (the model's own pooling and masks, read back from the layer's call).
``logistic_regression`` fits a multinomial logistic regression with an L2
penalty on standardised features (optax's L-BFGS, full batch) and predicts
the test rows' classes. Comparing the probe's accuracy on a pretrained
encoder with the same on a freshly initialised one measures what
pretraining put into the features, apart from what fine-tuning adds.
"""
from __future__ import annotations

from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np
import optax


def pooled_features(model_config, params, arrays: Mapping[str, np.ndarray],
                    batch_size: int = 256) -> np.ndarray:
  """``[rows, d]`` inputs of the classification layer of ``model_config``'s
  model with ``params`` on ``arrays`` (a pipeline's batches, e.g.
  ``experiment.pipeline_arrays``), deterministic (no dropout)."""
  import flax.linen as nn  # pylint: disable=g-import-not-at-top
  from hypermixer_jax import heads  # pylint: disable=g-import-not-at-top
  from hypermixer_jax import models  # pylint: disable=g-import-not-at-top
  head = model_config.head
  if head not in ("classify", "pair_classify"):
    raise ValueError(f"pooled_features: model.head={head!r}; a probe reads "
                     "a classifier's pooled features (head classify or "
                     "pair_classify).")
  model = models.build_model(model_config)
  layer = heads.get(head).module

  def features(p, batch):
    seen = []

    def grab(next_fn, args, kwargs, context):
      if context.module.name == layer and context.method_name == "__call__":
        seen.append(args[0])
      return next_fn(*args, **kwargs)
    inputs, kwargs = heads.model_inputs(batch, head)
    with nn.intercept_methods(grab):
      model.apply({"params": p}, inputs, deterministic=True, **kwargs)
    if len(seen) != 1:
      raise ValueError(f"pooled_features: the model called its {layer!r} "
                       f"layer {len(seen)} times, expected once.")
    return seen[0]

  run = jax.jit(features)
  keys = [k for k in arrays if k != "label"]
  rows = len(arrays["inputs"])
  out = []
  for i in range(0, rows, batch_size):
    batch = {k: arrays[k][i:i + batch_size] for k in keys}
    pad = batch_size - len(batch["inputs"])
    if pad:   # one compiled shape: zero rows (all padding) at the end
      batch = {k: np.pad(v, [(0, pad)] + [(0, 0)] * (v.ndim - 1))
               for k, v in batch.items()}
    out.append(np.asarray(run(params, batch))[:batch_size - pad])
  return np.concatenate(out)


def fit_logistic_regression(x: np.ndarray, y: np.ndarray, *,
                            num_classes: int, l2: float = 1e-2,
                            max_steps: int = 500, tol: float = 1e-6
                            ) -> dict[str, Any]:
  """Multinomial logistic regression on ``x [rows, d]`` (used as given),
  minimising mean cross-entropy + ``l2 / 2 * |W|^2`` (bias not penalised)
  with L-BFGS to a gradient norm below ``tol``: ``{'w', 'b', 'steps',
  'grad_norm'}``."""
  x = jnp.asarray(x, jnp.float32)
  p = {"w": jnp.zeros((x.shape[1], num_classes)),
       "b": jnp.zeros((num_classes,))}
  p, steps, norm = _lbfgs(p, x, jnp.asarray(y, jnp.int32), l2, max_steps,
                          tol)
  return {"w": np.asarray(p["w"]), "b": np.asarray(p["b"]),
          "steps": int(steps), "grad_norm": float(norm)}


@jax.jit
def _lbfgs(p, x, y, l2, max_steps, tol):
  """L-BFGS from ``p`` in one compiled loop (the data are arguments, so one
  compilation serves every fit of the same shapes)."""

  def loss(q):
    logits = x @ q["w"] + q["b"]
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
    return ce + 0.5 * l2 * jnp.sum(q["w"] ** 2)

  solver = optax.lbfgs()
  value_and_grad = optax.value_and_grad_from_state(loss)

  def step(carry):
    q, state, _, steps = carry
    value, grad = value_and_grad(q, state=state)
    updates, state = solver.update(grad, state, q, value=value, grad=grad,
                                   value_fn=loss)
    return (optax.apply_updates(q, updates), state, optax.tree.norm(grad),
            steps + 1)

  q, _, norm, steps = jax.lax.while_loop(
      lambda c: (c[3] < max_steps) & (c[2] > tol), step,
      (p, solver.init(p), jnp.asarray(jnp.inf, jnp.float32),
       jnp.asarray(0, jnp.int32)))
  return q, steps, norm


def logistic_regression(train_x: np.ndarray, train_y: np.ndarray,
                        test_x: np.ndarray, *, num_classes: int,
                        l2: float = 1e-2) -> np.ndarray:
  """Predicted classes of ``test_x`` by ``fit_logistic_regression`` on the
  train features standardised (train mean and sd per feature, applied to
  both)."""
  mean = train_x.mean(0)
  sd = train_x.std(0) + 1e-6
  fit = fit_logistic_regression((train_x - mean) / sd, train_y,
                                num_classes=num_classes, l2=l2)
  return np.argmax(((test_x - mean) / sd) @ fit["w"] + fit["b"], axis=-1)
