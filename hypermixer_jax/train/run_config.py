"""A run's own config: what ``--mode=evaluate|predict|export`` and a resumed
run start from, and the command line's config errors in one line.

Every training run writes its resolved config to ``WORKDIR/config.json``
(``workdir.save_config``); an exported folder holds one too, beside a copy of
the SentencePiece vocabulary (``vocab/``) and ``vocabulary.json`` (the
original path and the file's SHA-256). As in t5x and big_vision, a later
command on that folder starts from the saved config: ``--config=FILE`` is
optional there, ``--config.field=value`` overrides go on top and each
difference is logged. An override that changes the parameters' shapes, or
the vocabulary (which gives the embedding rows their meaning), is refused
naming the fields: the checkpoint could not be read into it.

A saved config may also be partial: a converted official checkpoint records
only its model and its image normalisation (``models.official_mixer``);
``--config=FILE`` then gives the rest.
"""
from __future__ import annotations

import copy
import difflib
import hashlib
import json
import os
import re
from typing import Any, Collection, Mapping, Sequence

from absl import logging
from etils import epath
import ml_collections
from ml_collections import config_dict

from hypermixer_jax.train import config_checks
from hypermixer_jax.train import storage

CONFIG_FILE = "config.json"
VOCAB_RECORD = "vocabulary.json"
VOCAB_DIR = "vocab"
# Model families that read token ids (the others have no vocabulary).
TOKEN_FAMILIES = ("text", "smlp")
# Fields that give the token ids their meaning (no shape depends on them).
VOCAB_FIELDS = ("data.vocab_path", "data.extra_ids")
# Subtrees a saved config does not pass on: the test hooks of the command
# that set them (a resumed run must not be killed again at the same step).
PER_COMMAND = ("debug",)
# Subtrees replaced whole by a saved config of another ``family`` (their
# fields depend on it); the rest, and these within one family, merged field
# by field.
BY_FAMILY = ("model",)


class ConfigFlagError(config_checks.ConfigError):
  """A bad ``--config`` / ``--config.field`` flag, or a saved config that
  cannot serve; the message is one line."""


# ---------------------------------------------------------------------------
# Saved configs.
# ---------------------------------------------------------------------------
def find(workdir: str | os.PathLike) -> epath.Path | None:
  """The saved config of a workdir, its checkpoints folder, a step folder or
  an exported folder; None when there is none."""
  path = epath.Path(workdir)
  candidates = [path]
  if path.name == "checkpoints" or path.name.isdigit():
    candidates.append(path.parent)
    if path.name.isdigit() and path.parent.name == "checkpoints":
      candidates.append(path.parent.parent)
  for folder in candidates:
    if (folder / CONFIG_FILE).exists():
      return folder / CONFIG_FILE
  return None


def checkpoint_steps(workdir: str | os.PathLike) -> list[int]:
  """The step folders of ``workdir/checkpoints``, oldest first."""
  folder = epath.Path(workdir) / "checkpoints"
  return sorted(int(p.name) for p in folder.iterdir()
                if p.name.isdigit()) if folder.is_dir() else []


def has_checkpoint(workdir: str | os.PathLike) -> bool:
  """Whether ``workdir/checkpoints`` holds a step folder (a run to resume)."""
  return bool(checkpoint_steps(workdir))


def run_copies(workdir: str | os.PathLike) -> list[epath.Path]:
  """The per-run copies of a workdir's config (``configs/<UTC
  time>-step<N>.json``, written by ``workdir.save_config``) that read as
  configs, newest first."""
  folder = epath.Path(workdir) / "configs"
  out = []
  for p in sorted(folder.glob("*.json"), reverse=True) if folder.is_dir() \
      else []:
    try:
      if isinstance(json.loads(p.read_text()), dict):
        out.append(p)
    except ValueError:
      continue
  return out


def _restore_hint(workdir: epath.Path) -> str:
  """What to do about a workdir's missing or unreadable config.json."""
  steps = checkpoint_steps(workdir)
  held = (f"the checkpoints (steps {', '.join(map(str, steps))}) are not "
          "affected" if steps else "no checkpoint is affected")
  copies = run_copies(workdir)
  if copies:
    return (f"{held}. Restore it from the copy its last run saved: cp "
            f"{copies[0]} {workdir / CONFIG_FILE}")
  return (f"{held}. Write it again with the run's fields, or pass "
          "--config=FILE with them (the saved config of a run that had one "
          "wins over --config, so move the broken file away first).")


def check_present(workdir: str | os.PathLike) -> None:
  """Refuses a workdir whose checkpoints have lost their ``config.json``
  (the command line would otherwise read it as a fresh run's)."""
  workdir = epath.Path(workdir)
  if has_checkpoint(workdir) and find(workdir) is None:
    raise ConfigFlagError(
        f"{workdir / CONFIG_FILE} is missing: {_restore_hint(workdir)}")


