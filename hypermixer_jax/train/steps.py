"""The train step, the jitted steps and the sharded train state.

The step functions are pure: ``train_step(state, batch, rng) -> (state,
metrics)``; the evaluation step (``evaluation.make_eval_step``) is
``(state, batch) -> sums``. ``jit_train_step`` / ``jit_eval_step`` compile
them with explicit in/out shardings (the train state donated), and make the
mesh and logical rules active while tracing, so the models' activation
constraints always bind.

Losses by head: ``hypermixer_jax.heads`` (the table of heads). MoE layers sow
into ``aux_loss`` (summed into the training loss) and ``moe_metrics``
(averaged into the metrics under ``moe/...``).
"""
from __future__ import annotations

from typing import Any, Callable

import flax.linen as nn
from flax.training import train_state
import jax
import jax.numpy as jnp
import optax

from hypermixer_jax import heads
from hypermixer_jax import sharding
from hypermixer_jax.models import common
from hypermixer_jax.train import optim

Batch = dict[str, jax.Array]
Metrics = dict[str, jax.Array]
MUTABLE = ["aux_loss", "moe_metrics"]


class TrainState(train_state.TrainState):
  """``step``, ``params``, ``opt_state`` (pytree) and static ``apply_fn``/``tx``.

  Params are plain (unboxed) arrays; their shardings come with the state from
  ``create_train_state``.
  """


def _sum_aux_losses(aux: Any) -> jax.Array:
  leaves = jax.tree.leaves(aux)
  return sum((jnp.sum(x.astype(jnp.float32)) for x in leaves),
             jnp.zeros((), jnp.float32))


def moe_metrics(collection: Any) -> Metrics:
  """``moe/<module path>/<name>``: each sown statistic, averaged over calls.

  Scalars stay scalars; a per-expert vector (``expert_usage [E]``) becomes one
  scalar per expert, ``moe/<path>/expert_usage/<e>``, so that load balance is
  visible in the logs rather than averaged away.
  """
  flat = jax.tree_util.tree_flatten_with_path(
      nn.unbox(collection), is_leaf=lambda x: isinstance(x, tuple))[0]
  out = {}
  for path, values in flat:
    name = common.path_str(path)
    values = values if isinstance(values, tuple) else (values,)
    mean = jnp.mean(jnp.stack([v.astype(jnp.float32) for v in values]), 0)
    if mean.ndim == 1:
      for e in range(mean.shape[0]):
        out[f"moe/{name}/{e}"] = mean[e]
    else:
      out[f"moe/{name}"] = jnp.mean(mean)
  return out


