"""Equal tuning on held-out training data: the studies' ``--tune``.

Every model of a comparison gets the same search (each learning rate with
each warm-up share, ``settings``), run with a seed that no reported run uses
and scored on a validation split carved from the training data
(``carve_lines``: every ``VALIDATION_EVERY``-th example, its digest
recorded), never on the set a number is reported on. Each model's best
setting (``choose``) then trains the reported seeds on the rest of the
training data (``tune`` runs both grids). Every study with ``--tune`` uses
it.
"""
from __future__ import annotations

import hashlib
import math
import pathlib
from typing import Callable, Sequence

import ml_collections
import numpy as np

from hypermixer_jax import experiment

LRS = (3e-4, 1e-3, 3e-3)
WARMUP_SHARES = (0.02, 0.1)
# The selection runs' seed: none of the reported runs uses it.
SEED = 100
VALIDATION_EVERY = 10
# A selection run's record key when its training stopped on NaN/Inf.
DIVERGED = "diverged"


def settings(steps: int, lrs: Sequence[float] | None = None,
             shares: Sequence[float] | None = None) -> list[dict]:
  """The search of every model: each learning rate with each warm-up share
  (at least one step), in a fixed order (None: ``LRS``, ``WARMUP_SHARES``)."""
  lrs, shares = _grid(lrs, shares)
  return [{"lr": lr, "warmup": max(1, round(share * steps)),
           "warmup_share": share} for lr in lrs for share in shares]


def _grid(lrs, shares):
  return (LRS if lrs is None else lrs,
          WARMUP_SHARES if shares is None else shares)


def headers(lrs: Sequence[float] | None = None,
            shares: Sequence[float] | None = None) -> list[str]:
  """The selection table's columns: the model, then each setting."""
  lrs, shares = _grid(lrs, shares)
  return ["model"] + [f"lr {lr:g}, warm-up {w:.0%}"
                      for lr in lrs for w in shares]


def carve_lines(source: str | pathlib.Path, folder: str | pathlib.Path, *,
                names: tuple[str, str] = ("train.jsonl", "validation.jsonl"),
                header: bool = False,
                group: Callable[[list[str]], list[str]] | None = None
                ) -> dict:
  """Splits the line-per-example file ``source`` into ``folder/names[0]``
  (train) and ``folder/names[1]`` (validation: every
  ``VALIDATION_EVERY``-th example, counting from the first) and describes
  them: file names, examples, sha256. ``header``: the first line is a
  header (a TSV's), kept at the top of both. ``group(rows)``: each
  example's group (e.g. its premise); then every ``VALIDATION_EVERY``-th
  group, in order of first appearance, is carved whole, so that no group
  has examples on both sides, and each part also counts its ``groups``.

  Deterministic: a second call rewrites identical files, so the record's
  digests name the split wherever it is rebuilt."""
  lines = pathlib.Path(source).read_text(encoding="utf-8").splitlines(True)
  head, rows = (lines[:1], lines[1:]) if header else ([], lines)
  if len(rows) < VALIDATION_EVERY:
    raise ValueError(f"{source}: {len(rows)} examples; carving a validation "
                     f"split (every {VALIDATION_EVERY}th) needs at least "
                     f"{VALIDATION_EVERY}.")
  # Each example's index among the groups (itself, without ``group``).
  if group is None:
    rank = range(len(rows))
  else:
    order = {}
    rank = [order.setdefault(g, len(order))
            for g in group(rows)]
  held = [i % VALIDATION_EVERY == 0 for i in rank]
  parts = {"validation": [x for x, h in zip(rows, held) if h],
           "train": [x for x, h in zip(rows, held) if not h]}
  folder = pathlib.Path(folder)
  folder.mkdir(parents=True, exist_ok=True)
  out = {"source": pathlib.Path(source).name,
         "source_sha256": experiment.file_digest(source)}
  for split, name in zip(("train", "validation"), names):
    path = folder / name
    settle_file(path, "".join(head + parts[split]))
    out[split] = {"path": str(path), "documents": len(parts[split]),
                  "sha256": experiment.file_digest(path)}
    if group is not None:
      out[split]["groups"] = len({r for r, h in zip(rank, held)
                                  if h == (split == "validation")})
  return out


