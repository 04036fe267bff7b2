"""The docs stay readable: short pages, short prose lines, links that resolve,
and the README's commands the ones CI runs."""
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
GUIDES = sorted((ROOT / "docs").glob("*.md"))
MAX_LINES = {"README.md": 300, "experiments/README.md": 300,
             **{f"docs/{p.name}": 400 for p in GUIDES}}
PROSE_WIDTH = 100
LINKED = ["README.md", "experiments/README.md", "CONTRIBUTING.md",
          *[f"docs/{p.name}" for p in GUIDES],
          *[str(p.relative_to(ROOT))
            for p in sorted(ROOT.glob("experiments/results/*/README.md"))]]


def _prose_lines(text):
  """(line number, line) outside code blocks, tables and included tables."""
  fence = include = False
  for number, line in enumerate(text.splitlines(), 1):
    if line.lstrip(" ").startswith("```"):
      fence = not fence
    elif line.startswith("<!-- table:"):
      include = True
    elif line.startswith("<!-- /table"):
      include = False
    elif not (fence or include or line.startswith("|")):
      yield number, line


def test_every_guide_the_readme_promises_exists():
  names = {p.name for p in GUIDES}
  assert {"training.md", "finetuning.md", "data.md", "pods.md",
          "performance.md", "experiments.md"} <= names, sorted(names)


@pytest.mark.parametrize("path", sorted(MAX_LINES))
def test_pages_are_short_and_their_prose_lines_fit(path):
  text = (ROOT / path).read_text()
  lines = text.count("\n")
  assert lines <= MAX_LINES[path], (
      f"{path} has {lines} lines, more than {MAX_LINES[path]}: move a section "
      f"into a guide under docs/ or an experiment's page and link it")
  # A URL cannot be wrapped, so a link's target does not count.
  long = [n for n, line in _prose_lines(text)
          if len(re.sub(r"\(https?://[^)\s]*\)", "()", line)) > PROSE_WIDTH]
  assert not long, (f"{path}: prose lines over {PROSE_WIDTH} characters at "
                    f"lines {long} (wrap them)")


@pytest.mark.parametrize("path", LINKED)
def test_relative_links_resolve(path):
  page = ROOT / path
  text = re.sub(r"^ *```.*?^ *```", "", page.read_text(),
                flags=re.DOTALL | re.MULTILINE)
  broken = []
  for target in re.findall(r"\]\(([^)\s]+)\)", text):
    if re.match(r"[a-z]+:", target) or target.startswith("#"):
      continue
    if not (page.parent / target.split("#")[0]).exists():
      broken.append(target)
  assert not broken, f"{path} links to files that do not exist: {broken}"


def _code(text):
  return "\n".join(re.findall(r"^```\w*\n(.*?)^```", text,
                              flags=re.DOTALL | re.MULTILINE))


def test_readme_set_up_and_test_commands_are_the_ones_ci_runs():
  readme = _code((ROOT / "README.md").read_text())
  ci = (ROOT / ".ci" / "run").read_text()
  test_command = re.search(r"^python -m pytest .*$", ci, re.MULTILINE).group(0)
  assert test_command in readme.splitlines(), (
      f"README.md's test command differs from .ci/run's {test_command!r}")
  install = re.search(r'pip install[^\n]*-e "\.\[([\w,]+)\]"', ci).group(1)
  extras = re.search(r'pip install -e "\.\[([\w,]+)\]"', readme)
  assert extras and set(extras.group(1).split(",")) <= set(install.split(",")), (
      f"README.md installs extras {extras and extras.group(1)} that .ci/run "
      f"does not test ({install})")