# ---------------------------------------------------------------------------
# Steps.
# ---------------------------------------------------------------------------
def make_train_step(model: nn.Module, head: str, *,
                    loss_weights: heads.LossWeights | None = None
                    ) -> Callable[[TrainState, Batch, jax.Array],
                                  tuple[TrainState, Metrics]]:
  """Pure ``(state, batch, rng) -> (state, metrics)`` for ``model``/``head``.

  ``loss_weights``: the model's ``ModelFacts.loss_weights`` (which positions
  carry loss; ``heads.with_loss_weights``).

  The dropout key is ``jax.random.fold_in(rng, state.step)``, so one base
  key serves the whole run. Metrics: the task metrics, ``aux_loss`` (sum of
  the sown auxiliary losses, already added to ``total_loss``), ``moe/...``,
  ``grad_norm`` (of this batch's gradient, before clipping; with gradient
  accumulation, of the micro-batch's) and ``is_finite`` (loss and gradient
  norm finite; the update itself is left to the optimizer, e.g.
  ``optax.apply_if_finite``). With ``optim.weighted_accumulation`` the
  micro-batch's ``denominator`` is its gradient's weight.
  """
  heads.get(head)

  def train_step(state: TrainState, batch: Batch, rng: jax.Array
                 ) -> tuple[TrainState, Metrics]:
    dropout_rng = jax.random.fold_in(rng, state.step)
    inputs, kwargs = heads.model_inputs(batch, head)

    def loss_fn(params):
      outputs, mutated = model.apply(
          {"params": params}, inputs, deterministic=False,
          rngs={"dropout": dropout_rng}, mutable=MUTABLE, **kwargs)
      loss, metrics = heads.compute_loss(head, outputs, batch,
                                         loss_weights=loss_weights)
      aux = _sum_aux_losses(mutated.get("aux_loss", {}))
      metrics.update(moe_metrics(mutated.get("moe_metrics", {})))
      metrics["aux_loss"] = aux
      metrics["total_loss"] = loss + aux
      return loss + aux, metrics

    grads, metrics = jax.grad(loss_fn, has_aux=True)(state.params)
    grad_norm = optax.tree.norm(grads)
    metrics["grad_norm"] = grad_norm
    metrics["is_finite"] = jnp.logical_and(
        jnp.isfinite(metrics["total_loss"]), jnp.isfinite(grad_norm))
    if isinstance(state.opt_state, optim.WeightedAccumulationState):
      # Accumulating (grad_accum_steps > 1): this micro-batch's gradient
      # weighs by the positions its loss averages over.
      updates, opt_state = state.tx.update(
          grads, state.opt_state, state.params,
          weight=metrics["denominator"])
      return state.replace(
          step=state.step + 1, params=optax.apply_updates(
              state.params, updates), opt_state=opt_state), metrics
    return state.apply_gradients(grads=grads), metrics

  return train_step


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
def _box_like_params(opt_state: Any, boxed_params: Any) -> Any:
  """Gives each optimizer-state leaf that mirrors a parameter its box.

  An optimizer state leaf mirrors a parameter when its key path ends with
  the parameter's path and the shapes agree (Adam's ``mu``/``nu``,
  the gradient accumulator's sums, ...). Other leaves (counts,
  factored statistics) stay plain and will be replicated. Matching by path
  works for any optax transformation, however nested.
  """
  params = {
      common.path_names(p): box
      for p, box in jax.tree_util.tree_flatten_with_path(
          boxed_params, is_leaf=common.is_box)[0] if common.is_box(box)}

  def rebox(path, leaf):
    key = common.path_names(path)
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
  return sharding.sharded_init(_state_init_fn(model, tx, sample_batch), key,
                               mesh, rules)


def abstract_train_state(model: nn.Module, tx: optax.GradientTransformation,
                         sample_batch: Any, mesh: jax.sharding.Mesh,
                         rules: sharding.Rules) -> tuple[TrainState, Any]:
  """``create_train_state``'s ``(state, shardings)`` with nothing allocated:
  the state's leaves are ``jax.ShapeDtypeStruct``s carrying their shardings
  (what ``jit_train_step(...).lower`` takes to compile for a mesh)."""
  return sharding.abstract_init(_state_init_fn(model, tx, sample_batch),
                                jax.random.key(0), mesh, rules)


def param_shapes(model: nn.Module, sample_batch: Any) -> Any:
  """The model's parameters as ``model.init`` returns them (boxed, with
  their logical axis names) for batches like ``sample_batch``, as shapes:
  nothing is allocated (what ``optim.make_optimizer`` reads)."""
  return jax.eval_shape(_params_init_fn(model, sample_batch),
                        jax.random.key(0))


def _params_init_fn(model: nn.Module, sample_batch: Any
                    ) -> Callable[[jax.Array], Any]:
  """``rng -> boxed params`` of ``model`` for batches like ``sample_batch``
  (arrays or shapes: only the inputs' shapes and dtypes are used)."""
  spec = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype),
                      sample_batch)

  def init_fn(rng):
    params_rng, dropout_rng = jax.random.split(rng)
    batch = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), spec)
    kwargs = {k: batch[k] for k in heads.MODEL_KWARGS if k in batch}
    return model.init({"params": params_rng, "dropout": dropout_rng},
                      batch["inputs"], deterministic=True, **kwargs)["params"]

  return init_fn


def _state_init_fn(model: nn.Module, tx: optax.GradientTransformation,
                   sample_batch: Any) -> Callable[[jax.Array], TrainState]:
  """``rng -> TrainState`` with boxed (logically named) params and moments."""
  params_init = _params_init_fn(model, sample_batch)

  def init_fn(rng):
    boxed = params_init(rng)
    opt_state = tx.init(nn.unbox(boxed))
    return TrainState(step=jnp.zeros((), jnp.int32), apply_fn=model.apply,
                      params=boxed, tx=tx,
                      opt_state=_box_like_params(opt_state, boxed))

  return init_fn
