"""setup.py's accelerator extras and the constraints file of tested versions."""
import ast
import importlib.metadata
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _extras():
  """setup.py's EXTRAS_REQUIRE, from its top-level assignments alone (the
  ``setuptools.setup`` call is not run)."""
  tree = ast.parse(open(os.path.join(ROOT, "setup.py"), encoding="utf-8").read())
  assigns = ast.Module([n for n in tree.body if isinstance(n, ast.Assign)], [])
  namespace = {}
  exec(compile(assigns, "setup.py", "exec"), namespace)  # pylint: disable=exec-used
  if "EXTRAS_REQUIRE" not in namespace:
    raise AssertionError("EXTRAS_REQUIRE not found in setup.py")
  return namespace["EXTRAS_REQUIRE"]


def _constraints():
  pins = {}
  for line in open(os.path.join(ROOT, "constraints.txt"), encoding="utf-8"):
    line = line.split("#")[0].strip()
    if line:
      name, version = line.split("==")
      pins[re.sub(r"[-_.]+", "-", name).lower()] = version
  return pins


def test_accelerator_extras_use_jax_extras():
  extras = _extras()
  assert extras["tpu"] == ["jax[tpu]>=0.9"]
  assert extras["cuda12"] == ["jax[cuda12]>=0.9"]
  assert {"test", "tpu", "cuda12", "cuda13"} <= set(extras)


def test_constraints_pin_what_the_tests_run_with():
  pins = _constraints()
  for name in ("jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "seqio",
               "tensorflow", "tensorflow-text", "tensorflow-datasets"):
    assert pins[name] == importlib.metadata.version(name), name
  # tensorflow-text is built against one TensorFlow release line.
  tf = pins["tensorflow"].split(".")[:2]
  assert pins["tensorflow-text"].split(".")[:2] == tf
  assert "hypermixer-jax" not in pins and "hypermixer_jax" not in pins


def test_tensorboard_is_installable_to_view_the_event_files():
  """Runs write TensorBoard event files; an extra installs the viewer."""
  extras = _extras()
  assert "tensorboard" in extras["profile"]
  assert extras["tensorboard"] == ["tensorboard"]


def test_console_help_lists_the_flags():
  """``hypermixer-train --help`` (the console script: ``__main__`` is not
  hypermixer_jax.main) shows the module's usage and flags, as ``python -m``
  does, not only "Try --helpfull"."""
  import subprocess  # pylint: disable=g-import-not-at-top
  import sys  # pylint: disable=g-import-not-at-top
  script = ("import sys; sys.argv = ['hypermixer-train', '--help']; "
            "from hypermixer_jax.main import run; run()")
  env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu")
  console = subprocess.run([sys.executable, "-c", script], env=env, cwd=ROOT,
                           capture_output=True, text=True, timeout=120)
  module = subprocess.run([sys.executable, "-m", "hypermixer_jax.main",
                           "--help"], env=env, cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
  assert console.returncode == module.returncode   # absl's --help exits 1
  for out in (console.stdout, module.stdout):
    assert "--mode=evaluate --workdir=" in out
    for flag in ("--config:", "--workdir:", "--mode:", "--output:",
                 "--input:", "--step:"):
      assert flag in out, (flag, out[-2000:])
  assert console.stdout == module.stdout.replace(
      f"{os.path.join(ROOT, 'hypermixer_jax', 'main.py')}:",
      "hypermixer-train:")


# The package's layers in order (CONTRIBUTING.md, "Layers"): a module may
# import its own layer and the layers before it, never a later one.
LAYERS = ("base", "data", "models", "sharding", "train", "entry")
# Imports of a later layer that CONTRIBUTING.md names as exceptions.
LAYER_EXCEPTIONS = {("hypermixer_jax/models/official_mixer.py", "train")}


def _layer(module: str) -> str:
  """Layer of ``hypermixer_jax[.a[.b]]`` (a dotted module name)."""
  parts = module.split(".")
  top = parts[1] if len(parts) > 1 else ""
  if top in ("heads", "runtime"):
    return "base"
  if top in ("data", "models", "sharding", "train"):
    return top
  if top in ("main", "experiment", "baselines", "probe"):
    return "entry"
  raise AssertionError(f"{module}: no layer; add it to LAYERS' table in "
                       "tests/packaging_test.py and to CONTRIBUTING.md")


def _package_imports(path: str) -> set[str]:
  """Every ``hypermixer_jax`` module a file imports, at any depth."""
  out = set()
  for node in ast.walk(ast.parse(open(path, encoding="utf-8").read())):
    if isinstance(node, ast.Import):
      out |= {a.name for a in node.names if a.name.startswith("hypermixer_jax")}
    elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith(
        "hypermixer_jax"):
      # `from hypermixer_jax import data` imports the module data.
      out |= ({f"{node.module}.{a.name}" for a in node.names}
              if node.module == "hypermixer_jax" else {node.module})
  return out


def test_no_layer_imports_a_later_one():
  package = os.path.join(ROOT, "hypermixer_jax")
  wrong, seen = [], set()
  for folder, _, files in os.walk(package):
    for name in files:
      if not name.endswith(".py") or name == "__init__.py" and (
          folder == package):
        continue
      path = os.path.join(folder, name)
      rel = os.path.relpath(path, ROOT)
      module = rel[:-3].replace(os.sep, ".").removesuffix(".__init__")
      own = LAYERS.index(_layer(module))
      for imported in _package_imports(path):
        layer = _layer(imported)
        seen.add(layer)
        if (LAYERS.index(layer) > own
            and (rel.replace(os.sep, "/"), layer) not in LAYER_EXCEPTIONS):
          wrong.append(f"{rel} imports {imported} ({layer})")
  assert not wrong, wrong
  assert seen >= set(LAYERS) - {"entry"}   # the walk found the imports


def test_the_layer_map_names_every_experiment_module():
  """CONTRIBUTING.md's layer map lists the modules of the experiment
  package, so that a new one is placed (and described) when it is added."""
  text = open(os.path.join(ROOT, "CONTRIBUTING.md"), encoding="utf-8").read()
  row = next(line for line in text.splitlines()
             if line.startswith("| entry points |"))
  listed = set(re.findall(r"`(\w+)`", row.split("`experiment/`", 1)[1]
                          .split(")", 1)[0]))
  folder = os.path.join(ROOT, "hypermixer_jax", "experiment")
  modules = {name[:-3] for name in os.listdir(folder)
             if name.endswith(".py") and name != "__init__.py"}
  assert modules <= listed, (
      f"add {sorted(modules - listed)} to CONTRIBUTING.md's layer map")
