"""Train and eval step functions, losses by head, sharded train state.

The step functions are pure: ``train_step(state, batch, rng) -> (state,
metrics)`` and ``eval_step(state, batch) -> metrics``. ``jit_train_step`` /
``jit_eval_step`` compile them with explicit in/out shardings (the state
donated), and make the mesh and logical rules active while tracing, so the
models' activation constraints always bind.

Losses (``compute_loss``) by head, each returning ``(loss, metrics)`` where
``metrics["denominator"]`` is the weight the loss averages over (tokens or
examples), so that a loop can average over batches exactly:

* ``mlm`` / ``causal_lm``: token cross-entropy weighted by ``weights``;
* ``classify`` / ``pair_classify`` / ``image``: example cross-entropy on
  ``label`` (optionally weighted by a per-example ``weights`` [B], e.g. to
  drop the padding examples of a last eval batch), with accuracy;
* ``regression``: mean squared error over the output features, weighted by
  ``weights`` [B, N].

MoE layers sow into ``aux_loss`` (summed into the training loss) and
``moe_metrics`` (averaged into the metrics under ``moe/...``).
"""
from __future__ import annotations

from typing import Any, Callable

import flax.linen as nn
from flax.core import meta
from flax.training import train_state
import jax
import jax.numpy as jnp
import optax

from hypermixer_jax import sharding

Batch = dict[str, jax.Array]
Metrics = dict[str, jax.Array]

# Batch keys passed to the model as keyword arguments (when present).
_MODEL_KWARGS = ("segment_ids", "token_type_ids", "positions")
_TOKEN_HEADS = ("mlm", "causal_lm")
_CLASS_HEADS = ("classify", "pair_classify", "image")
HEADS = _TOKEN_HEADS + _CLASS_HEADS + ("regression",)
MUTABLE = ["aux_loss", "moe_metrics"]


class TrainState(train_state.TrainState):
  """``step``, ``params``, ``opt_state`` (pytree) and static ``apply_fn``/``tx``.

  Params are plain (unboxed) arrays; their shardings come with the state from
  ``create_train_state``.
  """


def model_inputs(batch: Batch) -> tuple[jax.Array, dict[str, jax.Array]]:
  """Splits a batch into the model's positional input and keyword inputs."""
  return batch["inputs"], {k: batch[k] for k in _MODEL_KWARGS if k in batch}


# ---------------------------------------------------------------------------
# Losses.
# ---------------------------------------------------------------------------
def _weighted_mean(values: jax.Array, weights: jax.Array
                   ) -> tuple[jax.Array, jax.Array]:
  denom = jnp.sum(weights)
  return jnp.sum(values * weights) / jnp.maximum(denom, 1e-8), denom


def compute_loss(head: str, outputs: jax.Array, batch: Batch
                 ) -> tuple[jax.Array, Metrics]:
  """Task loss of ``outputs`` (the model's output for ``head``) on ``batch``.

  Computed in float32 whatever the compute dtype. Returns ``(loss,
  metrics)``; metrics hold ``loss``, ``denominator`` and, except for
  regression, ``accuracy``.
  """
  outputs = outputs.astype(jnp.float32)
  if head in _TOKEN_HEADS:
    targets, weights = batch["targets"], batch["weights"].astype(jnp.float32)
    ce = optax.softmax_cross_entropy_with_integer_labels(outputs, targets)
    loss, denom = _weighted_mean(ce, weights)
    correct = (jnp.argmax(outputs, -1) == targets).astype(jnp.float32)
    accuracy, _ = _weighted_mean(correct, weights)
  elif head in _CLASS_HEADS:
    labels = batch["label"]
    weights = batch.get("weights")
    weights = (jnp.ones(labels.shape, jnp.float32) if weights is None
               else weights.astype(jnp.float32))
    ce = optax.softmax_cross_entropy_with_integer_labels(outputs, labels)
    loss, denom = _weighted_mean(ce, weights)
    correct = (jnp.argmax(outputs, -1) == labels).astype(jnp.float32)
    accuracy, _ = _weighted_mean(correct, weights)
  elif head == "regression":
    targets = batch["targets"].astype(jnp.float32)
    weights = batch["weights"].astype(jnp.float32)
    se = jnp.mean(jnp.square(outputs - targets), axis=-1)  # [B, N]
    loss, denom = _weighted_mean(se, weights)
    return loss, {"loss": loss, "denominator": denom}
  else:
    raise ValueError(f"unknown head {head!r}; heads are {HEADS}.")
  return loss, {"loss": loss, "accuracy": accuracy, "denominator": denom}


