"""The training loop: ``train_and_evaluate(config, workdir)``.

One run, in named phases:

1. ``_setup``: mesh, rules, the model and its facts (``models.model_facts``:
   head, where the loss starts, whether it may pack), the optimizer and the
   sharded train state;
2. ``_restore``: the starting point, in an explicit, logged order: the
   newest checkpoint in ``workdir/checkpoints`` (a restarted job resumes,
   input pipeline position included), else ``config.init_checkpoint``
   (fine-tuning: the parameters not matching ``config.init_reinit`` are
   loaded, the rest initialised), else scratch;
3. ``_compile``: the train step, compiled ahead of time (its FLOPs feed the
   throughput/MFU figures);
4. ``_train``: the steps, each followed by ``_log`` (TensorBoard,
   ``metrics.jsonl``, console), ``_save`` (asynchronous checkpoints every
   ``checkpoint_every`` steps and when preempted; preemption is asked once
   per step, a multi-host sync point) and ``_evaluate`` (the evaluators of
   ``evaluation.declared``: the task's metrics every ``eval_every`` steps
   and the extras of ``config.evals``), with a stop and a clear error on a
   NaN or Inf loss or gradient: each step's flag is read while the next
   step runs (one step behind, so the host waits for no step it has not
   already queued), and the current step's before every log, save and
   evaluation; a non-finite state never becomes a checkpoint or an
   evaluation, and at most one step runs on from it. A run
   resumed from a step whose evaluation the interrupted run did not log
   (killed or preempted between the save and the evaluation) evaluates it
   first; a full disk stops with one line naming the newest checkpoint
   folder.

The loop knows no model, head or task: heads are ``hypermixer_jax.heads``,
model facts ``models.model_facts``, extras declared evaluators.
"""
from __future__ import annotations

import dataclasses
import os
import signal
from typing import Any, Callable

from absl import logging
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from hypermixer_jax import data as data_lib
from hypermixer_jax import heads
from hypermixer_jax import models
from hypermixer_jax import sharding
from hypermixer_jax.train import checkpoint as ckpt_lib
from hypermixer_jax.train import evaluation
from hypermixer_jax.train import metrics as metrics_lib
from hypermixer_jax.train import multihost
from hypermixer_jax.train import optim
from hypermixer_jax.train import preflight
from hypermixer_jax.train import profiling
from hypermixer_jax.train import run_config
from hypermixer_jax.train import steps
from hypermixer_jax.train import storage
from hypermixer_jax.train import workdir as workdir_lib


@dataclasses.dataclass
class TrainResult:
  """What one training run ends with.

  ``state`` is the final ``steps.TrainState`` (``state.params``: the trained
  parameters); ``eval_metrics`` the task evaluator's last metrics; ``evals``
  the outputs of each declared evaluator's last run; ``source`` where the
  run started from (``'workdir'``, ``'init_checkpoint'``, ``'scratch'``).
  ``notice``: a preemption notice (SIGTERM) came during the run; where not
  ``preempted`` it came after the last step (the run is whole), and the
  process should stop rather than start other work.
  """
  workdir: str
  step: int
  eval_metrics: dict[str, float]
  preempted: bool
  state: Any
  source: str = "scratch"
  evals: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)
  notice: bool = False


def check_model_fits_data(config: ml_collections.ConfigDict) -> None:
  """Rejects model/data combinations that would train on the wrong signal
  (the model's facts say whether it may train on packed rows)."""
  facts = models.model_facts(config.model)
  if config.data.get("packing", False) and facts.packing_error:
    raise ValueError(facts.packing_error)


def _pipeline(config, split: str, batch_size: int, *, train: bool):
  pcount = jax.process_count()
  if batch_size % pcount:
    raise ValueError(f"batch size {batch_size} must be divisible by the "
                     f"{pcount} processes")
  return data_lib.build_pipeline(
      config.data, split, batch_size=batch_size // pcount,
      shard_index=jax.process_index(), num_shards=pcount, seed=config.seed,
      repeat=train, shuffle=train)