def check_fits_checkpoints(config: ml_collections.ConfigDict | Mapping,
                           workdir: str | os.PathLike) -> None:
  """Refuses ``config`` when it gives the parameters other shapes or dtypes
  (or another vocabulary, or another optimizer state layout) than the run
  that saved ``workdir``'s checkpoints had, naming the fields; an edited
  ``config.json`` must not make intact checkpoints look damaged.

  The reference is the newest per-run copy (``run_copies``): the config of
  the run that wrote the newest steps. Nothing is checked without one.
  """
  workdir = epath.Path(workdir)
  copies = run_copies(workdir) if has_checkpoint(workdir) else []
  if not copies:
    return
  saved = load(copies[0])
  fields = shape_fields(saved, config)
  if not fields:
    return
  ours, theirs = flatten(_plain(config)), flatten(saved)
  changes = ", ".join(f"{k}: {_show(theirs.get(k, '-'))} -> "
                      f"{_show(ours.get(k, '-'))}" for k in fields)
  raise ConfigFlagError(
      f"this config changes the shapes, dtypes or vocabulary of the "
      f"parameters, or the optimizer state's layout or accumulation, that "
      f"{workdir / 'checkpoints'} holds ({changes}; the checkpoints "
      f"were saved with {copies[0]}, and they are intact). Put those fields "
      f"back (cp {copies[0]} {workdir / CONFIG_FILE} if config.json was "
      "edited), or train the new shapes in another --workdir.")


def check_accumulator(config, workdir: str | os.PathLike) -> None:
  """Refuses to resume training with gradient accumulation from a step saved
  with ``optax.MultiSteps``' state (earlier versions: a plain mean of the
  micro-batches' gradients), which ``optim.weighted_accumulation``'s state
  does not restore from. (Evaluation, prediction and export read the
  parameters alone: not checked there.)"""
  workdir = epath.Path(workdir)
  if (max(int(_plain(config).get("grad_accum_steps") or 1), 1) == 1
      or not has_checkpoint(workdir)):
    return
  step = checkpoint_steps(workdir)[-1]
  meta = workdir / "checkpoints" / str(step) / "state" / "_METADATA"
  if meta.exists() and re.search(r"""['"]gradient_step['"]""",
                                 meta.read_text()):
    raise ConfigFlagError(
        f"{meta.parent.parent} holds optax.MultiSteps' accumulator (saved by "
        "an earlier version, whose grad_accum_steps took a plain mean of the "
        "micro-batches' gradients); this version weighs them by their loss "
        "positions and keeps another state: resume it with the version that "
        "saved it, or train in another --workdir.")


def _tuples(x: Any) -> Any:
  """JSON lists back to the tuples the configs hold."""
  if isinstance(x, dict):
    return {k: _tuples(v) for k, v in x.items()}
  if isinstance(x, list):
    return tuple(_tuples(v) for v in x)
  return x


def _typed(saved: dict, template: Mapping | None) -> dict:
  """``saved`` with its ``None`` leaves typed like ``template``'s (an unset
  path stays overridable from the command line: ``placeholder(str)``)."""
  out = {}
  for k, v in saved.items():
    t = template.get(k) if isinstance(template, Mapping) else None
    if isinstance(v, dict):
      out[k] = _typed(v, t)
    elif v is None:
      kind = type(t) if t is not None and not isinstance(t, Mapping) else str
      out[k] = config_dict.placeholder(kind)
    else:
      out[k] = v
  return out


def load(path: str | os.PathLike) -> dict[str, Any]:
  """The saved config at ``path`` as nested dicts (tuples restored), with
  an exported folder's own copy of its vocabulary, without the
  ``PER_COMMAND`` subtrees."""
  path = epath.Path(path)
  try:
    saved = _tuples(json.loads(path.read_text()))
    if not isinstance(saved, dict):
      raise ValueError(f"a JSON {type(saved).__name__}, not an object")
  except ValueError as e:
    raise ConfigFlagError(
        f"{path} is cut short or not a config ({' '.join(str(e).split())}); "
        f"{_restore_hint(path.parent)}") from e
  for key in PER_COMMAND:
    saved.pop(key, None)
  record = path.parent / VOCAB_RECORD
  if record.exists():
    vocab = json.loads(record.read_text())
    copy = path.parent / vocab["file"] if vocab.get("file") else None
    if copy is not None and copy.exists():
      saved.setdefault("data", {})["vocab_path"] = os.fspath(copy)
    elif vocab.get("sha256") and epath.Path(vocab["path"]).exists():
      # The copy is gone: the original serves only if it is the same file.
      found = hashlib.sha256(epath.Path(vocab["path"]).read_bytes())
      if found.hexdigest() != vocab["sha256"]:
        raise ConfigFlagError(
            f"{vocab['path']} is not the vocabulary the parameters of "
            f"{path.parent} were trained with (SHA-256 {found.hexdigest()[:12]}"
            f"..., {VOCAB_RECORD} says {vocab['sha256'][:12]}...); restore "
            f"{copy} or pass --config.data.vocab_path=THE_RIGHT_FILE.")
  return saved