def _sum_aux_losses(aux: Any) -> jax.Array:
  leaves = jax.tree.leaves(aux)
  return sum((jnp.sum(x.astype(jnp.float32)) for x in leaves),
             jnp.zeros((), jnp.float32))


def _moe_metrics(collection: Any) -> Metrics:
  """``moe/<module path>/<name>``: each sown statistic, averaged over calls.

  Scalars stay scalars; a per-expert vector (``expert_usage [E]``) becomes one
  scalar per expert, ``moe/<path>/expert_usage/<e>``, so that load balance is
  visible in the logs rather than averaged away.
  """
  flat = jax.tree_util.tree_flatten_with_path(
      nn.unbox(collection), is_leaf=lambda x: isinstance(x, tuple))[0]
  out = {}
  for path, values in flat:
    name = "/".join(str(getattr(k, "key", getattr(k, "idx", k)))
                    for k in path)
    values = values if isinstance(values, tuple) else (values,)
    mean = jnp.mean(jnp.stack([v.astype(jnp.float32) for v in values]), 0)
    if mean.ndim == 1:
      for e in range(mean.shape[0]):
        out[f"moe/{name}/{e}"] = mean[e]
    else:
      out[f"moe/{name}"] = jnp.mean(mean)
  return out


def _loss_batch(model: nn.Module, batch: Batch) -> Batch:
  """The batch whose ``weights`` count in the loss.

  Models with a ``loss_start`` (sMLP with partial-prediction routing, whose
  router reads each row's first 20% of real tokens) count only the positions
  after that prefix (``model.loss_position_weights``, per row).
  """
  if not getattr(model, "loss_start", 0) or "weights" not in batch:
    return batch
  return {**batch, "weights": model.loss_position_weights(
      batch["weights"], batch.get("segment_ids"))}


# ---------------------------------------------------------------------------
# Steps.
# ---------------------------------------------------------------------------
def make_train_step(model: nn.Module, head: str
                    ) -> Callable[[TrainState, Batch, jax.Array],
                                  tuple[TrainState, Metrics]]:
  """Pure ``(state, batch, rng) -> (state, metrics)`` for ``model``/``head``.

  The dropout key is ``jax.random.fold_in(rng, state.step)``, so one base
  key serves the whole run. Metrics: the task metrics, ``aux_loss`` (sum of
  the sown auxiliary losses, already added to ``total_loss``), ``moe/...``,
  ``grad_norm`` and ``is_finite`` (loss and gradient norm finite; the
  update itself is left to the optimizer, e.g. ``optax.apply_if_finite``).
  """
  if head not in HEADS:
    raise ValueError(f"unknown head {head!r}; heads are {HEADS}.")

  def train_step(state: TrainState, batch: Batch, rng: jax.Array
                 ) -> tuple[TrainState, Metrics]:
    dropout_rng = jax.random.fold_in(rng, state.step)
    inputs, kwargs = model_inputs(batch)

    def loss_fn(params):
      outputs, mutated = model.apply(
          {"params": params}, inputs, deterministic=False,
          rngs={"dropout": dropout_rng}, mutable=MUTABLE, **kwargs)
      loss, metrics = compute_loss(head, outputs, _loss_batch(model, batch))
      aux = _sum_aux_losses(mutated.get("aux_loss", {}))
      metrics.update(_moe_metrics(mutated.get("moe_metrics", {})))
      metrics["aux_loss"] = aux
      metrics["total_loss"] = loss + aux
      return loss + aux, metrics

    grads, metrics = jax.grad(loss_fn, has_aux=True)(state.params)
    grad_norm = optax.tree.norm(grads)
    metrics["grad_norm"] = grad_norm
    metrics["is_finite"] = jnp.logical_and(
        jnp.isfinite(metrics["total_loss"]), jnp.isfinite(grad_norm))
    return state.apply_gradients(grads=grads), metrics

  return train_step


def make_eval_step(model: nn.Module, head: str
                   ) -> Callable[[TrainState, Batch], Metrics]:
  """Pure ``(state, batch) -> metrics`` (deterministic, task loss only)."""
  if head not in HEADS:
    raise ValueError(f"unknown head {head!r}; heads are {HEADS}.")

  def eval_step(state: TrainState, batch: Batch) -> Metrics:
    inputs, kwargs = model_inputs(batch)
    outputs, mutated = model.apply({"params": state.params}, inputs,
                                   deterministic=True, mutable=MUTABLE,
                                   **kwargs)
    _, metrics = compute_loss(head, outputs, _loss_batch(model, batch))
    metrics.update(_moe_metrics(mutated.get("moe_metrics", {})))
    return metrics

  return eval_step