def settle_file(path: pathlib.Path, text: str) -> None:
  """Writes ``text`` to ``path`` unless it holds it already, all at once
  (``storage.replace``): another process training from the file never
  reads it half-written, and an unchanged file is not touched."""
  from hypermixer_jax.train import storage  # pylint: disable=g-import-not-at-top
  if path.exists() and path.read_bytes() == text.encode("utf-8"):
    return
  storage.replace(path, text)


def tfds_carve(fraction: float = 1.0) -> dict:
  """TFDS split expressions carving a validation split from the first
  ``fraction`` of ``train`` (the share a run trains on): its first
  ``1 / VALIDATION_EVERY`` as ``validation``, the rest as ``train`` (so a
  run on a share trains on nine tenths of it). A contiguous slice, since
  TFDS slices by position; TFDS stores examples shuffled, so most held-out
  pairs share their premise (or question) with a training pair: the
  choice is optimistic about every setting alike, and never reads dev."""
  if not 0 < fraction <= 1:
    raise ValueError(f"fraction={fraction}: the share of train must be in "
                     "(0, 1].")
  end, held = 100 * fraction, 100 * fraction / VALIDATION_EVERY
  return {"train": f"train[{held:g}%:{end:g}%]",
          "validation": f"train[:{held:g}%]"}


def tfds_split_record(c: ml_collections.ConfigDict, carve: dict) -> dict:
  """``carve``'s parts as ``c``'s task reads them from TFDS: for each, its
  expression, examples and the sha256 of every feature of every example in
  order (sorted feature names), so that the record names the split
  wherever the dataset is read again."""
  from hypermixer_jax.data import tasks  # pylint: disable=g-import-not-at-top
  d = ml_collections.ConfigDict(c.data.to_dict())
  d.tfds_train_split, d.tfds_validation_split = (carve["train"],
                                                 carve["validation"])
  source = tasks.get_task(d).source
  out = {"tfds": source.tfds_dataset.builder.info.full_name}
  for part in ("train", "validation"):
    digest, n = hashlib.sha256(), 0
    for ex in source.get_dataset(part, shuffle=False).as_numpy_iterator():
      for key in sorted(ex):
        value = ex[key]
        digest.update(key.encode())
        digest.update(value if isinstance(value, bytes)
                      else np.asarray(value).tobytes())
      n += 1
    out[part] = {"split": carve[part], "documents": n,
                 "sha256": digest.hexdigest()}
  return out


def carved_tfds(c: ml_collections.ConfigDict, carve: dict,
                setting: dict | None = None, *, select: bool = False
                ) -> ml_collections.ConfigDict:
  """``carved`` for a TFDS source: a copy of ``c`` trained on ``carve``'s
  train part (``tfds_carve``); ``select``: evaluated once, at its last
  step, on the whole carved validation part."""
  c = at(ml_collections.ConfigDict(c.to_dict()), setting)
  c.data.tfds_train_split = carve["train"]
  if select:
    c.data.tfds_validation_split = carve["validation"]
    _scored_once(c)
  return c


def _scored_once(c: ml_collections.ConfigDict) -> None:
  """A selection run's evaluation: the whole ``validation`` split, once,
  at the last step."""
  c.eval_split = "validation"
  c.eval_every = c.num_train_steps
  c.eval_steps = -1


def split_tag(split: dict) -> dict[str, str]:
  """What every run chosen on or trained for ``split`` (``carve_lines``')
  records and must still hold (``tune``'s ``tag``): the carved validation
  part's digest, so that runs of another carve are retired and run
  again."""
  return {"carved_validation_sha256": split["validation"]["sha256"]}


def retire_other_carve(exp, key: str, stamp: dict) -> None:
  """Retires ``exp``'s record ``key`` where it was made on another carve
  than ``stamp``'s (``split_tag``), so that it runs again."""
  run = exp.runs.get(key)
  if run is None or exp.report_only:
    return
  got = {k: run.get(k) for k in stamp}
  if got != stamp:
    exp.supersede(key, f"recorded {got}, the carve now has {stamp}")


