"""The training loop: ``train_and_evaluate(config, workdir)``.

One run: build the mesh and the model, initialise the sharded train state,
pick the starting point in an explicit, logged order

  1. the newest checkpoint in ``workdir/checkpoints`` (a restarted job
     resumes, input pipeline position included);
  2. else ``config.init_checkpoint`` (fine-tuning: the parameters not
     matching ``config.init_reinit`` are loaded, the rest initialised);
  3. else scratch;

then train, logging to TensorBoard / ``metrics.jsonl`` / the console, with
asynchronous checkpoints every ``checkpoint_every`` steps, a save when the
job is preempted, evaluations every ``eval_every`` steps, and a stop with a
clear error on a NaN or Inf loss (checked before every save, so a
non-finite state never becomes a checkpoint).

With ``config.compare_controls`` the synthetic-task controls
(``config.controls``: mixer name -> mixer_kwargs) are trained the same way in
``workdir/controls/<mixer>`` and a table of evaluation MSEs is printed.
"""
from __future__ import annotations

import dataclasses
import itertools
import json
import os
import signal
from typing import Any

from absl import logging
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from hypermixer_jax import data as data_lib
from hypermixer_jax import models
from hypermixer_jax import sharding
from hypermixer_jax.train import checkpoint as ckpt_lib
from hypermixer_jax.train import evaluation
from hypermixer_jax.train import metrics as metrics_lib
from hypermixer_jax.train import multihost
from hypermixer_jax.train import optim
from hypermixer_jax.train import pseudo_attention as pa_lib
from hypermixer_jax.train import steps


@dataclasses.dataclass
class RunResult:
  """What one training run ends with."""
  name: str
  workdir: str
  step: int
  eval_metrics: dict[str, float]
  source: str                      # 'workdir', 'init_checkpoint', 'scratch'
  preempted: bool = False
  pseudo_attention: np.ndarray | None = None
  example: dict[str, np.ndarray] | None = None


def train_and_evaluate(config: ml_collections.ConfigDict,
                       workdir: str) -> dict[str, RunResult]:
  """Trains ``config``'s model in ``workdir`` (and the controls if asked).

  Returns ``{model name: RunResult}``, the main model first.
  """
  results = {config.model.mixer: _train(config, workdir,
                                        config.model.mixer)}
  if config.compare_controls and not results[config.model.mixer].preempted:
    for name, kwargs in config.controls.items():
      control = _control_config(config, name, kwargs)
      results[name] = _train(control, os.path.join(workdir, "controls", name),
                             name)
      if results[name].preempted:
        break
    _report_controls(results, config, workdir)
  return results


def _control_config(config, mixer: str, mixer_kwargs) -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict(config.to_dict())
  c.model.mixer = mixer
  c.model.mixer_kwargs = ml_collections.ConfigDict(
      mixer_kwargs.to_dict() if hasattr(mixer_kwargs, "to_dict")
      else dict(mixer_kwargs))
  c.compare_controls = False
  c.init_checkpoint = ""
  c.debug.kill_at_step = -1
  return c


def _report_controls(results: dict[str, RunResult], config, workdir: str):
  key = "mse" if config.model.head == "regression" else "loss"
  lines = [f"Evaluation {key} on {config.data.task} "
           f"({config.eval_split}, step {config.num_train_steps}):",
           f"  {'model':<12} {key:>10}"]
  for name, r in results.items():
    lines.append(f"  {name:<12} {r.eval_metrics.get(key, float('nan')):>10.5f}")
  table = "\n".join(lines)
  if jax.process_index() == 0:
    print(table, flush=True)
    with open(os.path.join(workdir, "results.json"), "w",
              encoding="utf-8") as f:
      json.dump({n: r.eval_metrics for n, r in results.items()}, f, indent=1)
    maps = {n: r.pseudo_attention for n, r in results.items()
            if r.pseudo_attention is not None}
    if maps:
      ex = next(iter(results.values())).example
      pa_lib.save_png(maps, os.path.join(workdir, "pseudo_attention_all.png"),
                      inputs=ex["inputs"], targets=ex["targets"])
  logging.info("%s", table)


# ---------------------------------------------------------------------------
# One run.
# ---------------------------------------------------------------------------
# Mixers that give each packed example its own hidden layer (one "slot" per
# segment, ``mixer_kwargs.max_segments`` of them) when not causal.
SLOT_MIXERS = ("hypermixer", "mlp_mixer")


def check_model_fits_data(model, config: ml_collections.ConfigDict) -> None:
  """Rejects model/data combinations that would train on the wrong signal."""
  mixer_kwargs = config.model.get("mixer_kwargs") or {}
  if (config.data.get("packing", False)
      and config.model.get("mixer") in SLOT_MIXERS
      and config.model.get("head") != "causal_lm"
      and mixer_kwargs.get("max_segments", 1) < 2):
    raise ValueError(
        f"model.mixer={config.model.mixer!r} mixes a packed row through one "
        "hidden layer per example, up to mixer_kwargs.max_segments (now 1), "
        "and a row with more examples would give NaN; set "
        "--config.data.packing=False, or "
        "--config.model.mixer_kwargs.max_segments=K with K at least the "
        "examples per row (compute grows with K).")
  if getattr(model, "loss_start", 0) and config.data.get("packing", False):
    raise ValueError(
        "model.mixer_kwargs.smoe_routing='partial' routes each row by its "
        "first 20% of tokens, which packed rows (several examples) do not "
        "have; set --config.data.packing=False or use "
        "--config.model.mixer_kwargs.smoe_routing=deterministic.")


