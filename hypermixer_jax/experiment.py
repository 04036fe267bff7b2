"""The experiment harness: one command per table or figure of a paper.

Every script in ``experiments/`` that reproduces a paper result is one
command with the same flags and the same outputs:

    python experiments/<name>.py --scale=small|paper --out=DIR [--shared=DIR]

* ``--scale=small`` is sized for a 2-core CPU machine (or one lent GPU) and
  ``--scale=paper`` is the paper's setting, meant for a pod;
* ``DIR/results.json`` holds every run's measurements, written after each
  run, so a killed experiment restarted with the same ``--out`` skips the
  runs it already has (and each training run resumes from its checkpoint);
* ``DIR/table.md`` is the Markdown table (with the paper's numbers beside
  ours where the paper has them) and ``DIR/<figure>.png`` the figure.

``Experiment`` is that bookkeeping (``Experiment.baseline``: a study's
trivial baselines, computed once); ``grid`` the cells of a study (models x
seeds x budgets x data sizes), each run once under its ``cell_key``
(``Experiment.cells``: a grid's results grouped by model; with
``--report_only`` it trains nothing and returns what is recorded);
``train`` runs one training job through the library's ``train_and_evaluate``
and returns its final evaluation and its learning curves (from
``metrics.jsonl``). ``parser`` gives the flags every experiment shares,
``load_config`` the configs of ``configs/`` that runs start from.
``small_vocab`` builds a study's in-domain SentencePiece vocabulary
(recorded with its digest), ``pipeline_arrays`` reads the tokens a model
sees (for the trivial baselines of ``hypermixer_jax.baselines``) and
``held_out_arrays`` those it is evaluated on,
``mean_sd`` / ``verdict`` turn seeds into the table's cells and words,
``table_row`` / ``perplexity_baseline_rows`` add the baselines' rows, and
``curve`` / ``mean_curve`` / ``plot_curves`` / ``baseline_lines`` draw the
learning curves beside the baselines. Nothing here knows a model or a task:
the scripts declare their runs as configs.
"""
from __future__ import annotations

import argparse
import hashlib
import itertools
import json
import math
import os
import pathlib
import shutil
import time
from typing import Any, Callable, Iterable, Sequence

SCALES = ("small", "paper")
_REPO = pathlib.Path(__file__).resolve().parent.parent


def default_shared_dir() -> pathlib.Path:
  """``$HYPERMIXER_SHARED_DATA``, else ``../shared/data`` beside the repo."""
  env = os.environ.get("HYPERMIXER_SHARED_DATA")
  return pathlib.Path(env) if env else _REPO.parent / "shared" / "data"


# The flags several experiments share: name -> (type, help). ``parser``
# adds those it is given a default for.
_COMMON_FLAGS = {
    "data_dir": (str, "TFDS data_dir (paper scale)"),
    "models": (str, "comma-separated models to run"),
    "mixers": (str, "comma-separated token mixers to run"),
    "families": (str, "comma-separated model families to run"),
    "seeds": (str, "comma-separated seeds (initialisation and data order)"),
    "steps": (int, "training steps per run (0: the scale's)"),
    "lengths": (str, "comma-separated sequence lengths"),
    "vocab": (str, "small scale: an 8k SentencePiece vocabulary trained on "
              "the experiment's train text (built into OUT/vocab), or T5's "
              "32k", ("small", "t5")),
}


def parser(name: str, description: str, *, report_only: bool = False,
           **defaults: Any) -> argparse.ArgumentParser:
  """The flags every experiment takes (scripts may add their own).

  ``defaults`` adds the shared flags of ``_COMMON_FLAGS`` with these
  defaults (a sequence of names becomes its comma-separated string), e.g.
  ``parser(name, __doc__, models=MODELS, seeds="0,1,2", steps=0)``;
  ``report_only`` adds ``--report_only`` (``Experiment.cell`` then trains
  nothing).
  """
  p = argparse.ArgumentParser(
      description=description,
      formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--scale", choices=SCALES, default="small",
                 help="small: this 2-core machine; paper: the paper's setting")
  p.add_argument("--out", default=f"experiments/results/{name}",
                 help="output directory (results.json, table.md, PNG; the "
                 "runs' checkpoints in runs/ are not committed)")
  p.add_argument("--shared", default=str(default_shared_dir()),
                 help="local data samples (SST-2 TSVs, vocabulary, ...)")
  p.add_argument("--compilation_cache", default="",
                 help="JAX persistent compilation cache directory (default "
                 "OUT/../.jax_cache: runs of the same model compile once)")
  for flag, default in defaults.items():
    if flag not in _COMMON_FLAGS:
      raise ValueError(f"parser: no shared flag --{flag}; add it with "
                       f"p.add_argument (shared: {', '.join(_COMMON_FLAGS)}).")
    kind, help_text, *choices = _COMMON_FLAGS[flag]
    if not isinstance(default, (str, int)):
      default = ",".join(map(str, default))
    p.add_argument(f"--{flag}", type=kind, default=default, help=help_text,
                   choices=choices[0] if choices else None)
  if report_only:
    p.add_argument("--report_only", action="store_true",
                   help="write the table and figure from the recorded runs, "
                   "training nothing")
  return p


