"""Executes every code cell of the Colab notebooks, so that one that rots fails.

Cells are run in order in one namespace, in quick mode
(``HYPERMIXER_COLAB_QUICK=1``: a few training steps, tiny sizes). Shell and
magic cells (``!pip install ...``, ``%...``) are Colab set-up and skipped.
"""
import json
import pathlib
import tempfile

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
