"""Evaluation: the one evaluation step, and the evaluators the loop runs.

``make_eval_step`` is the only evaluation step: it returns *sums* (loss x
denominator, accuracy x denominator, binary confusion counts when the task's
metrics include F1, MoE statistics; ``heads.eval_sums``) so that batches of
any size, and the padding examples of a last batch, average exactly; it
counts exactly the positions training counts (``loss_weights``). ``finalize``
turns the sums into the head's metrics (``heads.finalize``) and the task's
F1 (``hypermixer_jax.data.metrics``).

Evaluators (big_vision's ``config.evals``): the loop always runs
``TaskEvaluator`` (the task's metrics on ``config.eval_split`` every
``config.eval_every`` steps and at the end), and every evaluator declared in
``config.evals``::

    config.evals.<name> = dict(type=<a key of EVALUATORS>, every=<steps>,
                               **options of that evaluator)

``every`` > 0: every that many steps and at the end; 0: at the end only;
-1: never. An evaluator is ``Evaluator(context, **options)`` with
``run(state, step) -> dict``: float outputs are logged under ``<name>/``, and
all outputs of its last run are kept in ``TrainResult.evals[name]``.
"""
from __future__ import annotations

import dataclasses
import importlib
import itertools
from typing import Any, Callable, Iterable

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from hypermixer_jax import heads
from hypermixer_jax import sharding
from hypermixer_jax.data import metrics as task_metrics
from hypermixer_jax.train import metrics as metrics_lib
from hypermixer_jax.train import preflight
from hypermixer_jax.train import steps

# Evaluator type -> module defining ``Evaluator``.
EVALUATORS = {
    "pseudo_attention": "hypermixer_jax.train.pseudo_attention",
    # The task's metrics on another split (options: split, steps,
    # batch_size), e.g. a small validation subset every few steps as
    # ``eval`` and the whole test split at the end.
    "task": "hypermixer_jax.train.evaluation",
}


def make_eval_step(model: nn.Module, head: str, *,
                   loss_weights: heads.LossWeights | None = None,
                   task_metric_names: tuple[str, ...] = ()
                   ) -> Callable[[Any, dict], dict]:
  """Pure ``(state, batch) -> sums`` for ``model`` / ``head``.

  ``loss_weights``: the model's (``ModelFacts.loss_weights``), as in
  training.
  ``task_metric_names``: the task's official metrics
  (``data.metrics.metric_names``); ``'f1'`` adds the confusion counts.
  """
  heads.get(head)

  def eval_step(state, batch):
    inputs, kwargs = heads.model_inputs(batch, head)
    outputs, mutated = model.apply(
        {"params": state.params}, inputs, deterministic=True,
        mutable=steps.MUTABLE, **kwargs)
    sums = heads.eval_sums(head, outputs, batch, loss_weights=loss_weights,
                           task_metric_names=task_metric_names)
    sums.update(steps.moe_metrics(mutated.get("moe_metrics", {})))
    sums["num_batches"] = jnp.ones((), jnp.float32)
    return sums

  return eval_step


def finalize(sums: dict[str, float], head: str) -> dict[str, float]:
  """The metrics of summed statistics (see the module docstring)."""
  out = heads.finalize(head, sums)
  if "tp" in sums:
    out["f1"] = task_metrics.f1_from_counts(
        float(sums["tp"]), float(sums["fp"]), float(sums["fn"]))
  return out


def with_example_weights(batch: dict, head: str) -> dict:
  """``batch`` with per-example ``weights`` (1) where a classification
  head's batch has none: every batch of an evaluation holds them, so that a
  padded last batch (``evaluate``) has the same structure."""
  if heads.get(head).kind != "classes" or "weights" in batch:
    return batch
  return {**batch, "weights": np.ones(len(batch["label"]), np.float32)}