def split_record(split: dict) -> dict:
  """``carve_lines``' description without this machine's paths."""
  return {k: {f: v for f, v in x.items() if f != "path"}
          if isinstance(x, dict) else x for k, x in split.items()}


def at(c: ml_collections.ConfigDict, setting: dict | None
       ) -> ml_collections.ConfigDict:
  """``c`` (changed in place) at ``setting``'s learning rate and warm-up
  (None: ``c``'s own)."""
  if setting:
    c.learning_rate = setting["lr"]
    c.warmup_steps = min(setting["warmup"], c.num_train_steps)
  return c


def carved(c: ml_collections.ConfigDict, split: dict,
           setting: dict | None = None, *, select: bool = False
           ) -> ml_collections.ConfigDict:
  """A copy of the run config ``c`` trained on ``split``'s train part (a
  file of ``local_files``), at ``setting``'s learning rate and warm-up
  (None: ``c``'s). ``select``: a selection run, evaluated once, at its
  last step, on the whole carved validation part; the set a number is
  reported on is never read."""
  c = at(ml_collections.ConfigDict(c.to_dict()), setting)
  c.data.local_files.train = split["train"]["path"]
  if select:
    c.data.local_files.validation = split["validation"]["path"]
    _scored_once(c)
  return c


def lean(run: dict) -> dict:
  """A tuning run's record without its throughput curve (the record stays
  small), its FLOPs per train step kept (``runs.flops_per_step``)."""
  from hypermixer_jax.experiment import runs  # pylint: disable=g-import-not-at-top
  out = {k: v for k, v in run.items() if k != "train_curve"}
  flops = runs.flops_per_step(run)
  if flops == flops:   # not NaN
    out["flops_per_step"] = flops
  return out


def choose(selection: dict, score: Callable[[dict], float], *,
           higher: bool) -> dict:
  """Each model's setting of best ``score`` (``higher``: the largest) at
  the end of its selection runs (``selection``: {model: [run of each
  setting]}, each run recording its ``setting``); ties go to the earlier
  setting. A run that diverged (``DIVERGED``) or whose score is not finite
  is never chosen; a model with no other run gets no setting."""
  sign = -1.0 if higher else 1.0
  kept = {m: [r for r in runs
              if DIVERGED not in r and math.isfinite(score(r))]
          for m, runs in selection.items()}
  return {m: dict(min(runs, key=lambda r: sign * score(r))["setting"])
          for m, runs in kept.items() if runs}


def or_diverged(train: Callable[[], dict]) -> dict:
  """``train()``'s record, or where its loop stopped on NaN/Inf, a record
  of where (``DIVERGED``; without the message's workdir path), so that a
  search goes on to its next setting."""
  try:
    return train()
  except FloatingPointError as e:
    return {DIVERGED: str(e).split(";")[0]}


def _check_grid(exp, prefix: str, models: Sequence[str],
                settings_: list[dict], tag: dict) -> None:
  """A one-line error where a search recorded under ``prefix`` (with the
  same ``tag``) does not extend to ``settings_``: a setting at a recorded
  index differs (a reordered grid would retire every recorded cell and
  train it again), or the grid stops short of the recorded settings (a
  choice made from part of the search would retire the seeds). New
  learning rates belong at the end of the list."""
  head = f"{prefix}/model="
  for m in models:
    recorded = {}
    for key, r in exp.runs.items():
      at = key[len(head):].split("/setting=")
      if (key.startswith(head) and len(at) == 2 and at[0] == m
          and at[1].isdigit() and "setting" in r
          and all(r.get(k) == v for k, v in tag.items())):
        recorded[int(at[1])] = r["setting"]
    moved = [i for i in sorted(recorded)
             if i >= len(settings_) or recorded[i] != settings_[i]]
    if not moved:
      continue
    i, grid = moved[0], [recorded[j] for j in sorted(recorded)]
    lrs = ",".join(dict.fromkeys(f"{g['lr']:g}" for g in grid))
    shares = ",".join(dict.fromkeys(f"{g['warmup_share']:g}" for g in grid))
    asked = (f"this grid has lr {settings_[i]['lr']:g}, share "
             f"{settings_[i]['warmup_share']:g} there" if i < len(settings_)
             else f"this grid stops at {len(settings_)} settings")
    raise SystemExit(
        f"--tune: {head}{m}/setting={i} is recorded at lr "
        f"{recorded[i]['lr']:g}, warm-up share "
        f"{recorded[i]['warmup_share']:g}, but {asked}; the recorded search "
        f"has lrs {lrs} (in this order) x warm-up shares {shares}: pass "
        "those learning rates, new ones at the end, or another --out.")


