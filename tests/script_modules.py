"""Scripts as modules for the tests that call their ``main`` or helpers.

Scripts are entry points, not a package: nothing imports them but the
tests, which load one from its file (the library holds what scripts share).
"""
import importlib.util
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent


def load(path: str):
  """The script at ``path`` (relative to the repository) as a module, loaded
  once per test process under its file's stem."""
  name = pathlib.Path(path).stem
  if name in sys.modules:
    return sys.modules[name]
  spec = importlib.util.spec_from_file_location(name, ROOT / path)
  if spec is None:
    raise FileNotFoundError(f"script_modules.load: no script at {path}")
  module = importlib.util.module_from_spec(spec)
  sys.modules[name] = module   # dataclasses and pickling look it up here
  spec.loader.exec_module(module)
  return module