def jit_train_step(step_fn: Callable[..., Any], state_shardings: Any,
                   batch_shardings: Any, mesh: jax.sharding.Mesh,
                   rules: sharding.Rules) -> Callable[..., Any]:
  """``jax.jit`` of a train step: explicit shardings, the state donated.

  Metrics and the rng are replicated. The mesh and rules are active while
  tracing (``sharding.within``), so callers need no context.
  """
  replicated = jax.NamedSharding(mesh, jax.P())
  return jax.jit(sharding.within(step_fn, mesh, rules),
                 in_shardings=(state_shardings, batch_shardings, replicated),
                 out_shardings=(state_shardings, replicated),
                 donate_argnums=(0,))


def jit_eval_step(step_fn: Callable[..., Any], state_shardings: Any,
                  batch_shardings: Any, mesh: jax.sharding.Mesh,
                  rules: sharding.Rules) -> Callable[..., Any]:
  """``jax.jit`` of an eval step (nothing donated, metrics replicated)."""
  replicated = jax.NamedSharding(mesh, jax.P())
  return jax.jit(sharding.within(step_fn, mesh, rules),
                 in_shardings=(state_shardings, batch_shardings),
                 out_shardings=replicated)


# ---------------------------------------------------------------------------
# State.
# ---------------------------------------------------------------------------
def _is_box(x: Any) -> bool:
  return isinstance(x, meta.AxisMetadata)


def _path_key(path: tuple[Any, ...]) -> tuple[str, ...]:
  return tuple(str(k) for k in path)


def _box_like_params(opt_state: Any, boxed_params: Any) -> Any:
  """Gives each optimizer-state leaf that mirrors a parameter its box.

  An optimizer state leaf mirrors a parameter when its key path ends with
  the parameter's path and the shapes agree (Adam's ``mu``/``nu``,
  ``MultiSteps``' accumulated gradients, ...). Other leaves (counts,
  factored statistics) stay plain and will be replicated. Matching by path
  works for any optax transformation, however nested.
  """
  params = {
      _path_key(p): box for p, box in jax.tree_util.tree_flatten_with_path(
          boxed_params, is_leaf=_is_box)[0] if _is_box(box)}

  def rebox(path, leaf):
    key = _path_key(path)
    for start in range(len(key)):
      box = params.get(key[start:])
      if box is not None and getattr(leaf, "shape", None) == box.value.shape:
        return box.replace_boxed(leaf)
    return leaf

  return jax.tree_util.tree_map_with_path(rebox, opt_state)


def create_train_state(model: nn.Module, tx: optax.GradientTransformation,
                       key: jax.Array, sample_batch: Any,
                       mesh: jax.sharding.Mesh, rules: sharding.Rules
                       ) -> tuple[TrainState, Any]:
  """Initialises params and optimizer state directly in their shardings.

  Args:
    model: a Linen model whose parameters carry logical axis names.
    tx: any optax transformation.
    key: the init key.
    sample_batch: a batch (arrays or ``jax.ShapeDtypeStruct``s with global
      shapes); only its input shapes and dtypes are used.
    mesh, rules: from ``sharding.build_mesh`` / ``sharding.get_rules``.

  Returns:
    ``(state, state_shardings)``: a ``TrainState`` of plain arrays and the
    matching tree of ``NamedSharding`` (optimizer moments follow their
    parameters; counters are replicated).
  """
  spec = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype),
                      sample_batch)

  def init_fn(rng):
    params_rng, dropout_rng = jax.random.split(rng)
    inputs, kwargs = model_inputs(jax.tree.map(
        lambda s: jnp.zeros(s.shape, s.dtype), spec))
    boxed = model.init({"params": params_rng, "dropout": dropout_rng},
                       inputs, deterministic=True, **kwargs)["params"]
    opt_state = tx.init(nn.unbox(boxed))
    return TrainState(step=jnp.zeros((), jnp.int32), apply_fn=model.apply,
                      params=boxed, tx=tx,
                      opt_state=_box_like_params(opt_state, boxed))

  return sharding.sharded_init(init_fn, key, mesh, rules)