def load_complete(path: str | os.PathLike) -> dict[str, Any]:
  """``load(path)`` of a config that can run on its own (a training run's or
  an export's), not a converted checkpoint's model alone."""
  saved = load(path)
  if "num_train_steps" not in saved or "task" not in saved.get("data", {}):
    raise ConfigFlagError(
        f"{path} records only part of a config (a converted checkpoint's "
        "model); pass --config=FILE for the rest.")
  return saved


def get_config(workdir: str) -> ml_collections.ConfigDict:
  """``--config=<this file>:WORKDIR``: the saved config of ``WORKDIR``
  (what ``main.py`` passes when ``--config`` is absent)."""
  path = find(workdir)
  if path is None:
    raise ConfigFlagError(f"{workdir} holds no {CONFIG_FILE}; pass "
                          "--config=FILE.")
  return resolve(path, {})


def flatten(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
  """``{'a.b.c': leaf}`` of a config or nested dicts."""
  out = {}
  for k, v in tree.items():
    if isinstance(v, (Mapping, ml_collections.ConfigDict)):
      out.update(flatten(v, f"{prefix}{k}."))
    else:
      out[f"{prefix}{k}"] = v
  return out


def differences(a: Mapping, b: Mapping) -> dict[str, tuple[Any, Any]]:
  """``{field: (a's, b's)}`` where two configs differ (absent: ``'-'``)."""
  fa, fb = flatten(_tuples(_plain(a))), flatten(_tuples(_plain(b)))
  return {k: (fa.get(k, "-"), fb.get(k, "-"))
          for k in sorted(set(fa) | set(fb)) if fa.get(k, "-") != fb.get(k, "-")}


def _plain(tree: Mapping) -> dict:
  return tree.to_dict() if isinstance(tree, ml_collections.ConfigDict) else (
      dict(tree))


def _merge(base: dict, saved: Mapping, top: bool = True) -> dict:
  out = dict(base)
  for k, v in saved.items():
    mine = out.get(k)
    if isinstance(v, Mapping) and isinstance(mine, Mapping) and not (
        top and k in BY_FAMILY
        and v.get("family", mine.get("family")) != mine.get("family")):
      out[k] = _merge(mine, v, top=False)
    else:
      out[k] = v
  return out


def _param_shapes(model: Mapping) -> dict[str, tuple[Any, ...]]:
  """Each parameter's shape and dtype (a restore would cast another dtype
  silently), the scanned stacks unrolled."""
  import jax  # pylint: disable=g-import-not-at-top
  from hypermixer_jax.models import common  # pylint: disable=g-import-not-at-top
  from hypermixer_jax.models import zoo  # pylint: disable=g-import-not-at-top
  import flax.linen as nn  # pylint: disable=g-import-not-at-top
  variables = nn.unbox(zoo.abstract_variables(ml_collections.ConfigDict(
      _plain(model))))
  shapes = {common.path_str(p): (*x.shape, str(x.dtype)) for p, x in
            jax.tree_util.tree_flatten_with_path(
                variables.get("params", {}))[0]}
  # The scanned and unrolled stacks (model.scan_layers) hold the same
  # parameters, and checkpoints load across them: compared unrolled.
  out = {}
  for key, shape in shapes.items():
    m = _SCANNED_LEAF.match(key)
    if m:
      for i in range(shape[0]):
        out[f"{m[1]}/layer_{i}/{m[2]}"] = shape[1:]
    else:
      out[key] = shape
  return out


_SCANNED_LEAF = re.compile(r"(.*)/layers/layer/(.*)$")


# The training state's layout beyond the parameters: the optimizer's
# state holds a clipping stage only where ``clip_norm > 0`` and an
# accumulator only where ``grad_accum_steps > 1`` (``optim.make_optimizer``),
# so a checkpoint restores only into the same choices. Another k > 1 is
# refused too: the accumulator's count and the schedule's horizon
# (``num_train_steps // k`` updates) would disagree.
OPTIMIZER_LAYOUT = {
    "clip_norm": lambda v: bool(v) and float(v) > 0,
    "grad_accum_steps": lambda v: max(int(v or 1), 1),
}


def shape_fields(saved: Mapping, config: Mapping) -> list[str]:
  """The fields of ``config`` that give the parameters other shapes or
  dtypes than ``saved``'s (or another vocabulary, or another optimizer
  state layout); empty when the checkpoint fits."""
  diff = differences(saved, config)
  family = _plain(config).get("model", {}).get("family")
  fields = ([k for k in VOCAB_FIELDS if k in diff]
            if family in TOKEN_FAMILIES else [])
  fields += [k for k, layout in OPTIMIZER_LAYOUT.items()
             if k in diff and "-" not in diff[k]   # (absent: unknown)
             and layout(diff[k][0]) != layout(diff[k][1])]
  changed = [k for k in diff if k.startswith("model.")]
  if not changed:
    return fields
  saved_model = _plain(saved)["model"]
  new_model = _plain(config)["model"]
  before = _param_shapes(saved_model)
  if _param_shapes(new_model) == before:
    return fields
  # Name the fields that change the shapes on their own (each tried alone);
  # when only their combination does, all of the changed ones.
  alone = []
  new_flat = flatten(new_model)
  for k in changed:
    one = _merge(_tuples(saved_model), _unflatten(
        {k[len("model."):]: new_flat.get(k[len("model."):])}), top=False)
    try:
      if _param_shapes(one) != before:
        alone.append(k)
    except Exception:  # pylint: disable=broad-except
      alone.append(k)  # a field the family cannot build with alone
  return fields + (alone or changed)


def _unflatten(flat: Mapping[str, Any]) -> dict:
  out: dict = {}
  for k, v in flat.items():
    node = out
    *parents, leaf = k.split(".")
    for p in parents:
      node = node.setdefault(p, {})
    node[leaf] = v
  return out


def _show(v: Any) -> str:
  text = repr(v)
  return text if len(text) <= 80 else text[:77] + "..."


def resolve(saved_path: str | os.PathLike, overrides: Mapping[str, Any], *,
            given: ml_collections.ConfigDict | None = None
            ) -> ml_collections.ConfigDict:
  """The config of a command on a folder with a saved config.

  Args:
    saved_path: the folder's ``config.json`` (``find``).
    overrides: the command line's ``--config.field=value`` values
      (``config_flags.get_override_values``), applied last.
    given: the ``--config=FILE`` config when one was passed: fields the saved
      config lacks come from it (a partial or an older saved config), the
      saved ones replace its values (logged).

  Raises:
    ConfigFlagError: an override changes the parameters' shapes or the
      vocabulary (naming the fields), or a partial saved config has no
      ``--config`` to complete it.
  """
  if given is None:
    saved = load_complete(saved_path)
    from hypermixer_jax.train import config as train_config  # pylint: disable=g-import-not-at-top
    base = train_config.base_config().to_dict()
  else:
    saved = load(saved_path)
    base = given.to_dict()
    _check_same_run(saved_path, saved, base)
    replaced = differences(base, _merge(base, saved))
    if replaced:
      logging.info("The saved config %s replaces %d field(s) of --config: %s",
                   saved_path, len(replaced), "; ".join(
                       f"{k}: {_show(a)} -> {_show(b)}"
                       for k, (a, b) in replaced.items()))
  merged = _merge(_tuples(base), saved)
  config = ml_collections.ConfigDict(_typed(merged, base))
  if overrides:
    config.update_from_flattened_dict(dict(overrides))
  reference = ml_collections.ConfigDict(_typed(merged, base))
  changed = differences(reference, config)
  if changed:
    logging.info("Config of %s with the command line's overrides: %s",
                 saved_path, "; ".join(f"{k}: {_show(a)} -> {_show(b)}"
                                       for k, (a, b) in changed.items()))
  refused = shape_fields(reference, config)
  if refused:
    raise ConfigFlagError(
        f"--config.{refused[0]}"
        + "".join(f", --config.{k}" for k in refused[1:])
        + f" would change the shapes, dtypes or vocabulary of the "
        f"parameters, or the optimizer state's layout or accumulation, "
        f"saved with "
        f"{os.fspath(epath.Path(saved_path).parent)} (see its "
        f"{CONFIG_FILE}); drop the override(s), or train a new run in "
        "another --workdir.")
  check_fits_checkpoints(config, epath.Path(saved_path).parent)
  config.lock()
  return config


# What makes a saved run another job than a --config: its task and the
# kind of model (the shapes may differ for a run of the same job: a
# fine-tune's adopted from its init_checkpoint, an export's vocabulary copy,
# an override of the first command; the saved values then win, logged).
RUN_FIELDS = ("data.task", "model.family", "model.head", "model.mixer",
              "model.block")


def _check_same_run(saved_path, saved: Mapping, given: Mapping) -> None:
  """Refuses a ``--config`` of another job than the folder's saved run
  (``RUN_FIELDS``): the saved config would otherwise replace the given
  one's fields and resume the folder's run, the given config's own fields
  (e.g. its evaluators) merged into it."""
  diff = differences(_merge(_tuples(given), saved), given)
  fields = [k for k in RUN_FIELDS if k in diff]
  if not fields:
    return
  folder = os.fspath(epath.Path(saved_path).parent)
  shown = "; ".join(f"{k}: {_show(diff[k][0])} there, {_show(diff[k][1])} in "
                    "--config" for k in fields)
  raise ConfigFlagError(
      f"--workdir={folder} holds another run than --config ({shown}): "
      "resume it with --workdir alone (its saved config) or its own "
      "--config, or train this one in another --workdir.")


def write(config: ml_collections.ConfigDict | Mapping[str, Any],
          folder: str | os.PathLike, *, vocabulary: bool = False) -> None:
  """Writes ``folder/config.json``; with ``vocabulary``, also a copy of the
  config's SentencePiece model under ``folder/vocab/`` and
  ``vocabulary.json`` (its original path and SHA-256; path and digest alone
  when it cannot be read)."""
  folder = epath.Path(folder)
  folder.mkdir(parents=True, exist_ok=True)
  tree = _plain(config)
  storage.replace(folder / CONFIG_FILE, json.dumps(
      tree, indent=1, sort_keys=True, default=str) + "\n")
  path = tree.get("data", {}).get("vocab_path") if vocabulary else None
  if not path or tree.get("model", {}).get("family") not in TOKEN_FAMILIES:
    return
  record = {"path": path, "extra_ids": tree["data"].get("extra_ids")}
  try:
    content = epath.Path(path).read_bytes()
  except Exception as e:  # pylint: disable=broad-except
    logging.warning("Vocabulary %s not copied into %s (%s); the export "
                    "records its path only.", path, folder, e)
  else:
    name = epath.Path(path).name
    (folder / VOCAB_DIR).mkdir(exist_ok=True)
    storage.replace(folder / VOCAB_DIR / name, content)
    record.update(file=f"{VOCAB_DIR}/{name}",
                  sha256=hashlib.sha256(content).hexdigest())
  storage.replace(folder / VOCAB_RECORD, json.dumps(record, indent=1) + "\n")


def adopt_init_checkpoint(config: ml_collections.ConfigDict,
                          explicit: Collection[str] = ()
                          ) -> ml_collections.ConfigDict:
  """``config`` with the model shapes of ``config.init_checkpoint``.

  The checkpoint's saved config (its run's or export's ``config.json``, a
  converted checkpoint's model) knows the shapes of its parameters. A model
  field that gives the parameters fine-tuning loads (all but ``init_reinit``'s
  heads) another shape is taken from it when the command line left it at
  the config file's value (logged); one set on the command line
  (``explicit``: flattened ``--config.`` names) stops the run in one line
  naming each field with both values. Fields that shape nothing loaded
  (``head``, ``num_classes``, ``dropout_rate``, ``dtype``) stay this
  config's.

  Raises:
    ConfigFlagError: a conflict, another model family or mixer, or an
      init_checkpoint that does not exist (before anything is built).
  """
  init = config.get("init_checkpoint")
  if init and not storage.path(init).exists():
    raise ConfigFlagError(
        f"init_checkpoint {init}: no such folder; pass a trained run's "
        "workdir, an exported folder or a converted checkpoint.")
  path = find(config.init_checkpoint) if config.get("init_checkpoint") else None
  saved = load(path).get("model") if path is not None else None
  if not saved:
    return config
  ours = _tuples(_plain(config)["model"])
  where = f"init_checkpoint {config.init_checkpoint}"
  for field in ("family", "mixer"):
    if saved.get(field, ours.get(field)) != ours.get(field):
      example = (f" (e.g. --config=configs/glue.py:sst2,{saved[field]},"
                 "finetune)" if field == "mixer"
                 and ours.get("family") == "text" else "")
      raise ConfigFlagError(
          f"{where} holds a model.{field}={saved[field]!r} model, this run "
          f"builds {ours.get(field)!r}; fine-tune it with a config of its "
          f"{field}{example}, or drop --config.init_checkpoint.")
  reinit = [r for r in config.init_reinit.split(",") if r]

  def loaded(model: Mapping) -> dict[str, tuple[int, ...]]:
    return {k: v for k, v in _param_shapes(model).items()
            if not any(re.match(r, k) for r in reinit)}

  target, mine = loaded(saved), loaded(ours)
  if mine == target:
    return config
  theirs, flat = flatten(saved), flatten(ours)
  fields = []
  for k in (k for k in flat if k in theirs and theirs[k] != flat[k]):
    try:
      if loaded(_merge(ours, _unflatten({k: theirs[k]}), top=False)) != mine:
        fields.append(k)
    except Exception:  # pylint: disable=broad-except
      fields.append(k)  # a value the family cannot build with alone
  refused = [k for k in fields if f"model.{k}" in explicit]
  both = "; ".join(f"model.{k}: checkpoint {_show(theirs[k])}, config "
                   f"{_show(flat[k])}" for k in (refused or fields))
  try:
    adopted = loaded(_merge(ours, _unflatten({k: theirs[k] for k in fields}),
                            top=False))
  except Exception:  # pylint: disable=broad-except
    adopted = None   # the checkpoint's values do not build this model
  if refused or not fields or adopted != target:
    fix = (f"drop {', '.join(f'--config.model.{k}' for k in refused)} to "
           "take the checkpoint's values" if refused else
           "fine-tune it with the config of the model it holds")
    raise ConfigFlagError(
        f"{where} has other parameter shapes than this config ("
        f"{both or 'no single field explains it'}); {fix}, or train from "
        "scratch without --config.init_checkpoint.")
  logging.info("Model fields from %s (%s): %s", where, path, "; ".join(
      f"model.{k}: {_show(flat[k])} -> {_show(theirs[k])}" for k in fields))
  config = copy.deepcopy(config)
  with config.unlocked():
    config.update_from_flattened_dict(
        {f"model.{k}": theirs[k] for k in fields})
  return config


def adopt_init_vocabulary(config: ml_collections.ConfigDict,
                          explicit: Collection[str] = ()
                          ) -> ml_collections.ConfigDict:
  """``config`` reading ``config.init_checkpoint``'s vocabulary (its run's
  SentencePiece file, or an export's own copy) where the command line gave
  no ``data.vocab_path``: the checkpoint's token ids name its pieces, so
  the config file's default (e.g. the public T5 vocabulary on ``gs://``)
  would be refused or unreadable. A saved vocabulary that cannot be read
  here is not taken (``check_init_vocabulary`` warns)."""
  path = find(config.init_checkpoint) if config.get("init_checkpoint") else None
  if path is None or _plain(config)["model"].get("family") not in (
      TOKEN_FAMILIES) or "data.vocab_path" in explicit:
    return config
  theirs = load(path).get("data", {})
  vocab = theirs.get("vocab_path")
  if not vocab or vocab == config.data.get("vocab_path") or not epath.Path(
      vocab).is_file():
    return config
  fields = {"data.vocab_path": vocab}
  if "extra_ids" in theirs and "data.extra_ids" not in explicit:
    fields["data.extra_ids"] = theirs["extra_ids"]
  logging.info("Vocabulary from init_checkpoint %s: %s", config.init_checkpoint,
               "; ".join(f"{k}: {flatten(config).get(k)!r} -> {v!r}"
                         for k, v in fields.items()))
  config = copy.deepcopy(config)
  with config.unlocked():
    config.update_from_flattened_dict(fields)
  return config


# Config fields that name local files or folders (``data.local_files.*``
# too; each may be a comma-separated list).
PATH_FIELDS = ("data.vocab_path", "data.data_dir", "init_checkpoint")


def is_path_field(key: str) -> bool:
  return key in PATH_FIELDS or key.startswith("data.local_files.")


def absolute(value: Any, many: bool = False) -> Any:
  """A path field's value with its relative local paths made absolute
  (object-store URLs, absolute paths and empty values unchanged); ``many``:
  a comma-separated list (``data.local_files.*``)."""
  if not isinstance(value, str) or not value:
    return value
  parts = [p.strip() for p in value.split(",")] if many else [value]
  return ",".join(p if not p or os.path.isabs(p) else storage.absolute(p)
                  for p in parts)


def absolute_paths(config: ml_collections.ConfigDict
                   ) -> ml_collections.ConfigDict:
  """``config`` (in place) with the relative local paths of its path fields
  made absolute, as a command line gives them: the saved ``config.json``
  then names the same files whatever folder a later command (a resume,
  ``--mode=evaluate``) runs from."""
  flat = {k: _absolute_field(k, v)
          for k, v in flatten(config.to_dict()).items()
          if is_path_field(k) and _absolute_field(k, v) != v}
  if flat:
    config.update_from_flattened_dict(flat)
  return config


def absolute_overrides(overrides: Mapping[str, Any],
                       saved_path: str | os.PathLike) -> dict[str, Any]:
  """The command line's overrides on a saved run, its relative paths made
  absolute, except one equal to the saved value (a run saved with that
  relative path, resumed from its folder, keeps reading what it read)."""
  saved = flatten(load(saved_path))
  return {k: (_absolute_field(k, v) if is_path_field(k) and saved.get(k) != v
              else v) for k, v in overrides.items()}


def _absolute_field(key: str, value: Any) -> Any:
  many = key.startswith("data.local_files.")
  home = isinstance(value, str) and storage.unexpanded_home(
      f"--config.{key}", value, many)
  if home:
    raise ConfigFlagError(home)
  return absolute(value, many=many)


def check_init_vocabulary(config: ml_collections.ConfigDict) -> None:
  """Refuses, in one line, to fine-tune a token model from
  ``config.init_checkpoint`` with another vocabulary than it was trained
  with (another SentencePiece file's content, or ``data.extra_ids``): every
  token id would mean another piece. Where the saved config names a
  vocabulary that cannot be read here, nothing is compared (a warning says
  so)."""
  path = find(config.init_checkpoint) if config.get("init_checkpoint") else None
  if path is None or _plain(config)["model"].get("family") not in (
      TOKEN_FAMILIES):
    return
  theirs, ours = load(path).get("data", {}), _plain(config).get("data", {})
  a, b = theirs.get("vocab_path"), ours.get("vocab_path")
  if not a or not b or not epath.Path(a).is_file() or not epath.Path(
      b).is_file():
    unread = [f for f in (a, b) if f and not epath.Path(f).is_file()]
    if a and b and a != b and unread:
      logging.warning(
          "init_checkpoint %s was trained with the vocabulary %s, this run "
          "reads %s; %s cannot be read here, so the two are not compared: "
          "fine-tune with the vocabulary it was trained with.",
          config.init_checkpoint, a, b, " and ".join(unread))
    return
  digest = lambda f: hashlib.sha256(epath.Path(f).read_bytes()).hexdigest()  # noqa: E731
  extra = (theirs.get("extra_ids", 100), ours.get("extra_ids", 100))
  if digest(a) != digest(b) or extra[0] != extra[1]:
    raise ConfigFlagError(
        f"init_checkpoint {config.init_checkpoint} was trained with the "
        f"vocabulary {a} (data.extra_ids={extra[0]}), this run reads {b} "
        f"(data.extra_ids={extra[1]}), whose ids name other pieces: pass "
        f"--config.data.vocab_path={a} --config.data.extra_ids={extra[0]}.")


def input_mismatches(config: ml_collections.ConfigDict) -> list[str]:
  """How ``config``'s inputs differ from those ``config.init_checkpoint``
  was trained on, as far as its saved config records them (one line each)."""
  path = find(config.init_checkpoint) if config.get("init_checkpoint") else None
  if path is None:
    return []
  saved, ours = flatten(load(path)), flatten(config)
  key = "data.image_normalization"
  if key in saved and key in ours and saved[key] != ours[key]:
    return [f"init_checkpoint {config.init_checkpoint} was trained on "
            f"{key}={saved[key]!r} inputs, this run feeds {ours[key]!r}: pass "
            f"--config.{key}={saved[key]}."]
  return []


# ---------------------------------------------------------------------------
# The command line.
# ---------------------------------------------------------------------------
def flag_value(argv: Sequence[str], name: str) -> str | None:
  """The last ``--name=value`` / ``--name value`` of ``argv`` (no parsing
  of the other flags, which may still be undefined)."""
  value = None
  for i, arg in enumerate(argv):
    if arg.startswith(f"--{name}="):
      value = arg.split("=", 1)[1]
    elif arg == f"--{name}" and i + 1 < len(argv):
      value = argv[i + 1]
  return value


def check_config_file(spec: str, configs_dir: str | os.PathLike) -> None:
  """One line naming the configs there when ``--config=FILE[:arg]`` has no
  file (config_flags would only fail when the config is first read)."""
  path = spec.split(":", 1)[0]
  if epath.Path(path).is_file():
    return
  folder = epath.Path(path).parent if path and epath.Path(
      path).parent.is_dir() and any(epath.Path(path).parent.glob("*.py")) \
      else epath.Path(configs_dir)
  names = sorted(p.name for p in folder.glob("*.py")) if folder.is_dir() else []
  close = difflib.get_close_matches(epath.Path(path).name, names, n=1)
  hint = f" Did you mean {os.fspath(folder / close[0])}?" if close else ""
  raise ConfigFlagError(
      f"--config={spec}: no config file {path!r}.{hint} The configs in "
      f"{os.fspath(folder)}: {', '.join(names) or 'none'}.")


def load_config_file(spec: str) -> ml_collections.ConfigDict:
  """``get_config(arg)`` of ``--config=FILE[:arg]``, as config_flags does."""
  import importlib.util  # pylint: disable=g-import-not-at-top
  path, *arg = spec.split(":", 1)
  module_spec = importlib.util.spec_from_file_location("config_file", path)
  module = importlib.util.module_from_spec(module_spec)
  module_spec.loader.exec_module(module)
  return module.get_config(*arg)


def closest_fields(field: str, names: Collection[str], n: int = 3,
                   cutoff: float = 0.75) -> list[str]:
  """The ``n`` names of ``names`` closest to the misspelt ``field``.

  A name scores by its whole dotted path and by its last part alone, with
  underscores and case ignored, so that a field put at the wrong depth still
  finds its place (``model.hyperdim`` -> ``model.mixer_kwargs.hyper_dim``);
  on a tie, names under the same section come first, then shorter ones.
  Only names within 0.1 of the best score are kept: a shared section prefix
  alone scores about 0.8.
  """
  def norm(s: str) -> str:
    return s.replace("_", "").lower()

  def ratio(a: str, b: str) -> float:
    return difflib.SequenceMatcher(None, a, b).ratio()

  leaf, root = norm(field.rpartition(".")[2]), field.split(".")[0]
  scored = sorted(
      (-max(ratio(norm(field), norm(name)),
            ratio(leaf, norm(name.rpartition(".")[2]))),
       name.split(".")[0] != root, len(name), name) for name in names)
  best = -scored[0][0] if scored else 0.0
  return [name for score, _, _, name in scored[:n]
          if -score >= max(cutoff, best - 0.1)]


def flag_error(message: str, spec: str | None) -> str:
  """absl's message for a bad flag as one line that leads with the cause.

  When ``--config=FILE:ARG`` fails in ``get_config``, config_flags puts
  the config's own message (e.g. an unknown task) at the end of a
  flattened traceback; it comes first here, the traceback is dropped.
  """
  if spec and "parsing config file" in message:
    try:
      load_config_file(spec)
    except Exception as e:  # pylint: disable=broad-except
      cause = str(e).strip().splitlines()[0] if str(e).strip() else ""
      if spec.startswith(f"{__file__}:") and cause:
        return cause   # the saved config (no --config given): its own words
      return f"--config={spec}: {cause or type(e).__name__}"
  return f"{' '.join(message.split())} (--help lists the flags)"


def unknown_fields(config: ml_collections.ConfigDict,
                   argv: Sequence[str]) -> str | None:
  """One line for the first ``--config.field`` that ``config`` lacks, with
  the closest existing names; None when every one exists."""
  flat = flatten(config)
  names = set(flat)
  for k in flat:   # intermediate nodes are valid targets too
    parts = k.split(".")
    names.update(".".join(parts[:i]) for i in range(1, len(parts)))
  for arg in argv:
    if not arg.startswith(("--config.", "--noconfig.")):
      continue
    field = arg.split("=", 1)[0].split(".", 1)[1]
    if field in names:
      continue
    line = _unset_mixer_option(flat, field)
    if line:
      return line
    parts = field.split(".")
    close = closest_fields(field, names - {".".join(parts[:i])
                                           for i in range(1, len(parts))})
    parent, _, leaf = field.rpartition(".")
    siblings = sorted({n[len(parent) + 1 if parent else 0:].split(".")[0]
                       for n in names
                       if not parent or n.startswith(parent + ".")})
    if not close:   # a misspelt leaf under a right parent, e.g. model.d_mdl
      close = [f"{parent}.{c}" if parent else c for c in
               difflib.get_close_matches(leaf, siblings, n=3, cutoff=0.5)]
    hint = (f"; did you mean {' or '.join(f'--config.{c}' for c in close)}?"
            if close else f"; {'config.' + parent if parent else 'it'} has "
            f"{', '.join(siblings)}")
    return f"--config.{field}: the config has no field {field!r}{hint}"
  return None


def _unset_mixer_option(flat: Mapping[str, Any], field: str) -> str | None:
  """The line for ``model.mixer_kwargs.<option>`` that the config does not
  set: config_flags only overrides fields a config holds, so an option of
  the mixer left at its default needs a config file that sets it."""
  prefix = "model.mixer_kwargs."
  mixer = flat.get("model.mixer")
  leaf = field[len(prefix):]
  if not field.startswith(prefix) or "." in leaf:
    return None
  from hypermixer_jax.models import registry  # pylint: disable=g-import-not-at-top
  found = registry.options(mixer)
  if found is None:
    return None
  cls, options = found
  if leaf not in options:
    close = difflib.get_close_matches(leaf, options, n=1, cutoff=0.5)
    return (f"--config.{field}: mixer {mixer!r} ({cls.__name__}) has no "
            f"option {leaf!r}" + (f"; did you mean {close[0]!r}?" if close
                                  else f"; its options: {', '.join(options)}"))
  return (f"--config.{field}: {leaf!r} is an option of mixer {mixer!r} "
          f"({cls.__name__}) that this config leaves at its default, and "
          "--config.* only overrides fields a config sets; set "
          f"c.model.mixer_kwargs.{leaf} in a config file (e.g. a copy of the "
          "one given to --config) and pass that file.")
