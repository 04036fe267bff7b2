"""Optimiser and learning-rate schedule built from the run's config.

AdamW (decoupled weight decay on matrices only, never on biases, LayerNorm
scales or other vectors: leaves named ``bias`` or ``scale``, multi-head
[H, K] biases included, are left alone, and a leaf's rank leaves out the
axes that stack copies of it, a scanned stack's layers and an MoE layer's
experts, read from its logical axis names), linear warm-up followed by
linear, cosine or no decay, global-norm gradient clipping, and gradient
accumulation (``weighted_accumulation``).

Steps: one training step of the loop is one call of the train step on a
global batch of ``batch_size`` examples. With ``grad_accum_steps = k`` the
parameters change every k steps, on the gradient of the loss over the
``k * batch_size`` examples: each micro-batch's gradient weighted by the
positions (tokens, examples) its loss averages over, so that micro-batches
holding fewer loss tokens do not count for more (a plain mean of the k
gradients, ``optax.MultiSteps``, would). The schedule lives inside the
wrapped optimiser, so it counts real updates and runs over
``num_train_steps // k`` of them (``num_train_steps`` counts micro-batches:
``config_checks`` asks for a multiple of k).
"""
from __future__ import annotations

from typing import Any, NamedTuple

from flax import linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import optax

from hypermixer_jax.models import common

DECAYS = ("linear", "cosine", "constant")
# Logical axes that stack copies of a parameter rather than shape one: a
# scanned stack's layers ([L, d] LayerNorm scales are L vectors) and an MoE
# layer's experts ([E, F] biases are E vectors).
STACKED_AXES = (common.LAYERS, common.EXPERT)
# Flax's names of the leaves that shift or scale rather than mix features.
UNDECAYED_NAMES = ("bias", "scale")
# The rule ``weight_decay_mask`` applies, as runs record it. Runs recorded
# without it decayed every leaf of rank > 1: a scanned stack's LayerNorm
# scales and biases, an MoE layer's [E, F] biases and attention's [H, K]
# query / key / value biases included.
DECAY_MASK_RULE = "logical_rank"


def make_schedule(config: ml_collections.ConfigDict) -> optax.Schedule:
  """Linear warm-up to ``learning_rate``, then ``config.decay``.

  The schedule is indexed by optimiser updates (not micro-steps); linear and
  cosine decay reach ``end_learning_rate_factor * learning_rate`` after the
  last update, ``num_train_steps // grad_accum_steps``; constant keeps the
  peak.
  """
  if config.decay not in DECAYS:
    raise ValueError(f"config.decay={config.decay!r}; expected one of "
                     f"{DECAYS}")
  peak = config.learning_rate
  end = peak * config.get("end_learning_rate_factor", 0.0)
  warmup = max(int(config.warmup_steps), 0)
  updates = int(config.num_train_steps) // max(int(config.grad_accum_steps), 1)
  decay_steps = max(updates - warmup, 1)
  if config.decay == "linear":
    decay = optax.linear_schedule(peak, end, decay_steps)
  elif config.decay == "cosine":
    decay = optax.cosine_decay_schedule(peak, decay_steps,
                                        alpha=end / peak if peak else 0.0)
  else:
    decay = optax.constant_schedule(peak)
  if warmup == 0:
    return decay
  return optax.join_schedules(
      [optax.linear_schedule(0.0, peak, warmup), decay], [warmup])


def weight_decay_mask(params: Any) -> Any:
  """True for the leaves that get weight decay, matrices and higher ranks,
  as a tree of the unboxed parameters' structure.

  Leaves named as in ``UNDECAYED_NAMES`` never decay. A boxed leaf
  (``nn.Partitioned``, what ``model.init`` returns) counts its logical axes
  other than ``STACKED_AXES``; a plain array or shape counts all its
  dimensions (right only where no axis stacks copies).
  """
  def decays(path, leaf) -> bool:
    key = path[-1] if path else None
    if getattr(key, "key", None) in UNDECAYED_NAMES:
      return False
    if isinstance(leaf, nn.Partitioned):
      return sum(name not in STACKED_AXES for name in leaf.names) > 1
    return len(leaf.shape) > 1
  return jax.tree_util.tree_map_with_path(
      decays, params, is_leaf=lambda x: isinstance(x, nn.Partitioned))