def _padded(local: dict, rows: int) -> dict:
  """``local`` grown to ``rows`` rows: copies of its own rows with
  ``weights`` 0, so that they count in no loss or accuracy. They are real
  rows rather than zeros so that what a model computes per row and averages
  over rows (the ``moe/`` router statistics, diagnostics) sees no empty
  row (an empty row reads as all its tokens dropped)."""
  have = len(next(iter(local.values())))
  if have >= rows:
    return local
  if "weights" not in local:
    raise ValueError("an evaluation batch without 'weights' cannot be "
                     "padded: its padding rows would count in the metrics.")
  take = np.arange(rows - have) % have
  out = {k: np.concatenate([np.asarray(v), np.asarray(v)[take]])
         for k, v in local.items()}
  out["weights"][have:] = 0
  return out


def _every_process_has_a_batch(has: bool, split: str) -> None:
  """Raises the same ValueError on every process where one of them read no
  batch of ``split`` (the others would wait for it in the collective
  evaluation step)."""
  if jax.process_count() > 1:
    from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
    every = multihost_utils.process_allgather(np.asarray(has))
  else:
    every = np.asarray([has])
  if not every.all():
    missing = [int(i) for i in np.flatnonzero(~every)]
    raise ValueError(
        f"the evaluation split {split!r} gave no batch to process(es) "
        f"{missing} of {len(every)}: it has fewer examples than processes, "
        "or none; evaluate on a larger split.")


def _as_many_on_every_process(batches: Iterable[dict]) -> Iterable[dict]:
  """``batches``, and once this process has run out while another has not,
  its first batch again with every weight 0: the hosts' shards of a split
  differ in size, and every batch is a collective step."""
  if jax.process_count() == 1:
    yield from batches
    return
  from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
  it, template = iter(batches), None
  while True:
    local = next(it, None)
    if template is None and local is not None:
      template = local
    if not multihost_utils.process_allgather(np.asarray(local is not None)
                                             ).any():
      return
    if local is None and template is None:
      raise ValueError(
          f"process {jax.process_index()} read no batch of the evaluation "
          "split while another did: the split has fewer examples than "
          "processes.")
    yield local if local is not None else {
        **template, "weights": np.zeros_like(template["weights"])}