def tune(exp, models: Sequence[str], seeds: Sequence[int],
         settings_: Sequence[dict], prefix: str,
         run: Callable[[str, int, dict, str, bool], dict],
         score: Callable[[dict], float], *, higher: bool,
         reverse: bool = False, tag: dict | None = None,
         fields: Callable[[str], dict] | None = None
         ) -> tuple[dict, dict, dict]:
  """Equal tuning in ``exp``: every model's search over ``settings_`` (seed
  ``SEED``, cells under ``{prefix}tune``), then ``seeds`` at each model's
  best setting by ``score`` (cells under ``{prefix}tuned``).

  ``run(model, seed, setting, key, select)`` trains one cell and returns
  its record; ``select``: a selection run (scored on the carved validation
  split, never on the reported set). A grid that reorders or stops short
  of the recorded search is refused (``_check_grid``); a seed recorded at
  another setting (a choice that moved) is retired and run again
  (``Experiment.cells``' ``expect``). A model is chosen for only once its
  whole search is recorded, so a report of a partial search trains no
  seeds. A selection run whose loss or gradient became NaN/Inf is recorded
  as diverged (``DIVERGED``: the steps) and not chosen. ``reverse``: each grid from its last cell (a second process on the
  same records meets the first in the middle). ``tag``: fields every run
  records and every recorded run must hold (e.g. the carved split's digest:
  runs of another split are retired and run again). ``fields(model)``:
  what each of the model's records holds already and must still hold (e.g.
  its parameter count: a run of another width is retired and run again).

  Returns ``(searched, chosen, runs)``: {model: selection runs in the
  settings' order}, {model: its setting}, {model: its seeds' runs}."""
  settings_, tag = list(settings_), dict(tag or {})
  fields = fields or (lambda model: {})
  _check_grid(exp, f"{prefix}tune", models, settings_, tag)
  order = (lambda cells: cells[::-1]) if reverse else (lambda cells: cells)

  def select(cell, key):
    setting = settings_[cell["setting"]]
    record = or_diverged(lambda: run(cell["model"], SEED, setting, key, True))
    # (Stamped: a diverged run's record holds none of its own. Its seed
    # too: the command's --seeds are the reported runs', not this one's.)
    return dict(record, setting=setting, seed=SEED, **tag,
                **fields(cell["model"]))
  searched = exp.cells(f"{prefix}tune", order(experiment.grid(
      model=models, setting=range(len(settings_)))), select,
      expect=lambda cell: {"setting": settings_[cell["setting"]], **tag,
                           **fields(cell["model"])})
  # In the models' order, whichever process (--order) recorded them.
  searched = {m: sorted(searched[m], key=lambda x: settings_.index(
      x["setting"])) for m in models if m in searched}
  chosen = choose({m: r for m, r in searched.items()
                   if len(r) == len(settings_)}, score, higher=higher)
  _retire_length(exp, prefix, models, chosen, tag)

  def final(cell, key):
    setting = chosen[cell["model"]]
    return dict(run(cell["model"], cell["seed"], setting, key, False),
                setting=setting, seed=cell["seed"], **tag)
  ready = [m for m in models if m in chosen]
  runs = exp.cells(f"{prefix}tuned", order(experiment.grid(
      model=ready, seed=seeds)), final, expect=lambda cell: {
          "setting": chosen[cell["model"]], **tag,
          **fields(cell["model"])}) if ready else {}
  runs = {m: runs[m] for m in models if m in runs}
  return searched, chosen, runs


