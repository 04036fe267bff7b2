"""The run's config checked before anything is built or compiled.

``validate(config)`` walks every field: each float must be finite, and the
fields below must lie in their range. All problems are reported together,
each naming the field, its value and what it must be, in a ``ConfigError``.
Model-specific options (``model.mixer_kwargs``) are only checked for
finiteness here; the models check their own.
"""
from __future__ import annotations

import math
from typing import Any, Callable

from absl import logging
import ml_collections


class ConfigError(ValueError):
  """The config cannot run; the message lists every offending field."""


def _positive_int(v) -> bool:
  return isinstance(v, int) and not isinstance(v, bool) and v > 0


def _nonneg_int(v) -> bool:
  return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def _in(lo: float, hi: float, *, hi_open: bool = False, lo_open: bool = False
        ) -> Callable[[Any], bool]:
  def check(v):
    if isinstance(v, bool) or not isinstance(v, (int, float)):
      return False
    return ((v > lo if lo_open else v >= lo)
            and (v < hi if hi_open else v <= hi))
  return check


def _image_normalization(v) -> bool:
  from hypermixer_jax.data import config as data_config  # pylint: disable=g-import-not-at-top
  return v in data_config.IMAGE_NORMALIZATIONS


_POS = (_positive_int, "a positive integer")
_NONNEG = (_nonneg_int, "an integer >= 0")
_MESH = (lambda v: _positive_int(v) or v == -1,
         "a positive integer, or -1 (the remaining devices)")

# field -> (check, what it must be). Fields absent from a config are skipped.
RULES: dict[str, tuple[Callable[[Any], bool], str]] = {
    "num_train_steps": _POS,
    "batch_size": _POS,
    "eval_batch_size": _POS,
    "log_every": _POS,
    "grad_accum_steps": _POS,
    "eval_every": (_nonneg_int, "an integer >= 0 (0: evaluate at the end)"),
    "eval_steps": (lambda v: _positive_int(v) or v == -1,
                   "a positive integer, or -1 (the whole split)"),
    "checkpoint_every": (_nonneg_int, "an integer >= 0 (0: only at the end)"),
    "keep_checkpoints": (_nonneg_int, "an integer >= 0 (0: keep all)"),
    "warmup_steps": _NONNEG,
    "seed": (lambda v: isinstance(v, int) and not isinstance(v, bool),
             "an integer"),
    "learning_rate": (_in(0, math.inf, lo_open=True, hi_open=True),
                      "a finite number > 0"),
    "end_learning_rate_factor": (_in(0, 1), "in [0, 1]"),
    "weight_decay": (_in(0, math.inf, hi_open=True), "a finite number >= 0"),
    "b1": (_in(0, 1, hi_open=True), "in [0, 1)"),
    "b2": (_in(0, 1, hi_open=True), "in [0, 1)"),
    "eps": (_in(0, math.inf, lo_open=True, hi_open=True),
            "a finite number > 0"),
    "clip_norm": (_in(-math.inf, math.inf, lo_open=True, hi_open=True),
                  "a finite number (<= 0: no clipping)"),
    "peak_flops_per_device": (_in(0, math.inf, hi_open=True),
                              "a finite number >= 0 (0: the device kind's "
                              "peak from train.metrics.PEAK_FLOPS)"),
    "profile.start_step": (lambda v: isinstance(v, int)
                           and not isinstance(v, bool) and v >= -1,
                           "an integer >= -1 (-1: no profile)"),
    "profile.num_steps": _POS,
    "mesh.data": _MESH, "mesh.fsdp": _MESH, "mesh.tensor": _MESH,
    "mesh.expert": _MESH,
    "model.num_layers": _POS,
    "model.d_model": _POS,
    "model.d_ffn": _POS,
    "model.max_len": _POS,
    "model.vocab_size": _POS,
    "model.num_classes": _POS,
    "model.dropout_rate": (_in(0, 1, hi_open=True), "in [0, 1)"),
    "data.seq_len": _POS,
    "data.synthetic.num_examples": (_nonneg_int,
                                    "an integer >= 0 (0: endless)"),
    "data.synthetic.num_eval_examples": _POS,
    "model.mixer_kwargs.hyper_dim": _POS,
    "data.extra_ids": _NONNEG,
    "data.shuffle_buffer_size": _POS,
    "data.mlm.select_rate": (_in(0, 1, lo_open=True), "in (0, 1]"),
    "data.mlm.mask_token_rate": (_in(0, 1), "in [0, 1]"),
    "data.mlm.random_token_rate": (_in(0, 1), "in [0, 1]"),
    "data.image_size": _POS,
    "data.patch_size": _POS,
    "data.min_crop_area": (_in(0, 1, lo_open=True), "in (0, 1]"),
    "data.crop_fraction": (_in(0, 1, lo_open=True), "in (0, 1]"),
    "data.image_normalization": (_image_normalization,
                                 "'imagenet' or 'inception'"),
    "data.num_classes": _POS,
}


def _flatten(config, prefix: str = "") -> dict[str, Any]:
  out = {}
  for k, v in config.items():
    if isinstance(v, (ml_collections.ConfigDict, dict)):
      out.update(_flatten(v, f"{prefix}{k}."))
    else:
      out[f"{prefix}{k}"] = v
  return out


def _local_files(config: ml_collections.ConfigDict) -> list[str]:
  """The ``data.local_files.*`` fields that name files."""
  from hypermixer_jax.data import config as data_config  # pylint: disable=g-import-not-at-top
  data = config.get("data")
  return ([f"data.local_files.{k}" for k in data_config.local_files(data)]
          if data is not None and "local_files" in data else [])


