"""One training run of an experiment and the data it saw: the library's
``train_and_evaluate`` wrapped to return what a record keeps, the arrays of
the pipeline (for the trivial baselines) and a config field matched to a
target (parameters, FLOPs)."""
from __future__ import annotations

import itertools
import math
import os
from typing import Any, Callable


def match_field(config, field: str, measure: Callable[[Any], float],
                target: float, *, lo: int, hi: int, multiple: int = 16):
  """``config`` (a ``ConfigDict``) with ``field`` set to the multiple of
  ``multiple`` (at least ``multiple``) whose ``measure(config)`` is nearest
  ``target``: e.g. the FFN width that gives a model another's parameters or
  FLOPs. ``measure`` must be affine in the field: its values at ``lo`` and
  ``hi`` give the line."""
  import ml_collections  # pylint: disable=g-import-not-at-top

  def at(value):
    c = ml_collections.ConfigDict(config.to_dict())
    c[field] = int(value)
    return c
  m_lo, m_hi = measure(at(lo)), measure(at(hi))
  slope = (m_hi - m_lo) / (hi - lo)
  best = lo + (target - m_lo) / slope
  candidates = sorted({max(multiple, multiple * math.floor(best / multiple)),
                       max(multiple, multiple * math.ceil(best / multiple))})
  return at(min(candidates,
                key=lambda v: abs(m_lo + slope * (v - lo) - target)))