def _eval_pipelines(config) -> Callable[[str, int], data_lib.Pipeline]:
  """``(split, batch_size) -> pipeline`` for the evaluators: each split's
  pipeline is built once and restarted at each evaluation (its tf.data graph
  is not traced again)."""
  built = {}

  def pipeline(split: str, batch_size: int) -> data_lib.Pipeline:
    if (split, batch_size) not in built:
      built[split, batch_size] = _pipeline(config, split, batch_size,
                                           train=False)
    return built[split, batch_size].restarted()

  return pipeline


def _poison(batch: dict) -> dict:
  """NaN in every float array of the batch (the ``nan_at_step`` test hook)."""
  return {k: (np.full_like(v, np.nan) if np.issubdtype(v.dtype, np.floating)
              else v) for k, v in batch.items()}


class _NonFinite(FloatingPointError):
  pass


# A run that has logged nothing this long after its compilation says so once.
QUIET_SECONDS = 60.0


@dataclasses.dataclass
class _Run:
  """What the phases share."""
  config: ml_collections.ConfigDict
  workdir: str
  mesh: jax.sharding.Mesh
  rules: sharding.Rules
  model: Any
  facts: models.ModelFacts
  schedule: Any
  state: Any
  state_sh: Any
  sample: dict[str, np.ndarray]     # host-local first batch (shapes)
  train_rng: jax.Array
  is_main: bool


# ---------------------------------------------------------------------------
# Phases.
# ---------------------------------------------------------------------------
def _setup(config: ml_collections.ConfigDict, workdir: str) -> _Run:
  """Mesh, model, optimizer and the freshly initialised sharded state."""
  storage.path(workdir).mkdir(parents=True, exist_ok=True)
  mesh = sharding.build_mesh(config.mesh)
  rules = sharding.get_rules(config.sharding)
  logging.info("mesh %s on %d devices (%d processes), rules %r",
               dict(mesh.shape), mesh.size, jax.process_count(),
               config.sharding.rules)
  model = models.build_model(config.model)
  facts = models.model_facts(config.model)
  check_model_fits_data(config)

  rng = jax.random.key(config.seed)
  # Dropout keys: the train step folds this key with the step number.
  # Made inside jit, so that every process holds the replicated key (a
  # device_put of a host value cannot address other hosts' devices).
  train_rng = jax.jit(lambda: jax.random.fold_in(jax.random.key(config.seed),
                                                 1),
                      out_shardings=jax.NamedSharding(mesh, jax.P()))()
  # Shapes come from a separate, unshuffled pipeline so that the training
  # pipeline's first batch is not consumed before its position is restored.
  sample = next(iter(_pipeline(config, "train", config.batch_size,
                               train=False)))
  heads.check_batch(facts.head, sample)
  spec = sharding.global_batch_spec(sample)
  tx, schedule = optim.make_optimizer(config, steps.param_shapes(model, spec))
  state, state_sh = steps.create_train_state(
      model, tx, jax.random.fold_in(rng, 0), spec, mesh, rules)
  n_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(state.params))
  logging.info("model family %s, head %s: %.3fM parameters",
               config.model.family, facts.head, n_params / 1e6)
  return _Run(config, workdir, mesh, rules, model, facts, schedule, state,
              state_sh, sample, train_rng, jax.process_index() == 0)


