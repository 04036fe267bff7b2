"""Executes every code cell of the Colab notebooks, so that one that rots fails.

Cells are run in order in one namespace, in quick mode
(``HYPERMIXER_COLAB_QUICK=1``: a few training steps, tiny sizes). The install
cell runs too: its guard must leave this checkout's own install alone (the
commands it would run on Colab are checked with ``subprocess.run`` faked).
Shell and magic cells (``!...``, ``%...``) would be skipped; there are none.
"""
import importlib.util
import json
import pathlib
import subprocess
import sys
import tempfile
import types

import matplotlib
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "colabs").glob("*.ipynb"))


def _code_cells(path):
  nb = json.loads(path.read_text(encoding="utf-8"))
  assert nb["nbformat"] == 4, path
  for cell in nb["cells"]:
    assert cell["cell_type"] in ("code", "markdown", "raw"), cell
    assert isinstance(cell["source"], list)
    if cell["cell_type"] == "code":
      assert cell["outputs"] == [] and cell["execution_count"] is None, (
          f"{path.name}: commit notebooks without outputs")
      yield "".join(cell["source"])


def test_notebooks_are_found():
  assert {p.name for p in NOTEBOOKS} >= {"quickstart.ipynb",
                                         "finetune_glue.ipynb"}


def _is_shell(source):
  """A cell whose first statement is a shell command or an IPython magic."""
  lines = [l.strip() for l in source.splitlines()]
  first = next((l for l in lines if l and not l.startswith("#")), "")
  return first.startswith(("!", "%"))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
@pytest.mark.slow
def test_notebook_runs(path, request, tmp_path, monkeypatch):
  monkeypatch.setenv("HYPERMIXER_COLAB_QUICK", "1")
  monkeypatch.setenv("HYPERMIXER_ROOT", str(ROOT))
  if path.stem == "finetune_glue":  # offline only with the local samples
    monkeypatch.setenv("HYPERMIXER_SHARED_DATA",
                       str(request.getfixturevalue("shared_data")))
  monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
  monkeypatch.chdir(tmp_path)
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  namespace = {"__name__": "__main__"}
  try:
    for i, source in enumerate(_code_cells(path)):
      if _is_shell(source):
        continue
      exec(compile(source, f"{path.name}[cell {i}]", "exec"), namespace)  # pylint: disable=exec-used
  finally:
    plt.close("all")


REPO = "https://example.org/fork/hypermixer-jax"


def _install(path, monkeypatch, *, colab=False, installed=True):
  """``(commands run, namespace)`` of the notebook's install cell, with
  ``subprocess.run`` faked, on Colab or not, with the library importable or
  not."""
  [cell] = [s for s in _code_cells(path) if "INSTALL = [" in s]
  ran = []
  monkeypatch.setattr(subprocess, "run", lambda command, **kw: ran.append(
      command) or subprocess.CompletedProcess(command, 0, "", ""))
  if colab:
    monkeypatch.setitem(sys.modules, "google.colab",
                        types.ModuleType("google.colab"))
  else:
    monkeypatch.delitem(sys.modules, "google.colab", raising=False)
  if not installed:
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: (
        None if name == "hypermixer_jax" else real(name, *a)))
  namespace = {"ROOT": "/content/hypermixer-jax", "REF": "main",
               "REPO_URL": REPO}
  exec(compile(cell, f"{path.name}[install]", "exec"), namespace)  # pylint: disable=exec-used
  return ran, namespace


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_install_runs_only_on_colab_or_without_the_library(
    path, monkeypatch, capsys):
  """Run locally (nbconvert, "Run all") beside an installed checkout, the
  install cell leaves that install alone; on Colab, or where the library is
  missing, it clones and installs."""
  ran, _ = _install(path, monkeypatch)
  assert ran == []
  assert capsys.readouterr().out == (
      f"hypermixer_jax is installed already ({ROOT / 'hypermixer_jax'}): "
      "nothing to install\n")
  on_colab, _ = _install(path, monkeypatch, colab=True)
  assert on_colab[0] == (f"test -d /content/hypermixer-jax || git clone -q "
                         f"--depth 1 --branch main {REPO} "
                         "/content/hypermixer-jax")
  assert on_colab[2] == (f"{sys.executable} -m pip install -q -c "
                         "/tmp/colab_keep.txt /content/hypermixer-jax")
  missing, _ = _install(path, monkeypatch, installed=False)
  assert missing == on_colab


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_install_keeps_colabs_jax_and_needs_no_restart(path, monkeypatch):
  """One variable holds the repository; the install pins Colab's own
  jax/jaxlib/TensorFlow (constraints), is not editable, and nothing switches
  matplotlib's backend."""
  sources = list(_code_cells(path))
  assert sum("REPO_URL = " in s for s in sources) == 1
  assert not any(_is_shell(s) for s in sources)
  shell, _ = _install(path, monkeypatch, colab=True)
  assert not any("github.com" in l for l in shell), shell
  installs = [l for l in shell if "pip install" in l]
  assert installs and all("-c /tmp/colab_keep.txt" in l for l in installs)
  assert not any(" -e " in l or "jax[" in l or "--upgrade" in l
                 for l in installs), installs
  assert not any("matplotlib.use" in s for s in sources)