def evaluate(eval_step: Callable[[Any, dict], dict], state: Any,
             batches: Iterable[dict], mesh: jax.sharding.Mesh,
             rules: sharding.Rules, head: str, max_batches: int = -1, *,
             local_batch_size: int = 0) -> dict[str, float]:
  """Runs ``eval_step`` over ``batches`` (host-local NumPy) and finalizes.

  ``eval_step`` must be jitted (``steps.jit_eval_step``); sums stay on the
  device until the end, so evaluation does not sync per batch. A batch
  whose rows do not divide over the devices of the batch axis (the last of
  a split) is padded with rows of weight 0 (``_padded``; every batch needs
  ``weights``: ``with_example_weights``); with several processes, to
  ``local_batch_size`` (this process's share; 0: its first batch's size),
  and the processes agree on the number of batches.
  """
  shards = sharding.batch_shards(mesh, rules)
  multi = jax.process_count() > 1
  total, done = None, 0
  of = f"/{max_batches}" if max_batches >= 0 else ""
  # A whole split (and the first batch's compilation) can take minutes.
  with metrics_lib.Heartbeat(
      lambda t: f"evaluating: {done}{of} batches in {metrics_lib.duration(t)}",
      enabled=jax.process_index() == 0):
    for i, local in enumerate(_as_many_on_every_process(batches)):
      if 0 <= max_batches <= i:
        break
      have = len(next(iter(local.values())))
      local_batch_size = local_batch_size or have
      local = _padded(local, local_batch_size if multi
                      else -(-have // shards) * shards)
      sums = eval_step(state, sharding.make_global_batch(local, mesh, rules))
      total = sums if total is None else jax.tree.map(jnp.add, total, sums)
      done = i + 1
  if total is None:
    raise ValueError("the evaluation split gave no batch")
  return finalize(jax.tree.map(np.asarray, jax.device_get(total)), head)


# ---------------------------------------------------------------------------
# Evaluators.
# ---------------------------------------------------------------------------
@dataclasses.dataclass
class Context:
  """What an evaluator may use: the run's config, model and placement.

  ``pipeline(split, batch_size)`` gives the host's unshuffled, one-epoch
  batches of a split; ``write_image(tag, step, image)`` logs an image.
  """
  config: ml_collections.ConfigDict
  workdir: str
  model: nn.Module
  facts: Any                       # models.ModelFacts
  mesh: jax.sharding.Mesh
  rules: sharding.Rules
  state_shardings: Any
  pipeline: Callable[[str, int], Iterable[dict]]
  write_image: Callable[[str, int, np.ndarray], None]
  is_main: bool


class TaskEvaluator:
  """The task's metrics (``finalize``) on ``config.eval_split``.

  ``eval_steps`` batches of ``eval_batch_size`` (-1: the whole split). As the
  ``task`` evaluator of ``config.evals``, ``split``, ``steps`` and
  ``batch_size`` choose another split and size.
  """

  def __init__(self, context: Context, *, split: str = "",
               steps: int | None = None, batch_size: int = 0):
    self.ctx = context
    self.split = split or context.config.eval_split
    self.steps = context.config.eval_steps if steps is None else int(steps)
    self.batch_size = int(batch_size) or context.config.eval_batch_size
    self._step_fn = None

  def _compiled(self, first: dict):
    if self._step_fn is None:
      c = self.ctx
      spec = sharding.global_batch_spec(first)
      self._step_fn = steps.jit_eval_step(
          make_eval_step(c.model, c.facts.head,
                         loss_weights=c.facts.loss_weights,
                         task_metric_names=task_metrics.metric_names(
                             c.config.data.task)),
          c.state_shardings, sharding.batch_shardings(spec, c.mesh, c.rules),
          c.mesh, c.rules)
    return self._step_fn

  def run(self, state, step: int) -> dict[str, float]:
    del step
    c = self.ctx
    head = c.facts.head
    it = (with_example_weights(b, head)
          for b in c.pipeline(self.split, self.batch_size))
    # The first batch gives the shapes; it goes back in front.
    first = next(it, None)
    _every_process_has_a_batch(first is not None, self.split)
    batches = itertools.chain([first], it)
    return evaluate(self._compiled(first), state, batches, c.mesh, c.rules,
                    head, self.steps, local_batch_size=(
                        self.batch_size // jax.process_count()))


Evaluator = TaskEvaluator  # the ``task`` type of ``config.evals``


@dataclasses.dataclass
class Scheduled:
  """An evaluator and when it runs (see the module docstring)."""
  name: str
  evaluator: Any
  every: int

  def due(self, step: int, last: bool) -> bool:
    if self.every < 0:
      return False
    return last or (self.every > 0 and step % self.every == 0)


def declared(context: Context) -> list[Scheduled]:
  """The task evaluator (as ``eval``) and the evaluators of ``config.evals``."""
  config = context.config
  out = [Scheduled("eval", TaskEvaluator(context), int(config.eval_every))]
  for name, spec in (config.get("evals") or {}).items():
    options = dict(spec)
    kind = options.pop("type", None)
    if kind not in EVALUATORS:
      raise ValueError(f"config.evals.{name}.type={kind!r}; evaluator types: "
                       f"{', '.join(EVALUATORS)}.")
    every = int(options.pop("every", 0))
    if "filename" in options:   # an evaluator's files stay in the workdir
      preflight.inside(context.workdir, options["filename"],
                         f"evals.{name}.filename")
    module = importlib.import_module(EVALUATORS[kind])
    out.append(Scheduled(name, module.Evaluator(context, **options), every))
  return out