def _restore(run: _Run, ck: ckpt_lib.Checkpointer, train_pipe) -> str:
  """Own checkpoint > init checkpoint > scratch; returns which (logged)."""
  config = run.config
  restored = ck.restore_latest(ckpt_lib.abstract_like(run.state, run.state_sh))
  if restored is not None:
    latest, run.state, data_state = restored
    if data_state is not None:
      train_pipe.set_state(data_state)
    logging.info("Start: resuming from own checkpoint %s step %d (sources "
                 "in order: workdir > init_checkpoint > scratch).",
                 ck.directory, latest)
    return "workdir"
  if config.init_checkpoint:
    run_config.check_init_vocabulary(config)
    for line in run_config.input_mismatches(config):
      logging.warning("%s", line)
    reinit = [r for r in config.init_reinit.split(",") if r]
    params = ckpt_lib.load_pretrained(config.init_checkpoint,
                                      run.state.params, reinit)
    run.state = run.state.replace(params=params)
    logging.info("Start: parameters from init_checkpoint %s, re-initialised "
                 "%s (no checkpoint in %s).", config.init_checkpoint, reinit,
                 ck.directory)
    return "init_checkpoint"
  logging.info("Start: from scratch (no checkpoint in %s, no "
               "init_checkpoint).", ck.directory)
  return "scratch"


def _compile(run: _Run):
  """The compiled train step and the throughput meter (FLOPs from XLA)."""
  spec = sharding.global_batch_spec(run.sample)
  batch_sh = sharding.batch_shardings(spec, run.mesh, run.rules)
  train_step = steps.jit_train_step(
      steps.make_train_step(run.model, run.facts.head,
                            loss_weights=run.facts.loss_weights),
      run.state_sh, batch_sh, run.mesh, run.rules)
  replicated = jax.NamedSharding(run.mesh, jax.P())
  with metrics_lib.announce("compiling the train step", enabled=run.is_main):
    compiled = train_step.lower(
        ckpt_lib.abstract_like(run.state, run.state_sh),
        ckpt_lib.abstract_like(spec, batch_sh),
        jax.ShapeDtypeStruct(run.train_rng.shape, run.train_rng.dtype,
                             sharding=replicated)).compile()
  batch_size = run.config.batch_size
  # Batch contract (CONTRIBUTING.md): axis 1 of ``inputs`` is the sequence
  # (tokens, patches or positions).
  tokens = batch_size * run.sample["inputs"].shape[1]
  throughput = metrics_lib.Throughput(
      batch_size, tokens, metrics_lib.step_flops(compiled),
      metrics_lib.device_peak_flops(run.mesh.devices.flat,
                                    run.config.peak_flops_per_device))
  return compiled, throughput


@dataclasses.dataclass
class _Progress:
  """The loop's running record."""
  step: int
  all_finite: Any = True
  checked_until: int = 0
  preempted: bool = False
  eval_metrics: dict[str, float] = dataclasses.field(default_factory=dict)
  evals: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)


def _check_finite(progress: _Progress, ck: ckpt_lib.Checkpointer,
                  step: int) -> None:
  if not bool(jax.device_get(progress.all_finite)):
    ck.wait_until_finished()
    latest = ck.latest_step()
    saved = (f"the latest checkpoint is step {latest} in {ck.directory}"
             if latest is not None else f"no checkpoint in {ck.directory} yet")
    raise _NonFinite(
        f"loss or gradient became NaN/Inf at step {step}; stopping. "
        f"Not saved; "
        f"{saved}. Lower the learning rate, enable clipping or check the "
        "data.")
  progress.checked_until = step