def pipeline_arrays(data_config, split: str, batch_size: int = 1024, *,
                    seed: int = 0, batches: int = -1) -> dict[str, Any]:
  """One unshuffled epoch of ``split`` as NumPy arrays (the batches the
  library's pipeline hands a model, concatenated): the tokens and positions
  the trivial baselines are fitted and scored on. ``batches``: only the
  first that many batches (-1: all); ``seed``: the pipeline's (e.g. MLM
  masks)."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  from hypermixer_jax import data  # pylint: disable=g-import-not-at-top
  pipeline = data.build_pipeline(data_config, split, batch_size=batch_size,
                                 seed=seed, repeat=False, shuffle=False)
  out = list(itertools.islice(pipeline, batches if batches >= 0 else None))
  return {k: np.concatenate([b[k] for b in out]) for k in out[0]}


def held_out_arrays(config) -> dict[str, Any]:
  """The held-out batches a run of the training ``config`` is evaluated on
  (what the training loop evaluates: ``eval_steps`` batches of its
  ``eval_split``), concatenated."""
  return pipeline_arrays(config.data, config.eval_split,
                         config.eval_batch_size, seed=config.seed,
                         batches=config.eval_steps)


# The workdir of a run after whose last step a preemption notice came
# (``train``): the process starts no other run.
_NOTICE: list[str] = []

# What a record keeps of each logged training interval.
THROUGHPUT = ("steps_per_sec", "tokens_per_sec", "tflops_per_device")


def train(config, workdir: str, *, with_params: bool = False
          ) -> dict[str, Any]:
  """Trains ``config`` in ``workdir`` and returns what an experiment records.

  ``{'eval': final evaluation metrics, 'step': last step, 'source': where
  the run started from ('scratch', 'init_checkpoint' or 'workdir': resumed),
  'eval_curve': {step: metrics}, 'train_curve': {step: throughput},
  'weight_decay_mask': the optimiser's decay rule (optim.DECAY_MASK_RULE)}``;
  curves come from the run's ``metrics.jsonl``, of which the training
  intervals keep only their throughput (``THROUGHPUT``: what tables read; the
  losses stay in the workdir). A workdir that already holds checkpoints resumes
  when they were trained with ``config`` (``set_aside_other_run``).
  With ``with_params`` the result also holds ``'params'``, the trained
  parameters (``trained_params``): use them, then drop them before the result
  is recorded (they are not JSON).
  """
  from hypermixer_jax.train import loop  # pylint: disable=g-import-not-at-top
  from hypermixer_jax.train import metrics  # pylint: disable=g-import-not-at-top
  from hypermixer_jax.train import optim  # pylint: disable=g-import-not-at-top
  if _NOTICE:
    raise SystemExit(
        f"a preemption notice (SIGTERM) came after the last step of "
        f"{_NOTICE[0]}, which is recorded; stopping before {workdir}: run "
        "the same command again to go on.")
  set_aside_other_run(config, workdir)
  result = loop.train_and_evaluate(config, workdir)
  if getattr(result, "preempted", False):
    # A run stopped by a preemption notice (SIGTERM) is not a result: the
    # experiment stops before recording it, and its command resumes it.
    raise SystemExit(f"{workdir}: preempted at step {result.step} (its "
                     "checkpoint is saved); run the same command again to "
                     "resume.")
  if getattr(result, "notice", False):
    # The notice came after the last step: the run is whole and is
    # recorded; the next run of this process stops instead of starting.
    _NOTICE.append(workdir)
  curves = {split: {int(s): r for s, r in
                    metrics.read_metrics(workdir, split).items()}
            for split in ("train", "eval")}
  train_curve = {s: {k: v for k, v in r.items() if k in THROUGHPUT}
                 for s, r in curves["train"].items()}
  out = {"eval": dict(result.eval_metrics), "step": int(result.step),
         "source": result.source, "eval_curve": curves["eval"],
         "train_curve": {s: r for s, r in train_curve.items() if r},
         "weight_decay_mask": optim.DECAY_MASK_RULE}
  if with_params:
    out["params"] = trained_params(config, workdir, result)
  return out


def decay_rules_differ(model_configs) -> bool:
  """Whether the weight-decay rule of runs recorded without
  ``weight_decay_mask`` (every leaf of rank > 1 decays) decays other leaves
  than the current rule (``optim.weight_decay_mask``) in one of the models
  of ``model_configs``: then such records did not train what the cell now
  trains."""
  import jax  # pylint: disable=g-import-not-at-top
  from flax import linen as nn  # pylint: disable=g-import-not-at-top
  from hypermixer_jax.models import zoo  # pylint: disable=g-import-not-at-top
  from hypermixer_jax.train import optim  # pylint: disable=g-import-not-at-top
  for model_config in model_configs:
    boxed = zoo.abstract_variables(model_config)["params"]
    old = [len(x.shape) > 1 for x in jax.tree.leaves(nn.unbox(boxed))]
    if jax.tree.leaves(optim.weight_decay_mask(boxed)) != old:
      return True
  return False


def retire_other_decay_rule(exp, keys, model_configs) -> list[str]:
  """Retires (``exp.supersede``) each of ``keys`` recorded without
  ``weight_decay_mask`` where ``decay_rules_differ(model_configs)``, so that
  the cell trains again under the current rule instead of mixing runs of
  two rules in one comparison. Returns the keys retired."""
  old = [k for k in keys if k in exp.runs
         and "weight_decay_mask" not in exp.runs[k]]
  if not old or exp.report_only or not decay_rules_differ(model_configs):
    return []
  for key in old:
    exp.supersede(key, OTHER_DECAY_RULE)
  return old


# Why ``retire_other_decay_rule`` retired a record (``superseded_because``).
OTHER_DECAY_RULE = ("trained under the earlier weight-decay rule (every leaf "
                    "of rank > 1), which decays other leaves of this model")


def decay_rule_pairs(data: dict, field: str) -> list[tuple[str, float, float]]:
  """``(key, retired, current)`` values of ``eval[field]`` for each record
  ``retire_other_decay_rule`` retired whose cell has run again: what the
  rule changed, the setting and seed being the same."""
  out = []
  for name, old in data.get("superseded", {}).items():
    new = data.get("runs", {}).get(name.split("#")[0], {})
    if (old.get("superseded_because") == OTHER_DECAY_RULE
        and field in old.get("eval", {}) and field in new.get("eval", {})):
      out.append((name, old["eval"][field], new["eval"][field]))
  return out


# Fields a cell's run may change between its starts without changing what
# it trains (prefixes of the flattened config).
BOOKKEEPING = ("checkpoint_every", "keep_checkpoints", "async_checkpoints",
               "log_every", "profile.", "debug.")


def _same_files(a: Any, b: Any) -> bool:
  """Whether two config values name files of equal content (one path, or
  a comma-separated list): the same data reached by another path."""
  from hypermixer_jax.experiment.digests import file_digest  # pylint: disable=g-import-not-at-top
  if not (isinstance(a, str) and isinstance(b, str)):
    return False
  paths = [p.split(",") for p in (a, b)]
  return (len(paths[0]) == len(paths[1])
          and all(os.path.isfile(p) for p in paths[0] + paths[1])
          and all(file_digest(x) == file_digest(y)
                  for x, y in zip(*paths)))


def set_aside_other_run(config, workdir: str) -> str | None:
  """Moves ``workdir`` aside (to ``<workdir>.other-config-<UTC time>``)
  when its checkpoints were trained with another config than ``config``
  (any saved copy, ``configs/*.json``, differing outside ``BOOKKEEPING``,
  files of equal content by another path aside):
  a cell whose setting moved while its run was cut short (a choice that
  changed, a grid extended) would otherwise resume the old setting's run
  and record it as the new one. Returns where it went, or None."""
  import datetime  # pylint: disable=g-import-not-at-top
  import json  # pylint: disable=g-import-not-at-top
  from hypermixer_jax.train import run_config  # pylint: disable=g-import-not-at-top
  if not run_config.has_checkpoint(workdir):
    return None
  ours = json.loads(config.to_json_best_effort(sort_keys=True))
  for copy in run_config.run_copies(workdir):
    diff = {k: v for k, v in run_config.differences(
        json.loads(copy.read_text()), ours).items()
            if not k.startswith(BOOKKEEPING) and not _same_files(*v)
            and "-" not in v}   # (a field the older code did not have)
    if diff:
      break
  else:
    return None
  stamp = datetime.datetime.now(datetime.timezone.utc).strftime(
      "%Y%m%dT%H%M%SZ")
  dest = f"{os.fspath(workdir).rstrip('/')}.other-config-{stamp}"
  from etils import epath  # pylint: disable=g-import-not-at-top
  epath.Path(workdir).rename(dest)
  shown = "; ".join(f"{k}: {a!r} -> {b!r}" for k, (a, b) in
                    list(diff.items())[:4])
  print(f"{workdir}: its checkpoints were trained with another config "
        f"({shown}{'; ...' if len(diff) > 4 else ''}); moved to {dest}, "
        "training this config from scratch.", flush=True)
  return dest


def trained_params(config, workdir: str, result: Any = None):
  """The parameters a run in ``workdir`` ended with.

  ``result.state.params`` when the training loop's result carries its final
  state; otherwise they are read from the checkpoint of the final step
  (``config.num_train_steps``) in ``workdir`` into the freshly initialised
  model of ``config.model``: that step or an error, never an older step in
  its place.
  """
  state = getattr(result, "state", None)
  if state is not None:
    return state.params
  import flax.linen as nn  # pylint: disable=g-import-not-at-top
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from etils import epath  # pylint: disable=g-import-not-at-top
  from hypermixer_jax.models import zoo  # pylint: disable=g-import-not-at-top
  from hypermixer_jax.train import checkpoint  # pylint: disable=g-import-not-at-top
  x = zoo.dummy_inputs(config.model)
  params = zoo.build_model(config.model).init(
      jax.random.key(0), jnp.zeros(x.shape, x.dtype))["params"]
  final = epath.Path(workdir) / "checkpoints" / str(config.num_train_steps)
  if not final.exists():
    raise FileNotFoundError(
        f"{workdir} has no checkpoint of its final step "
        f"{config.num_train_steps}: the run has not finished (run it again "
        "to resume it).")
  return checkpoint.load_pretrained(final, nn.unbox(params), reinit=())


def flops_per_step(run: dict[str, Any]) -> float:
  """XLA's per-device FLOPs of one train step of a recorded run (the whole
  step, on one device), from its logged throughput: ``tflops_per_device /
  steps_per_sec`` of the last logged interval, the loop's count of the
  compiled step, so it does not depend on the machine's load. NaN when the
  run logged none. A record without its curve (``selection.lean``) keeps
  the figure as ``flops_per_step``."""
  if "flops_per_step" in run:
    return float(run["flops_per_step"])
  train = run.get("train_curve", {})
  logs = [train[s] for s in sorted(train, key=int)
          if "tflops_per_device" in train[s]]
  if not logs:
    return float("nan")
  return logs[-1]["tflops_per_device"] * 1e12 / logs[-1]["steps_per_sec"]
