"""scripts/reports.sh: every report command parses with its script's flags
(a flag renamed in a script would otherwise break the rebuild of the
committed tables only when someone runs it)."""
import argparse
import pathlib
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


@pytest.mark.parametrize("command", _commands(), ids=lambda c: " ".join(
    [pathlib.Path(c[0]).stem] + [a.split("=")[0] for a in c[1:]]))
def test_each_report_command_parses(command, monkeypatch):
  original = argparse.ArgumentParser.parse_args

  def parse_then_stop(self, args=None, namespace=None):
    parsed = original(self, args, namespace)   # SystemExit(2) on a bad flag
    assert parsed.report_only
    raise _Parsed

  monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_then_stop)
  monkeypatch.setattr(sys, "argv", command)
  module = script_modules.load(command[0])
  with pytest.raises(_Parsed):
    module.main()
