"""The command line every experiment shares: its flags, the configs it
starts from, and where the local data samples are."""
from __future__ import annotations

import argparse
import os
import pathlib
from typing import Any, Callable

from hypermixer_jax import runtime


SCALES = ("small", "paper")
REPO = pathlib.Path(__file__).resolve().parents[2]


def default_shared_dir() -> pathlib.Path:
  """``$HYPERMIXER_SHARED_DATA``, else ``../shared/data`` beside the repo."""
  env = os.environ.get("HYPERMIXER_SHARED_DATA")
  return pathlib.Path(env) if env else REPO.parent / "shared" / "data"


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

  Experiments train in-process, so building their parser first in
  ``main`` stands for ``main.run()``'s start-up: libtpu (installed for
  compile mode) must not start on a machine without TPU chips, which has
  to be settled before JAX's first device query, as must
  ``runtime.retain_host_memory``.
  """
  runtime.prepare_host()
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


def tune_flags(p: argparse.ArgumentParser, carved_from: str,
               table: str = "table_tuned.md", *,
               budget_check: bool = False) -> None:
  """Adds ``--tune`` (every model's learning rate and warm-up chosen alike
  on ``carved_from``, carved from the training data: ``selection.tune``;
  its report in ``table``), ``--lrs`` (the search's rates) and
  ``--order``; ``budget_check``: also ``--budget_check`` (``check_budget``),
  the training length judged on the carved split."""
  p.add_argument("--tune", action="store_true",
                 help=f"small scale: every model's learning rate and warm-up "
                 f"chosen alike on {carved_from.replace('%', '%%')} carved "
                 "from the training "
                 "set, then the seeds at each model's choice "
                 f"({table})")
  p.add_argument("--lrs", default="",
                 help="--tune: the search's learning rates, the same for "
                 "every model (default: selection.LRS, 3e-4,1e-3,3e-3); "
                 "rates appended after the recorded ones keep their runs "
                 "(another order is refused: settings are keyed by place)")
  p.add_argument("--order", choices=("forward", "reverse"), default="forward",
                 help="--tune: reverse runs the grids from their last cell "
                 "(a second process on the same --out)")
  if budget_check:
    p.add_argument("--budget_check", default="", help="with --tune: "
                   "training lengths (e.g. 500) at which each model's choice "
                   "is also trained and scored on the carved validation "
                   "split (the length rule's check)")


def check_tune(args: argparse.Namespace, carved_from: str) -> None:
  """``--tune`` needs the small scale, which carves its validation split
  from local training files."""
  if args.tune and args.scale != "small":
    raise SystemExit(f"--tune: the small scale carves its validation split "
                     f"from {carved_from}; use --scale=small.")


def check_budget(args: argparse.Namespace) -> None:
  """``--budget_check`` trains each model's choice of ``--tune``'s search
  at other lengths, so it needs ``--tune``."""
  if getattr(args, "budget_check", "") and not args.tune:
    raise SystemExit("--budget_check: it trains each model's setting chosen "
                     "by --tune at other lengths; add --tune.")


def split(text: str, kind: Callable[[str], Any] = str) -> list[Any]:
  """A comma-separated flag's values (``'0,1,2'`` -> ``[0, 1, 2]`` with
  ``kind=int``); empty items are dropped."""
  return [kind(x) for x in text.split(",") if x]


def load_config(file: str, arg: str):
  """``configs/<file>``'s ``get_config(arg)`` (the configs folder is not a
  package: experiments start from the same configs as ``main.py``)."""
  import importlib.util  # pylint: disable=g-import-not-at-top
  spec = importlib.util.spec_from_file_location(
      f"_config_{file[:-3]}", REPO / "configs" / file)
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