def split(text: str, kind: Callable[[str], Any] = str) -> list[Any]:
  """A comma-separated flag's values (``'0,1,2'`` -> ``[0, 1, 2]`` with
  ``kind=int``); empty items are dropped."""
  return [kind(x) for x in text.split(",") if x]


def load_config(file: str, arg: str):
  """``configs/<file>``'s ``get_config(arg)`` (the configs folder is not a
  package: experiments start from the same configs as ``main.py``)."""
  import importlib.util  # pylint: disable=g-import-not-at-top
  spec = importlib.util.spec_from_file_location(
      f"_config_{file[:-3]}", _REPO / "configs" / file)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config(arg)


def parse(p: argparse.ArgumentParser) -> argparse.Namespace:
  """Parses the flags and turns on JAX's persistent compilation cache, so
  that an experiment's runs of one model (seeds, data fractions, a restart)
  reuse its compiled steps."""
  args = p.parse_args()
  import jax  # pylint: disable=g-import-not-at-top
  cache = args.compilation_cache or os.path.join(
      os.path.dirname(os.path.abspath(args.out)), ".jax_cache")
  jax.config.update("jax_compilation_cache_dir", cache)
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)
  return args


def require(path: os.PathLike | str, what: str) -> str:
  """``path`` as a string, or a clear error naming ``what`` and the flag."""
  if not os.path.exists(path):
    raise FileNotFoundError(
        f"{what} not found at {path}; pass --shared=DIR (or set "
        "HYPERMIXER_SHARED_DATA) to the folder holding the data samples.")
  return str(path)


def markdown_table(headers: Sequence[str],
                   rows: Iterable[Sequence[Any]]) -> str:
  """A GitHub Markdown table; floats with 4 significant digits."""
  def cell(v):
    if isinstance(v, float):
      return "nan" if v != v else f"{v:.4g}"
    return str(v)
  lines = ["| " + " | ".join(headers) + " |",
           "| " + " | ".join("---" for _ in headers) + " |"]
  lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
  return "\n".join(lines)


def table_row(headers: Sequence[str], cells: dict[str, Any]) -> list[Any]:
  """A row of a table with ``headers``: ``cells`` by header, '' elsewhere
  (the baselines' rows, which fill a few columns)."""
  unknown = set(cells) - set(headers)
  if unknown:
    raise ValueError(f"table_row: no column {sorted(unknown)}; columns: "
                     f"{list(headers)}.")
  return [cells.get(h, "") for h in headers]


def perplexity_baseline_rows(headers: Sequence[str], base: dict[str, Any],
                             value: str, ratio: str) -> list[list[Any]]:
  """The unigram and add-k bigram rows of a language model table: ``base``'s
  ``unigram`` / ``bigram`` perplexity (``bigram_k`` its k) in column
  ``value``, their ratio to the unigram in column ``ratio``."""
  uni, bi = base["unigram"], base["bigram"]
  return [table_row(headers, {headers[0]: "unigram (train counts, add-1)",
                              value: f"{uni:.1f}", ratio: "1.00"}),
          table_row(headers, {headers[0]: f"bigram (add-{base['bigram_k']:g})",
                              value: f"{bi:.1f}", ratio: f"{bi / uni:.2f}"})]


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


