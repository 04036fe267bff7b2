"""The experiments' entry points and the shape of their folders: scripts
import only the library, edit no sys.path, and stay short."""
import ast
import importlib.util
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None,
                    reason="libtpu is not installed")
@pytest.mark.parametrize("entry", [
    "from hypermixer_jax.experiment import flags; flags.parser('x', 'doc')",
    "from hypermixer_jax.experiment import bench; bench.parser('doc')",
])
def test_script_parsers_keep_libtpu_out(entry):
  """An experiment trains in-process, without main.run(): building its
  parser first must keep libtpu (installed, no TPU chip) from starting, as
  main.run() does, or its start-up lines reach every script's stderr."""
  code = entry + "\nimport jax\nprint(jax.config.jax_platforms, " \
      "jax.devices()[0].platform)\n"
  env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
  out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, timeout=120,
                       env=dict(env, PYTHONPATH=ROOT), capture_output=True,
                       text=True)
  assert out.returncode == 0, out.stderr
  assert out.stdout.split() == ["cpu", "cpu"]
  assert out.stderr.strip() == "", out.stderr


SCRIPT_DIRS = ("experiments", "benchmarks")
MAX_SCRIPT_LINES, MAX_FUNCTION_LINES = 250, 60
# Scripts still over the limits, with their size today: the test fails when
# one grows, and when one is brought under (then take it off this list).
OVER_LIMITS = {}


def _scripts():
  return sorted(p for d in SCRIPT_DIRS
                for p in pathlib.Path(ROOT, d).glob("*.py"))


def _tree(path):
  return ast.parse(path.read_text(encoding="utf-8"), str(path))


def test_no_script_imports_another():
  """What scripts share lives in hypermixer_jax (experiment.glue, .mlm,
  .nli, .train_steps, ...): a script is an entry point, not a library."""
  stems = {p.stem for p in _scripts()}
  found = []
  for path in _scripts():
    for node in ast.walk(_tree(path)):
      names = ([a.name for a in node.names] if isinstance(node, ast.Import)
               else [node.module or ""] if isinstance(node, ast.ImportFrom)
               else [])
      found += [f"{path.name}:{node.lineno} imports {n}" for n in names
                if n.split(".")[0] in stems]
  assert not found, found


def test_no_sys_path_edits():
  """Scripts import only hypermixer_jax, and tests load a script from its
  file (script_modules.load); torch_worker.py alone adds the official
  PyTorch repository it times, which is no package."""
  found = []
  paths = _scripts() + sorted(pathlib.Path(ROOT, "tests").glob("*.py"))
  for path in paths:
    if path.name == "torch_worker.py":
      continue
    for node in ast.walk(_tree(path)):
      if (isinstance(node, ast.Attribute) and node.attr == "path"
          and isinstance(node.value, ast.Name) and node.value.id == "sys"):
        found.append(f"{path.relative_to(ROOT)}:{node.lineno}")
  assert not found, f"sys.path used at {found}"


def _sizes(path):
  """(lines of the file, {function: lines} of those over the limit)."""
  tree = _tree(path)
  long = {f.name: f.end_lineno - f.lineno + 1 for f in ast.walk(tree)
          if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
          and f.end_lineno - f.lineno + 1 > MAX_FUNCTION_LINES}
  return len(path.read_text(encoding="utf-8").splitlines()), long


def test_scripts_stay_short():
  """A script at most 250 lines, no function over 60 (what is longer has
  reusable parts that belong in the library)."""
  problems = []
  for path in _scripts():
    lines, long = _sizes(path)
    name = f"{path.parent.name}/{path.name}"
    known = OVER_LIMITS.get(name, {})
    if lines > max(MAX_SCRIPT_LINES, known.get("lines", 0)):
      problems.append(f"{name}: {lines} lines")
    for fn, n in long.items():
      if n > known.get(fn, 0):
        problems.append(f"{name}:{fn} {n} lines")
    if known and lines <= MAX_SCRIPT_LINES and not long:
      problems.append(f"{name} is within the limits: drop it from "
                      "OVER_LIMITS")
  assert not problems, problems


def test_size_check_sees_a_long_function(tmp_path):
  body = "\n".join(f"  x{i} = {i}" for i in range(MAX_FUNCTION_LINES))
  path = tmp_path / "long.py"
  path.write_text(f"def f():\n{body}\n", encoding="utf-8")
  assert _sizes(path) == (MAX_FUNCTION_LINES + 1,
                          {"f": MAX_FUNCTION_LINES + 1})
