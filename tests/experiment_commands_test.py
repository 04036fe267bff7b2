"""The experiment commands the project gives: every report command of
scripts/reports.sh and every ``python experiments/...`` command of the
pages parses with its script's flags (a flag renamed in a script would
otherwise break them only when someone runs one)."""
import argparse
import pathlib
import re
import shlex
import sys

import pytest

import script_modules

ROOT = pathlib.Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "reports.sh"


def _commands() -> list[list[str]]:
  """Each ``run experiments/<name>.py ...`` line of the script (continued
  lines joined), as its arguments with ``$R`` expanded."""
  text = SCRIPT.read_text().replace("\\\n", " ")
  out = []
  for line in text.splitlines():
    words = shlex.split(line.replace("$R", "experiments/results"))
    if words[:1] == ["run"] and words[1].startswith("experiments/"):
      out.append(words[1:])
  return out


class _Parsed(Exception):
  pass


def test_the_script_reports_every_study_with_a_tune_table():
  scripts = {c[0] for c in _commands()}
  tuned = {c[0] for c in _commands() if "--tune" in c}
  assert len(_commands()) >= 20
  for path in sorted(ROOT.glob("experiments/results/*/table_tuned*.md")):
    study = path.parent.name
    if study == "synthetic_data_efficiency_paper":
      continue
    assert f"experiments/{study}.py" in tuned, study
  assert "experiments/causal_lm.py" in scripts
  # Every --tune report names its grid: the default would be refused or cut
  # the recorded search short.
  for c in _commands():
    if "--tune" in c:
      assert any(a.startswith("--lrs=") for a in c), c


PAGES = sorted([ROOT / "README.md", ROOT / "experiments" / "README.md",
                *ROOT.glob("docs/*.md"),
                *ROOT.glob("experiments/results/*/README.md")])


def _page_commands() -> list[tuple[str, list[str]]]:
  """(page, arguments) of each ``[taskset -c N] python experiments/X.py``
  command in a page's code blocks (continued lines joined, comments and
  shell variables dropped)."""
  out = []
  for page in PAGES:
    text = page.read_text().replace("\\\n", " ")
    for line in text.splitlines():
      if not re.match(r"\s*(taskset -c \d+ )?python experiments/\S+\.py",
                      line):
        continue
      words = shlex.split(line.split(" #")[0].strip(), comments=True)
      if words[:2] == ["taskset", "-c"]:
        words = words[3:]
      if ">" in words:   # the output redirected
        words = words[:words.index(">")]
      if words[:1] == ["python"] and "<" not in words[1]:
        args = [w for w in words[1:] if "$" not in w and "CIFAR_DIR" not in w]
        out.append((str(page.relative_to(ROOT)), args))
  return out


def _parses(command: list[str], monkeypatch, report_only: bool) -> None:
  original = argparse.ArgumentParser.parse_args

  def parse_then_stop(self, args=None, namespace=None):
    parsed = original(self, args, namespace)   # SystemExit(2) on a bad flag
    assert getattr(parsed, "report_only", False) or not report_only
    raise _Parsed

  monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_then_stop)
  monkeypatch.setattr(sys, "argv", command)
  module = script_modules.load(command[0])
  with pytest.raises(_Parsed):
    module.main()


@pytest.mark.parametrize("command", _commands(), ids=lambda c: " ".join(
    [pathlib.Path(c[0]).stem] + [a.split("=")[0] for a in c[1:]]))
def test_each_report_command_parses(command, monkeypatch):
  _parses(command, monkeypatch, report_only=True)


def test_the_pages_give_commands():
  assert len(_page_commands()) >= 50


@pytest.mark.parametrize("page,command", _page_commands(),
                         ids=lambda x: x if isinstance(x, str) else " ".join(
                             [pathlib.Path(x[0]).stem]
                             + [a.split("=")[0] for a in x[1:]]))
def test_each_command_of_the_pages_parses(page, command, monkeypatch):
  del page
  _parses(command, monkeypatch, report_only=False)