def test_constraints_line_pins_jax_and_tensorflow(monkeypatch):
  """The notebooks' `pip freeze | grep` keeps exactly the packages Colab's
  runtime provides and the library must not replace."""
  import re  # pylint: disable=g-import-not-at-top
  shell, _ = _install(NOTEBOOKS[0], monkeypatch, colab=True)
  [line] = [l for l in shell if "pip freeze" in l]
  pattern = re.search(r"grep -iE '([^']+)'", line).group(1)
  monkeypatch.undo()   # the real subprocess.run again
  freeze = subprocess.run([sys.executable, "-m", "pip", "freeze"],
                          capture_output=True, text=True, check=True).stdout
  kept = {l.split("==")[0].lower() for l in freeze.splitlines()
          if re.search(pattern, l, re.IGNORECASE)}
  assert {"jax", "jaxlib", "tensorflow", "numpy"} <= kept, kept
  assert not kept & {"flax", "seqio", "optax", "tensorflow-text"}, kept
  # Colab's accelerator builds of jax are kept too.
  for name in ("libtpu==0.0.42", "jax-cuda12-plugin==0.10.2",
               "jax-cuda12-pjrt==0.10.2"):
    assert re.search(pattern, name, re.IGNORECASE), name


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_empty_repo_url_stops_with_a_message_and_a_checkout_is_used(
    path, tmp_path, monkeypatch):
  """The repository is a Colab form field: empty, and with no checkout
  around, the first cell stops saying what to set; from a checkout it is
  that checkout that gets installed."""
  sources = list(_code_cells(path))
  [cell] = [s for s in sources if "REPO_URL = " in s]
  assert 'REPO_URL = ""  # @param {type:"string"}' in cell
  monkeypatch.delenv("HYPERMIXER_ROOT", raising=False)
  monkeypatch.chdir(tmp_path)
  with pytest.raises(SystemExit, match=r"REPO_URL is empty and no "
                     r"hypermixer-jax checkout is here: set REPO_URL in the "
                     r"form above"):
    exec(compile(cell, "cell", "exec"), {})  # pylint: disable=exec-used
  monkeypatch.chdir(ROOT / "colabs")   # Jupyter started in the checkout
  namespace = {}
  exec(compile(cell, "cell", "exec"), namespace)  # pylint: disable=exec-used
  assert namespace["ROOT"] == str(ROOT)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_open_in_colab_badge(path):
  nb = json.loads(path.read_text(encoding="utf-8"))
  first = "".join(nb["cells"][0]["source"])
  assert ("[![Open In Colab](https://colab.research.google.com/assets/"
          "colab-badge.svg)](https://colab.research.google.com/github/") in first
  assert first.split("](https://colab.research.google.com/github/")[1].split(
      ")")[0].endswith(f"/blob/main/colabs/{path.name}")