def selection_rows(selection: dict, chosen: dict, labels: dict,
                   cell: Callable[[dict], str],
                   lrs: Sequence[float] | None = None,
                   shares: Sequence[float] | None = None) -> list[list]:
  """One row per model: ``cell(run)`` at every setting, the chosen one
  marked with ``*``."""
  lrs, shares = _grid(lrs, shares)
  rows = []
  for m, runs in selection.items():
    cells = {(r["setting"]["lr"], r["setting"]["warmup_share"]):
             "diverged" if DIVERGED in r else
             cell(r) + (" *" if r["setting"] == chosen.get(m) else "")
             for r in runs}
    rows.append([labels[m]] + [cells.get((lr, w), "not run")
                               for lr in lrs for w in shares])
  return rows


def search_section(searched: dict, chosen: dict, labels: dict,
                   lrs: Sequence[float] | None = None, *,
                   shares: Sequence[float] | None = None,
                   what: str = "accuracy (%)",
                   cell: Callable[[dict], str] | None = None) -> str:
  """A table's search section: each model's validation ``what`` at every
  setting, ``cell(run)`` of each selection run (default: its final
  accuracy in %), the chosen one marked, and the models chosen at the
  edge of the searched learning rates."""
  cell = cell or (lambda r: f"{100 * r['eval']['accuracy']:.2f}")
  edge = at_edge(chosen, labels, lrs)
  return (f"Validation {what} of each setting (the chosen one: *):\n\n"
          + experiment.markdown_table(headers(lrs, shares), selection_rows(
              searched, chosen, labels, cell, lrs, shares))
          + ("\n\nChosen at the edge of the searched learning rates (a "
             "wider search may find a better one): " + ", ".join(edge) + "."
             if edge else ""))


def at_edge(chosen: dict, labels: dict,
            lrs: Sequence[float] | None = None) -> list[str]:
  """The models whose chosen learning rate is the highest or the lowest of
  the grid (of two or more rates), as ``"label (lr X)"``."""
  lrs, _ = _grid(lrs, None)
  if len(set(lrs)) < 2:
    return []
  return [f"{labels[m]} (lr {s['lr']:g})" for m, s in chosen.items()
          if s and s["lr"] in (min(lrs), max(lrs))]


def notes(what: str, split: dict, steps: int, seeds: str, n_settings: int,
          reported_on: str, score: str) -> str:
  """How ``--tune`` chose and what it reports (a table's notes' start):
  ``what`` names the carved source ("document of the C4 sample"),
  ``reported_on`` the set the seeds are scored on, ``score`` the selection
  criterion."""
  return (
      f"Equal tuning: each model trained {steps} steps at each of the "
      f"{n_settings} settings (seed {SEED}) and scored ({score}) on the "
      f"carved validation split, every {VALIDATION_EVERY}th {what} "
      f"({split['validation']['documents']:,} examples, sha256 "
      f"{split['validation']['sha256'][:12]}...); the chosen setting (*) "
      f"then trained with seeds {seeds} on the other "
      f"{split['train']['documents']:,} (sha256 "
      f"{split['train']['sha256'][:12]}...) and scored on {reported_on}. ")