def _log(run: _Run, progress: _Progress, ck, metrics, step: int, writer,
         bar, throughput) -> None:
  """Train scalars of ``step`` to TensorBoard / jsonl / console."""
  metrics = jax.device_get(metrics)
  _check_finite(progress, ck, step)
  scalars = {k: v for k, v in metrics.items() if k != "is_finite"}
  accum = int(run.config.grad_accum_steps)
  scalars["learning_rate"] = run.schedule(max(step // accum - 1, 0))
  scalars.update(throughput.update(step))
  writer.write_scalars(step, scalars)
  bar.update(step, scalars)


def _save(run: _Run, progress: _Progress, ck, train_pipe, step: int,
          last: bool) -> None:
  """Checkpoint when due: periodic, on preemption, at the last step."""
  if (progress.preempted or last
      or ck.should_save(step, preempted=progress.preempted)):
    _check_finite(progress, ck, step)
    ck.save(step, run.state, train_pipe.get_state(), force=True)


def _evaluate(run: _Run, progress: _Progress, evaluators, step: int,
              last: bool, writer, bar) -> None:
  """Runs the evaluators due at ``step`` and logs their float outputs."""
  for ev in evaluators:
    if not ev.due(step, last):
      continue
    out = ev.evaluator.run(run.state, step)
    scalars = {k: v for k, v in out.items() if np.ndim(v) == 0}
    if ev.name == "eval":
      progress.eval_metrics = out
      writer.write_scalars(step, scalars, split="eval")
    else:
      progress.evals[ev.name] = out
      if scalars:
        writer.write_scalars(step, scalars, split=ev.name)
    if scalars:
      bar.write(f"step {step} {ev.name}: " + ", ".join(
          f"{k}={v:.5g}" for k, v in scalars.items()))


def _train(run: _Run, progress: _Progress, ck, train_pipe, compiled,
           throughput, evaluators, writer, bar, profiler) -> None:
  """Steps ``progress.step + 1 .. num_train_steps`` (or until preempted)."""
  config = run.config
  total = int(config.num_train_steps)
  throughput.start(progress.step)
  it = iter(train_pipe)
  first = min(total, (progress.step // config.log_every + 1) * config.log_every)
  bar.until_first_line(lambda t: (
      f"step {progress.step}/{total}, no log line in {metrics_lib.duration(t)}"
      f": the first comes at step {first} (log_every={config.log_every}); "
      "pass a smaller --config.log_every to see progress sooner."),
                       QUIET_SECONDS)
  for step in range(progress.step + 1, total + 1):
    local = next(it)
    if step == config.debug.nan_at_step:
      local = _poison(local)
    batch = sharding.make_global_batch(local, run.mesh, run.rules)
    with profiler.step(step):
      run.state, m = compiled(run.state, batch, run.train_rng)
      profiler.keep(m)
    progress.step = step
    if progress.checked_until < step - 1:
      # The previous step's flag: ready by now, while this step runs.
      _check_finite(progress, ck, step - 1)
    progress.all_finite = jnp.logical_and(progress.all_finite, m["is_finite"])
    if step % config.log_every == 0 or step == total:
      _log(run, progress, ck, m, step, writer, bar, throughput)
    if step == config.debug.sigterm_at_step:
      os.kill(os.getpid(), signal.SIGTERM)
    progress.preempted = ck.reached_preemption(step)
    _save(run, progress, ck, train_pipe, step, step == total)
    if step == config.debug.kill_after_save_at_step:
      _die(ck, writer)   # the window between a save and its evaluation
    if progress.preempted:
      logging.warning("preemption at step %d: checkpoint saved, stopping.",
                      step)
      return
    if any(ev.due(step, step == total) for ev in evaluators):
      _check_finite(progress, ck, step)   # never evaluate a non-finite state
    _evaluate(run, progress, evaluators, step, step == total, writer, bar)
    if step == config.debug.kill_at_step:
      _die(ck, writer)


def _die(ck, writer) -> None:
  """Test hook: dies like a preempted VM (no cleanup), after the pending
  checkpoint is on disk so that the resume point is known."""
  ck.wait_until_finished()
  writer.flush()
  os.kill(os.getpid(), signal.SIGKILL)


def _missed(run: _Run, evaluators, step: int) -> list:
  """The evaluators due at ``step`` (the step a run resumes from) that left
  no record of it in ``metrics.jsonl``: the interrupted run stopped between
  the save and the evaluation (a kill, a preemption). Evaluators without
  scalars leave no record and run again (they rewrite their files)."""
  due = [ev for ev in evaluators if ev.due(step, False)]
  logged = workdir_lib.logged_splits(run.workdir, step) if run.is_main \
      else set()
  missing = np.array([ev.name not in logged for ev in due])
  if jax.process_count() > 1:   # every process runs the same evaluations
    from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
    missing = multihost_utils.broadcast_one_to_all(missing)
  return [ev for ev, m in zip(due, missing) if m]


def train_and_evaluate(config: ml_collections.ConfigDict,
                       workdir: str) -> TrainResult:
  """Trains ``config``'s model in ``workdir``; see the module docstring."""
  # Config and data checked before anything is built; the workdir locked.
  with workdir_lib.guard(config, workdir, is_main=jax.process_index() == 0):
    # A full disk fails in many places (Orbax's threads, logs, configs):
    # one line, with what is safe on disk.
    with preflight.quiet_disk_full():
      try:
        return _train_and_evaluate(config, workdir)
      except Exception as e:  # pylint: disable=broad-except
        if preflight.disk_full(e) is None:
          raise
        raise preflight.disk_full_error(workdir) from None


def _train_and_evaluate(config: ml_collections.ConfigDict,
                        workdir: str) -> TrainResult:
  run = _setup(config, workdir)
  ck = ckpt_lib.Checkpointer(
      os.path.join(workdir, "checkpoints"), save_every=config.checkpoint_every,
      keep=config.keep_checkpoints, async_save=config.async_checkpoints,
      sigterm=True, check_data=multihost.checked_position)
  train_pipe = _pipeline(config, "train", config.batch_size, train=True)
  profiler = profiling.StepProfiler(workdir, config.profile.start_step,
                                    config.profile.num_steps)
  writer = bar = None
  try:
    source = _restore(run, ck, train_pipe)
    start = int(jax.device_get(run.state.step))
    if start > int(config.num_train_steps):
      # Its evaluation would be logged as the last step's, beside the
      # records the run made there with other parameters.
      raise run_config.ConfigFlagError(
          f"config.num_train_steps={config.num_train_steps} is below step "
          f"{start}, which {ck.directory} resumes from: set it to at least "
          f"{start} (--mode=evaluate scores the checkpoints as they are), or "
          "train in another --workdir.")
    # The resolved config, and nothing the interrupted run logged after
    # ``start`` (it is logged again), before the writer opens the logs.
    workdir_lib.start_logs(config, workdir, start, is_main=run.is_main)
    writer = metrics_lib.MetricWriter(workdir, enabled=run.is_main)
    compiled, throughput = _compile(run)
    evaluators = evaluation.declared(evaluation.Context(
        config=config, workdir=workdir, model=run.model, facts=run.facts,
        mesh=run.mesh, rules=run.rules, state_shardings=run.state_sh,
        pipeline=_eval_pipelines(config),
        write_image=writer.write_image, is_main=run.is_main))
    if start == 0:
      writer.write_text("config", f"```\n{config}\n```")
    total = int(config.num_train_steps)
    bar = metrics_lib.ProgressBar(total, start, enabled=run.is_main)
    progress = _Progress(step=start, checked_until=start)
    if 0 < start < total:
      missed = _missed(run, evaluators, start)
      if missed:
        logging.warning("Evaluating step %d (%s) first: the run that saved "
                        "it stopped before evaluating it.", start,
                        ", ".join(ev.name for ev in missed))
        _evaluate(run, progress, missed, start, False, writer, bar)
    _train(run, progress, ck, train_pipe, compiled, throughput, evaluators,
           writer, bar, profiler)
    if start >= total:  # nothing left to train: evaluate what is there
      _evaluate(run, progress, evaluators, total, True, writer, bar)
  finally:
    if bar is not None:
      bar.close()
    profiler.close()
    ck.close()
    if writer is not None:
      writer.close()
  return TrainResult(workdir=workdir, step=progress.step,
                     eval_metrics=progress.eval_metrics,
                     preempted=progress.preempted, state=run.state,
                     source=source, evals=progress.evals,
                     notice=progress.preempted or ck.notice_received)
