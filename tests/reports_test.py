"""Every committed table is what the report code writes from the committed
record: each `--report_only` command of scripts/reports.sh, run here on a
copy of its experiment's folder, writes the same `table*.md` files (a
table edited by hand, or left stale by a change of the report code, fails;
the claims table has its own test in experiment_claims_test.py)."""
import pathlib
import shlex
import shutil
import sys

import pytest

import script_modules

ROOT = pathlib.Path(__file__).resolve().parent.parent
REPORTS = ROOT / "scripts" / "reports.sh"


def _commands():
  """The script's report commands (``run experiments/X.py ...``), with
  ``$R`` spelled out; `-m` modules and helper scripts are left to their own
  tests."""
  text = REPORTS.read_text().replace("\\\n", " ")
  commands = []
  for line in text.splitlines():
    line = line.strip()
    if not line.startswith("run experiments/"):
      continue
    commands.append(shlex.split(
        line.removeprefix("run ").replace("$R", "experiments/results")))
  return commands


def _out(argv):
  return next(a.split("=", 1)[1] for a in argv if a.startswith("--out="))


def test_every_report_names_its_folder():
  commands = _commands()
  assert len(commands) > 10, "scripts/reports.sh: no report commands found"
  for argv in commands:
    assert "--report_only" in argv, argv
    assert (ROOT / _out(argv) / "results.json").is_file(), argv


@pytest.mark.parametrize(
    "argv", _commands(),
    ids=lambda a: " ".join(x for x in a[1:] if not x.startswith("--out"))
    [:80] + f" [{pathlib.Path(a[0]).stem}]")
def test_committed_tables_are_what_the_report_writes(argv, tmp_path,
                                                     monkeypatch, shared_data):
  # (A report reads the sample data's digests and the studies' shared
  # vocabulary store, experiments/results/vocab/, beside its folder.)
  del shared_data
  folder = _out(argv)
  committed = ROOT / folder
  copy = tmp_path / folder
  shutil.copytree(committed, copy,
                  ignore=shutil.ignore_patterns("runs", "claims", "*.lock"))
  store = ROOT / "experiments" / "results" / "vocab"
  if store.is_dir():
    shutil.copytree(store, tmp_path / "experiments" / "results" / "vocab")
  monkeypatch.chdir(tmp_path)
  monkeypatch.setattr(sys, "argv", list(argv))
  script_modules.load(argv[0]).main()
  written = sorted(p.relative_to(copy) for p in copy.rglob("table*.md"))
  assert written, f"{argv[0]} wrote no table under {folder}"
  stale = [str(rel) for rel in written
           if (committed / rel).read_text() != (copy / rel).read_text()]
  assert not stale, (
      f"{folder}: {stale} differ from what `{' '.join(argv)}` writes from "
      "the committed results.json (a table edited by hand, or report code "
      "changed since): run scripts/reports.sh and commit the tables")