def length_check(exp, prefix: str, searched: dict, chosen: dict, lengths,
                 steps: int, run: Callable[[str, dict, int, str], dict],
                 score: Callable[[dict], float], *,
                 higher: bool = False, tag: dict | None = None) -> dict:
  """A training length judged on the carved validation split: ``{length:
  {model: score}}`` of each model at its chosen lr and warm-up share,
  trained with seed ``SEED`` for each of ``lengths`` (``run(model,
  setting, length, key)``: the record of a selection run of that length;
  ``score(record)``; a run that diverged, or whose score is not finite,
  scores inf, or -inf where ``higher`` scores are better), at ``steps`` its own
  selection run. The shorter runs keep the setting tuned at ``steps`` (not
  searched at their length), which favours ``steps``. Cells under
  ``{prefix}budget/steps=<length>``; ``tag``: fields every run records
  (``tune``'s: a run of another is retired and run again)."""
  tag = dict(tag or {})
  def scored(r):
    s = math.nan if DIVERGED in r else score(r)
    return s if math.isfinite(s) else (-math.inf if higher else math.inf)

  def trained(model, setting, n, key):
    return or_diverged(lambda: run(model, setting, n, key))
  out = {steps: {m: scored(r) for m, runs in searched.items() for r in runs
                 if m in chosen and r["setting"] == chosen[m]}}
  for n in sorted(set(lengths) - {steps}):
    if not chosen:   # no search whole yet (a report): nothing to train
      out[n] = {}
      continue
    at_n = {m: dict(lr=s["lr"], warmup=max(1, round(s["warmup_share"] * n)),
                    warmup_share=s["warmup_share"]) for m, s in chosen.items()}
    done = exp.cells(
        f"{prefix}budget/steps={n}", experiment.grid(model=list(chosen)),
        lambda cell, key, n=n, at_n=at_n: dict(
            trained(cell["model"], at_n[cell["model"]], n, key),
            setting=at_n[cell["model"]], **tag),
        expect=lambda cell, at_n=at_n: {"setting": at_n[cell["model"]],
                                        **tag})
    out[n] = {m: scored(r[0]) for m, r in done.items()}
  return out


def accuracy_length_check(exp, prefix: str, tuned: tuple, models, lengths,
                          steps: int, config, carve, run,
                          baseline: Callable[[], dict], bar: str
                          ) -> tuple[dict, dict]:
  """``({length: {model: validation accuracy}}, baselines)``: the length
  check (``length_check``) of a study whose runs record ``eval.accuracy``
  on the carved validation part, judged by its rule's bar, the trivial
  baseline ``baseline()[bar]`` scored on those examples (recorded under
  ``{prefix}carved_validation/seed=SEED``). ``tuned``: ``(split, searched,
  chosen, ...)`` of the study's search. A run: ``config(model, SEED,
  steps)`` (the untuned run config) made a selection run by ``carve(c,
  split, setting, select=True)`` (the study's ``carved_config``), trained
  and recorded by ``run(exp, c, key)``. The length the rule picks (the
  shortest at which the best of ``models`` is above the bar) is recorded
  (``record_length``)."""
  split, searched, chosen = tuned[:3]
  tag = split_tag(split)

  def train(model, setting, n, key):
    c = carve(config(model, SEED, n), split, setting, select=True)
    return lean(run(exp, c, key))
  base = exp.baseline(f"{prefix}carved_validation/seed={SEED}", baseline,
                      tag=tag)
  chosen = {m: chosen[m] for m in models if m in chosen}
  acc = length_check(exp, prefix, searched, chosen, lengths, steps, train,
                     lambda r: r["eval"]["accuracy"], higher=True, tag=tag)
  record_length(exp, prefix, steps, shortest_length(
      acc, base[bar], models, best_above=True), acc, chosen, tag)
  return acc, base


def length_note(checked: bool, tuned: bool) -> str:
  """How a budget note says whether its training length was checked on the
  carved split (``length_confirmed``): in this (``tuned``) table's last
  section, or in table_tuned.md's."""
  if not checked:
    return "not confirmed on a carved split"
  return ("checked on the carved validation split in the last section"
          if tuned else "checked on the carved validation split at each "
          "model's tuned setting (table_tuned.md)")


def record_length(exp, prefix: str, steps: int, picked: int | None,
                  scores: dict, chosen: dict, tag: dict | None = None
                  ) -> None:
  """Records under ``length_checks`` that the length rule, judged on the
  carved validation split under ``prefix`` at the lengths of ``scores``
  (``length_check``'s), picks ``picked`` for runs of ``steps``, for the
  models of ``chosen`` at those settings (``tag``: the search's; ``tune``
  retires the record when a choice or the tag moves)."""
  exp.save(length_checks={**exp.data.get("length_checks", {}), prefix: {
      "steps": steps, "picked": picked, "lengths": sorted(scores),
      "chosen": chosen, "tag": dict(tag or {})}})