def grid(**axes: Sequence[Any]) -> list[dict[str, Any]]:
  """Every combination of the named axes, the first axis slowest.

  ``grid(model=("a", "b"), seed=(0, 1))`` ->
  ``[{'model': 'a', 'seed': 0}, {'model': 'a', 'seed': 1}, ...]``.
  """
  for name, values in axes.items():
    if isinstance(values, (str, bytes)) or not len(values):  # pylint: disable=g-explicit-length-test
      raise ValueError(f"grid axis {name}={values!r} must be a non-empty "
                       "sequence of values (e.g. seed=(0, 1, 2)).")
  names = list(axes)
  return [dict(zip(names, values))
          for values in itertools.product(*axes.values())]


def cell_key(prefix: str, cell: dict[str, Any]) -> str:
  """``prefix/name=value/...``: a cell's key in ``results.json``."""
  parts = [prefix] if prefix else []
  parts += [f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}"
            for k, v in cell.items()]
  return "/".join(parts)


def mean_sd(values: Sequence[float]) -> tuple[float, float]:
  """Mean and sample standard deviation (ddof=1; 0 for a single value)."""
  values = [float(v) for v in values]
  if not values:
    raise ValueError("mean_sd needs at least one value.")
  mean = sum(values) / len(values)
  if len(values) == 1:
    return mean, 0.0
  var = sum((v - mean) ** 2 for v in values) / (len(values) - 1)
  return mean, math.sqrt(var)


def fmt_mean_sd(values: Sequence[float], scale: float = 1.0,
                digits: int = 1) -> str:
  """``'81.3 ± 0.4 (n=3)'`` of ``scale * values``; ``'81.3 (n=1)'`` for one
  value (it has no spread); '' for no values."""
  if not values:
    return ""
  mean, sd = mean_sd([scale * v for v in values])
  if len(values) == 1:
    return f"{mean:.{digits}f} (n=1)"
  return f"{mean:.{digits}f} ± {sd:.{digits}f} (n={len(values)})"


MIN_SEEDS = 3     # seeds a side before ``verdict`` decides anything


def verdict(ours: Sequence[float], other: Sequence[float],
            paper_says_higher: bool) -> str:
  """Whether seeds of two settings back a paper's claim "ours > other"
  (``paper_says_higher``) or "ours < other".

  'agrees' / 'disagrees' when the difference of the means exceeds the seed
  spread (the sum of the two sample standard deviations), with at least
  ``MIN_SEEDS`` seeds on each side; 'not decided' otherwise. (Two seeds are
  too few: on MNLI a Transformer at 44.4 / 44.6 was ahead of HyperMixer's
  three seeds beyond the spread, and its third seed, 42.4, undid that.)
  """
  if len(ours) < MIN_SEEDS or len(other) < MIN_SEEDS:
    return "not decided"
  (m1, s1), (m2, s2) = mean_sd(ours), mean_sd(other)
  if abs(m1 - m2) <= s1 + s2:
    return "not decided"
  return "agrees" if (m1 > m2) == paper_says_higher else "disagrees"


def file_digest(path: os.PathLike | str) -> str:
  """SHA-256 of a file's bytes (hex), recorded beside what it produced."""
  h = hashlib.sha256()
  with open(path, "rb") as f:
    for chunk in iter(lambda: f.read(1 << 20), b""):
      h.update(chunk)
  return h.hexdigest()