class WeightedAccumulationState(NamedTuple):
  """``weighted_accumulation``'s state: the micro-batch within the update,
  the weighted sum of gradients and of weights, and the inner state."""
  mini_step: jax.Array
  weight_sum: jax.Array
  acc_grads: Any
  inner_opt_state: Any


def weighted_accumulation(inner: optax.GradientTransformation, every_k: int
                          ) -> optax.GradientTransformationExtraArgs:
  """``inner`` applied every ``every_k`` calls, to the weighted mean of their
  gradients: ``sum_i w_i g_i / sum_i w_i``, where ``g_i`` is a micro-batch's
  gradient of its loss (a mean over its ``w_i`` positions) and ``w_i`` is
  passed as ``update(..., weight=w_i)`` (1 when not given: the plain mean).
  That is the gradient of the loss over all the positions of the k
  micro-batches. Between updates the parameters do not change (zero
  updates); a call whose weights sum to 0 so far updates on zeros."""
  def init(params):
    return WeightedAccumulationState(
        mini_step=jnp.zeros((), jnp.int32),
        weight_sum=jnp.zeros((), jnp.float32),
        acc_grads=jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32),
                               params),
        inner_opt_state=inner.init(params))

  def update(updates, state, params=None, *, weight=1.0, **extra):
    del extra
    weight = jnp.asarray(weight, jnp.float32)
    acc = jax.tree.map(lambda a, g: a + weight * g.astype(jnp.float32),
                       state.acc_grads, updates)
    total = state.weight_sum + weight

    def emit(_):
      mean = jax.tree.map(
          lambda a, g: (a / jnp.maximum(total, 1e-30)).astype(g.dtype),
          acc, updates)
      out, inner_state = inner.update(mean, state.inner_opt_state, params)
      return out, WeightedAccumulationState(
          jnp.zeros((), jnp.int32), jnp.zeros((), jnp.float32),
          jax.tree.map(jnp.zeros_like, acc), inner_state)

    def hold(_):
      return jax.tree.map(jnp.zeros_like, updates), WeightedAccumulationState(
          state.mini_step + 1, total, acc, state.inner_opt_state)
    return jax.lax.cond(state.mini_step == every_k - 1, emit, hold, None)

  return optax.GradientTransformationExtraArgs(init, update)


def make_optimizer(
    config: ml_collections.ConfigDict, params: Any
) -> tuple[optax.GradientTransformation, optax.Schedule]:
  """Returns ``(tx, schedule)`` for ``config`` (see the module docstring).

  Fields read: ``learning_rate``, ``warmup_steps``, ``decay``,
  ``num_train_steps``, ``weight_decay``, ``b1``, ``b2``, ``clip_norm`` (<= 0
  disables clipping) and ``grad_accum_steps`` (1 disables accumulation).
  ``params``: the model's parameters as ``model.init`` returns them (boxed,
  with logical axis names) or their shapes (``steps.param_shapes``); their
  names say which leaves are matrices (``weight_decay_mask``).
  """
  schedule = make_schedule(config)
  parts = []
  if config.clip_norm and config.clip_norm > 0:
    parts.append(optax.clip_by_global_norm(config.clip_norm))
  parts.append(optax.adamw(schedule, b1=config.b1, b2=config.b2,
                           eps=config.get("eps", 1e-8),
                           weight_decay=config.weight_decay,
                           mask=weight_decay_mask(params)))
  tx = optax.chain(*parts)
  accum = int(config.grad_accum_steps)
  if accum < 1:
    raise ValueError(f"config.grad_accum_steps={accum} must be >= 1")
  if accum > 1:
    tx = weighted_accumulation(tx, accum)
  return tx, schedule