def _pipeline(config, split: str, batch_size: int, *, train: bool):
  pcount = jax.process_count()
  if batch_size % pcount:
    raise ValueError(f"batch size {batch_size} must be divisible by the "
                     f"{pcount} processes")
  return data_lib.build_pipeline(
      config.data, split, batch_size=batch_size // pcount,
      shard_index=jax.process_index(), num_shards=pcount, seed=config.seed,
      repeat=train, shuffle=train)


def _global_spec(local: dict, shardings=None) -> dict:
  """Global ``ShapeDtypeStruct``s of a host-local batch."""
  pcount = jax.process_count()
  out = {k: jax.ShapeDtypeStruct((v.shape[0] * pcount,) + v.shape[1:],
                                 v.dtype) for k, v in local.items()}
  if shardings is not None:
    out = jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype,
                                                          sharding=sh),
                       out, shardings)
  return out


def _poison(batch: dict) -> dict:
  """NaN in every float array of the batch (the ``nan_at_step`` test hook)."""
  return {k: (np.full_like(v, np.nan) if np.issubdtype(v.dtype, np.floating)
              else v) for k, v in batch.items()}


class _NonFinite(FloatingPointError):
  pass


def _train(config: ml_collections.ConfigDict, workdir: str,
           name: str) -> RunResult:
  is_main = jax.process_index() == 0
  os.makedirs(workdir, exist_ok=True)
  mesh = sharding.build_mesh(config.mesh)
  rules = sharding.get_rules(config.sharding)
  logging.info("[%s] mesh %s on %d devices (%d processes), rules %r", name,
               dict(mesh.shape), mesh.size, jax.process_count(),
               config.sharding.rules)
  model = models.build_model(config.model)
  check_model_fits_data(model, config)
  head = config.model.head
  tx, schedule = optim.make_optimizer(config)
  accum = int(config.grad_accum_steps)

  rng = jax.random.key(config.seed)
  init_rng = jax.random.fold_in(rng, 0)
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
  spec = _global_spec(sample)
  batch_sh = sharding.batch_shardings(spec, mesh, rules)
  state, state_sh = steps.create_train_state(model, tx, init_rng, spec, mesh,
                                             rules)
  n_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(state.params))
  logging.info("[%s] model %s/%s/%s: %.3fM parameters", name,
               config.model.mixer, config.model.block, head, n_params / 1e6)

  # --- Where to start from: own workdir, then init checkpoint, then scratch.
  ck = ckpt_lib.Checkpointer(
      os.path.join(workdir, "checkpoints"), save_every=config.checkpoint_every,
      keep=config.keep_checkpoints, async_save=config.async_checkpoints)
  train_pipe = _pipeline(config, "train", config.batch_size, train=True)
  latest = ck.latest_step()
  if latest is not None:
    state, data_state = ck.restore(latest,
                                   ckpt_lib.abstract_like(state, state_sh))
    data_state = multihost.own_data_state(data_state)
    if data_state is not None:
      train_pipe.set_state(data_state)
    source = "workdir"
    logging.info("[%s] Start: resuming from own checkpoint %s step %d "
                 "(sources in order: workdir > init_checkpoint > scratch).",
                 name, ck.directory, latest)
  elif config.init_checkpoint:
    reinit = [r for r in config.init_reinit.split(",") if r]
    params = ckpt_lib.load_pretrained(config.init_checkpoint, state.params,
                                      reinit)
    state = state.replace(params=params)
    source = "init_checkpoint"
    logging.info("[%s] Start: parameters from init_checkpoint %s, "
                 "re-initialised %s (no checkpoint in %s).", name,
                 config.init_checkpoint, reinit, ck.directory)
  else:
    source = "scratch"
    logging.info("[%s] Start: from scratch (no checkpoint in %s, no "
                 "init_checkpoint).", name, ck.directory)
  start_step = int(jax.device_get(state.step))

  train_step = steps.jit_train_step(steps.make_train_step(model, head),
                                    state_sh, batch_sh, mesh, rules)
  rng_spec = jax.ShapeDtypeStruct(train_rng.shape, train_rng.dtype,
                                  sharding=jax.NamedSharding(mesh, jax.P()))
  compiled = train_step.lower(
      ckpt_lib.abstract_like(state, state_sh), _global_spec(sample, batch_sh),
      rng_spec).compile()
  flops = metrics_lib.step_flops(compiled)
  seq = sample["inputs"].shape[1] if sample["inputs"].ndim > 1 else 1
  throughput = metrics_lib.Throughput(
      config.batch_size, config.batch_size * seq, flops,
      config.peak_flops_per_device)
  eval_step = None

  writer = metrics_lib.MetricWriter(workdir, enabled=is_main)
  if start_step == 0:
    writer.write_text("config", f"```\n{config}\n```")
  bar = metrics_lib.ProgressBar(config.num_train_steps, start_step,
                                enabled=is_main)
  total = int(config.num_train_steps)
  all_finite = jnp.array(True)
  checked_until = start_step
  eval_metrics: dict[str, float] = {}
  preempted = False

  def check_finite(step):
    nonlocal checked_until
    if not bool(jax.device_get(all_finite)):
      ck.wait_until_finished()
      raise _NonFinite(
          f"[{name}] loss or gradient became NaN/Inf between steps "
          f"{checked_until + 1} and {step}; stopping. Not saved; the latest "
          f"checkpoint is step {ck.latest_step()} in {ck.directory}. Lower "
          "the learning rate, enable clipping or check the data.")
    checked_until = step

  def run_eval(step):
    nonlocal eval_step
    batches = _pipeline(config, config.eval_split, config.eval_batch_size,
                        train=False)
    if eval_step is None:
      # The pipeline continues from where it stands: its first batch, taken
      # here for the shapes, must go back in front.
      it = iter(batches)
      first = next(it)
      batches = itertools.chain([first], it)
      eval_sh = sharding.batch_shardings(_global_spec(first), mesh, rules)
      eval_step = steps.jit_eval_step(
          evaluation.make_eval_step(model, head, config.model.num_classes),
          state_sh, eval_sh, mesh, rules)
    result = evaluation.evaluate(eval_step, state, batches, mesh, rules, head,
                                 config.eval_steps)
    writer.write_scalars(step, result, split="eval")
    bar.write(f"[{name}] step {step} eval: " + ", ".join(
        f"{k}={v:.5g}" for k, v in result.items()))
    return result

  throughput.start(start_step)
  it = iter(train_pipe)
  step = start_step
  try:
    for step in range(start_step + 1, total + 1):
      local = next(it)
      if step == config.debug.nan_at_step:
        local = _poison(local)
      batch = sharding.make_global_batch(local, mesh, rules)
      state, m = compiled(state, batch, train_rng)
      all_finite = jnp.logical_and(all_finite, m["is_finite"])

      if step % config.log_every == 0 or step == total:
        m = jax.device_get(m)
        check_finite(step)
        scalars = {k: v for k, v in m.items() if k != "is_finite"}
        scalars["learning_rate"] = schedule(max(step // accum - 1, 0))
        scalars.update(throughput.update(step))
        writer.write_scalars(step, scalars)
        bar.update(step, scalars)
      preempted = ck.reached_preemption(step)
      if preempted or ck.should_save(step) or step == total:
        check_finite(step)
        ck.save(step, state,
                multihost.gather_data_states(train_pipe.get_state()),
                force=True)
        if preempted:
          logging.warning("[%s] preemption at step %d: checkpoint saved, "
                          "stopping.", name, step)
          break
      if (config.eval_every and step % config.eval_every == 0) or \
          step == total:
        eval_metrics = run_eval(step)
      if step == config.debug.kill_at_step:
        # Test hook: die like a preempted VM (no cleanup), after the pending
        # checkpoint is on disk so that the resume point is known.
        ck.wait_until_finished()
        writer.flush()
        os.kill(os.getpid(), signal.SIGKILL)
    if start_step >= total and not eval_metrics:
      eval_metrics = run_eval(total)
  finally:
    bar.close()
    ck.close()
    writer.flush()

  result = RunResult(name=name, workdir=workdir, step=step,
                     eval_metrics=eval_metrics, source=source,
                     preempted=preempted)
  if (config.pseudo_attention and config.model.family == "continuous"
      and not preempted):
    _pseudo_attention(config, model, state, result, writer)
  writer.close()
  return result


def _pseudo_attention(config, model, state, result: RunResult, writer):
  """Map of the first validation example, saved as PNG and to TensorBoard."""
  example = next(iter(_pipeline(config, config.eval_split, 1, train=False)))
  params = jax.device_get(state.params)
  x = jnp.asarray(example["inputs"][0])
  apply = jax.jit(lambda x: model.apply({"params": params}, x[None])[0])
  pam = np.asarray(pa_lib.pseudo_attention(apply, x))
  result.pseudo_attention = pam
  result.example = {k: np.asarray(example[k][0, :, 0])
                    for k in ("inputs", "targets")}
  if jax.process_index() == 0:
    path = os.path.join(result.workdir, "pseudo_attention.png")
    pa_lib.save_png({result.name: pam}, path, **result.example)
    import matplotlib.image  # pylint: disable=g-import-not-at-top
    writer.write_image("pseudo_attention", result.step,
                       matplotlib.image.imread(path)[..., :3])
    logging.info("[%s] pseudo-attention map written to %s", result.name, path)