def length_confirmed(data: dict, prefix: str, steps: int,
                     models=()) -> bool:
  """True where ``record_length`` under ``prefix`` recorded that the length
  rule picks ``steps`` on the carved validation split, a shorter length
  was tried, and ``models`` were all judged."""
  r = data.get("length_checks", {}).get(prefix, {})
  return (r.get("picked") == steps
          and any(n < steps for n in r.get("lengths", ()))
          and set(models) <= set(r.get("chosen", {})))


def _retire_length(exp, prefix: str, models, chosen: dict,
                   tag: dict) -> None:
  """Drops the ``length_checks`` record under ``prefix`` when one of
  ``models`` it judged is now chosen at another setting, or its search's
  tag changed: its verdict was for other runs."""
  r = exp.data.get("length_checks", {}).get(prefix)
  if r is None:
    return
  moved = [m for m in models if m in r.get("chosen", {})
           and chosen.get(m) != r["chosen"][m]]
  if moved or r.get("tag", {}) != tag:
    exp.save(length_checks={k: v for k, v in exp.data["length_checks"].items()
                            if k != prefix})


def shortest_length(scores: dict, bar, models, *,
                    best_above: bool = False) -> int | None:
  """The shortest length of ``scores`` (``length_check``'s) at which every
  one of ``models`` scores below ``bar`` (one number, or one per model:
  each scored on its own positions); ``best_above``: at which the best of
  them (the highest score) is above ``bar`` (one number). None where no
  length meets the rule, or where a shorter length that a model not yet run
  could decide comes first."""
  bars = bar if isinstance(bar, dict) else {m: bar for m in models}
  for n in sorted(scores):
    got = [m for m in models if m in scores[n]]
    if best_above:
      passed = [m for m in got if scores[n][m] > bar]
      failed = len(got) == len(models) and not passed
    else:
      failed = any(not scores[n][m] < bars[m] for m in got)   # NaN fails
      passed = len(got) == len(models) and not failed
    if passed:
      return n
    if not failed:   # a model not run could decide it: nothing longer counts
      return None
  return None


def length_section(scores: dict, bar: float, bar_label: str, models,
                   steps: int, labels: dict, *, best_above: bool = False,
                   fmt: Callable[[float], str] = "{:.1f}".format) -> str:
  """A tuned table's section on the training length: each model's
  validation score at each length (``fmt``), the bar, and the length the
  rule (the shortest at which every model is below the bar;
  ``best_above``: at which the best model is above it) picks."""
  lengths = sorted(scores)
  diverged = -math.inf if best_above else math.inf

  def cell(n, m):
    if m not in scores[n]:
      return "not run"
    return "diverged" if scores[n][m] == diverged else fmt(scores[n][m])
  rows = [[labels[m]] + [cell(n, m) for n in lengths] for m in models]
  rows.append([f"bar: {bar_label}"] + [
      "/".join(fmt(b) for b in sorted(set(bar.values())))
      if isinstance(bar, dict) else fmt(bar)] * len(lengths))
  rule = shortest_length(scores, bar, models, best_above=best_above)
  what = ("the best model is above the bar" if best_above
          else "every model is below the bar")
  if rule is None:
    said = ("no length meets it with the runs recorded (or a shorter one "
            "waits on a model not run)")
  elif rule != steps:
    said = f"the rule picks {rule:,} steps, not the {steps:,} used"
  elif min(lengths) < steps:
    said = (f"the rule picks {rule:,} steps, the length used: confirmed on "
            "validation")
  else:
    said = (f"the rule holds at the {steps:,} used; no shorter length was "
            "tried, so it is not confirmed")
  return ("\n\nTraining length on the carved validation split (seed "
          f"{SEED}, each model at its chosen lr and warm-up share; the "
          f"shortest length at which {what}; a "
          f"shorter length keeps the setting tuned at {steps:,} steps, "
          f"which favours {steps:,}): {said}."
          "\n\n" + experiment.markdown_table(
              ["model"] + [f"{n:,} steps" for n in lengths], rows))