def config_fingerprint(config) -> str:
  """SHA-256 of a run's config (a ``ConfigDict``) with every path of an
  existing file replaced by that file's digest: two configs with the same
  fingerprint train the same run, wherever their files live."""
  def settle(value):
    if isinstance(value, dict):
      return {k: settle(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
      return [settle(v) for v in value]
    if isinstance(value, str) and value and os.path.isfile(value):
      return "file sha256 " + file_digest(value)
    return value
  text = json.dumps(settle(config.to_dict()), sort_keys=True, default=str)
  return hashlib.sha256(text.encode()).hexdigest()


def small_vocab(out: os.PathLike | str, patterns: str | Sequence[str],
                fields: Sequence[str], size: int = 8000) -> dict[str, Any]:
  """An in-domain SentencePiece vocabulary of ``size`` pieces trained on the
  train text only (``hypermixer_jax.data.train_vocab``), cached as
  ``out/vocab/spm<size>.model``.

  Returns ``{'path', 'pieces', 'sha256', 'model_vocab_size'}``:
  ``model_vocab_size`` is the embedding size a model needs (pieces + seqio's
  100 extra ids, rounded up to a multiple of 128).
  """
  from hypermixer_jax.data import train_vocab  # pylint: disable=g-import-not-at-top
  prefix = pathlib.Path(out) / "vocab" / f"spm{size}"
  model = prefix.with_suffix(".model")
  if not model.exists():
    prefix.parent.mkdir(parents=True, exist_ok=True)
    train_vocab.train(patterns, str(prefix), size, fields=tuple(fields))
  return {"path": str(model), "pieces": size, "sha256": file_digest(model),
          "model_vocab_size": -(-(size + 100) // 128) * 128}


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


class Experiment:
  """Results of one experiment directory, saved after every run."""

  def __init__(self, out: os.PathLike | str, args: argparse.Namespace | None
               = None):
    self.out = pathlib.Path(out)
    self.out.mkdir(parents=True, exist_ok=True)
    self.path = self.out / "results.json"
    self.data: dict[str, Any] = {"runs": {}}
    if self.path.exists():
      self.data = json.loads(self.path.read_text(encoding="utf-8"))
    # A report (--report_only) trains nothing and keeps the recorded
    # command's arguments.
    self.report_only = bool(getattr(args, "report_only", False))
    if args is not None and not self.report_only:
      self.data["args"] = {k: _portable(v) for k, v in vars(args).items()}
    self._t0 = time.time()
    self._ran = False      # whether this process ran a cell (wall_s_total)
    self._retired: set[str] = set()   # keys superseded by this process

  @property
  def runs(self) -> dict[str, Any]:
    return self.data["runs"]

  def workdir(self, key: str) -> str:
    # Absolute: Orbax refuses relative checkpoint paths.
    return str((self.out / "runs" / key).resolve())

  def reload(self) -> None:
    """Merges in the runs other processes recorded in ``results.json``."""
    # Several processes may work on one experiment (e.g. one per core, with
    # --order=reverse): runs recorded by the others are kept, never dropped.
    if self.path.exists():
      on_disk = json.loads(self.path.read_text(encoding="utf-8"))
      self.data["runs"] = {**{k: v for k, v in on_disk.get("runs", {}).items()
                              if k not in self._retired},
                           **self.data["runs"]}

  def _claim(self, key: str) -> bool:
    """True when this process may run ``key``; False after waiting for
    another live process that claimed it (its result is then merged in)."""
    claims = self.out / "claims"
    claims.mkdir(exist_ok=True)
    path = claims / (key.replace("/", "__") + ".pid")
    while True:
      try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
      except FileExistsError:
        try:
          pid = int(path.read_text() or 0)
        except (OSError, ValueError):
          pid = 0
        if pid and pid != os.getpid() and _alive(pid):
          time.sleep(10)
          self.reload()
          if key in self.runs:
            return False
          continue
        path.unlink(missing_ok=True)  # its process died: take it over
        continue
      with os.fdopen(fd, "w") as f:
        f.write(str(os.getpid()))
      return True

  def run(self, key: str, fn: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """``fn()``'s result under ``key``; skipped when already recorded (by
    this or another process working on the same directory)."""
    self.reload()
    if key not in self.runs and self._claim(key):
      t0 = time.time()
      result = dict(fn())
      result.setdefault("wall_s", time.time() - t0)
      self._ran = True
      self.runs[key] = result
      self.save()
      print(f"[{self.out.name}] {key}: "
            + json.dumps({k: v for k, v in result.items()
                          if not isinstance(v, (dict, list))}), flush=True)
    return self.runs[key]

  def adopt(self, key: str, config, source: os.PathLike | str,
            source_key: str, source_config) -> dict[str, Any] | None:
    """Records another experiment's run as this one's ``key``, instead of
    training it again, when both train the same run: ``source_key`` is
    recorded in ``source``'s ``results.json`` and ``source_config`` (the
    config the source trained it with) has ``config``'s fingerprint (equal
    settings, files of equal content). The record keeps where it came from
    (``adopted_from``). Returns it, or None (nothing recorded) when the
    source lacks the run or the configs differ (``run`` then trains it), or
    in a report (which records nothing)."""
    self.reload()
    if key in self.runs or self.report_only:
      return self.runs.get(key)
    source = pathlib.Path(source)
    path = source / "results.json"
    if not path.exists():
      return None
    run = json.loads(path.read_text(encoding="utf-8"))["runs"].get(source_key)
    if run is None or (config_fingerprint(config)
                       != config_fingerprint(source_config)):
      return None
    self.runs[key] = dict(run, adopted_from=f"{source.name}: {source_key}")
    self.save()
    print(f"[{self.out.name}] {key}: adopted from {source.name} "
          f"({source_key}), the same config", flush=True)
    return self.runs[key]

  def supersede(self, key: str, why: str) -> None:
    """Retires ``key``'s recorded result: it moves to ``superseded[key]``
    with ``why`` (kept, for the record) and its work directory to
    ``runs/superseded/`` (a run there would resume from its checkpoints),
    so that the cell runs again. A report leaves the cell out."""
    result = self.runs.pop(key)
    self._retired.add(key)
    self.data.setdefault("superseded", {})[key] = dict(
        result, superseded_because=why)
    print(f"[{self.out.name}] {key}: superseded ({why})", flush=True)
    if self.report_only:   # a report changes nothing on disk
      return
    old = pathlib.Path(self.workdir(key))
    if old.exists():
      dest = self.out / "runs" / "superseded" / key
      dest.parent.mkdir(parents=True, exist_ok=True)
      if dest.exists():
        shutil.rmtree(dest)
      old.rename(dest)
    self.save()

  def cell(self, key: str, fn: Callable[[], dict[str, Any]]
           ) -> dict[str, Any] | None:
    """A grid cell's result: ``run(key, fn)``, or in a report
    (``--report_only``) the recorded result, None where there is none."""
    if self.report_only:
      self.reload()
      return self.runs.get(key)
    return self.run(key, fn)

  def cells(self, prefix: str, cells: Iterable[dict[str, Any]],
            fn: Callable[[dict[str, Any], str], dict[str, Any]],
            by: str = "model",
            expect: Callable[[dict[str, Any]], dict[str, Any]] | None = None
            ) -> dict[Any, list[dict[str, Any]]]:
    """Every cell under ``cell_key(prefix, cell)`` (``fn(cell, key)`` runs
    it), grouped by ``cell[by]`` in grid order: ``{value: [result, ...]}``
    (e.g. each model's seeds); a report leaves out the cells not recorded.

    ``expect(cell)``: fields (e.g. the parameter count) a recorded result
    of the cell must hold; a result that holds other values was made by
    another setting of the cell, and is retired (``supersede``) and run
    again rather than mixed into the current setting's seeds."""
    out: dict[Any, list[dict[str, Any]]] = {}
    for c in cells:
      key = cell_key(prefix, c)
      if expect is not None and key in self.runs:
        want = expect(c)
        got = {k: self.runs[key].get(k) for k in want}
        if got != want:
          self.supersede(key, f"recorded {got}, the cell now has {want}")
      result = self.cell(key, lambda c=c, key=key: fn(c, key))
      if result is not None:
        out.setdefault(c[by], []).append(result)
    return out

  def baseline(self, key: str, fn: Callable[[], dict[str, Any]]
               ) -> dict[str, Any]:
    """The trivial baselines recorded under ``key`` in ``results.json``'s
    ``baselines``: ``fn()``, computed and saved the first time they are
    asked for (in a report too)."""
    bases = self.data.setdefault("baselines", {})
    if key not in bases:
      bases[key] = fn()
      self.save()
    return bases[key]

  def vocab(self, patterns: str | Sequence[str], fields: Sequence[str],
            size: int, trained_on: str) -> dict[str, Any]:
    """``small_vocab`` built in this directory and recorded in
    ``results.json`` (its path relative to the directory, and what it was
    trained on)."""
    vocab = small_vocab(self.out, patterns, fields, size)
    self.save(vocab={**vocab, "path": f"vocab/spm{size}.model",
                     "trained_on": trained_on})
    return vocab

  def save(self, **extra) -> None:
    self.data.update(extra)
    self.reload()
    tmp = self.path.with_suffix(f".json.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(self.data, indent=1, default=float),
                   encoding="utf-8")
    tmp.replace(self.path)

  def write_table(self, title: str, table: str, notes: str = "", *,
                  name: str = "table") -> str:
    """Writes ``<name>.md`` (title, table, notes) and prints it."""
    text = f"## {title}\n\n{table}\n"
    if notes:
      text += f"\n{notes.strip()}\n"
    (self.out / f"{name}.md").write_text(text, encoding="utf-8")
    if self._ran:  # a report from recorded runs adds no run time
      self.save(wall_s_total=self.data.get("wall_s_total", 0.0)
                + time.time() - self._t0)
    print(text, flush=True)
    return text

  def figure_path(self, name: str) -> str:
    return str(self.out / f"{name}.png")

  def save_figure(self, fig, name: str) -> None:
    """Writes ``fig`` as ``<name>.png`` beside the table."""
    fig.savefig(self.figure_path(name), dpi=120)


def _portable(value: Any) -> Any:
  """A path inside the repository's folder as a path relative to the
  repository (recorded commands carry no machine's absolute paths)."""
  if isinstance(value, str) and os.path.isabs(value):
    rel = os.path.relpath(value, _REPO)
    if rel.split(os.sep)[:2] != [os.pardir, os.pardir]:
      return rel
  return value


def _alive(pid: int) -> bool:
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:
    return True
  return True


def train(config, workdir: str, *, with_params: bool = False
          ) -> dict[str, Any]:
  """Trains ``config`` in ``workdir`` and returns what an experiment records.

  ``{'eval': final evaluation metrics, 'step': last step, 'source': where
  the run started from ('scratch', 'init_checkpoint' or 'workdir': resumed),
  'eval_curve': {step: metrics}, 'train_curve': {step: metrics}}``; curves
  come from the run's ``metrics.jsonl``. A workdir that already holds checkpoints resumes.
  With ``with_params`` the result also holds ``'params'``, the trained
  parameters (``trained_params``): use them, then drop them before the result
  is recorded (they are not JSON).
  """
  from hypermixer_jax.train import loop  # pylint: disable=g-import-not-at-top
  from hypermixer_jax.train import metrics  # pylint: disable=g-import-not-at-top
  result = loop.train_and_evaluate(config, workdir)
  if isinstance(result, dict):  # {name: RunResult}, main model first
    result = next(iter(result.values()))
  curves = {split: {int(s): r for s, r in
                    metrics.read_metrics(workdir, split).items()}
            for split in ("train", "eval")}
  out = {"eval": dict(result.eval_metrics), "step": int(result.step),
         "source": result.source, "eval_curve": curves["eval"],
         "train_curve": curves["train"]}
  if with_params:
    out["params"] = trained_params(config, workdir, result)
  return out


def trained_params(config, workdir: str, result: Any = None):
  """The parameters a run in ``workdir`` ended with.

  ``result.state.params`` when the training loop's result carries its final
  state; otherwise they are read from the newest checkpoint in ``workdir``
  into the freshly initialised model of ``config.model``.
  """
  state = getattr(result, "state", None)
  if state is not None:
    return state.params
  import flax.linen as nn  # pylint: disable=g-import-not-at-top
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from hypermixer_jax.models import zoo  # pylint: disable=g-import-not-at-top
  from hypermixer_jax.train import checkpoint  # pylint: disable=g-import-not-at-top
  x = zoo.dummy_inputs(config.model)
  params = zoo.build_model(config.model).init(
      jax.random.key(0), jnp.zeros(x.shape, x.dtype))["params"]
  return checkpoint.load_pretrained(workdir, nn.unbox(params), reinit=())


def figure(ncols: int = 1, nrows: int = 1, size=(5.0, 3.6)):
  """``(fig, axes)`` of a matplotlib ``Figure`` that needs no pyplot backend
  (nothing global changes in a notebook); save with ``fig.savefig(path)``."""
  from matplotlib.figure import Figure  # pylint: disable=g-import-not-at-top
  fig = Figure(figsize=(size[0] * ncols, size[1] * nrows), layout="constrained")
  axes = fig.subplots(nrows, ncols, squeeze=False)
  return fig, axes


def flops_per_step(run: dict[str, Any]) -> float:
  """XLA's per-device FLOPs of one train step of a recorded run (the whole
  step, on one device), from its logged throughput: ``tflops_per_device /
  steps_per_sec`` of the last logged interval, the loop's count of the
  compiled step, so it does not depend on the machine's load. NaN when the
  run logged none."""
  train = run.get("train_curve", {})
  logs = [train[s] for s in sorted(train, key=int)
          if "tflops_per_device" in train[s]]
  if not logs:
    return float("nan")
  return logs[-1]["tflops_per_device"] * 1e12 / logs[-1]["steps_per_sec"]


def curve(run: dict[str, Any], metric: str, scale: float = 1.0
          ) -> tuple[list[int], list[float]]:
  """``(steps, scale * metric)`` of a run's evaluation curve (its steps are
  ints in a fresh result, strings once read back from ``results.json``)."""
  points = run["eval_curve"]
  steps = sorted(points, key=int)
  return [int(s) for s in steps], [scale * points[s][metric] for s in steps]


def mean_curve(runs: Sequence[dict[str, Any]], metric: str,
               scale: float = 1.0):
  """``(steps, values [runs, steps])``: the evaluation curves of ``runs``
  (e.g. the seeds of one model) at the steps all of them evaluated."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  curves = [dict(zip(*curve(r, metric, scale))) for r in runs]
  steps = sorted(set.intersection(*[set(c) for c in curves]))
  return steps, np.array([[c[s] for s in steps] for c in curves])


def plot_curves(ax, runs: dict[str, Sequence[dict[str, Any]]], metric: str,
                label: Callable[[str], str], scale: float = 1.0) -> None:
  """Every run's evaluation curve of ``metric`` against step on ``ax``:
  ``runs`` is ``{name: [run of each seed]}``, one colour and one legend
  entry (``label(name)``) per name."""
  for i, (name, seed_runs) in enumerate(runs.items()):
    for j, run in enumerate(seed_runs):
      ax.plot(*curve(run, metric, scale), marker="o", ms=3, color=f"C{i}",
              alpha=0.8, label=label(name) if j == 0 else None)


def baseline_lines(ax, lines: dict[str, float]) -> None:
  """The trivial baselines as horizontal lines on ``ax`` (``{label: y}``;
  black dashed, then grey dotted)."""
  styles = itertools.cycle((("k", "--"), ("grey", ":")))
  for (name, y), (color, ls) in zip(lines.items(), styles):
    ax.axhline(y, color=color, ls=ls, lw=0.8, label=name)


def style_axes(ax, xlabel: str, ylabel: str, *, xscale: str = "",
               yscale: str = "", title: str = "", legend: float = 7,
               legend_outside: bool = False) -> None:
  """A figure's axis labels, scales (``'log'``, or ``'log2'`` for base 2),
  title and legend (font size ``legend``; 0: no legend; ``legend_outside``:
  right of the axes, for plots whose curves fill them)."""
  for scale, set_scale in ((xscale, ax.set_xscale), (yscale, ax.set_yscale)):
    if scale:
      set_scale("log", **({"base": 2} if scale == "log2" else {}))
  ax.set_xlabel(xlabel)
  ax.set_ylabel(ylabel)
  if title:
    ax.set_title(title)
  if legend and legend_outside:
    ax.legend(fontsize=legend, loc="upper left", bbox_to_anchor=(1.02, 1.0),
              borderaxespad=0.0)
  elif legend:
    ax.legend(fontsize=legend)


def time_rounds(calls: dict[str, Callable[[], Any]], rounds: int,
                min_seconds: float = 0.0,
                clock: Callable[[], float] = time.perf_counter
                ) -> dict[str, list[float]]:
  """Seconds of every call of ``calls`` (each must block until its result is
  ready), timed in interleaved rounds, one call of each per round, so that a
  change of the machine's load hits all of them alike: at least ``rounds``
  rounds, and more while a call's times add up to less than
  ``min_seconds``."""
  times: dict[str, list[float]] = {name: [] for name in calls}
  done = 0
  while done < rounds or any(sum(t) < min_seconds for t in times.values()):
    for name, call in calls.items():
      t0 = clock()
      call()
      times[name].append(clock() - t0)
    done += 1
  return times


def compiled_bytes(compiled) -> int:
  """Memory a compiled JAX call needs: XLA's memory analysis, temporaries +
  arguments + outputs (0 where the backend gives none)."""
  mem = compiled.memory_analysis()
  if mem is None:
    return 0
  return int(sum(getattr(mem, f, 0) or 0 for f in (
      "temp_size_in_bytes", "argument_size_in_bytes",
      "output_size_in_bytes")))