def problems(config: ml_collections.ConfigDict) -> list[str]:
  """One line per invalid field (empty when the config is valid)."""
  flat = _flatten(config)
  out = []
  for name, value in flat.items():
    if isinstance(value, float) and not math.isfinite(value):
      if name not in RULES:
        out.append(f"{name}={value}: must be a finite number")
  for name, (check, what) in RULES.items():
    if name in flat and not check(flat[name]):
      out.append(f"{name}={flat[name]!r}: must be {what}")
  if "data.mlm.mask_token_rate" in flat:
    total = (flat["data.mlm.mask_token_rate"]
             + flat.get("data.mlm.random_token_rate", 0.0))
    if isinstance(total, float) and total > 1:
      out.append(f"data.mlm.mask_token_rate + data.mlm.random_token_rate = "
                 f"{total}: must be <= 1")
  accum, steps = flat.get("grad_accum_steps", 1), flat.get("num_train_steps")
  if (isinstance(accum, int) and accum > 1 and isinstance(steps, int)
      and steps % accum):
    out.append(f"num_train_steps={steps}: must be a multiple of "
               f"grad_accum_steps={accum} (it counts micro-batches; the "
               f"last {steps % accum} would never be applied), e.g. "
               f"{steps // accum * accum or accum}")
  family = flat.get("model.family")
  for name, spec in (config.get("evals") or {}).items():
    if (spec or {}).get("type") == "pseudo_attention" and (
        family != "continuous"):
      # Its Jacobian needs real-valued inputs; token ids are integers.
      out.append(f"evals.{name}: a pseudo_attention map needs a model of "
                 f"continuous inputs (the synthetic task), not "
                 f"model.family={family!r}; use a config without it")
  local = _local_files(config)
  for field in ("data.tfds_train_split", "data.tfds_validation_split"):
    if local and flat.get(field):
      out.append(f"{field}={flat[field]!r} selects part of a TFDS split, but "
                 f"{local[0]} is set: local files are read whole, for every "
                 f"split; drop {field}, or cut the file itself")
  if "decay" in flat:
    from hypermixer_jax.train import optim  # pylint: disable=g-import-not-at-top
    if flat["decay"] not in optim.DECAYS:
      out.append(f"decay={flat['decay']!r}: must be one of {optim.DECAYS}")
  return out


def doubts(config: ml_collections.ConfigDict) -> list[str]:
  """Valid settings that probably do not do what was meant (warned)."""
  flat = _flatten(config)
  steps = flat.get("num_train_steps")
  out = []
  if not isinstance(steps, int):
    return out
  warmup = flat.get("warmup_steps")
  accum = flat.get("grad_accum_steps", 1)
  updates = steps // accum if isinstance(accum, int) and accum > 0 else steps
  if isinstance(warmup, int) and warmup > updates and "learning_rate" in flat:
    from hypermixer_jax.train import optim  # pylint: disable=g-import-not-at-top
    top = float(optim.make_schedule(config)(max(updates - 1, 0)))
    out.append(f"warmup_steps={warmup} > the run's {updates} optimiser "
               f"updates: the learning rate only reaches {top:.3g}, not "
               f"learning_rate={flat['learning_rate']:g}. Set "
               f"--config.warmup_steps={max(updates // 10, 1)} (or fewer).")
  local = _local_files(config)
  if local and flat.get("data.data_dir"):
    out.append(f"data.data_dir={flat['data.data_dir']!r} is not read: "
               f"{local[0]} is set, and local files serve every split. Drop "
               "one of the two.")
  log_every = flat.get("log_every")
  if isinstance(log_every, int) and log_every > steps:
    out.append(f"log_every={log_every} > num_train_steps={steps}: the only "
               f"train log line comes at the end. Set --config.log_every="
               f"{max(steps // 10, 1)} to see progress.")
  return out


def check_model(model: ml_collections.ConfigDict) -> None:
  """The model builds from its config (the Linen module only, no
  parameters), or a ``ConfigError`` of one line: an unknown mixer, block or
  head, a mixer option the mixer does not take, a head it cannot serve."""
  from hypermixer_jax import models  # pylint: disable=g-import-not-at-top
  from hypermixer_jax.models import registry  # pylint: disable=g-import-not-at-top
  mixer, given = model.get("mixer"), dict(model.get("mixer_kwargs") or {})
  found = registry.options(mixer)
  if found is not None and given:
    cls, valid = found
    foreign = sorted(set(given) - set(valid))
    if foreign:
      raise ConfigError(
          f"model.mixer={mixer!r} ({cls.__name__}) does not take "
          f"model.mixer_kwargs {', '.join(foreign)}, which the config sets "
          "for its own mixer; choose the mixer by the config file's "
          f"argument (e.g. --config=configs/default.py:{mixer}, "
          f"configs/glue.py:sst2,{mixer}) or a config that sets "
          "mixer_kwargs for it (valid: "
          f"{', '.join(valid)}).")
  try:
    models.build_model(model)
  except ValueError as e:
    raise ConfigError(f"model: {' '.join(str(e).split())}") from None


def validate(config: ml_collections.ConfigDict) -> None:
  """Raises ``ConfigError`` listing every invalid field (before compiling);
  logs a warning for each of ``doubts``."""
  found = problems(config)
  if found:
    raise ConfigError(
        "Invalid config (fix with --config.<field>=...):\n  "
        + "\n  ".join(found))
  for doubt in doubts(config):
    logging.warning("%s", doubt)
